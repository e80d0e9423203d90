"""What a cached refit call remembers between calls (issue 32: its per-call Python work), and that a change
is still caught: accepted options by name, type and value; the tensors' signature taken once per run."""

from __future__ import annotations

import pytest
import torch

from triton_reshard import Layout, Shard, refit
from triton_reshard.execute.options import RefitOptions


def test_accepted_options_are_remembered_by_value_and_type():
    a = RefitOptions.of(overlap=True, bucket_bytes=1 << 20)
    assert RefitOptions.of(bucket_bytes=1 << 20, overlap=True) is a
    assert RefitOptions.of(overlap=True, bucket_bytes=(1 << 20) + 4096) is not a
    RefitOptions.of(bucket_bytes=4096 * 1024)
    # True == 1 and hash(True) == hash(1): the type keeps a refused value from hitting an accepted one
    with pytest.raises(TypeError, match="bucket_bytes must be an int, got True"):
        RefitOptions.of(bucket_bytes=True)


def test_refused_options_raise_every_time():
    for _ in range(3):
        with pytest.raises(TypeError, match="got 1.5"):
            RefitOptions.of(bucket_bytes=1.5)
    with pytest.raises(TypeError, match="timeout"):
        RefitOptions.of(timeout=[1])  # unhashable: checked without the memo
    with pytest.raises(TypeError, match="timeout"):
        RefitOptions.of(timeout=[1])


def _one_rank():
    src = Layout.from_placements({"t": (4, 16)}, [0], [Shard(0)], torch.bfloat16)
    dst = Layout.from_placements({"t": (4, 16)}, [0], [Shard(1)], torch.bfloat16)
    g = torch.arange(64, dtype=torch.float32).reshape(4, 16).to(torch.bfloat16)
    return src, dst, g


def test_changed_tensors_are_still_checked_after_cached_calls():
    src, dst, g = _one_rank()
    s = src.shard({"t": g}, 0)
    d = dst.allocate(0)
    for _ in range(3):
        d["t"].view(torch.int16).fill_(-1)
        refit(s, d, src, dst)
        assert torch.equal(d["t"].view(torch.int16), g.view(torch.int16))
    with pytest.raises(ValueError, match="shape"):
        refit(s, {"t": torch.empty(4, 15, dtype=torch.bfloat16)}, src, dst)
    with pytest.raises(ValueError, match="dtype"):
        refit({"t": g.float()}, d, src, dst)
    gone = g.clone()
    gone.untyped_storage().resize_(0)
    with pytest.raises(ValueError, match="no valid storage"):
        refit({"t": gone}, d, src, dst)
    mem = torch.zeros(80, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="rank 0: .*'t'"):  # the destination overlaps the source, shifted
        refit({"t": mem[:64].view(4, 16)}, {"t": mem[16:80].view(4, 16)}, src, dst)
    # new tensor objects with other memory: bound again, still exact
    s2 = {"t": g.clone()}
    d2 = dst.allocate(0)
    refit(s2, d2, src, dst)
    assert torch.equal(d2["t"].view(torch.int16), g.view(torch.int16))


def test_the_per_tensor_checks_run_once_per_signature(monkeypatch):
    """Tensors with the signature of the last ones that passed skip the per-tensor checks (a cached call's
    per-call Python, issue 44); anything the checks read that changed runs them again: other tensors, and the
    same tensor objects whose storage was freed in place (FSDP's ``resize_(0)``)."""
    from triton_reshard.execute import checks

    src, dst, g = _one_rank()
    s = src.shard({"t": g}, 0)
    d = dst.allocate(0)
    calls = []
    real = checks.check_side
    monkeypatch.setattr(checks, "check_side", lambda *a: calls.append(a[1]) or real(*a))
    for _ in range(3):
        d["t"].view(torch.int16).fill_(-1)
        refit(s, d, src, dst)
        assert torch.equal(d["t"].view(torch.int16), g.view(torch.int16))
    assert calls == ["source", "destination"]  # the first call only
    refit({"t": s["t"].clone()}, d, src, dst)  # other memory: checked again
    assert calls == ["source", "destination"] * 2
    s["t"].untyped_storage().resize_(0)  # the very tensor that passed, its storage freed in place
    with pytest.raises(ValueError, match="no valid storage"):
        refit(s, d, src, dst)
    with pytest.raises(ValueError, match="no valid storage"):  # and every time after
        refit(s, d, src, dst)
