"""MXFP8 quantization (issue 33): the torch reference (``ops/quantize.quantize_mxfp8``, vLLM 0.33's
``_mxfp8_e4m3_quantize_torch`` rules) against an independent exact computation and hand-checked edge blocks, and
the Triton kernel (``kernels/quant.py`` with ``FMT=1``, under ``TRITON_INTERPRET=1``) against the reference, bit
for bit on every value byte and every E8M0 scale byte. vLLM's own function is compared in
``tests/engines/test_quant_formats_vllm.py``."""

from __future__ import annotations

import math

import pytest
import torch

from triton_reshard.layout import MXFP8
from triton_reshard.ops import quantize as Q

FP8 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    Q.clear_cache()
    yield
    Q.clear_cache()


def exact_scale_byte(amax: float) -> int:
    """E8M0 byte from the exact rule: clamp(ceil(log2(max(amax, tiny) / 448)) + 127, 0, 254), in exact arithmetic
    (amax / 448 rounded to float32 first, as the reference divides in float32)."""
    a = max(amax, 2.0 ** -126)
    y = torch.tensor(a, dtype=torch.float32) / torch.tensor(448.0)
    m, e = math.frexp(float(y))  # y = m 2^e, m in [0.5, 1)
    c = e - 1 if m == 0.5 else e  # ceil(log2 y)
    return min(max(c + 127, 0), 254)


def test_reference_edge_blocks_hand_checked():
    x = torch.zeros(8, 32, dtype=torch.bfloat16)
    x[1, 0] = 448.0  # amax 448 -> scale 2^0 (byte 127), values exact
    x[1, 1] = -1.0
    x[2, 0] = 450.0  # just above 448 (the next bf16) -> 2^1 (byte 128): 450 / 2 = 225 -> 224 in e4m3
    x[3, 0] = 1.0  # 1 / 448 -> ceil(log2) = -8 -> byte 119; 1 * 2^8 = 256
    x[4, 0] = 2.0 ** -120  # amax below 448 * 2^-127: byte 0 (2^-127); value 2^7 = 128
    x[5, :] = 3.0 * 2 ** -133  # bf16 denormal-range amax (normal in fp32), byte 0
    x[6, 0] = 7 * 2.0 ** 10  # amax / 448 = 2^4 exactly: byte 131, value 7 * 2^6 = 448
    q, s = Q.quantize_mxfp8(x)
    assert s.dtype == torch.uint8 and s.shape == (8, 1) and q.dtype == FP8
    assert s[:, 0].tolist() == [0, 127, 128, 119, 0, 0, 131, 0]
    assert q.view(torch.uint8)[0].eq(0).all()  # an all-zero block: zeros, scale byte 0
    assert q[1, 0].item() == 448.0 and q[1, 1].item() == -1.0
    assert q[2, 0].item() == 224.0
    assert q[3, 0].item() == 256.0
    assert q[4, 0].item() == 128.0
    assert q[6, 0].item() == 448.0
    deq = q.float().view(8, 1, 32) * torch.exp2(s.float() - 127).unsqueeze(-1)
    assert deq.view(8, 32)[1, 0] == 448 and deq.view(8, 32)[3, 0] == 1.0


def test_reference_non_finite_policy():
    x = torch.ones(4, 64, dtype=torch.float32)
    x[0, 3] = float("inf")
    x[1, 40] = -float("inf")
    x[2, 5] = float("nan")
    x[3, 33] = -float("nan")
    q, s = Q.quantize_mxfp8(x)
    u = q.view(torch.uint8)
    assert s.tolist() == [[254, 127 - 8], [127 - 8, 254], [0xFF, 127 - 8], [127 - 8, 0xFF]]
    assert u[0, 3] == 0x7E and u[1, 40] == 0xFE  # +-inf saturate to +-448
    assert u[0, :32].sum() == 0x7E  # the block's finite values flush to 0 at scale 2^127
    assert (u[2, :32] == 0x7F).all() and (u[3, 32:] == 0x7F).all()  # a NaN block: every value NaN 0x7F
    assert (u[2, 32:] == u[0, 32:]).all()  # other blocks untouched by the policy


def test_reference_scale_matches_exact_rule_for_every_bf16_amax():
    """Every positive finite bf16 value as a block amax (32,639 blocks): the scale byte is the exact rule's (torch's
    float32 log2 never rounds across an integer for these), and the values are the e4m3 cast of the exact
    power-of-two scaling."""
    bits = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = torch.zeros(bits.numel(), 32, dtype=torch.bfloat16)
    x[:, 0] = bits
    x[:, 1] = -bits / 3
    q, s = Q.quantize_mxfp8(x)
    want = torch.tensor([exact_scale_byte(float(v)) for v in bits.float()], dtype=torch.uint8)
    assert torch.equal(s[:, 0], want)
    scaled = x.double() * torch.exp2(127.0 - want.double()).unsqueeze(-1)
    assert torch.equal(q.view(torch.uint8), scaled.float().to(FP8).view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_reference_any_leading_dims_and_random(dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(3, 5, 96, generator=g) * torch.logspace(-6, 4, 96)).to(dtype)
    q, s = Q.quantize_mxfp8(x)
    assert q.shape == x.shape and s.shape == (3, 5, 3)
    q2, s2 = Q.quantize_mxfp8(x.reshape(15, 96))
    assert torch.equal(q.view(torch.uint8).reshape(15, 96), q2.view(torch.uint8))
    assert torch.equal(s.reshape(15, 3), s2)


def test_reference_refuses_bad_blocks():
    with pytest.raises(ValueError, match="multiple of 32"):
        Q.quantize_mxfp8(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="1x32"):
        Q.quantize_mxfp8(torch.zeros(2, 64), (16,))


def _items(shapes, dtype, seed=0, strided=False):
    g = torch.Generator().manual_seed(seed)
    items = []
    for sh in shapes:
        x = (torch.randn(sh, generator=g) * torch.logspace(-30, 30, sh[-1]) ).to(dtype)
        if strided:
            x = x.t().contiguous().t()
        q = torch.full(sh, 0x5A, dtype=torch.uint8).view(FP8)
        s = torch.full(sh[:-1] + (sh[-1] // 32,), 0xA5, dtype=torch.uint8)
        items.append((x, q, s))
    return items


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("strided", [False, True])
def test_triton_matches_reference(dtype, strided):
    items = _items([(5, 64), (3, 96), (1, 32)], dtype, strided=strided)
    Q.quantize_views(items, (1, 32), backend="triton", fmt="mxfp8")
    for x, q, s in items:
        rq, rs = Q.quantize_mxfp8(x)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
        assert torch.equal(s, rs)


def test_triton_special_values_and_every_bf16_exponent():
    """Kernel = reference on zeros, denormal-range and tiny blocks, +-inf, NaN, and one block per bf16 exponent
    (with mantissas at both ends of the binade, where the log2 rounding could differ)."""
    vals = []
    for e in range(-133, 128):
        for m in (1.0, 1.0078125, 1.5, 1.9921875):
            vals.append(m * 2.0 ** e)
    n = len(vals)
    x = torch.zeros(n + 4, 32, dtype=torch.float32)
    x[:n, 0] = torch.tensor(vals)
    x[:n, 1:] = x[:n, :1] * torch.linspace(-1, 1, 31)
    x[n + 1, 4] = float("inf")
    x[n + 2, 7] = -float("nan")
    x[n + 3, :] = 2.0 ** -149  # fp32 subnormals
    x = x.to(torch.bfloat16).float()
    for dtype in (torch.bfloat16, torch.float32):
        src = x.to(dtype)
        q = torch.empty(src.shape, dtype=FP8)
        s = torch.empty(n + 4, 1, dtype=torch.uint8)
        Q.quantize_views([(src, q, s)], (1, 32), backend="triton", fmt=MXFP8)
        rq, rs = Q.quantize_mxfp8(src)
        assert torch.equal(s, rs), (s.view(-1) != rs.view(-1)).nonzero()[:5]
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


def test_triton_fp32_amax_near_powers_of_two():
    """fp32 amaxes a few ulps around 448 * 2^k (where torch's float32 log2 could round across the integer): the
    kernel follows torch through the measured thresholds."""
    base = torch.tensor([448.0 * 2.0 ** k for k in range(-40, 40, 3)], dtype=torch.float32)
    bits = base.view(torch.int32)
    vals = torch.cat([(bits + d).view(torch.float32) for d in range(-3, 4)])
    x = torch.zeros(vals.numel(), 32)
    x[:, 0] = vals
    q = torch.empty(x.shape, dtype=FP8)
    s = torch.empty(vals.numel(), 1, dtype=torch.uint8)
    Q.quantize_views([(x, q, s)], (32,), backend="triton", fmt="mxfp8")
    rq, rs = Q.quantize_mxfp8(x)
    assert torch.equal(s, rs) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


def test_one_launch_for_many_items(monkeypatch):
    """One launch of the 1 x B kernel for every block of every item, many blocks per program (its grid: the
    blocks over G, not one program per block)."""
    calls = []
    kernel = Q.get_rows_kernel()

    class Counter:
        def __getitem__(self, grid):
            def run(*a, **k):
                calls.append((k["FMT"], grid, k["G"]))
                return kernel[grid](*a, **k)
            return run

    monkeypatch.setattr(Q, "get_rows_kernel", lambda: Counter())
    items = _items([(2, 64), (4, 32), (1, 128), (300, 64)], torch.bfloat16, seed=1)
    Q.quantize_views(items, (1, 32), backend="triton", fmt="mxfp8", key="k")
    blocks = 4 + 4 + 4 + 600
    assert len(calls) == 1 and calls[0][0] == 1 and calls[0][2] > 1
    assert calls[0][1] == (-(-blocks // calls[0][2]),)
    for x, q, s in items:
        rq, rs = Q.quantize_mxfp8(x)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)


def test_bad_items_name_the_format():
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="mxfp8 scales"):
        Q.quantize_views([(x, torch.empty(2, 64, dtype=FP8), torch.empty(2, 2))], (1, 32), fmt="mxfp8")
    with pytest.raises(ValueError, match="unknown quantization format"):
        Q.quantize_views([(x, torch.empty(2, 64, dtype=FP8), torch.empty(2, 2))], (1, 32), fmt="mxfp9")


def test_triton_fp32_amax_whose_scale_is_subnormal():
    """fp32 amaxes whose ``amax / 448`` is a float32 subnormal just above 2^-127 (amax ~2.6e-36): torch's float32
    ``log2`` rounds the first dozen of them to -127 (scale byte 0), the exact rule would give byte 1. The kernel
    follows torch there too (a review found it took the exact rule for subnormal scales)."""
    ys = torch.arange(0x400000 - 4, 0x400000 + 40, dtype=torch.int32).view(torch.float32)
    amax = ys * torch.tensor(448.0)
    assert torch.equal(amax / torch.tensor(448.0), ys)  # each one divides back to its subnormal
    x = torch.zeros(amax.numel(), 32)
    x[:, 3] = amax
    x[:, 5] = -amax / 2
    q = torch.empty(x.shape, dtype=FP8)
    s = torch.empty(amax.numel(), 1, dtype=torch.uint8)
    Q.quantize_views([(x, q, s)], (32,), backend="triton", fmt="mxfp8")
    rq, rs = Q.quantize_mxfp8(x)
    assert 0 in rs.view(-1).tolist() and 1 in rs.view(-1).tolist()
    assert torch.equal(s, rs), (s.view(-1) != rs.view(-1)).nonzero().view(-1)[:5]
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
