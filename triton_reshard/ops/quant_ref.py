"""The torch reference quantizers (any device): block FP8 (vLLM's ``per_block_cast_to_fp8``), MXFP8 and
NVFP4, their dequantizers, and :func:`reference`, which picks one by format. The numbers they follow, and the
one-launch Triton kernel that must equal them bit for bit, are described in :mod:`~triton_reshard.ops.quantize`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..layout.formats import QuantFormat, quant_format

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
AMAX_FLOOR = 1e-4  # amax is clamped to (float32) this before the division: all-zero blocks stay finite
SOURCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

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


def check_source(x: torch.Tensor, what: str) -> None:
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
    check_source(x, "x")
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
    check_source(x, "x")
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


def global_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(global_scale, weight_scale_2)`` of each tensor group's amax, for the formats with a global scale
    (``QuantFormat.global_scale``; the one such format's rule, :func:`nvfp4_global_scale`)."""
    return nvfp4_global_scale(amax)


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
    check_source(x, "x")
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

def reference(fmt: QuantFormat | str, x: torch.Tensor, block: Sequence[int], ue8m0: bool = False,
              global_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference quantizer of format ``fmt``: ``(values, scales)`` of ``x`` (its logical, unpacked
    shape). The format value (layout room) names its reference; this room holds the code."""
    fmt = quant_format(fmt)
    return globals()[fmt.reference](x, block, ue8m0=ue8m0, global_scale=global_scale)
