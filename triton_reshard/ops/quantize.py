"""Block-FP8 quantization: the torch reference and the launcher of the one-launch Triton kernel.

A tensor is cut into *blocks* (``block``: one extent per dimension, e.g. ``(128, 128)`` for a matrix or
``(1, 128, 128)`` for stacked experts ``[E, rows, cols]``); each block becomes float8_e4m3fn values and one
float32 *scale*, the dequantization multiplier (``weight_scale_inv`` in DeepSeek-V3 / Qwen3-FP8
checkpoints): ``x ~= q.float() * scale``. The numbers are vLLM's ``per_block_cast_to_fp8``
(``vllm/utils/deep_gemm.py``, 0.33) bit for bit:

- a partial block at the edge is padded with zeros (which cannot change its amax, a max of ``|x|``);
- ``amax = max |x|`` in float32, clamped to ``AMAX_FLOOR`` (an all-zero block gets ``1e-4 / 448``);
- ``scale = amax / FP8_MAX``, or with ``ue8m0`` its power of two ``2 ** ceil(log2(scale))``;
- ``q = (x * (1 / scale)).to(float8_e4m3fn)``, the product in float32.

:func:`quantize_blocks` is the reference (torch ops, any device). :func:`quantize_views` is the batched form
the executor calls: it writes into caller-owned views, with the ``"torch"`` backend (the reference per item)
or the ``"triton"`` backend (``kernels/quant.py``: **one launch per source dtype for all blocks of all
items**, one program per block). No framework knowledge lives here.

**UE8M0.** The exact power-of-two rule is "the float32 exponent, plus one unless the mantissa is zero".
torch's ``pow(2, ceil(log2(s)))`` rounds ``log2`` to float32 first and so keeps the exponent for mantissas a
few ulps above zero: on this machine's CPU, over every float32 ``s`` in ``[1e-4/448, 1e5/448]``
(250,579,503 values), 54 differ from the exact rule: mantissas 1..5 for exponents -22..-17, 1..2 for
-16..-9, 1 for -8..-5 and for 4..7 (exactly where float32 ``log2`` rounds ``k + log2(1 + m 2^-23)`` to
``k``). No bfloat16 or float16 ``amax`` (vLLM's inputs) reaches one of them (``amax / 448`` never lands a
few ulps above a power of two), so for those sources both rules agree; float32 sources can hit them. The
reference is torch's formula; the kernel reproduces it through a per-exponent threshold table measured
with torch's own formula on the tensors' device (:func:`ue8m0_thresholds`), which also follows a device
whose ``log2`` rounds differently, as long as its mistakes sit just above powers of two.

**Division.** ``scale = amax / 448`` and ``1 / scale`` are IEEE (correctly rounded) divisions, as on
the CPU: the reference divides by a float32 *tensor* because CUDA's eager ``tensor / python_scalar``
multiplies by the scalar's reciprocal instead; the kernel uses ``div_rn``. (vLLM runs its function through
``torch.compile``; on CPU the compiled and eager results are equal, see the engine tests. What inductor's
GPU code does for these divisions was not checked here: no GPU.)
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..layout.specs import FP8_BLOCK, QuantFormat, quant_format
from . import BACKENDS, resolve_backend
from .launcher import cached_table, interpreting, kernel_module, storage_view

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
AMAX_FLOOR = 1e-4  # amax is clamped to (float32) this before the division: all-zero blocks stay finite
SOURCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
Q_DTYPES = (FP8_DTYPE, torch.uint8)  # q_out: fp8 or a uint8 view of the same bytes
CACHE_SIZE = 256
# Mantissas probed per exponent for the UE8M0 table: at both ends of every binade.
UE8M0_PROBE = 1024

Item = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


# ---------------------------------------------------------------------------------------------------------
# blocks


def normalize_block(block: Sequence[int], ndim: int) -> tuple[int, ...]:
    """``block`` with one entry per dimension: missing leading entries are 1 (``(128, 128)`` for a 3-D
    tensor is ``(1, 128, 128)``). Entries must be positive ints; more entries than dims is an error."""
    try:
        entries = tuple(block)
    except TypeError:
        raise TypeError(f"block must be a sequence of ints, got {type(block).__name__}") from None
    if not entries or not all(isinstance(b, (int, np.integer)) and not isinstance(b, bool) for b in entries):
        raise TypeError(f"block must be a non-empty sequence of ints, got {block!r}")
    if any(b <= 0 for b in entries):
        raise ValueError(f"block entries must be > 0, got {tuple(int(b) for b in entries)}")
    if len(entries) > ndim:
        raise ValueError(f"block {tuple(int(b) for b in entries)} has more entries than the tensor has "
                         f"dims ({ndim})")
    return (1,) * (ndim - len(entries)) + tuple(int(b) for b in entries)


def scale_shape(shape: Sequence[int], block: Sequence[int]) -> tuple[int, ...]:
    """Shape of the scales of a tensor of ``shape``: ``ceil(shape[d] / block[d])`` per dimension."""
    blk = normalize_block(block, len(shape))
    return tuple(-(-int(n) // b) for n, b in zip(shape, blk, strict=True))


# ---------------------------------------------------------------------------------------------------------
# torch reference


def ue8m0_pow2(sf: torch.Tensor) -> torch.Tensor:
    """vLLM's ``_ceil_to_ue8m0``: ``2 ** ceil(log2(|sf|))`` with torch ops (the UE8M0 scale)."""
    return torch.pow(2.0, torch.ceil(torch.log2(sf.abs())))


def _check_source(x: torch.Tensor, what: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: expected a tensor, got {type(x).__name__}")
    if x.dtype not in SOURCE_DTYPES:
        raise TypeError(f"{what}: dtype {x.dtype} cannot be quantized; expected one of "
                        f"{', '.join(str(d) for d in SOURCE_DTYPES)}")
    if x.dim() == 0:
        raise ValueError(f"{what}: a 0-dim tensor has no blocks; give it at least one dimension")


def quantize_blocks(x: torch.Tensor, block: Sequence[int], ue8m0: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` (bf16 / fp16 / fp32, any strides) per block: ``(q, scale)``.

    ``q``: float8_e4m3fn, ``x.shape``, contiguous; ``scale``: float32 of :func:`scale_shape`, the
    dequantization multiplier of each block. For a 2-D ``x`` this is vLLM's ``per_block_cast_to_fp8(x,
    block, ue8m0)`` bit for bit (the same ops in the same order, with an IEEE division by 448 on every
    device; see the module docstring).
    """
    _check_source(x, "x")
    blk = normalize_block(block, x.dim())
    sshape = scale_shape(x.shape, blk)
    if x.numel() == 0:
        return (torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device),
                torch.empty(sshape, dtype=torch.float32, device=x.device))
    padded = tuple(s * b for s, b in zip(sshape, blk, strict=True))
    if padded == tuple(x.shape):  # whole blocks: no padded copy (zeros change no amax, see below)
        xp = x if x.is_contiguous() else x.contiguous()
    else:
        xp = torch.zeros(padded, dtype=x.dtype, device=x.device)
        xp[tuple(slice(0, n) for n in x.shape)] = x
    view_shape = tuple(v for s, b in zip(sshape, blk, strict=True) for v in (s, b))  # (n0, b0, n1, b1, ...)
    xv = xp.view(view_shape)
    inner = tuple(range(1, 2 * x.dim(), 2))
    # |x| and its max are exact in the source dtype, so taking the max before widening to fp32 gives vLLM's
    # ``x.abs().float().amax(...)`` bit for bit at a third of the memory traffic
    amax = xv.abs().amax(dim=inner, keepdim=True).float().clamp(AMAX_FLOOR)
    sf = amax / torch.full((), FP8_MAX, dtype=torch.float32, device=x.device)
    if ue8m0:
        sf = ue8m0_pow2(sf)
    q = (xv * (1.0 / sf)).to(FP8_DTYPE)
    q = q.view(padded)[tuple(slice(0, n) for n in x.shape)].contiguous()
    return q, sf.reshape(sshape)


def quantize_blocks_ref(x: torch.Tensor, block: Sequence[int], ue8m0: bool = False,
                        global_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Block FP8's reference in the :class:`~triton_reshard.layout.specs.QuantFormat` signature (:func:`quantize_blocks`)."""
    return quantize_blocks(x, block, ue8m0)


E8M0_NAN = 0xFF  # the E8M0 scale byte of a block holding a NaN (the OCP MX encoding of NaN)
FP32_TINY = torch.finfo(torch.float32).tiny


def quantize_mxfp8(x: torch.Tensor, block: Sequence[int] = (32,), ue8m0: bool = False,
                   global_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 (OCP MX, E4M3 values, one E8M0 byte per 32 elements along the last dim): ``(q, scale)``, ``q``
    float8_e4m3fn of ``x.shape``, ``scale`` uint8 ``[..., K // 32]``; the dequantized value is ``q * 2^(scale -
    127)``. vLLM 0.33's ``_mxfp8_e4m3_quantize_torch`` (``mxfp8_utils.py``) bit for bit on finite inputs:

    - ``amax = max |x|`` in float32, clamped to the smallest normal float32 (an all-zero block gets scale byte
      0, i.e. 2^-127, and zeros);
    - ``scale = clamp(ceil(log2(amax / 448)) + 127, 0, 254)`` (torch's float32 ``log2``; ``amax / 448`` an IEEE
      division); ``q = fp8(x / 2^(scale - 127))`` (exact scaling by a power of two, then torch's cast:
      round to nearest even);
    - non-finite: a block with ±inf gets scale 254 (as vLLM: its infinities saturate to ±448, its finite values
      flush towards 0); a block with a NaN gets scale byte 0xFF (E8M0's NaN; vLLM casts a NaN float to uint8
      there, which C leaves undefined: 0 on x86) and every value NaN (0x7F, as vLLM).

    ``block`` must be ``(..., 1, 32)`` (what :class:`~triton_reshard.layout.specs.BlockQuant` stores for MXFP8); the last
    dim a multiple of 32 (vLLM asserts it)."""
    _check_source(x, "x")
    blk = normalize_block(block, x.dim())
    if blk[-1] != 32 or any(b != 1 for b in blk[:-1]):
        raise ValueError(f"MXFP8 blocks 1x32 along the last dim, got block {blk}")
    if x.shape[-1] % 32:
        raise ValueError(f"MXFP8: the last dim ({x.shape[-1]}) must be a multiple of 32")
    nb = x.shape[-1] // 32
    xb = x.float().reshape(*x.shape[:-1], nb, 32)
    amax = xb.abs().amax(dim=-1).clamp(min=FP32_TINY)
    sb = torch.ceil(torch.log2(amax / torch.full((), FP8_MAX, dtype=torch.float32, device=x.device))) + 127.0
    sb = sb.clamp(0, 254)
    nan = torch.isnan(sb)
    scale = sb.nan_to_num(0.0).to(torch.uint8).masked_fill(nan, E8M0_NAN)
    q = (xb / torch.exp2(sb - 127.0).unsqueeze(-1)).to(FP8_DTYPE)
    if bool(nan.any()):  # every value of a NaN block is the positive NaN 0x7F (whatever sign its NaNs carry)
        q = q.view(torch.uint8).masked_fill(nan.unsqueeze(-1), 0x7F).view(FP8_DTYPE)
    return q.reshape(x.shape), scale


E2M1_MAX = 6.0
NVFP4_GLOBAL_NUM = E2M1_MAX * FP8_MAX  # 2688: global scale = 2688 / amax (ModelOpt, vLLM)
NVFP4_AMAX_FLOOR = 1e-8  # vLLM's online NVFP4 path clamps the tensor amax here
# E2M1 magnitudes by code (0..7); bit 3 of a nibble is the sign
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def nvfp4_global_scale(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(global_scale, weight_scale_2)`` float32 of a tensor (group) amax: ``gs = 2688 / max(amax, 1e-8)`` (the
    very torch expression vLLM uses: a Python float over a tensor, which torch computes as ``reciprocal * 2688``,
    one ulp off an IEEE division at times), the
    quantization multiplier ``ref_nvfp4_quant`` takes, and ``weight_scale_2 = 1 / gs``, the per-tensor decode
    multiplier a ModelOpt checkpoint stores (vLLM 0.33's ``online/nvfp4.py`` computes both so)."""
    a = amax.float().clamp_min(NVFP4_AMAX_FLOOR)
    gs = NVFP4_GLOBAL_NUM / a  # torch: a.reciprocal() * 2688 (a float / tensor), as vLLM writes it
    return gs, (1.0 / gs).to(torch.float32)


def _reciprocal(x: torch.Tensor) -> torch.Tensor:
    """vLLM's ``get_reciprocal``: ``1 / (x + (x == 0) * 1e8)``."""
    return 1.0 / (x + (x == 0) * 1e8)


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes (sign in bit 3, kept for -0.0) of float values that are E2M1 values (``cast_to_fp4``'s
    output)."""
    mag = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for k, m in enumerate(E2M1_VALUES[1:], 1):
        code = torch.where(mag == m, k, code).to(torch.uint8)
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def quantize_nvfp4(x: torch.Tensor, block: Sequence[int] = (16,), ue8m0: bool = False,
                   global_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 (ModelOpt, as vLLM loads it): ``(packed, scale)``: ``packed`` uint8 ``[..., K/2]``, two E2M1 codes a
    byte (element ``2i`` in the low nibble, ``2i+1`` in the high one: vLLM's ``break_fp4_bytes``), ``scale``
    float8_e4m3fn ``[..., K/16]``; ``global_scale``: the float32 quantization multiplier of the tensor (group)
    (:func:`nvfp4_global_scale`). The values and scales are vLLM 0.33's ``ref_nvfp4_quant(x, global_scale, 16)``
    (``nvfp4_emulation_utils.py``) bit for bit, the same torch ops in the same order:

    - ``scale = e4m3(clamp(gs * (max|x| * fp32(1/6)), -448, 448))`` per block of 16 along the last dim;
    - ``x * 1 / (scale * 1/gs)`` (``get_reciprocal``: a zero scale gives ``1e-8``), clamped to +-6, rounded to
      E2M1 by ``cast_to_fp4``'s thresholds (ties to the even code);
    - a negative value that rounds to zero keeps its sign bit (nibble 0x8: vLLM's float output is ``-0.0``
      there); an input ``-0.0`` gives 0x0 (vLLM multiplies by ``torch.sign(-0.0)``, which is ``0``).
      Non-finite inputs are refused before this (the global amax would be inf/NaN).
    """
    _check_source(x, "x")
    blk = normalize_block(block, x.dim())
    if blk[-1] != 16 or any(b != 1 for b in blk[:-1]):
        raise ValueError(f"NVFP4 blocks 1x16 along the last dim, got block {blk}")
    if x.shape[-1] % 16:
        raise ValueError(f"NVFP4: the last dim ({x.shape[-1]}) must be a multiple of 16")
    if global_scale is None:
        raise ValueError("NVFP4 needs the tensor's global scale (nvfp4_global_scale of its amax)")
    gs = global_scale.float().reshape(()).to(x.device)
    lead = x.shape[:-1]
    xb = x.reshape(-1, x.shape[-1] // 16, 16)
    vec_max = torch.max(torch.abs(xb), dim=-1, keepdim=True)[0].to(torch.float32)
    scale = gs * (vec_max * (1 / E2M1_MAX))
    scale = torch.clamp(scale, max=448, min=-448)
    scale = scale.to(torch.float8_e4m3fn).to(torch.float32)
    output_scale = _reciprocal(scale * _reciprocal(gs))
    scaled = xb.to(torch.float32) * output_scale
    v = torch.clamp(scaled, -6.0, 6.0)
    sign = torch.sign(v)
    a = torch.abs(v)
    a = torch.where((a >= 0.0) & (a <= 0.25), 0.0, a)
    a = torch.where((a > 0.25) & (a < 0.75), 0.5, a)
    a = torch.where((a >= 0.75) & (a <= 1.25), 1.0, a)
    a = torch.where((a > 1.25) & (a < 1.75), 1.5, a)
    a = torch.where((a >= 1.75) & (a <= 2.5), 2.0, a)
    a = torch.where((a > 2.5) & (a < 3.5), 3.0, a)
    a = torch.where((a >= 3.5) & (a <= 5.0), 4.0, a)
    a = torch.where(a > 5.0, 6.0, a)
    codes = e2m1_codes(a * sign).reshape(*lead, x.shape[-1])
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), scale.to(torch.float8_e4m3fn).reshape(*lead, x.shape[-1] // 16)


def dequantize_nvfp4(packed: torch.Tensor, scale: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """float32 values of NVFP4 data: ``e2m1 * (scale * weight_scale_2)`` (vLLM's ``dequantize_to_dtype``)."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(*packed.shape[:-1], -1).long()
    v = lut[codes & 7] * torch.where((codes & 8) > 0, -1.0, 1.0)
    s = (scale.float() * weight_scale_2.float().reshape(())).repeat_interleave(16, dim=-1)
    return v * s


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: Sequence[int],
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q.float() * scale`` with every scale broadcast over its block, cast to ``dtype``."""
    qf = (q.view(FP8_DTYPE) if q.dtype == torch.uint8 else q).float()
    blk = normalize_block(block, q.dim())
    if tuple(scale.shape) != scale_shape(q.shape, blk):
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match q {tuple(q.shape)} with block "
                         f"{blk}: expected {scale_shape(q.shape, blk)}")
    s = scale.float()
    for d, b in enumerate(blk):
        s = s.repeat_interleave(b, dim=d).narrow(d, 0, q.shape[d])
    return (qf * s).to(dtype)


# ---------------------------------------------------------------------------------------------------------
# validation


def validate_items(items: Sequence[Item], block: Sequence[int], fmt: QuantFormat = FP8_BLOCK,
                   ) -> tuple[torch.device | None, list[tuple[int, ...]]]:
    """Check every ``(src, q_out, s_out)`` item; return the common device and each item's normalized block.

    Raises TypeError / ValueError naming the item (by index) before anything is written.
    """
    device = None
    blocks = []
    n_fields = 4 if fmt.global_scale else 3
    for i, item in enumerate(items):
        if not isinstance(item, (tuple, list)) or len(item) != n_fields:
            if fmt.global_scale:
                raise TypeError(f"item {i}: {fmt.name} takes (src, q_out, s_out, global_scale) tensors, got "
                                f"{type(item).__name__} of {len(item) if isinstance(item, (tuple, list)) else '?'}")
            raise TypeError(f"item {i}: expected a (src, q_out, s_out) triple of tensors, got "
                            f"{type(item).__name__}")
        src, q, s = item[:3]
        if fmt.global_scale and (not isinstance(item[3], torch.Tensor) or item[3].numel() != 1
                                 or item[3].dtype != torch.float32):
            raise TypeError(f"item {i}: the global scale must be a one-element float32 tensor")
        for name, t in (("src", src), ("q_out", q), ("s_out", s)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"item {i}: {name} must be a tensor, got {type(t).__name__}")
        _check_source(src, f"item {i}: src")
        if q.dtype not in (fmt.value_dtype, torch.uint8):
            raise TypeError(f"item {i}: q_out has dtype {q.dtype}; expected {fmt.value_dtype} or a uint8 view "
                            "of the same bytes")
        if s.dtype != fmt.scale_dtype:
            raise TypeError(f"item {i}: s_out has dtype {s.dtype}; expected {fmt.scale_dtype} ({fmt.name} scales)")
        try:
            blk = normalize_block(block, src.dim())
        except (TypeError, ValueError) as e:
            raise type(e)(f"item {i}: {e}") from None
        if fmt.pack == 1 and q.shape != src.shape:
            raise ValueError(f"item {i}: q_out shape {tuple(q.shape)} != src shape {tuple(src.shape)}")
        want_q = tuple(src.shape[:-1]) + (src.shape[-1] // fmt.pack,)
        if tuple(q.shape) != want_q:
            raise ValueError(f"item {i}: q_out shape {tuple(q.shape)}; src {tuple(src.shape)} in {fmt.name} is "
                             f"{want_q}")
        want = scale_shape(src.shape, blk)
        if tuple(s.shape) != want:
            raise ValueError(f"item {i}: s_out shape {tuple(s.shape)}; src {tuple(src.shape)} with block {blk} "
                             f"has {want} blocks")
        if device is None:
            device = src.device
        if any(t.device != device for t in (src, q, s)):
            raise ValueError(f"item {i}: mixed devices: src on {src.device}, q_out on {q.device}, s_out on "
                             f"{s.device}, earlier items on {device}")
        for name, t in (("q_out", q), ("s_out", s)):
            if t.numel() > 1 and any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride(), strict=True)):
                raise ValueError(f"item {i}: {name} {tuple(t.shape)} with strides {t.stride()} writes some "
                                 "elements more than once")
        blocks.append(blk)
    return device, blocks


# ---------------------------------------------------------------------------------------------------------
# UE8M0 thresholds


_THRESHOLDS: dict[tuple[str, int | None], torch.Tensor] = {}


def ue8m0_thresholds(device: torch.device | str, full: bool = False) -> torch.Tensor:
    """int32[256]: for each biased float32 exponent ``e``, the first mantissa that torch's
    :func:`ue8m0_pow2` on ``device`` rounds up to ``2^(e - 126)`` (below it: ``2^(e - 127)``).

    Measured once per device on the first and last ``UE8M0_PROBE`` mantissas of every exponent a scale can
    have (``fp32(1e-4) / 448`` up to the largest float); the exact rule would give 1 everywhere. Raises if
    torch's results there are not of that form (the kernel could not reproduce them). In between the probe
    ends torch is taken to round up: checked over every float32 of the range on this machine's CPU
    (``tests/test_quant.py``, slow)."""
    dev = torch.device(device)
    cache_key = (dev.type, dev.index, full)
    cached = _THRESHOLDS.get(cache_key)
    if cached is not None:
        return cached
    # ``full``: every normal exponent (MXFP8's ``ceil(log2(amax / 448))`` reaches them all)
    lo = 1 if full else int(np.float32(np.float32(AMAX_FLOOR) / np.float32(FP8_MAX)).view(np.int32)) >> 23
    exps = torch.arange(lo, 255, dtype=torch.int64)
    mant = torch.cat([torch.arange(UE8M0_PROBE), torch.arange((1 << 23) - UE8M0_PROBE, 1 << 23)])
    bits = ((exps[:, None] << 23) | mant[None, :]).to(torch.int32)
    got = ue8m0_pow2(bits.view(torch.float32).to(dev)).cpu().view(torch.int32).to(torch.int64)
    down = got == (exps[:, None] << 23)
    upv = got == ((exps[:, None] + 1) << 23)
    thr = down[:, :UE8M0_PROBE].sum(dim=1)
    expect_down = mant[None, :] < thr[:, None]
    bad = ~((down & expect_down) | (upv & ~expect_down))
    if bool(bad.any()):
        r, c = (int(v) for v in bad.nonzero()[0])
        x = bits[r, c].view(torch.float32).item()
        raise RuntimeError(f"torch's pow(2, ceil(log2(x))) on {dev} gives {got[r, c].to(torch.int32).view(torch.float32).item()!r} "
                           f"for x = {x!r} (bits {int(bits[r, c]) & 0xFFFFFFFF:#010x}): not a threshold rule "
                           "the Triton UE8M0 path can reproduce")
    table = torch.ones(256, dtype=torch.int32)
    table[lo:255] = thr.to(torch.int32)
    if full:
        table[0] = _subnormal_threshold(dev)
    table = table.to(dev)
    _THRESHOLDS[cache_key] = table
    return table


def _subnormal_threshold(dev: torch.device) -> int:
    """MXFP8 on a subnormal ``y = amax / 448`` (amax below ~2^-117): the first mantissa (of ``y``'s bits) whose
    ``ceil(log2(y)) + 127`` torch gives as 1, not 0 (the exact rule: ``0x400001``, just above 2^-127; torch's
    float32 ``log2`` rounds the next few to -127 on this machine's CPU). Raises if torch's results are not 0
    below it and 1 from it on (the kernel could not reproduce them)."""
    m = torch.arange(1, 1 << 23, dtype=torch.int32)
    got = (torch.ceil(torch.log2(m.view(torch.float32).to(dev))) + 127.0).clamp(0, 254).cpu()
    ones = (got == 1).nonzero()
    t = int(ones[0]) + 1 if len(ones) else 1 << 23
    if not (bool((got[:t - 1] == 0).all()) and bool((got[t - 1:] == 1).all())):
        raise RuntimeError(f"torch's ceil(log2(y)) on {dev} for subnormal float32 y is not a threshold rule the "
                           "Triton MXFP8 path can reproduce")
    return t


# ---------------------------------------------------------------------------------------------------------
# Triton: tables, cache, launch


def tile_of(block: Sequence[int]) -> tuple[int, int]:
    """The ``(BM, BN)`` tile (powers of two) one program loads for ``block`` (its two inner extents)."""
    bm = block[-2] if len(block) > 1 else 1
    return 1 << (bm - 1).bit_length(), 1 << (block[-1] - 1).bit_length()


def _check_triton(device: torch.device, blocks: list[tuple[int, ...]]) -> None:
    from ..kernels import quant as k

    if interpreting():
        if device.type != "cpu":
            raise ValueError(f"under TRITON_INTERPRET=1 the Triton quantizer runs on CPU tensors, got {device}")
    elif device.type != "cuda":
        raise ValueError(f"the Triton quantizer needs CUDA tensors (or TRITON_INTERPRET=1 for CPU), got {device}")
    for blk in dict.fromkeys(blocks):
        if any(b != 1 for b in blk[:-2]):
            raise ValueError(f"block {blk}: the Triton quantizer blocks at most the two innermost dims (leading "
                             "entries must be 1); use backend='torch'")
        bm, bn = tile_of(blk)
        if bm * bn > k.MAX_TILE:
            raise ValueError(f"block {blk} needs a {bm}x{bn} tile; the Triton quantizer takes at most "
                             f"{k.MAX_TILE} elements per block (one program per block, e.g. 128x128)")


@dataclass(slots=True)
class QuantGroup:
    """One launch: every block of the items of one source dtype."""

    src_dtype: torch.dtype
    src_base: int  # item whose src storage is the source base pointer
    q_base: int
    s_base: int
    table: torch.Tensor  # int64[num_blocks, FIELDS] on the device
    num_blocks: int
    contig: bool = False  # every item has column stride 1 on both sides
    src_align: int = 1  # every block start and row stride is a multiple of this (source elements)
    q_align: int = 1  # the same for q (bytes)
    g_base: int | None = None  # item whose global-scale storage is the global-scale base pointer (NVFP4)


@dataclass(slots=True)
class QuantTable:
    signature: tuple
    device: torch.device
    tile: tuple[int, int]
    groups: list[QuantGroup] = field(default_factory=list)
    fallback: list[int] = field(default_factory=list)  # items quantized with torch (misaligned offsets)


def signature(items: Sequence[Item]) -> tuple:
    """Identity of a list of items: every pointer, shape and stride."""
    return tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for item in items for t in item)


def _block_rows(src: torch.Tensor, q: torch.Tensor, s: torch.Tensor, blk: tuple[int, ...],
                src_off: int, q_off: int, s_off: int, pack: int = 1, g_off: int = 0) -> np.ndarray:
    """Block rows (``kernels/quant.py`` layout) of one item, offsets relative to the group's bases (``pack``:
    logical elements a q byte holds; ``g_off``: its global scale's offset)."""
    from ..kernels import quant as k

    sshape = tuple(s.shape)
    idx = np.indices(sshape, dtype=np.int64).reshape(len(sshape), -1)  # block index per dim
    n = idx.shape[1]
    rows = np.zeros((n, int(k.FIELDS)), dtype=np.int64)
    soff = np.full(n, src_off, dtype=np.int64)
    qoff = np.full(n, q_off, dtype=np.int64)
    aoff = np.full(n, s_off, dtype=np.int64)
    qblk = blk[:-1] + (blk[-1] // pack,)
    for d in range(src.dim()):
        soff += idx[d] * (blk[d] * src.stride(d))
        qoff += idx[d] * (qblk[d] * q.stride(d))
        aoff += idx[d] * s.stride(d)
    rows[:, int(k.F_G)] = g_off
    rows[:, int(k.F_SRC)], rows[:, int(k.F_Q)], rows[:, int(k.F_S)] = soff, qoff, aoff
    ncol = src.shape[-1]
    rows[:, int(k.F_COLS)] = np.minimum(blk[-1], ncol - idx[-1] * blk[-1])
    rows[:, int(k.F_SCS)], rows[:, int(k.F_QCS)] = src.stride(-1), q.stride(-1)
    if src.dim() > 1:
        rows[:, int(k.F_ROWS)] = np.minimum(blk[-2], src.shape[-2] - idx[-2] * blk[-2])
        rows[:, int(k.F_SRS)], rows[:, int(k.F_QRS)] = src.stride(-2), q.stride(-2)
    else:
        rows[:, int(k.F_ROWS)] = 1
    return rows


def _base(tensors: list[torch.Tensor]) -> int:
    return min(range(len(tensors)), key=lambda j: tensors[j].untyped_storage().data_ptr())


def prepare(items: Sequence[Item], block: Sequence[int], fmt: QuantFormat = FP8_BLOCK) -> QuantTable:
    """Validate ``items`` and build the block table of every source-dtype group (on the device)."""
    device, blocks = validate_items(items, block, fmt)
    ssz = fmt.scale_bytes
    if device is None:
        raise ValueError("no items to quantize")
    _check_triton(device, blocks)
    table = QuantTable(signature=(tuple(block), fmt.name, signature(items)), device=device, tile=tile_of(blocks[0]))
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, (src, _q, _s, *_g) in enumerate(items):
        if src.numel():
            by_dtype.setdefault(src.dtype, []).append(i)
    host, built = [], []
    for dtype, members in by_dtype.items():
        sb = members[_base([items[i][0] for i in members])]
        qb = members[_base([items[i][1] for i in members])]
        ab = members[_base([items[i][2] for i in members])]
        sp0 = items[sb][0].untyped_storage().data_ptr()
        qp0 = items[qb][1].untyped_storage().data_ptr()
        ap0 = items[ab][2].untyped_storage().data_ptr()
        gb = members[_base([items[i][3] for i in members])] if fmt.global_scale else None
        gp0 = items[gb][3].untyped_storage().data_ptr() if fmt.global_scale else 0
        rows = []
        for i in members:
            src, q, s = items[i][:3]
            gbytes = items[i][3].data_ptr() - gp0 if fmt.global_scale else 0
            sbytes, qbytes, abytes = src.data_ptr() - sp0, q.data_ptr() - qp0, s.data_ptr() - ap0
            if sbytes % src.element_size() or abytes % ssz or gbytes % 4:
                table.fallback.append(i)  # not a whole number of elements from the base: torch does it
                continue
            rows.append(_block_rows(src, q, s, blocks[i], sbytes // src.element_size(), qbytes, abytes // ssz,
                                    fmt.pack, gbytes // 4))
        if rows:
            t = np.concatenate(rows)
            host.append(t.reshape(-1))
            built.append((dtype, sb, qb, ab, t.shape, _alignment(t, [items[i] for i in members], dtype), gb))
    table.fallback.sort()
    if built:
        flat = torch.from_numpy(np.concatenate(host)).to(device)
        off = 0
        for dtype, sb, qb, ab, shape, align, gb in built:
            t = flat[off:off + shape[0] * shape[1]].view(shape)
            off += t.numel()
            table.groups.append(QuantGroup(dtype, sb, qb, ab, t, shape[0], *align, g_base=gb))
    return table


def _pow2_divisor(values: np.ndarray, cap: int) -> int:
    """The largest power of two <= ``cap`` dividing every value."""
    g = int(np.gcd.reduce(np.abs(values))) if values.size else 0
    return cap if g == 0 else min(g & -g, cap)


def _alignment(rows: np.ndarray, items: Sequence[Item], dtype: torch.dtype) -> tuple[bool, int, int]:
    """``(contig, src_align, q_align)`` of a group's block rows (see ``kernels/quant.py``): vector
    widths of at most 16 bytes that every block start and row stride allow."""
    from ..kernels import quant as k

    if not all(src.stride(-1) == 1 and q.stride(-1) == 1 for src, q, *_ in items if src.numel()):
        return False, 1, 1
    src_vals = np.concatenate([rows[:, int(k.F_SRC)], rows[:, int(k.F_SRS)]])
    q_vals = np.concatenate([rows[:, int(k.F_Q)], rows[:, int(k.F_QRS)]])
    return True, _pow2_divisor(src_vals, 16 // dtype.itemsize), _pow2_divisor(q_vals, 16)


def get_kernel():
    """The quant kernel for the current mode (see :func:`~triton_reshard.ops.launcher.kernel_module`)."""
    from ..kernels import quant as kquant  # triton is imported only by the Triton backend

    return kernel_module(kquant, "quant_blocks_kernel").quant_blocks_kernel


# Elements of a block a program holds at once on a GPU (``RB`` rows of ``BN``), and per thread.
GPU_CHUNK = 2048
GPU_PER_THREAD = 16


def launch_params(bm: int, bn: int) -> tuple[int, int]:
    """``(RB, num_warps)``: rows per chunk and warps. Under the interpreter one chunk is the whole tile
    (every loop step costs Python time there); on a GPU chunks of ``GPU_CHUNK`` elements, 16 per thread
    (4 warps for 128x128 blocks in 16-row chunks, 1 warp for 16x16 blocks)."""
    if interpreting():
        return bm, 1
    rb = max(1, min(bm, GPU_CHUNK // bn))
    return rb, max(1, min(8, rb * bn // (32 * GPU_PER_THREAD)))


KERNEL_FMT = {"fp8-block": 0, "mxfp8": 1, "nvfp4": 2}  # formats with a kernel (quant_rows_kernel's FMT: 1, 2)


def get_rows_kernel():
    """The many-blocks-per-program kernel of 1 x B blocks (MXFP8, NVFP4: ``kernels/quant.quant_rows_kernel``)."""
    from ..kernels import quant as kquant

    return kernel_module(kquant, "quant_rows_kernel").quant_rows_kernel


def rows_per_program(bn: int) -> tuple[int, int]:
    """``(G, num_warps)`` of the 1 x B kernel: ``G`` blocks a program (a ``[G, bn]`` tile of ``GPU_CHUNK``
    elements on a GPU, 4 warps; under the interpreter 8x that: each program costs Python time there)."""
    g = max(1, GPU_CHUNK // bn)
    return (g * 8, 1) if interpreting() else (g, max(1, min(8, GPU_CHUNK // (32 * GPU_PER_THREAD))))


def launch(table: QuantTable, items: Sequence[Item], ue8m0: bool, block: Sequence[int],
           fmt: QuantFormat = FP8_BLOCK) -> None:
    """Run the blocks described by ``table`` (built from ``items`` or an identical list)."""
    if table.groups and fmt.block is not None:  # 1 x B blocks (MXFP8, NVFP4): many blocks per program
        kernel = get_rows_kernel()
        _bm, bn = table.tile
        g_rows, warps = rows_per_program(bn)
        mx = KERNEL_FMT[fmt.name]
        thr = ue8m0_thresholds(table.device, full=True) if mx == 1 else torch.ones(1, dtype=torch.int32,
                                                                                     device=table.device)
        for g in table.groups:
            bf16 = g.src_dtype == torch.bfloat16
            kernel[(triton_cdiv(g.num_blocks, g_rows),)](
                storage_view(items[g.src_base][0], torch.int16 if bf16 else g.src_dtype),
                storage_view(items[g.q_base][1], torch.uint8),
                storage_view(items[g.s_base][2], torch.uint8),
                g.table,
                thr,
                g.num_blocks,
                SRC_BF16=bf16,
                BN=bn,
                G=g_rows,
                CONTIG=g.contig,
                FMT=mx,
                g_ptr=storage_view(items[g.g_base][3], torch.float32) if g.g_base is not None else None,
                num_warps=warps,
            )
    elif table.groups:  # block FP8: one program per block
        kernel = get_kernel()
        bm, bn = table.tile
        rb, warps = launch_params(bm, bn)
        thr = ue8m0_thresholds(table.device) if ue8m0 else torch.ones(1, dtype=torch.int32, device=table.device)
        for g in table.groups:
            bf16 = g.src_dtype == torch.bfloat16
            kernel[(g.num_blocks,)](
                storage_view(items[g.src_base][0], torch.int16 if bf16 else g.src_dtype),
                storage_view(items[g.q_base][1], torch.uint8),
                storage_view(items[g.s_base][2], torch.float32),
                g.table,
                thr,
                g.num_blocks,
                SRC_BF16=bf16,
                UE8M0=bool(ue8m0),
                BM=bm,
                BN=bn,
                RB=rb,
                CONTIG=g.contig,
                SRC_ALIGN=g.src_align,
                Q_ALIGN=g.q_align,
                num_warps=warps,
            )
    if table.fallback:
        _torch_items([items[i] for i in table.fallback], block, ue8m0, fmt)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def reference(fmt: QuantFormat | str, x: torch.Tensor, block: Sequence[int], ue8m0: bool = False,
              global_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference quantizer of format ``fmt``: ``(values, scales)`` of ``x`` (its logical, unpacked
    shape). The format value (layout room) names its reference; this room holds the code."""
    fmt = quant_format(fmt)
    return globals()[fmt.reference](x, block, ue8m0=ue8m0, global_scale=global_scale)


def _torch_items(items: Sequence[Item], block: Sequence[int], ue8m0: bool, fmt: QuantFormat = FP8_BLOCK) -> None:
    for src, q, s, *g in items:
        if src.numel() == 0:
            continue
        qq, ss = reference(fmt, src, block, ue8m0, global_scale=g[0] if g else None)
        q.copy_(qq.view(torch.uint8) if q.dtype == torch.uint8 else qq)
        s.copy_(ss)


_CACHE: OrderedDict[Hashable, QuantTable] = OrderedDict()


def quantize_views(items: Sequence[Item], block: Sequence[int], ue8m0: bool = False,
                   backend: str | None = "torch", key: Hashable | None = None,
                   fmt: QuantFormat | str = FP8_BLOCK) -> None:
    """Quantize every ``(src, q_out, s_out)`` item per block into its caller-owned outputs.

    ``src``: bf16 / fp16 / fp32 view, any strides and storage offset; ``q_out``: float8_e4m3fn view or a
    uint8 view of the same bytes, ``src.shape``; ``s_out``: float32 view of ``scale_shape(src.shape,
    block)``. ``block`` as in :func:`normalize_block` (the same for every item). Each ``src`` is blocked from
    its first element: it must start on a block boundary of its global tensor, and only its last block along
    a dim may be partial (the global edge). Outputs of different items must not overlap one another or any
    source (the Triton backend writes them in parallel).

    ``backend``: ``"torch"`` (the reference per item), ``"triton"`` (one launch per source dtype for all
    blocks of all items; CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``) or ``None`` (as
    :func:`triton_reshard.ops.resolve_backend`). ``key``: as in ``triton_copy_views``, a hashable naming a
    list that recurs; its block table is cached and rebuilt when any pointer, shape or stride changed.

    ``fmt``: the :class:`~triton_reshard.layout.specs.QuantFormat` (or its name) picks the quantizer: block FP8 (above),
    MXFP8 (``q_out`` float8_e4m3fn, ``s_out`` uint8 E8M0 of ``[..., K // 32]``; ``block`` ``(..., 1, 32)``),
    NVFP4 (items ``(src, q_out, s_out, global_scale)``: ``q_out`` uint8 ``[..., K/2]`` packed pairs, ``s_out``
    float8_e4m3fn ``[..., K/16]``, ``global_scale`` the float32 one-element multiplier of the item's tensor;
    ``block`` ``(..., 1, 16)`` in logical elements).
    """
    if not items:
        return
    fmt = quant_format(fmt)
    if backend is None:
        first = items[0][0] if isinstance(items[0], (tuple, list)) and items[0] else None
        backend = resolve_backend(first.device if isinstance(first, torch.Tensor) else None)
    if backend not in BACKENDS:
        raise ValueError(f"unknown quantize backend {backend!r}; expected one of {BACKENDS}")
    with torch.no_grad():
        if backend == "torch":
            validate_items(items, block, fmt)
            _torch_items(items, block, ue8m0, fmt)
            return
        if fmt.name not in KERNEL_FMT:
            return _other_kernels(items, block, fmt, key)
        if key is None:
            launch(prepare(items, block, fmt), items, ue8m0, block, fmt)
            return
        table = cached_table(_CACHE, key, lambda: (tuple(block), fmt.name, signature(items)),
                             lambda: prepare(items, block, fmt), CACHE_SIZE)
        launch(table, items, ue8m0, block, fmt)


def _other_kernels(items, block, fmt: QuantFormat, key) -> None:
    raise NotImplementedError(f"no Triton quantizer for format {fmt.name!r} yet; use backend='torch'")


def clear_cache() -> None:
    """Forget every cached block table (and the UE8M0 thresholds)."""
    _CACHE.clear()
    _THRESHOLDS.clear()


def blocks_count(shape: Sequence[int], block: Sequence[int]) -> int:
    """Number of blocks (= programs of the Triton backend) of a tensor of ``shape``."""
    return math.prod(scale_shape(shape, block))
