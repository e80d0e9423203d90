"""Bare Triton kernel that quantizes many blocks of many tensors to block-FP8 (float8_e4m3fn) in one launch.

The launcher (``triton_reshard/ops/quantize.py``) cuts every ``(src, q_out, s_out)`` item into its quantization
blocks and writes one *block row* per block; **one program quantizes one block**. The numerics are those of
the torch reference ``triton_reshard.ops.quantize.quantize_blocks`` (itself vLLM's ``per_block_cast_to_fp8``):

    amax = max |x| over the block (zero padding of an edge block adds nothing: |0| never raises a max)
    amax = max(amax, AMAX_FLOOR)                    (NaN stays NaN, as torch's clamp)
    sf   = amax / FP8_MAX                           (IEEE division, ``div_rn``)
    sf   = 2 ** ceil(log2(sf))                      (UE8M0 only; see ``_ue8m0``)
    q    = fp8(x * (1 / sf))                        (fp32 multiply by the IEEE reciprocal)

**Why a block needs nothing from other programs.** The launcher requires every block to fit one tile of
``BM x BN`` elements (``BM``/``BN``: powers of two >= the block's two inner extents, ``BM * BN <= 16384``,
i.e. up to 128x128), and the program that owns a block walks all of it (masked to its real extents) in
chunks of ``RB`` rows: a first pass reduces the block's amax over every chunk, a second quantizes and
stores them. The amax, the scale, the reciprocal and every quantized element of the block are therefore
computed inside that one program: no cross-program reduction, no atomics, no ordering between programs.
Blocks never overlap, so programs write disjoint outputs.

Block table: ``int64[num_blocks, FIELDS]``, one row per block, fields at the ``F_*`` indices:

- ``F_SRC``: element offset of the block's first element from ``src_ptr`` (in source elements);
- ``F_Q``: byte offset of its first quantized element from ``q_ptr`` (q travels as uint8 bits);
- ``F_S``: element offset of the block's scale from ``s_ptr`` (float32);
- ``F_ROWS`` / ``F_COLS``: the block's real extents (< BM / BN only for blocks at a tensor's edge);
- ``F_SRS`` / ``F_SCS``: source element strides of the block's row / column dimension;
- ``F_QRS`` / ``F_QCS``: the same for q (bytes = elements: fp8 is one byte; NVFP4: packed bytes);
- ``F_G``: element offset of the block's global scale from ``g_ptr`` (float32; NVFP4 only);
- ``F_QM`` / ``F_SM`` / ``F_MLEN`` / ``F_SLOT`` (the integrity digest, issue 46; read only with ``DIGEST``): the
  byte offset of the block's message from ``q_ptr``'s and from ``s_ptr``'s storage start, the message's length
  in bytes, and (:func:`quant_rows_kernel` only) the slot of its program's partial sums the block adds to:
  ``sums_ptr[program_id * SLOTS + F_SLOT]`` (:func:`quant_blocks_kernel` stores at ``sums_ptr[program_id]``).

**The digest** (``DIGEST``): each program also hashes the bytes it writes into its message (the quantized
values and the scale, at their message positions), as ``csrc/digest.c`` defines the hash (linear in the
bytes: a byte ``b`` at message byte ``p`` adds ``b << 8 (p % 8)`` times the coefficient of its 1 KiB row, a
tail byte its own coefficient), so the launcher's per-message sum of the partials equals the CPU digest of
the bytes written (``ops/quant_digest.py``).

The fp32 -> e4m3fn conversion is done on the bits (``_e4m3fn_bits``): it reproduces torch's
``Tensor.to(torch.float8_e4m3fn)`` (c10 ``fp8e4m3fn_from_fp32_value``: round to nearest even, subnormals
down to 2^-9, finite overflow and +-inf saturate to +-448, NaN -> 0x7F with the sign bit) on every
platform. Triton's own ``.to(tl.float8e4nv)`` is not that in the interpreter (Triton 3.8: 179 of 1031
values around every e4m3fn rounding boundary differ: ties are not rounded to even, 500 -> 0x78, inf -> 0x78,
NaN -> 0x7C) and is the hardware's ``cvt.rn.satfinite`` on GPUs. Only integer operations are used, so no
fused multiply-add can change a rounding.
"""

import triton
import triton.language as tl

# Table layout, shared with the launcher (constexpr so the kernel may read them; ``int()`` on the host).
F_SRC = tl.constexpr(0)
F_Q = tl.constexpr(1)
F_S = tl.constexpr(2)
F_ROWS = tl.constexpr(3)
F_COLS = tl.constexpr(4)
F_SRS = tl.constexpr(5)
F_SCS = tl.constexpr(6)
F_QRS = tl.constexpr(7)
F_QCS = tl.constexpr(8)
F_G = tl.constexpr(9)
F_QM = tl.constexpr(10)
F_SM = tl.constexpr(11)
F_MLEN = tl.constexpr(12)
F_SLOT = tl.constexpr(13)
FIELDS = tl.constexpr(14)
# Largest tile (BM * BN elements) one program takes: a 128x128 block.
MAX_TILE = 16384
# fp32 bits of the constants: 448.0 (float8_e4m3fn max) and float32(1e-4) (the amax floor, what torch's
# ``clamp(1e-4)`` compares with on a float32 tensor).
FP8_MAX_BITS = tl.constexpr(0x43E00000)
AMAX_FLOOR_BITS = tl.constexpr(0x38D1B717)
DO_NOT_SPECIALIZE = ("num_blocks",)
DO_NOT_SPECIALIZE_ON_ALIGNMENT = ("table_ptr", "coef_ptr", "sums_ptr")


@triton.jit
def _f32(bits):
    """A float32 scalar with the given bit pattern."""
    return tl.full([], bits, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _terms(w, p, mask, mlen, coef_ptr, E: tl.constexpr):
    """The digest's terms (int64, mod 2**64; 0 where not ``mask``) of ``E``-byte values whose bits are ``w``
    (zero-extended int64) at message byte ``p`` (a multiple of ``E``) of an ``mlen``-byte message: a word's
    byte adds ``b << 8 (p % 8)`` times its row's coefficient, a tail byte (past the last whole word) its own
    coefficient, after the rows' (``csrc/digest.c``; ``kernels/copy.py``'s ``_digest``, not reduced)."""
    lim = mlen // 8 * 8
    body = mask & (p < lim)
    c = tl.load(coef_ptr + (p >> 10), mask=body, other=0)
    h = tl.where(body, c * (w << ((p & 7) * 8)), 0)
    rows = (mlen // 8 + 127) // 128
    for j in tl.static_range(E):
        q = p + j
        tail = mask & (q >= lim) & (q < mlen)
        cj = tl.load(coef_ptr + (rows + q - lim), mask=tail, other=0)
        h += tl.where(tail, cj * ((w >> (8 * j)) & 255), 0)
    return h


@triton.jit
def _isum(x, AXIS: tl.constexpr):
    """``tl.sum`` of int64 terms (along ``AXIS``; None: all), written as in ``_block_amax`` (see there)."""
    return tl.reduce(x, AXIS, tl.standard._sum_combine)


@triton.jit
def _msg_fields(row, zero, DIGEST: tl.constexpr):
    """A block row's ``F_QM``, ``F_SM``, ``F_MLEN`` (the digest's; ``zero`` each without it)."""
    if DIGEST:
        return tl.load(row + F_QM), tl.load(row + F_SM), tl.load(row + F_MLEN)
    return zero, zero, zero


@triton.jit
def _e4m3fn_bits(y):
    """float32 -> float8_e4m3fn bits (int32 in 0..255), exactly as torch's ``.to(torch.float8_e4m3fn)``."""
    b = y.to(tl.int32, bitcast=True)
    sign = (b >> 24) & 0x80
    a = b & 0x7FFFFFFF
    # |y| < 2^-6 (below the smallest e4m3fn normal): round |y| / 2^-9 to nearest even in integers. The
    # significand M (implicit bit included) times 2^(E - 150) is |y|; in units of 2^-9 that is
    # M >> (141 - E). E <= 120 here, so the shift is >= 21; it is capped at 31, where M (< 2^24) is below
    # half a unit and rounds to 0, as every shift >= 25 does. (The floor of 21 only keeps the shift defined
    # in lanes that take another branch.)
    e = a >> 23
    m = (a & 0x7FFFFF) | tl.where(e > 0, 0x800000, 0)
    sh = tl.maximum(tl.minimum(141 - e, 31), 21)
    q = m >> sh
    rem = m & ((1 << sh) - 1)
    half = 1 << (sh - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    sub = q + up.to(tl.int32)
    # 2^-6 <= |y| < 480: rebias the exponent (127 -> 7) and round the mantissa to 3 bits, to nearest even
    # (the +0x7FFFF +odd bias of c10). c10 also maps a carry into the NaN pattern 0x7F to 448; below 464 no
    # carry reaches it (464 is the midpoint 448 | 480 and goes to the branch below), kept as in c10.
    odd = (a >> 20) & 1
    nrm = ((a - (120 << 23) + 0x7FFFF + odd) >> 20) & 0xFF
    nrm = tl.where(nrm == 0x7F, 0x7E, nrm)
    # |y| >= 480 (the first value that does not round to 448) or inf: 448; NaN: 0x7F.
    big = tl.where(a > 0x7F800000, 0x7F, 0x7E)
    res = tl.where(a >= (1087 << 20), big, tl.where(a < (121 << 23), sub, nrm))
    return res | sign


@triton.jit
def _ue8m0(sf, thr_ptr):
    """torch's ``pow(2, ceil(log2(sf)))`` for a positive float32 ``sf`` (inf and NaN pass unchanged).

    The exact rule is "the exponent, plus one unless the mantissa is zero". torch's formula rounds
    ``log2`` to float32 first, so a mantissa of a few ulps above zero can round ``log2`` down to the
    integer and keep the exponent; ``thr_ptr[e]`` (int32[256], measured with torch on this device by the
    launcher) is the first mantissa, for biased exponent ``e``, that torch rounds up.
    """
    b = sf.to(tl.int32, bitcast=True)
    e = (b >> 23) & 0xFF
    m = b & 0x7FFFFF
    t = tl.load(thr_ptr + e)
    e2 = e + (m >= t).to(tl.int32)
    p = (e2 << 23).to(tl.float32, bitcast=True)
    return tl.where(e == 255, sf, p)


@triton.jit
def _load_chunk(src_ptr, src0, r, c, rows, cols, srs, scs, SRC_BF16: tl.constexpr, FULL_WIDTH: tl.constexpr):
    """Rows ``r`` (a column of row indices) x columns ``c`` of a block as float32; 0 outside the block.

    ``FULL_WIDTH``: the block has all ``BN`` columns, so the mask is constant along a row (which lets the
    compiler vectorize contiguous rows)."""
    mask = (r < rows) & (c < c.shape[1]) if FULL_WIDTH else (r < rows) & (c < cols)
    x = tl.load(src_ptr + (src0 + r.to(tl.int64) * srs + c * scs), mask=mask, other=0)
    if SRC_BF16:
        # bf16 -> fp32 is exact: the bf16 bits are the top half of the fp32 bits.
        x = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        x = x.to(tl.float32)
    return x, mask


@triton.jit
def _quant_chunk(src_ptr, q_ptr, src0, q0, r, c, rows, cols, srs, scs, qrs, qcs, inv, qm, mlen, coef_ptr,
                 SRC_BF16: tl.constexpr, FULL_WIDTH: tl.constexpr, DIGEST: tl.constexpr):
    """Quantize rows ``r`` of a block with the reciprocal scale ``inv`` and store their fp8 bits; the digest
    sum of the bytes stored (``DIGEST``: message at byte ``qm`` of ``q_ptr``, ``mlen`` bytes), else 0."""
    x, mask = _load_chunk(src_ptr, src0, r, c, rows, cols, srs, scs, SRC_BF16, FULL_WIDTH)
    code = _e4m3fn_bits(x * inv)
    qoff = q0 + r.to(tl.int64) * qrs + c * qcs
    tl.store(q_ptr + qoff, code.to(tl.uint8), mask=mask)
    h = q0 * 0
    if DIGEST:
        h += _isum(_terms(code.to(tl.int64), qoff - qm, mask, mlen, coef_ptr, 1), None)
    return h


@triton.jit
def _mx_scale(amax, has_nan, thr_ptr):
    """MXFP8's E8M0 scale byte and the reciprocal of its power of two, for a block amax (vLLM's
    ``clamp(ceil(log2(max(amax, tiny) / 448)) + 127, 0, 254)``; NaN: byte 0xFF and a NaN reciprocal).

    ``y = amax / 448`` (IEEE). A normal ``y`` with biased exponent ``e`` and mantissa ``m`` has ``ceil(log2 y) + 127
    = e + (m >= thr[e])`` (``thr``: torch's rounding of ``log2``, measured as for UE8M0). A subnormal ``y`` (amax
    below ~2^-117) has ``e = 0``: 1 from the measured mantissa ``thr[0]`` on (torch's ``log2`` rounds a few
    mantissas above 2^-127 to -127; the exact rule would start at ``0x400001``), else 0; inf gives 254."""
    tiny = _f32(0x00800000)
    a = tl.where(amax < tiny, tiny, amax)
    y = tl.math.div_rn(a, _f32(FP8_MAX_BITS))
    b = y.to(tl.int32, bitcast=True)
    e = (b >> 23) & 0xFF
    m = b & 0x7FFFFF
    t = tl.load(thr_ptr + e)
    sb = tl.where(e == 0, (m >= t).to(tl.int32), e + (m >= t).to(tl.int32))
    sb = tl.minimum(tl.where(e == 255, 254, sb), 254)
    # 2^(127 - sb): biased exponent 254 - sb; sb = 254 (an inf block) is the subnormal 2^-127
    inv = tl.where(sb == 254, 0x00400000, (254 - sb) << 23).to(tl.float32, bitcast=True)
    inv = tl.where(has_nan > 0, float("nan"), inv)
    sb = tl.where(has_nan > 0, 255, sb)
    return sb, inv


@triton.jit
def _e4m3_value(code):
    """float32 value of float8_e4m3fn bits ``code`` (0..0x7E; exact)."""
    e = (code >> 3) & 0xF
    m = code & 0x7
    nrm = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * _f32(0x3B000000)  # m * 2^-9
    return tl.where(e == 0, sub, nrm)


@triton.jit
def _block_amax(src_ptr, src0, rr, c, rows, cols, srs, scs, SRC_BF16: tl.constexpr, BN: tl.constexpr,
                RB: tl.constexpr):
    """Pass 1 of :func:`quant_blocks_kernel`: the block's amax, floored at ``AMAX_FLOOR_BITS``, NaN if any
    element is NaN. Masked lanes hold 0 and cannot raise it. NaN is tracked explicitly (torch's amax and
    clamp keep it; a max on the GPU and the interpreter's np.nanmax drop it). ``tl.reduce`` with the combine
    function of ``tl.max`` is ``tl.max`` itself, but also works when triton.language was imported before
    TRITON_INTERPRET=1 was set (``tl.max`` is then a compiled-mode JITFunction the interpreter refuses to
    call; the interpreter recognizes this combine function: np.nanmax)."""
    amax = tl.full([], 0.0, tl.float32)
    has_nan = tl.full([], 0, tl.int32)
    for r0 in range(0, rows, RB):
        if cols == BN:
            x, _ = _load_chunk(src_ptr, src0, r0 + rr, c, rows, cols, srs, scs, SRC_BF16, True)
        else:
            x, _ = _load_chunk(src_ptr, src0, r0 + rr, c, rows, cols, srs, scs, SRC_BF16, False)
        amax = tl.maximum(amax, tl.reduce(tl.abs(x), None, tl.standard._elementwise_max))
        has_nan = tl.maximum(has_nan, tl.reduce((x != x).to(tl.int32), None, tl.standard._elementwise_max))
    amax = tl.where(has_nan > 0, float("nan"), amax)
    floor = _f32(AMAX_FLOOR_BITS)
    return tl.where(amax < floor, floor, amax)


@triton.jit(do_not_specialize=DO_NOT_SPECIALIZE, do_not_specialize_on_alignment=DO_NOT_SPECIALIZE_ON_ALIGNMENT)
def quant_blocks_kernel(
    src_ptr,
    q_ptr,
    s_ptr,
    table_ptr,
    thr_ptr,
    num_blocks,
    SRC_BF16: tl.constexpr,
    UE8M0: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    RB: tl.constexpr,
    CONTIG: tl.constexpr,
    SRC_ALIGN: tl.constexpr,
    Q_ALIGN: tl.constexpr,
    coef_ptr=None,
    sums_ptr=None,
    DIGEST: tl.constexpr = False,
):
    """Quantize block ``program_id`` of the block table (layout in the module docstring): block FP8 (MXFP8 and
    NVFP4, 1 x B blocks, run many blocks a program in :func:`quant_rows_kernel`).

    ``src_ptr``: the source storage (int16 bits when ``SRC_BF16``, else float16 / float32);
    ``q_ptr``: uint8 storage of the quantized bytes; ``s_ptr``: float32 storage of the scales;
    ``thr_ptr``: the UE8M0 thresholds (read only when ``UE8M0``); ``BM`` x ``BN``: the tile.

    The block is walked in chunks of ``RB`` rows, twice: once for the amax, once to quantize and store
    (the second read of the block, at most 64 KiB, mostly hits in cache). Holding the whole 128x128 tile
    at once would keep 64 values and their 64-bit addresses per thread live (255 registers and spills on
    sm_90 at 8 warps). ``CONTIG``: every item has column stride 1 on both sides; ``SRC_ALIGN`` /
    ``Q_ALIGN``: every block's start and row stride are multiples of these (elements), which lets the
    compiler use vector loads and stores. ``DIGEST``: also the digest sum of the block's bytes written into its
    message (values and scale; ``coef_ptr``: the keyed coefficients), stored at ``sums_ptr[F_SLOT]``.
    """
    pid = tl.program_id(0).to(tl.int64)
    if pid < num_blocks:
        row = table_ptr + pid * FIELDS
        src0 = tl.load(row + F_SRC)
        q0 = tl.load(row + F_Q)
        s0 = tl.load(row + F_S)
        rows = tl.load(row + F_ROWS)
        cols = tl.load(row + F_COLS)
        srs = tl.load(row + F_SRS)
        qrs = tl.load(row + F_QRS)
        if CONTIG:
            scs = 1
            qcs = 1
        else:
            scs = tl.load(row + F_SCS)
            qcs = tl.load(row + F_QCS)
        if SRC_ALIGN > 1:
            src0 = tl.multiple_of(src0, SRC_ALIGN)
            srs = tl.multiple_of(srs, SRC_ALIGN)
        if Q_ALIGN > 1:
            q0 = tl.multiple_of(q0, Q_ALIGN)
            qrs = tl.multiple_of(qrs, Q_ALIGN)
        rr = tl.arange(0, RB)[:, None]
        c = tl.arange(0, BN)[None, :].to(tl.int64)
        amax = _block_amax(src_ptr, src0, rr, c, rows, cols, srs, scs, SRC_BF16, BN, RB)  # pass 1
        sf = tl.math.div_rn(amax, _f32(FP8_MAX_BITS))
        if UE8M0:
            sf = _ue8m0(sf, thr_ptr)
        inv = tl.math.div_rn(_f32(0x3F800000), sf)
        h = q0 * 0  # the digest sum of the bytes written (int64, wraps mod 2**64)
        qm, sm, mlen = _msg_fields(row, h, DIGEST)
        # Pass 2: quantize and store.
        for r0 in range(0, rows, RB):
            if cols == BN:
                h += _quant_chunk(src_ptr, q_ptr, src0, q0, r0 + rr, c, rows, cols, srs, scs, qrs, qcs, inv, qm,
                                  mlen, coef_ptr, SRC_BF16, True, DIGEST)
            else:
                h += _quant_chunk(src_ptr, q_ptr, src0, q0, r0 + rr, c, rows, cols, srs, scs, qrs, qcs, inv, qm,
                                  mlen, coef_ptr, SRC_BF16, False, DIGEST)
        tl.store(s_ptr + s0, sf)
        if DIGEST:
            sbits = sf.to(tl.uint32, bitcast=True).to(tl.int64)
            h += _terms(sbits, s0 * 4 - sm, s0 >= 0, mlen, coef_ptr, 4)
            tl.store(sums_ptr + pid, h)


@triton.jit
def _e2m1_rows(x, amax, gs, G: tl.constexpr, BN: tl.constexpr):
    """NVFP4 of ``[G, BN]`` rows ``x`` (float32) of amax ``amax`` and global scales ``gs``: (packed value bytes
    ``[G, BN // 2]``, scale bits ``[G]``)."""
    sv = gs * (amax * _f32(0x3E2AAAAB))
    sv = tl.minimum(sv, _f32(FP8_MAX_BITS))
    s8 = _e4m3fn_bits(sv)
    sf = _e4m3_value(s8)
    t = sf * tl.math.div_rn(tl.full([G], 1.0, tl.float32), gs)
    t = tl.where(t == 0, _f32(0x4CBEBC20), t)
    os = tl.math.div_rn(tl.full([G], 1.0, tl.float32), t)
    y = tl.minimum(tl.maximum(x * os[:, None], -6.0), 6.0)
    a = tl.abs(y)
    code = tl.where(a <= 0.25, 0, tl.where(a < 0.75, 1, tl.where(a <= 1.25, 2, tl.where(
        a < 1.75, 3, tl.where(a <= 2.5, 4, tl.where(a < 3.5, 5, tl.where(a <= 5.0, 6, 7)))))))
    code = code | tl.where(y < 0, 8, 0)
    lo, hi = tl.split(tl.reshape(code, (G, BN // 2, 2)))
    return (lo | (hi << 4)).to(tl.uint8), s8


@triton.jit
def _rows_digest(row, live, qoff, qbyte, qmask, s0, sbyte, coef_ptr, sums_ptr, pid, SLOTS: tl.constexpr,
                 G: tl.constexpr):
    """The digest of the rows kernel's program: per row the terms of its value bytes ``qbyte`` (at ``qoff``
    from ``q_ptr``) and its scale byte ``sbyte`` (at ``s0`` from ``s_ptr``), summed per slot (``F_SLOT``) into
    ``sums_ptr[pid * SLOTS ..]``; ``SLOTS == G``: one slot per row (the launcher's choice where a program's
    rows reach more than a few messages)."""
    qm = tl.load(row + F_QM, mask=live, other=0)
    sm = tl.load(row + F_SM, mask=live, other=0)
    mlen = tl.load(row + F_MLEN, mask=live, other=0)
    hq = _terms(qbyte.to(tl.int64) & 255, qoff - qm[:, None], qmask, mlen[:, None], coef_ptr, 1)
    h = _isum(hq, 1)
    h += _terms(sbyte.to(tl.int64) & 255, s0 - sm, live, mlen, coef_ptr, 1)
    if SLOTS == G:
        tl.store(sums_ptr + pid * G + tl.arange(0, G), h, mask=live)
    else:
        slot = tl.load(row + F_SLOT, mask=live, other=0)
        for k in tl.static_range(SLOTS):
            tl.store(sums_ptr + pid * SLOTS + k, _isum(tl.where(live & (slot == k), h, 0), 0))


@triton.jit(do_not_specialize=DO_NOT_SPECIALIZE, do_not_specialize_on_alignment=DO_NOT_SPECIALIZE_ON_ALIGNMENT)
def quant_rows_kernel(
    src_ptr,
    q_ptr,
    s_ptr,
    table_ptr,
    thr_ptr,
    num_blocks,
    SRC_BF16: tl.constexpr,
    BN: tl.constexpr,
    G: tl.constexpr,
    CONTIG: tl.constexpr,
    FMT: tl.constexpr,
    g_ptr=None,
    coef_ptr=None,
    sums_ptr=None,
    DIGEST: tl.constexpr = False,
    SLOTS: tl.constexpr = 1,
):
    """MXFP8 (``FMT`` 1) and NVFP4 (``FMT`` 2) blocks of one row (1 x ``BN``, every block whole): **``G`` blocks per
    program**, block rows ``program_id * G ..`` of the same table as :func:`quant_blocks_kernel`, as one
    ``[G, BN]`` tile. The numbers are that kernel's, block by block (each row's amax, scale and values depend on
    its own row only); a row past ``num_blocks`` is masked. ``DIGEST``: also the digest sums of the bytes
    written into the messages, ``SLOTS`` per program (:func:`_rows_digest`)."""
    pid = tl.program_id(0).to(tl.int64)
    g = pid * G + tl.arange(0, G).to(tl.int64)
    live = g < num_blocks
    row = table_ptr + g * FIELDS
    src0 = tl.load(row + F_SRC, mask=live, other=0)
    q0 = tl.load(row + F_Q, mask=live, other=0)
    s0 = tl.load(row + F_S, mask=live, other=0)
    if CONTIG:
        scs = tl.full([G], 1, tl.int64)
        qcs = tl.full([G], 1, tl.int64)
    else:
        scs = tl.load(row + F_SCS, mask=live, other=0)
        qcs = tl.load(row + F_QCS, mask=live, other=0)
    c = tl.arange(0, BN)[None, :].to(tl.int64)
    mask = live[:, None] & (c < BN)
    x = tl.load(src_ptr + (src0[:, None] + c * scs[:, None]), mask=mask, other=0)
    if SRC_BF16:
        x = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        x = x.to(tl.float32)
    amax = tl.reduce(tl.abs(x), 1, tl.standard._elementwise_max)
    has_nan = tl.reduce((x != x).to(tl.int32), 1, tl.standard._elementwise_max)
    if FMT == 2:
        gs = tl.load(g_ptr + tl.load(row + F_G, mask=live, other=0), mask=live, other=1.0)
        byte, s8 = _e2m1_rows(x, amax, gs, G, BN)
        cc = tl.arange(0, BN // 2)[None, :].to(tl.int64)
        qoff = q0[:, None] + cc * qcs[:, None]
        qmask = live[:, None] & (cc < BN // 2)
        tl.store(q_ptr + qoff, byte, mask=qmask)
        tl.store(s_ptr + s0, s8.to(tl.uint8), mask=live)
        if DIGEST:
            _rows_digest(row, live, qoff, byte, qmask, s0, s8, coef_ptr, sums_ptr, pid, SLOTS, G)
    else:
        sb, inv = _mx_scale(amax, has_nan, thr_ptr)
        code = tl.where(has_nan[:, None] > 0, 0x7F, _e4m3fn_bits(x * inv[:, None]))
        qoff = q0[:, None] + c * qcs[:, None]
        tl.store(q_ptr + qoff, code.to(tl.uint8), mask=mask)
        tl.store(s_ptr + s0, sb.to(tl.uint8), mask=live)
        if DIGEST:
            _rows_digest(row, live, qoff, code, mask, s0, sb, coef_ptr, sums_ptr, pid, SLOTS, G)
