"""Recording a block-FP8 loader (``integrations.vllm.record_vllm`` / ``layout_from_records``) without vLLM: a
toy model whose quantized layer has vLLM's attributes (``weight_block_size``, ``weight`` in fp8 and
``weight_scale_inv``) and whose ``load_weights`` copies TP row halves of the checkpoint's weight and scales.
The real vLLM 0.33 loader is recorded in ``tests/engines/test_vllm_fp8.py``."""

from __future__ import annotations

import pytest
import torch

from triton_reshard import Fragment, Layout, block_quant_layout
from triton_reshard.integrations.record import layout_from_records
from triton_reshard.integrations.vllm import block_quantized_params, record_vllm

FP8 = torch.float8_e4m3fn
CKPT = {"lin.weight": (64, 32), "lin.weight_scale_inv": (4, 2), "norm.weight": (32,)}


class Lin(torch.nn.Module):
    def __init__(self, rows, cols, block):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(rows, cols, dtype=FP8), requires_grad=False)
        self.weight_scale_inv = torch.nn.Parameter(torch.empty(-(-rows // block[0]), -(-cols // block[1])),
                                                   requires_grad=False)
        self.weight_block_size = list(block)


class Toy(torch.nn.Module):
    """TP rank ``t`` of 2: rows [32t, 32t+32) of ``lin`` and their scale rows; ``scale_rows``: where its loader
    takes the scale rows from (wrong on purpose in a test); ``skip_scale``: a loader that forgets them."""

    def __init__(self, t, scale_rows=None, skip_scale=False):
        super().__init__()
        self.lin = Lin(32, 32, (16, 16))
        self.norm = torch.nn.Parameter(torch.empty(32, dtype=torch.bfloat16), requires_grad=False)
        self.t, self.scale_rows, self.skip_scale = t, scale_rows, skip_scale

    def load_weights(self, weights):
        for name, w in weights:
            if name == "lin.weight":
                self.lin.weight.copy_(w.narrow(0, 32 * self.t, 32))
            elif name == "lin.weight_scale_inv" and not self.skip_scale:
                self.lin.weight_scale_inv.copy_(w.narrow(0, self.scale_rows if self.scale_rows is not None
                                                         else 2 * self.t, 2))
            elif name == "norm.weight":
                self.norm.copy_(w)


def _expected() -> Layout:
    frags = [Fragment("lin.weight", t, (32 * t, 0), (32, 32), "lin.weight") for t in (0, 1)]
    frags += [Fragment("norm.weight", t, (0,), (32,), "norm") for t in (0, 1)]
    plain = Layout.from_fragments({"lin.weight": ((64, 32), FP8), "norm.weight": ((32,), torch.bfloat16)}, frags)
    return block_quant_layout(plain, ["lin.weight"], (16, 16))


def test_recorded_block_fp8_layout():
    model = Toy(0)
    assert block_quantized_params(model) == {"lin.weight": (16, 16)}
    recs = [record_vllm(Toy(t), CKPT, t) for t in (0, 1)]
    assert all(r.quant["lin.weight"].block == (16, 16) and r.quant["lin.weight"].scale == "lin.weight_scale_inv"
               for r in recs)
    got = layout_from_records(recs)
    assert got.digest == _expected().digest
    # a BF16 trainer's tensors (no scales): record_vllm adds the scale tensors the loader expects, records again
    bf16 = {n: s for n, s in CKPT.items() if not n.endswith("_scale_inv")}
    assert layout_from_records([record_vllm(Toy(t), bf16, t) for t in (0, 1)]).digest == got.digest
    ue = layout_from_records([record_vllm(Toy(t), CKPT, t, ue8m0=True) for t in (0, 1)])
    assert ue.quantized["lin.weight"].quant.ue8m0 and ue.digest != got.digest


def test_recorded_scale_errors():
    rec = record_vllm(Toy(0, skip_scale=True), CKPT, 0)
    with pytest.raises(ValueError, match=r"lin\.weight: block-FP8 parameter .* no 'lin\.weight_scale_inv'"):
        rec.raise_on_problems()
    # rank 1's loader takes rank 0's scale rows: the Layout refuses the recorded scales, naming tensor and rank
    recs = [record_vllm(Toy(0), CKPT, 0), record_vllm(Toy(1, scale_rows=0), CKPT, 1)]
    with pytest.raises(ValueError, match=r"quantized tensor 'lin\.weight' on rank 1 .* lacks the scale fragment"):
        layout_from_records(recs)
    r0, r1 = (record_vllm(Toy(t), CKPT, t) for t in (0, 1))
    r1.quant["lin.weight"] = type(r1.quant["lin.weight"])((32, 16), "lin.weight_scale_inv")
    with pytest.raises(ValueError, match=r"rank 1 holds it quantized as"):
        layout_from_records([r0, r1])
