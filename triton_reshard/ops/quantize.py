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

from ..layout.formats import FP8_BLOCK, MXFP8, NVFP4, QuantFormat, quant_format
from . import BACKENDS, resolve_backend
from .launcher import cached_table, interpreting, kernel_module, storage_view
from .quant_ref import (  # noqa: F401  (re-exported: the reference quantizers lived here)
    AMAX_FLOOR,
    FP8_DTYPE,
    FP8_MAX,
    SOURCE_DTYPES,
    check_source,
    dequantize_blocks,
    dequantize_nvfp4,
    e2m1_codes,
    global_scales,
    normalize_block,
    nvfp4_global_scale,
    quantize_blocks,
    quantize_blocks_ref,
    quantize_mxfp8,
    quantize_nvfp4,
    reference,
    scale_shape,
    ue8m0_pow2,
)

Q_DTYPES = (FP8_DTYPE, torch.uint8)  # q_out: fp8 or a uint8 view of the same bytes
CACHE_SIZE = 256
# Mantissas probed per exponent for the UE8M0 table: at both ends of every binade.
UE8M0_PROBE = 1024

Item = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


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
        check_source(src, f"item {i}: src")
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
    msg_of: np.ndarray | None = None  # the digest: each block row's message (``ops/quant_digest.py``)
    slots: int = 1  # the digest: partial sums per program
    slot_msg: torch.Tensor | None = None  # the digest: each partial's message (int64 on the device)


@dataclass(slots=True)
class QuantTable:
    signature: tuple
    device: torch.device
    tile: tuple[int, int]
    groups: list[QuantGroup] = field(default_factory=list)
    fallback: list[int] = field(default_factory=list)  # items quantized with torch (misaligned offsets)
    msgs: object = None  # the digest: the messages (``ops.copy.Messages``) the kernels hash
    covered: list | None = None  # the digest: per message, the byte ranges the kernels write


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


def _message_fields(msgs, q: torch.Tensor, s: torch.Tensor, qp0: int, ap0: int) -> tuple | None:
    """The digest's fields of an item whose values ``q`` and scales ``s`` lie in one of ``msgs``: (message,
    its ``F_QM`` / ``F_SM`` / ``F_MLEN``, the two byte ranges written), else None (torch quantizes it; its bytes
    are hashed from the message)."""
    wq, ws = msgs.find(q), msgs.find(s)
    if wq is None or ws is None or wq[0] != ws[0]:
        return None
    m, (mp, mlen) = wq[0], msgs.spans[wq[0]]
    cover = [(wq[1], wq[1] + q.numel()), (ws[1], ws[1] + s.numel() * s.element_size())]
    return m, (mp - qp0, mp - ap0, mlen), cover


def prepare(items: Sequence[Item], block: Sequence[int], fmt: QuantFormat = FP8_BLOCK, msgs=None) -> QuantTable:
    """Validate ``items`` and build the block table of every source-dtype group (on the device); with ``msgs``
    (``ops.copy.Messages``, the digest's), also each block's message fields (``ops/quant_digest.py``)."""
    from ..kernels import quant as k

    device, blocks = validate_items(items, block, fmt)
    ssz = fmt.scale_bytes
    if device is None:
        raise ValueError("no items to quantize")
    _check_triton(device, blocks)
    table = QuantTable(signature=(tuple(block), fmt.name, signature(items)), device=device, tile=tile_of(blocks[0]),
                       msgs=msgs, covered=None if msgs is None else [[] for _ in msgs.spans])
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
        rows, msg_of = [], []
        for i in members:
            src, q, s = items[i][:3]
            gbytes = items[i][3].data_ptr() - gp0 if fmt.global_scale else 0
            sbytes, qbytes, abytes = src.data_ptr() - sp0, q.data_ptr() - qp0, s.data_ptr() - ap0
            where = _message_fields(msgs, q, s, qp0, ap0) if msgs is not None else (0, (0, 0, 0), ())
            if sbytes % src.element_size() or abytes % ssz or gbytes % 4 or where is None:
                table.fallback.append(i)  # not a whole number of elements from the base: torch does it
                continue
            r = _block_rows(src, q, s, blocks[i], sbytes // src.element_size(), qbytes, abytes // ssz, fmt.pack,
                            gbytes // 4)
            r[:, int(k.F_QM)], r[:, int(k.F_SM)], r[:, int(k.F_MLEN)] = where[1]
            rows.append(r)
            msg_of.append(np.full(len(r), where[0], dtype=np.int64))
            if msgs is not None:
                table.covered[where[0]] += where[2]
        if rows:
            t = np.concatenate(rows)
            host.append(t.reshape(-1))
            built.append((dtype, sb, qb, ab, t.shape, _alignment(t, [items[i] for i in members], dtype), gb,
                          np.concatenate(msg_of)))
    table.fallback.sort()
    if built:
        flat = torch.from_numpy(np.concatenate(host)).to(device)
        off = 0
        for dtype, sb, qb, ab, shape, align, gb, msg_of in built:
            t = flat[off:off + shape[0] * shape[1]].view(shape)
            off += t.numel()
            table.groups.append(QuantGroup(dtype, sb, qb, ab, t, shape[0], *align, g_base=gb,
                                           msg_of=msg_of if msgs is not None else None))
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


KERNEL_FMT = {FP8_BLOCK: 0, MXFP8: 1, NVFP4: 2}  # formats with a kernel (quant_rows_kernel's FMT: 1, 2)


def get_rows_kernel():
    """The many-blocks-per-program kernel of 1 x B blocks (MXFP8, NVFP4: ``kernels/quant.quant_rows_kernel``)."""
    from ..kernels import quant as kquant

    return kernel_module(kquant, "quant_rows_kernel").quant_rows_kernel


def rows_per_program(bn: int) -> tuple[int, int]:
    """``(G, num_warps)`` of the 1 x B kernel: ``G`` blocks a program (a ``[G, bn]`` tile of ``GPU_CHUNK``
    elements on a GPU, 4 warps; under the interpreter 8x that: each program costs Python time there)."""
    g = max(1, GPU_CHUNK // bn)
    return (g * 8, 1) if interpreting() else (g, max(1, min(8, GPU_CHUNK // (32 * GPU_PER_THREAD))))


def _digest_args(g: QuantGroup, coef: torch.Tensor | None, nprog: int) -> tuple[dict, torch.Tensor | None]:
    """The digest's kernel arguments of group ``g`` (none without ``coef`` or a slot table) and its partials."""
    if coef is None or g.slot_msg is None:
        return {}, None
    part = torch.zeros(nprog * g.slots, dtype=torch.int64, device=coef.device)
    return {"coef_ptr": coef, "sums_ptr": part, "DIGEST": True}, part


def launch(table: QuantTable, items: Sequence[Item], ue8m0: bool, block: Sequence[int],
           fmt: QuantFormat = FP8_BLOCK, coef: torch.Tensor | None = None) -> torch.Tensor | None:
    """Run the blocks described by ``table`` (built from ``items`` or an identical list). With ``coef`` (int64
    keyed coefficients on the device) and a table built for the digest (``ops/quant_digest.py``): the
    per-message digest sums of the bytes the kernels wrote (int64 on the device, mod 2**64), else None."""
    sums = None
    if coef is not None and table.msgs is not None:
        sums = torch.zeros(len(table.msgs.spans) + 1, dtype=torch.int64, device=table.device)
    if table.groups and fmt.block is not None:  # 1 x B blocks (MXFP8, NVFP4): many blocks per program
        kernel = get_rows_kernel()
        _bm, bn = table.tile
        g_rows, warps = rows_per_program(bn)
        mx = KERNEL_FMT[fmt]
        thr = ue8m0_thresholds(table.device, full=True) if mx == 1 else torch.ones(1, dtype=torch.int32,
                                                                                     device=table.device)
        for g in table.groups:
            bf16 = g.src_dtype == torch.bfloat16
            dg, part = _digest_args(g, coef, triton_cdiv(g.num_blocks, g_rows))
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
                **dg,
                **({"SLOTS": g.slots} if dg else {}),
            )
            if part is not None:
                sums.index_add_(0, g.slot_msg, part)
    elif table.groups:  # block FP8: one program per block
        kernel = get_kernel()
        bm, bn = table.tile
        rb, warps = launch_params(bm, bn)
        thr = ue8m0_thresholds(table.device) if ue8m0 else torch.ones(1, dtype=torch.int32, device=table.device)
        for g in table.groups:
            bf16 = g.src_dtype == torch.bfloat16
            dg, part = _digest_args(g, coef, g.num_blocks)
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
                **dg,
            )
            if part is not None:
                sums.index_add_(0, g.slot_msg, part)
    if table.fallback:
        _torch_items([items[i] for i in table.fallback], block, ue8m0, fmt)
    return None if sums is None else sums[:-1]


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


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
        if fmt not in KERNEL_FMT:
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
