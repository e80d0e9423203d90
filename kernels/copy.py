"""Bare Triton kernel that copies many strided regions (with a fused dtype cast) in one launch.

The launcher (``triton_reshard/ops/copy.py``) describes every ``(src_view, dst_view)`` pair of one
dtype group as a *region* and cuts the regions into *tiles*; each program copies ``TILES_PER_PROG`` tiles.

Region table: ``int64[num_regions, REGION_FIELDS]``, one row per region, fields at the ``F_*`` indices:

- ``F_SRC`` / ``F_DST``: element offset of the region's first element from ``src_ptr`` / ``dst_ptr``;
- ``F_NUMEL``: number of elements (> 0); ``F_NDIM``: 1 to ``MAX_DIMS`` after merging dimensions that are
  contiguous on both sides (dimension 0 is the innermost one);
- ``F_VEC``: 1 when full blocks may use vector accesses (both innermost strides are 1 and every offset and
  outer stride is a multiple of the vector width; see ``triton_copy._vector_ok``);
- ``F_SIZE + k`` (k < ``MAX_DIMS - 1``): size of dimension k (the outermost size is never needed);
- ``F_SSTRIDE + k`` / ``F_DSTRIDE + k`` (k < ``MAX_DIMS``): element strides on each side;
- ``F_MSTART`` / ``F_MLEN`` (the digest, issue 46): the byte offset of the region's message (on the message
  side: the destination of a pack, the source of an unpack) from that side's pointer, and its length in bytes.

Tile table: ``int64[num_tiles, TILE_FIELDS]``: ``(r_lo, r_hi, start, stop)``: the tile covers regions
``r_lo .. r_hi - 1``, starting at element ``start`` of region ``r_lo`` and stopping before element ``stop`` of
region ``r_hi - 1`` (every region in between is covered whole). A big region is cut into several one-region
tiles; runs of small regions share one tile, so they do not cost a program each.

A program walks its regions in blocks of ``BLOCK`` elements. A full block of a region whose ``F_VEC`` flag
is set moves ``BLOCK // VEC`` groups of ``VEC`` contiguous elements with 16-byte loads and stores; any other
block goes element by element, ``BLOCK // VEC`` elements at a time, so both paths hold the same number of
values per thread (about 60 registers on sm_90 for up to 4 groups per thread).

All offset arithmetic is 64-bit; only the carry of the index decomposition inside one block runs in 32 bits
(the launcher keeps inner sizes of multi-dimensional regions below ``MAX_INNER_SIZE``).
"""

import triton
import triton.language as tl

# Table layout, shared with the launcher (constexpr so that the kernel may read them; ``int()`` on the host).
MAX_DIMS = tl.constexpr(5)
F_SRC = tl.constexpr(0)
F_DST = tl.constexpr(1)
F_NUMEL = tl.constexpr(2)
F_NDIM = tl.constexpr(3)
F_VEC = tl.constexpr(4)
F_SIZE = tl.constexpr(5)
F_SSTRIDE = tl.constexpr(9)  # F_SIZE + MAX_DIMS - 1
F_DSTRIDE = tl.constexpr(14)  # F_SSTRIDE + MAX_DIMS
F_MSTART = tl.constexpr(19)  # F_DSTRIDE + MAX_DIMS
F_MLEN = tl.constexpr(20)
REGION_FIELDS = tl.constexpr(21)
TILE_FIELDS = tl.constexpr(4)
# Inner sizes of multi-dimensional regions stay below this so that ``index + BLOCK`` fits in int32.
MAX_INNER_SIZE = 1 << 30
# Arguments that vary from call to call and must not trigger a recompilation (the tables are views into one
# int64 buffer at any 8-byte offset; only scalars are loaded from them).
DO_NOT_SPECIALIZE = ("num_tiles", "slots", "tile_elems", "shape_class")
DO_NOT_SPECIALIZE_ON_ALIGNMENT = ("regions_ptr", "tiles_ptr", "coef_ptr", "sums_ptr")


@triton.jit
def _convert(x, OUT_DTYPE: tl.constexpr, SRC_BF16: tl.constexpr, VIA_F32: tl.constexpr,
             DST_BF16: tl.constexpr, BF16_NAN: tl.constexpr):
    """Cast ``x`` like torch's ``.to()``; bf16 travels as int16 bits on both sides."""
    if SRC_BF16:
        # bf16 -> fp32 is exact: the bf16 bits are the top half of the fp32 bits.
        x = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    if VIA_F32:
        # torch converts to 16-bit floats through fp32 (c10::Half/BFloat16 only take a float).
        x = x.to(tl.float32)
    if DST_BF16:
        # Round to nearest even on the bits (as c10::BFloat16 does); NaN becomes the canonical BF16_NAN.
        u = x.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where(x != x, BF16_NAN, r)
        y = r.to(tl.uint16).to(tl.int16, bitcast=True)
    else:
        y = x.to(OUT_DTYPE)
    return y


@triton.jit
def _offsets(c, lane, nd, src0, dst0, d0, d1, d2, d3, s0, s1, s2, s3, s4, t0, t1, t2, t3, t4):
    """Element offsets (int64) of the elements ``c + lane`` of one region (``lane``: int32 block)."""
    if nd == 1:
        idx = c + lane
        soff = src0 + idx * s0
        doff = dst0 + idx * t0
    elif nd == 2:
        # One 32-bit division per element: the carry out of the inner dimension.
        j0 = (c % d0).to(tl.int32) + lane
        q0 = j0 // d0.to(tl.int32)
        j0 = j0 - q0 * d0.to(tl.int32)
        j1 = c // d0 + q0
        soff = src0 + j0.to(tl.int64) * s0 + j1 * s1
        doff = dst0 + j0.to(tl.int64) * t0 + j1 * t1
    else:
        # Decompose the block start once (64-bit scalars), then carry lane by lane in 32 bits.
        q = c // d0
        i1 = q % d1
        q = q // d1
        i2 = q % d2
        q = q // d2
        i3 = q % d3
        i4 = q // d3
        k0 = (c % d0).to(tl.int32) + lane
        q0 = k0 // d0.to(tl.int32)
        k0 = k0 - q0 * d0.to(tl.int32)
        k1 = i1.to(tl.int32) + q0
        q1 = k1 // d1.to(tl.int32)
        k1 = k1 - q1 * d1.to(tl.int32)
        k2 = i2.to(tl.int32) + q1
        q2 = k2 // d2.to(tl.int32)
        k2 = k2 - q2 * d2.to(tl.int32)
        k3 = i3.to(tl.int32) + q2
        q3 = k3 // d3.to(tl.int32)
        k3 = k3 - q3 * d3.to(tl.int32)
        k4 = i4 + q3
        soff = (src0 + k0.to(tl.int64) * s0 + k1.to(tl.int64) * s1 + k2.to(tl.int64) * s2
                + k3.to(tl.int64) * s3 + k4 * s4)
        doff = (dst0 + k0.to(tl.int64) * t0 + k1.to(tl.int64) * t1 + k2.to(tl.int64) * t2
                + k3.to(tl.int64) * t3 + k4 * t4)
    return soff, doff


@triton.jit
def _bits64(v, E: tl.constexpr):
    """The ``E``-byte values ``v`` as their bits, zero-extended to int64 (the digest's words)."""
    if E == 1:
        w = v.to(tl.uint8, bitcast=True).to(tl.int64)
    elif E == 2:
        w = v.to(tl.uint16, bitcast=True).to(tl.int64)
    elif E == 4:
        w = v.to(tl.uint32, bitcast=True).to(tl.int64)
    else:
        w = v.to(tl.int64, bitcast=True)
    return w


@triton.jit
def _digest(v, off, mask, mstart, mlen, coef_ptr, E: tl.constexpr):
    """The integrity digest's sum (``csrc/digest.c``, mod 2**64 in int64) over the message-side values ``v``
    of element offsets ``off``: element k sits at message byte ``p = off * E - mstart`` of an ``mlen``-byte
    message. A word's byte b adds ``b << 8 (p % 8)`` times the coefficient of its 1 KiB row; a tail byte (past
    the last whole word) its own coefficient. The launcher keeps ``p`` a multiple of ``E`` (an element never
    straddles two words)."""
    p = off * E - mstart
    lim = mlen // 8 * 8
    w = _bits64(v, E)
    body = mask & (p < lim)
    c = tl.load(coef_ptr + (p >> 10), mask=body, other=0)
    h = tl.where(body, c * (w << ((p & 7) * 8)), 0)
    if mlen != lim:  # a tail: its bytes have coefficients of their own, after the rows'
        rows = (mlen // 8 + 127) // 128
        for j in tl.static_range(E):
            q = p + j
            tail = mask & (q >= lim) & (q < mlen)
            cj = tl.load(coef_ptr + (rows + q - lim), mask=tail, other=0)
            h += tl.where(tail, cj * ((w >> (8 * j)) & 255), 0)
    return tl.reduce(h, None, tl.standard._sum_combine)  # tl.sum: see kernels/delta.py


@triton.jit
def _region(src_ptr, dst_ptr, row, seg_start, seg_stop, coef_ptr, lane, group, inner, out_dtype,
            SRC_VEC: tl.constexpr, DST_VEC: tl.constexpr, VEC: tl.constexpr, SRC_BF16: tl.constexpr,
            VIA_F32: tl.constexpr, DST_BF16: tl.constexpr, BF16_NAN: tl.constexpr, BLOCK: tl.constexpr,
            DIGEST: tl.constexpr, MSG_DST: tl.constexpr, MSG_BYTES: tl.constexpr):
    """Copy elements ``[seg_start, seg_stop)`` of the region at ``row``; with ``DIGEST``, return the digest
    sum of the message-side values (the written ones where the message is the destination, ``MSG_DST``)."""
    src0, dst0 = tl.load(row + F_SRC), tl.load(row + F_DST)
    nd, vec = tl.load(row + F_NDIM), tl.load(row + F_VEC) != 0
    d0, d1, d2, d3 = (tl.load(row + F_SIZE), tl.load(row + (F_SIZE + 1)), tl.load(row + (F_SIZE + 2)),
                      tl.load(row + (F_SIZE + 3)))
    s0, s1, s2, s3, s4 = (tl.load(row + F_SSTRIDE), tl.load(row + (F_SSTRIDE + 1)),
                          tl.load(row + (F_SSTRIDE + 2)), tl.load(row + (F_SSTRIDE + 3)),
                          tl.load(row + (F_SSTRIDE + 4)))
    t0, t1, t2, t3, t4 = (tl.load(row + F_DSTRIDE), tl.load(row + (F_DSTRIDE + 1)),
                          tl.load(row + (F_DSTRIDE + 2)), tl.load(row + (F_DSTRIDE + 3)),
                          tl.load(row + (F_DSTRIDE + 4)))
    mstart, mlen = tl.load(row + F_MSTART), tl.load(row + F_MLEN)
    h = mstart * 0  # the digest sum (int64, wraps mod 2**64)
    for c in range(seg_start, seg_stop, BLOCK):
        if vec & (c + BLOCK <= seg_stop):
            # Full block, innermost stride 1 on both sides, groups of VEC elements aligned to 16 bytes:
            # decompose one index per group, then 16-byte accesses. ``// V * V`` is exact here and tells
            # the compiler the alignment.
            gs, gd = _offsets(c, group, nd, src0, dst0, d0, d1, d2, d3, s0, s1, s2, s3, s4, t0, t1, t2, t3, t4)
            vsoff = (gs // SRC_VEC * SRC_VEC)[:, None] + inner[None, :]
            vdoff = (gd // DST_VEC * DST_VEC)[:, None] + inner[None, :]
            vx = tl.load(src_ptr + vsoff)
            vy = _convert(vx, out_dtype, SRC_BF16, VIA_F32, DST_BF16, BF16_NAN)
            tl.store(dst_ptr + vdoff, vy)
            if DIGEST:
                full = vdoff >= 0
                if MSG_DST:
                    h += _digest(vy, vdoff, full, mstart, mlen, coef_ptr, MSG_BYTES)
                else:
                    h += _digest(vx, vsoff, full, mstart, mlen, coef_ptr, MSG_BYTES)
        else:
            # Element by element, in chunks of BLOCK // VEC (as many elements per thread as the vector
            # path has groups, so that this path does not set the register count).
            for cc in range(c, tl.minimum(c + BLOCK, seg_stop), BLOCK // VEC):
                soff, doff = _offsets(cc, lane, nd, src0, dst0, d0, d1, d2, d3, s0, s1, s2, s3, s4, t0, t1,
                                      t2, t3, t4)
                mask = cc + lane < seg_stop
                x = tl.load(src_ptr + soff, mask=mask)
                y = _convert(x, out_dtype, SRC_BF16, VIA_F32, DST_BF16, BF16_NAN)
                tl.store(dst_ptr + doff, y, mask=mask)
                if DIGEST:
                    if MSG_DST:
                        h += _digest(y, doff, mask, mstart, mlen, coef_ptr, MSG_BYTES)
                    else:
                        h += _digest(x, soff, mask, mstart, mlen, coef_ptr, MSG_BYTES)
    return h


@triton.jit(do_not_specialize=DO_NOT_SPECIALIZE, do_not_specialize_on_alignment=DO_NOT_SPECIALIZE_ON_ALIGNMENT)
def copy_regions_kernel(
    src_ptr,
    dst_ptr,
    regions_ptr,
    tiles_ptr,
    coef_ptr,  # DIGEST: the keyed coefficients (int64), else unused
    sums_ptr,  # DIGEST: int64[num_tiles, slots]: per tile, the digest sum of each region it covers
    num_tiles,
    slots,  # DIGEST: the most regions one tile covers
    tile_elems,  # autotune key and pruning only (configs with BLOCK > tile_elems waste lanes)
    shape_class,  # autotune key only (log2 bucket of the mean region size)
    SRC_VEC: tl.constexpr,
    DST_VEC: tl.constexpr,
    VEC: tl.constexpr,
    SRC_BF16: tl.constexpr,
    VIA_F32: tl.constexpr,
    DST_BF16: tl.constexpr,
    BF16_NAN: tl.constexpr,
    BLOCK: tl.constexpr,
    TILES_PER_PROG: tl.constexpr,
    DIGEST: tl.constexpr = False,
    MSG_DST: tl.constexpr = True,
    MSG_BYTES: tl.constexpr = 1,
):
    """Copy every tile of the tile table: ``dst[region] = src[region].to(dst dtype)``.

    ``SRC_VEC`` / ``DST_VEC``: elements per 16 bytes on each side; ``VEC``: the larger of the two, the
    group of elements that the aligned fast path moves as one vector.
    ``SRC_BF16``: the source holds bf16 bits (int16 pointer); ``DST_BF16``: write bf16 bits (int16
    pointer); ``VIA_F32``: convert through fp32 first; ``BF16_NAN``: bits written for a NaN into bf16.
    ``DIGEST``: each program also sums the integrity digest of the message-side bytes it moves (the
    destination's, ``MSG_DST``, for a pack; the source's for an unpack; ``MSG_BYTES`` per element) into
    ``sums_ptr``, one slot per (tile, region); the launcher adds the slots up per message.
    """
    out_dtype = dst_ptr.dtype.element_ty
    pid = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, BLOCK // VEC)
    group = lane * VEC
    inner = tl.arange(0, VEC)
    for k in range(TILES_PER_PROG):
        t = pid * TILES_PER_PROG + k
        if t < num_tiles:
            tile = tiles_ptr + t * TILE_FIELDS
            r_lo = tl.load(tile)
            r_hi = tl.load(tile + 1)
            first = tl.load(tile + 2)
            last = tl.load(tile + 3)
            for r in range(r_lo, r_hi):
                seg_start = tl.where(r == r_lo, first, 0)
                seg_stop = tl.where(r == r_hi - 1, last, tl.load(regions_ptr + r * REGION_FIELDS + F_NUMEL))
                h = _region(src_ptr, dst_ptr, regions_ptr + r * REGION_FIELDS, seg_start, seg_stop, coef_ptr,
                            lane, group, inner, out_dtype, SRC_VEC, DST_VEC, VEC, SRC_BF16, VIA_F32, DST_BF16,
                            BF16_NAN, BLOCK, DIGEST, MSG_DST, MSG_BYTES)
                if DIGEST:
                    tl.store(sums_ptr + t * slots + (r - r_lo), h)
