"""Our block-FP8 quantizer against vLLM 0.33's own ``per_block_cast_to_fp8`` (``vllm/utils/deep_gemm.py``).

vLLM wraps the function in ``torch.compile(dynamic=True, backend=current_platform.simple_compile_backend)``:
inductor on this CPU platform, and it compiles and runs here (~20 s per specialization: block size and
``use_ue8m0`` are guarded, so the four combinations compile four times). We compare with the compiled
function (what vLLM runs) and with its undecorated original (``_torchdynamo_orig_callable``), bit for bit on
every fp8 byte and every float32 scale, for ``quantize_blocks`` (the torch reference) and for the Triton
kernel through ``quantize_views`` (under ``TRITON_INTERPRET=1`` on CPU tensors).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: the engine tier runs in the env "
                                   "tests/engines/install.sh builds (bash .ci/run does both)")
deep_gemm = pytest.importorskip("vllm.utils.deep_gemm")

from tests.test_quant import ue8m0_hard_cases  # noqa: E402
from triton_reshard.ops import quantize as Q  # noqa: E402

pytestmark = pytest.mark.slow

COMPILED = deep_gemm.per_block_cast_to_fp8
EAGER = getattr(COMPILED, "_torchdynamo_orig_callable", None) or COMPILED.__wrapped__


def matrix(shape, dtype, seed, zero_block=None, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * scale
    x[0, -1] = 40.0 * scale  # one large value per tensor
    if zero_block is not None:
        r, c = zero_block
        x[:r, :c] = 0  # a whole zero block (and a zero corner of bigger blocks)
    return x.to(dtype)


def _cases():
    out = []
    for block in ((128, 128), (16, 16)):
        bm, bn = block
        for ue8m0 in (False, True):
            name = f"{bm}x{bn}-{'ue8m0' if ue8m0 else 'fp32scale'}"
            out += [
                pytest.param(block, ue8m0, (3 * bm - 7, 2 * bn + 5), torch.bfloat16, 0, id=f"{name}-edge-bf16"),
                pytest.param(block, ue8m0, (2 * bm, 3 * bn), torch.bfloat16, 1, id=f"{name}-whole-bf16"),
                pytest.param(block, ue8m0, (bm // 2 + 1, 5 * bn - 3), torch.bfloat16, 2, id=f"{name}-short-bf16"),
                pytest.param(block, ue8m0, (bm + 3, bn + 1), torch.float16, 3, id=f"{name}-edge-fp16"),
                pytest.param(block, ue8m0, (2 * bm + 1, bn - 1), torch.float32, 4, id=f"{name}-edge-fp32"),
            ]
    return out


def _triton(x, block, ue8m0, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q = torch.full(x.shape, 0xFF, dtype=torch.uint8)
    s = torch.full(Q.scale_shape(x.shape, block), -1, dtype=torch.int32).view(torch.float32)
    Q.quantize_views([(x, q, s)], block, ue8m0, backend="triton")
    return q.view(torch.float8_e4m3fn), s


def _assert_same(ours, theirs, what):
    (q, s), (vq, vs) = ours, theirs
    assert vq.dtype == torch.float8_e4m3fn and q.shape == vq.shape and s.shape == vs.shape, what
    diff = (q.view(torch.uint8) != vq.view(torch.uint8)).nonzero()
    assert diff.numel() == 0, f"{what}: {diff.shape[0]} fp8 bytes differ from vLLM's, first at {diff[0].tolist()}"
    assert torch.equal(s.view(torch.int32), vs.view(torch.int32)), f"{what}: scales differ from vLLM's"


@pytest.mark.parametrize(("block", "ue8m0", "shape", "dtype", "seed"), _cases())
def test_matches_vllm_per_block_cast_to_fp8(block, ue8m0, shape, dtype, seed, monkeypatch):
    x = matrix(shape, dtype, seed, zero_block=block, scale=0.02 if seed % 2 else 3.0)
    theirs = COMPILED(x, list(block), ue8m0)
    _assert_same(EAGER(x, list(block), ue8m0), theirs, "vLLM eager vs compiled")
    _assert_same(Q.quantize_blocks(x, block, ue8m0), theirs, "quantize_blocks")
    _assert_same(_triton(x, block, ue8m0, monkeypatch), theirs, "Triton kernel")


@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32scale", "ue8m0"])
def test_matches_vllm_where_ue8m0_rounding_is_delicate(ue8m0, monkeypatch):
    """float32 blocks whose amax / 448 lies a few ulps above a power of two, where torch's
    ``pow(2, ceil(log2(s)))`` keeps the exponent and the exact bit rule would not."""
    x = ue8m0_hard_cases()
    theirs = COMPILED(x, [16, 16], ue8m0)
    _assert_same(EAGER(x, [16, 16], ue8m0), theirs, "vLLM eager vs compiled")
    _assert_same(Q.quantize_blocks(x, (16, 16), ue8m0), theirs, "quantize_blocks")
    _assert_same(_triton(x, (16, 16), ue8m0, monkeypatch), theirs, "Triton kernel")
