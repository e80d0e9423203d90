"""Our MXFP8 and NVFP4 quantizers against vLLM 0.33's own functions (issue 33), bit for bit.

- MXFP8: ``vllm/model_executor/layers/quantization/utils/mxfp8_utils._mxfp8_e4m3_quantize_torch`` (the path
  vLLM takes off Blackwell/ROCm), against ``quantize_mxfp8`` (torch reference) and the Triton kernel
  (``quantize_views(..., fmt="mxfp8", backend="triton")`` under ``TRITON_INTERPRET=1``): every value byte and
  every E8M0 byte, on random, real-weight-like (small normal values with outliers), zero, denormal and +-inf
  blocks. NaN blocks: vLLM's values (all NaN) are compared; its scale byte comes from a float NaN cast to uint8
  (undefined in C), ours is E8M0's NaN 0xFF by policy.
- NVFP4: ``nvfp4_emulation_utils.ref_nvfp4_quant`` (float E2M1 values and float32 block scales) against
  ``quantize_nvfp4``: vLLM's own unpacker ``break_fp4_bytes`` applied to our packed bytes gives its values bit
  for bit (zeros compared with their sign), and our e4m3 scales as float32 equal its scales; the global scale
  and ``weight_scale_2`` equal those of vLLM's online NVFP4 path (``2688 / amax``, ``1 / gs``); vLLM's
  ``dequantize_to_dtype`` (``swizzle=False``) of our bytes equals our dequantization.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: the engine tier runs in the env "
                                   "tests/engines/install.sh builds (bash .ci/run does both)")
mx = pytest.importorskip("vllm.model_executor.layers.quantization.utils.mxfp8_utils")
nv = pytest.importorskip("vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils")

from triton_reshard.ops import quantize as Q  # noqa: E402

pytestmark = pytest.mark.slow
FP8 = torch.float8_e4m3fn


def inputs(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(48, 256, generator=g) * 0.02  # weight-like
    x[3, 7] = 1.5  # outliers
    x[10, 100] = -0.9
    x[16:24] *= torch.logspace(-20, 20, 256)  # every binade of scales
    x[30, :32] = 0  # an all-zero block
    x[31, 32:64] = 2.0 ** -130  # denormal block (bf16/fp32)
    x[32, :] = torch.linspace(-448 * 4, 448 * 4, 256)  # blocks above 448
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("seed", [0, 1])
def test_mxfp8_reference_and_kernel_match_vllm(dtype, seed, monkeypatch):
    x = inputs(dtype, seed)
    if dtype == torch.float16:
        x = x.float().clamp(-6e4, 6e4).to(dtype)
    vq, vs = mx._mxfp8_e4m3_quantize_torch(x)
    q, s = Q.quantize_mxfp8(x)
    assert torch.equal(s, vs)
    assert torch.equal(q.view(torch.uint8), vq.view(torch.uint8))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kq = torch.full(x.shape, 0x5A, dtype=torch.uint8)
    ks = torch.full(s.shape, 0xA5, dtype=torch.uint8)
    Q.quantize_views([(x, kq, ks)], (1, 32), backend="triton", fmt="mxfp8")
    assert torch.equal(ks, vs)
    assert torch.equal(kq, vq.view(torch.uint8))


def test_mxfp8_non_finite_policy_against_vllm():
    x = torch.ones(4, 64)
    x[0, 3] = float("inf")
    x[1, 40] = -float("inf")
    x[2, 5] = float("nan")
    vq, vs = mx._mxfp8_e4m3_quantize_torch(x)
    q, s = Q.quantize_mxfp8(x)
    assert torch.equal(q.view(torch.uint8), vq.view(torch.uint8))  # inf -> +-448, a NaN block: all NaN
    ok = torch.ones_like(s, dtype=torch.bool)
    ok[2, 0] = False
    assert torch.equal(s[ok], vs[ok]) and int(s[2, 0]) == 0xFF


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nvfp4_matches_ref_nvfp4_quant(dtype, seed):
    x = inputs(dtype, seed)
    if dtype == torch.float16:
        x = x.float().clamp(-6e4, 6e4).to(dtype)
    amax = x.abs().amax().float()
    gs, ws2 = Q.nvfp4_global_scale(amax)
    # vLLM's online NVFP4 path: global_scale = (6 * 448) / amax, weight_scale_2 = 1 / global_scale
    vgs = (6.0 * 448.0) / amax.clamp_min(1e-8)
    assert torch.equal(gs.view(torch.int32), vgs.view(torch.int32))
    assert torch.equal(ws2.view(torch.int32), (1.0 / vgs).to(torch.float32).view(torch.int32))
    vvals, vscale = nv.ref_nvfp4_quant(x, vgs, 16)
    packed, scale = Q.quantize_nvfp4(x, (16,), global_scale=gs)
    assert torch.equal(scale.float().view(torch.int32), vscale.view(torch.int32))
    got = nv.break_fp4_bytes(packed, torch.float32)
    assert torch.equal(got, vvals.abs() * torch.where(torch.signbit(got), -1.0, 1.0))  # magnitudes
    assert torch.equal(got.view(torch.int32), vvals.view(torch.int32))  # and signs, -0.0 included
    deq = nv.dequantize_to_dtype(packed, scale, ws2, torch.float32, 16, swizzle=False)
    assert torch.equal(deq, Q.dequantize_nvfp4(packed, scale, ws2))


def test_nvfp4_zero_tensor_and_zero_blocks():
    x = torch.zeros(4, 32, dtype=torch.bfloat16)
    x[1, 16:] = -0.0
    x[2, :16] = torch.tensor(0.001).to(torch.bfloat16)
    gs, _ws2 = Q.nvfp4_global_scale(x.abs().amax().float())
    vvals, vscale = nv.ref_nvfp4_quant(x, (6.0 * 448.0) / x.abs().amax().float().clamp_min(1e-8), 16)
    packed, scale = Q.quantize_nvfp4(x, (16,), global_scale=gs)
    assert torch.equal(scale.float(), vscale)
    assert torch.equal(nv.break_fp4_bytes(packed, torch.float32).view(torch.int32), vvals.view(torch.int32))
