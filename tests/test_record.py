"""``integrations.record``: layouts recorded from a model's own ``load_weights`` on meta tensors: no data read or written.

The loaders here are small torch modules whose ``load_weights`` does what framework loaders do (narrow the
checkpoint tensor, copy into a slice of a fused or stacked parameter, pad a vocab, select an expert row),
plus the writes that are *not* box copies and must be reported by parameter name: a transpose, arithmetic, a
concatenation into a temporary, a broadcast, an indexed write. The real engines' loaders are checked in
``tests/engines/test_vllm_real.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from triton_reshard import Fragment
from triton_reshard.integrations import checkpoint_shapes, layout_from_records, record_load

H, I, V, E = 8, 6, 11, 3  # noqa: E741


class Fused(nn.Module):
    """A TP rank ``t`` of 2 of a gated MLP with fused ``[gate_t; up_t]``, a padded vocab shard and stacked
    experts: every write a box copy."""

    def __init__(self, t: int):
        super().__init__()
        self.t = t
        self.gate_up = nn.Parameter(torch.full((I, H), 7.0))  # [gate_t; up_t], I/2 rows each
        self.embed = nn.Parameter(torch.full((8, H), 7.0))  # vocab 11 padded to 16, split in 2
        self.w13 = nn.Parameter(torch.full((E, 2 * I, H), 7.0))
        self.bias = nn.Parameter(torch.full((H,), 7.0), requires_grad=False)

    def load_weights(self, weights):
        for name, w in weights:
            if name in ("gate", "up"):
                half = I // 2
                at = 0 if name == "gate" else half
                self.gate_up.data[at:at + half].copy_(w.narrow(0, self.t * half, half))
            elif name == "embed":
                rows = w[self.t * 8:(self.t + 1) * 8]
                self.embed.data[:rows.shape[0]].copy_(rows)
                self.embed.data[rows.shape[0]:].fill_(0)  # padding: a fill, not a transfer
            elif name.startswith("expert."):
                _, e, kind = name.split(".")
                self.w13.data[int(e)].narrow(0, 0 if kind == "gate" else I, I).copy_(w.to(self.w13.dtype))
            elif name == "bias":
                self.bias.copy_(w)


def _ckpt():
    c = {"gate": (I, H), "up": (I, H), "embed": (V, H), "bias": (H,)}
    for e in range(E):
        c[f"expert.{e}.gate"] = (I, H)
        c[f"expert.{e}.up"] = (I, H)
    return c


def test_records_box_copies_and_writes_nothing():
    """Narrow, slice, select, a cast and padding fills, on meta tensors: boxes, and no byte read or written."""
    recs = []
    for t in range(2):
        m = Fused(t)
        before = {n: p.detach().clone() for n, p in m.named_parameters()}
        rec = record_load(dict(m.named_parameters()), m.load_weights, _ckpt(), rank=t)
        for n, p in m.named_parameters():
            assert torch.equal(p, before[n]), f"{n} was written"
        assert rec.problems == [] and rec.uncovered == [] and rec.unused == []
        assert rec.fills == 1
        recs.append(rec)
    f = {(x.tensor, x.rank): x for x in recs[1].fragments}
    assert f[("gate", 1)] == Fragment("gate", 1, (3, 0), (3, H), "gate_up", (0, 0))
    assert f[("up", 1)] == Fragment("up", 1, (3, 0), (3, H), "gate_up", (3, 0))
    assert f[("embed", 1)] == Fragment("embed", 1, (8, 0), (3, H), "embed", (0, 0))  # 3 real rows, 5 padding
    assert f[("expert.2.up", 1)] == Fragment("expert.2.up", 1, (0, 0), (I, H), "w13", (2, I, 0))
    layout = layout_from_records(recs)
    # the recorded layout slices a checkpoint exactly as the loader does with real data
    g = torch.Generator().manual_seed(0)
    ckpt = {n: torch.randn(s, generator=g) for n, s in _ckpt().items()}
    for t in range(2):
        m = Fused(t)
        m.load_weights(ckpt.items())
        mine = layout.shard(ckpt, t)
        for n, p in m.named_parameters():
            assert torch.equal(mine[n], p), n


def _one(load, params, ckpt):
    return record_load(params, load, ckpt, rank=3)


COMPUTED = "computed from the checkpoint"
REORDERED = "not one box in order"


@pytest.mark.parametrize(
    ("write", "words"),
    [
        pytest.param(lambda p, w: p.copy_(w.t()), REORDERED, id="transpose"),
        pytest.param(lambda p, w: p.copy_(w.permute(1, 0).contiguous()), REORDERED, id="transpose-contiguous"),
        pytest.param(lambda p, w: p.copy_(w * 2), COMPUTED, id="arithmetic"),
        pytest.param(lambda p, w: p.copy_(w.float() + 1.0), COMPUTED, id="cast-then-arithmetic"),
        pytest.param(lambda p, w: p.copy_(w.flip(0)), COMPUTED, id="flip"),
        pytest.param(lambda p, w: p.copy_(w[:1].expand(4, 4)), REORDERED, id="broadcast-view"),
        pytest.param(lambda p, w: p.copy_(w[:1]), "broadcast", id="broadcast-copy"),
        pytest.param(lambda p, w: p.copy_(torch.zeros(4, 4)), COMPUTED, id="not-from-the-checkpoint"),
        pytest.param(lambda p, w: p.t().copy_(w), "not a box of it", id="transposed-param-view"),
        pytest.param(lambda p, w: p.index_copy_(0, torch.tensor([1, 0, 2, 3]), w), "aten.index_copy", id="index_copy"),
        pytest.param(lambda p, w: p.copy_(w[torch.tensor([1, 0, 2, 3])]), COMPUTED, id="gather"),
    ],
)
def test_non_box_writes_are_reported_by_name(write, words):
    p = nn.Parameter(torch.zeros(4, 4))

    def load(weights):
        for _n, w in weights:
            write(p.data, w)

    rec = _one(load, {"layer.w": p}, {"ckpt.w": (4, 4)})
    assert rec.fragments == []
    assert len(rec.problems) == 1 and rec.problems[0].startswith("layer.w: ") and words in rec.problems[0], rec.problems
    assert torch.equal(p, torch.zeros(4, 4))
    with pytest.raises(ValueError, match=r"rank 3: .*layer\.w"):
        layout_from_records([rec])


def test_concatenation_into_a_temporary_is_reported():
    p = nn.Parameter(torch.zeros(4, 4))

    def load(weights):
        ws = dict(weights)
        p.data.copy_(torch.cat([ws["a"], ws["b"]]))

    rec = _one(load, {"fused": p}, {"a": (2, 4), "b": (2, 4)})
    assert len(rec.problems) == 1 and rec.problems[0].startswith("fused: ") and COMPUTED in rec.problems[0]


def test_unused_and_uncovered_are_listed():
    p, q = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))

    def load(weights):
        for n, w in weights:
            if n == "x":
                p.data.copy_(w)

    rec = _one(load, {"p": p, "derived": q}, {"x": (2,), "mtp.y": (2,)})
    assert rec.unused == ["mtp.y"] and rec.uncovered == ["derived"] and not rec.problems
    assert layout_from_records([rec]).local_shapes(3) == {"p": (2,)}


def test_checkpoint_shapes_reads_headers_only(tmp_path):
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(3, 5), "b": torch.zeros(7)}, str(tmp_path / "model-00001.safetensors"))
    save_file({"c": torch.zeros(2, 2, 2)}, str(tmp_path / "model-00002.safetensors"))
    assert checkpoint_shapes(str(tmp_path)) == {"a": (3, 5), "b": (7,), "c": (2, 2, 2)}
    with pytest.raises(FileNotFoundError):
        checkpoint_shapes(str(tmp_path / "nothing"))
