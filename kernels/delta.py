"""Bare Triton kernels of the delta op: change detection + compaction (pack) and scatter (unpack).

The launcher and the torch reference are in ``triton_reshard/ops/delta.py``; the encoded message format
(headers, alignment, endianness) is defined there. One program handles one *chunk*: a run of at most
65,536 consecutive elements (row-major order) of one view. Every pointer argument of one launch is a base
pointer (the start of one storage) and the tables give element offsets from it, so one launch serves many
views of many tensors of one element size; all values move as raw bits (an integer dtype of the element's
size), so NaN payloads and signed zeros are compared and copied exactly.

Pack table ``int64[num_chunks, P_FIELDS]``: ``P_SRC`` / ``P_SNAP`` element offset of the view's first
element from ``src_ptr`` / ``snap_ptr``; ``P_START`` the chunk's first element (row-major index in its
view); ``P_NUMEL`` its length; ``P_SIZE + k`` sizes (k = 0 innermost; 4 dimensions, padded with 1) and
``P_SSTRIDE + k`` / ``P_PSTRIDE + k`` element strides of the source and snapshot views; ``P_OUT`` the
byte offset of the chunk's header in the message, ``P_KIND`` its encoding and ``P_COUNT`` its number of
changed elements (the last three are filled on the device between the two passes).

Unpack table ``int64[num_chunks, U_FIELDS]``: ``U_DST`` element offset of the destination view,
``U_START`` / ``U_NUMEL`` as above, ``U_SIZE + k`` / ``U_STRIDE + k`` its geometry, ``U_IN`` the byte
offset of the chunk in the message (read from the message's directory), ``U_KIND`` / ``U_COUNT`` read from
its header (the launcher has checked every header against the table before this kernel runs).

Sums and prefix sums are written ``tl.reduce`` / ``tl.associative_scan`` with ``tl.standard._sum_combine``
(what ``tl.sum`` / ``tl.cumsum`` are on the GPU): if ``triton.language`` was imported before
``TRITON_INTERPRET=1`` was set, ``tl.sum`` is a compiled-mode function the interpreter refuses to call, while
it recognizes this combine function (the same workaround as ``kernels/quant.py``'s ``tl.max``).
"""

import triton
import triton.language as tl

KIND_DENSE = tl.constexpr(0)
KIND_BITMASK = tl.constexpr(1)
KIND_OFFSETS = tl.constexpr(2)
HEADER_BYTES = tl.constexpr(16)

P_SRC = tl.constexpr(0)
P_SNAP = tl.constexpr(1)
P_START = tl.constexpr(2)
P_NUMEL = tl.constexpr(3)
P_SIZE = tl.constexpr(4)
P_SSTRIDE = tl.constexpr(8)
P_PSTRIDE = tl.constexpr(12)
P_OUT = tl.constexpr(16)
P_KIND = tl.constexpr(17)
P_COUNT = tl.constexpr(18)
P_FIELDS = tl.constexpr(19)

U_DST = tl.constexpr(0)
U_START = tl.constexpr(1)
U_NUMEL = tl.constexpr(2)
U_SIZE = tl.constexpr(3)
U_STRIDE = tl.constexpr(7)
U_IN = tl.constexpr(11)
U_KIND = tl.constexpr(12)
U_COUNT = tl.constexpr(13)
U_FIELDS = tl.constexpr(14)
MAX_DIMS = 4


@triton.jit
def _pad16(n):
    return (n + 15) // 16 * 16


@triton.jit
def _elem_offsets(idx, d0, d1, d2, s0, s1, s2, s3):
    """Element offsets (int64) of the row-major indices ``idx`` of a view of up to 4 dims (0 innermost)."""
    i0 = idx % d0
    q = idx // d0
    i1 = q % d1
    q = q // d1
    i2 = q % d2
    i3 = q // d2
    return i0 * s0 + i1 * s1 + i2 * s2 + i3 * s3


@triton.jit(do_not_specialize=("num_chunks",))
def delta_pack_kernel(
    src_ptr,  # element bits (int8/16/32/64) of the sources' base storage
    snap_ptr,  # the same for the snapshots
    val_ptr,  # the message as the same integer dtype (values are written through it)
    m16_ptr,  # the message as int16 (offsets)
    m32_ptr,  # the message as int32 (bitmask words)
    table_ptr,
    count_ptr,  # int64[num_chunks]: written by the COUNT pass
    num_chunks,
    ESIZE: tl.constexpr,
    COUNT: tl.constexpr,  # True: only count the changed elements of every chunk
    UPDATE: tl.constexpr,  # write the changed values into the snapshot
    BLOCK: tl.constexpr,
):
    """Pass 1 (``COUNT``): changed elements per chunk. Pass 2: encode every chunk's body at ``P_OUT``
    (the header is written by the launcher) and, with ``UPDATE``, bring the snapshot up to date."""
    chunk = tl.program_id(0).to(tl.int64)
    if chunk < num_chunks:
        row = table_ptr + chunk * P_FIELDS
        src0 = tl.load(row + P_SRC)
        snap0 = tl.load(row + P_SNAP)
        start = tl.load(row + P_START)
        n = tl.load(row + P_NUMEL)
        d0 = tl.load(row + P_SIZE)
        d1 = tl.load(row + P_SIZE + 1)
        d2 = tl.load(row + P_SIZE + 2)
        s0 = tl.load(row + P_SSTRIDE)
        s1 = tl.load(row + P_SSTRIDE + 1)
        s2 = tl.load(row + P_SSTRIDE + 2)
        s3 = tl.load(row + P_SSTRIDE + 3)
        p0 = tl.load(row + P_PSTRIDE)
        p1 = tl.load(row + P_PSTRIDE + 1)
        p2 = tl.load(row + P_PSTRIDE + 2)
        p3 = tl.load(row + P_PSTRIDE + 3)
        lane = tl.arange(0, BLOCK).to(tl.int64)
        running = tl.program_id(0) * 0  # int32 scalar: changed elements seen so far in this chunk
        if COUNT:
            for c in range(0, n, BLOCK):
                j = c + lane
                m = j < n
                s = tl.load(src_ptr + src0 + _elem_offsets(start + j, d0, d1, d2, s0, s1, s2, s3), mask=m)
                p = tl.load(snap_ptr + snap0 + _elem_offsets(start + j, d0, d1, d2, p0, p1, p2, p3), mask=m)
                ch = (s != p) & m
                running += tl.reduce(ch.to(tl.int32), 0, tl.standard._sum_combine)
            tl.store(count_ptr + chunk, running.to(tl.int64))
        else:
            out = tl.load(row + P_OUT)
            kind = tl.load(row + P_KIND)
            count = tl.load(row + P_COUNT)
            nwords = (n + 31) // 32
            body = out + HEADER_BYTES
            if kind == KIND_DENSE:
                vbase = body // ESIZE
            elif kind == KIND_OFFSETS:
                vbase = (body + _pad16(2 * count)) // ESIZE
            else:
                vbase = (body + _pad16(4 * nwords)) // ESIZE
            shifts = tl.arange(0, 32)
            for c in range(0, n, BLOCK):
                j = c + lane
                m = j < n
                soff = src0 + _elem_offsets(start + j, d0, d1, d2, s0, s1, s2, s3)
                poff = snap0 + _elem_offsets(start + j, d0, d1, d2, p0, p1, p2, p3)
                s = tl.load(src_ptr + soff, mask=m)
                p = tl.load(snap_ptr + poff, mask=m)
                ch = (s != p) & m
                if kind == KIND_DENSE:
                    tl.store(val_ptr + vbase + j, s, mask=m)
                else:
                    pos = running + tl.associative_scan(ch.to(tl.int32), 0, tl.standard._sum_combine) - 1
                    tl.store(val_ptr + vbase + pos, s, mask=ch)
                    if kind == KIND_OFFSETS:
                        tl.store(m16_ptr + body // 2 + pos, j.to(tl.int16), mask=ch)
                    else:
                        bits = tl.reshape(ch.to(tl.int32), (BLOCK // 32, 32)) << shifts[None, :]
                        words = tl.reduce(bits, 1, tl.standard._sum_combine)
                        w = c // 32 + tl.arange(0, BLOCK // 32)
                        tl.store(m32_ptr + body // 4 + w, words, mask=w < nwords)
                    running += tl.reduce(ch.to(tl.int32), 0, tl.standard._sum_combine)
                if UPDATE:
                    tl.store(snap_ptr + poff, s, mask=ch)


@triton.jit(do_not_specialize=("num_chunks",))
def delta_unpack_kernel(
    dst_ptr,  # element bits of the destinations' base storage
    val_ptr,  # the message as the same integer dtype
    m16_ptr,
    m32_ptr,
    table_ptr,
    bad_ptr,  # int32[num_chunks]: set to 1 where the body is inconsistent (offset out of range, bit count)
    num_chunks,
    ESIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Write every chunk's changed values (all values for a dense chunk) into its destination view; every
    other element keeps its bits."""
    chunk = tl.program_id(0).to(tl.int64)
    if chunk < num_chunks:
        row = table_ptr + chunk * U_FIELDS
        dst0 = tl.load(row + U_DST)
        start = tl.load(row + U_START)
        n = tl.load(row + U_NUMEL)
        d0 = tl.load(row + U_SIZE)
        d1 = tl.load(row + U_SIZE + 1)
        d2 = tl.load(row + U_SIZE + 2)
        t0 = tl.load(row + U_STRIDE)
        t1 = tl.load(row + U_STRIDE + 1)
        t2 = tl.load(row + U_STRIDE + 2)
        t3 = tl.load(row + U_STRIDE + 3)
        inb = tl.load(row + U_IN)
        kind = tl.load(row + U_KIND)
        count = tl.load(row + U_COUNT)
        nwords = (n + 31) // 32
        body = inb + HEADER_BYTES
        lane = tl.arange(0, BLOCK).to(tl.int64)
        bad = tl.program_id(0) * 0
        if kind == KIND_DENSE:
            for c in range(0, n, BLOCK):
                j = c + lane
                m = j < n
                v = tl.load(val_ptr + body // ESIZE + j, mask=m)
                doff = dst0 + _elem_offsets(start + j, d0, d1, d2, t0, t1, t2, t3)
                tl.store(dst_ptr + doff, v, mask=m)
        elif kind == KIND_OFFSETS:
            vbase = (body + _pad16(2 * count)) // ESIZE
            for c in range(0, count, BLOCK):
                k = c + lane
                m = k < count
                o = tl.load(m16_ptr + body // 2 + k, mask=m, other=0).to(tl.int64) & 0xFFFF
                ok = m & (o < n)
                bad += tl.reduce((m & (o >= n)).to(tl.int32), 0, tl.standard._sum_combine)
                v = tl.load(val_ptr + vbase + k, mask=ok)
                doff = dst0 + _elem_offsets(start + o, d0, d1, d2, t0, t1, t2, t3)
                tl.store(dst_ptr + doff, v, mask=ok)
        else:
            vbase = (body + _pad16(4 * nwords)) // ESIZE
            shifts = tl.arange(0, 32)
            running = tl.program_id(0) * 0
            for c in range(0, n, BLOCK):
                w = c // 32 + tl.arange(0, BLOCK // 32)
                words = tl.load(m32_ptr + body // 4 + w, mask=w < nwords, other=0)
                bits = tl.reshape((words[:, None] >> shifts[None, :]) & 1, (BLOCK,))
                j = c + lane
                ch = (bits != 0) & (j < n)
                pos = running + tl.associative_scan(bits, 0, tl.standard._sum_combine) - 1
                ok = ch & (pos < count)
                v = tl.load(val_ptr + vbase + pos, mask=ok)
                doff = dst0 + _elem_offsets(start + j, d0, d1, d2, t0, t1, t2, t3)
                tl.store(dst_ptr + doff, v, mask=ok)
                running += tl.reduce(bits, 0, tl.standard._sum_combine)
            bad += (running != count).to(tl.int32)
        if bad != 0:
            tl.store(bad_ptr + chunk, 1)
