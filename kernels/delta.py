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


@triton.jit
def _values_at(body, kind, count, nwords, ESIZE: tl.constexpr):
    """Where a chunk's values start in the message, in elements: after its offsets (int16, padded to 16
    bytes) or its bitmask words (int32, padded), or right at the body for a dense chunk."""
    if kind == KIND_DENSE:
        vbase = body // ESIZE
    elif kind == KIND_OFFSETS:
        vbase = (body + _pad16(2 * count)) // ESIZE
    else:
        vbase = (body + _pad16(4 * nwords)) // ESIZE
    return vbase


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
            vbase = _values_at(body, kind, count, nwords, ESIZE)
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


# ---------------------------------------------------------------------------------------------------------
# Format version 2 (issue 44; ``triton_reshard/ops/delta_v2.py`` defines the bytes): narrow differences in
# blocks of 256 elements of a chunk. One program handles ``BPT`` blocks (one per row of its tiles); the
# launcher gives every block a row of ``int64[num_blocks, V_FIELDS]``: ``V_CHUNK`` its chunk's row in the
# launch's chunk table (the v1 pack / unpack table above), ``V_K`` its index in the chunk, ``V_CNT`` /
# ``V_CODE`` its changed elements and width code (written by the stats pass on the sender, read from its
# descriptor on the receiver), ``V_MODE`` its positions' mode, ``V_PAY`` the byte offset of its payload in
# the message and ``V_POSB`` the bytes of its positions (the values follow them); a patched block's
# (``ops/delta_patch.py``) ``V_NEXC`` exceptions at ``V_XAT`` (``V_MODE`` its positions' mode 0..2, ``V_CODE``
# its base code); ``V_OVER`` (stats pass) its changed elements wider than each base code c = 1..5's width,
# 9 bits each at bit 9 (c - 1), from which the launcher picks the layout. Values of 2 and 4 bits share
# bytes with their neighbours, possibly another program's: they are OR-ed into the zeroed message with
# ``atomic_or`` on 32-bit words (a value never crosses one: it starts at a multiple of its width); every
# other byte has one writer.
#
# The digest (issue 46; ``DIGEST`` of the encode pass): each program also sums the integrity hash
# (``csrc/digest.c``) of every byte it writes into the zeroed message (values of dense chunks, descriptors,
# positions, narrow values), into ``sums_ptr[program_id]``. The hash is linear in the bytes and the message
# starts as zeros, so these sums plus the hash of the headers the launcher writes are the hash of the whole
# message; an OR-ed small value adds its own bits (no two writers share a bit). A message is a multiple of 16
# bytes: no tail bytes, every byte is in a whole word.

NB = tl.constexpr(256)  # elements per block (ops/delta_v2.BLOCK)
RAW = tl.constexpr(6)
KIND_NARROW = tl.constexpr(3)
MODE_OFFSETS = tl.constexpr(0)
MODE_BITMASK = tl.constexpr(1)
MODE_ALL = tl.constexpr(2)
V_CHUNK = tl.constexpr(0)
V_K = tl.constexpr(1)
V_CNT = tl.constexpr(2)
V_CODE = tl.constexpr(3)
V_MODE = tl.constexpr(4)
V_PAY = tl.constexpr(5)
V_POSB = tl.constexpr(6)
V_NEXC = tl.constexpr(7)
V_XAT = tl.constexpr(8)
V_OVER = tl.constexpr(9)
V_FIELDS = tl.constexpr(10)
MAX_EXC = tl.constexpr(4)  # exceptions of a patched block at most (ops/delta_patch.MAX_EXCEPTIONS)


@triton.jit
def _rows(table_ptr, ci, base: tl.constexpr, valid):
    """Four consecutive int64 fields ``base..base+3`` of the table rows ``ci`` (column vectors)."""
    a = tl.load(table_ptr + ci + base, mask=valid, other=1)[:, None]
    b = tl.load(table_ptr + ci + base + 1, mask=valid, other=1)[:, None]
    c = tl.load(table_ptr + ci + base + 2, mask=valid, other=1)[:, None]
    d = tl.load(table_ptr + ci + base + 3, mask=valid, other=1)[:, None]
    return a, b, c, d


@triton.jit
def _diff_code(s, p, ESIZE: tl.constexpr):
    """(d, raw, code) of bit patterns ``s`` (new) and ``p`` (old): ``d = s - p`` modulo 2**(8 ESIZE) read as
    a signed int64, ``s``'s bits as int64 (zero-extended below 8 bytes) and the code of the narrowest width
    holding ``d`` (``RAW`` at the element's width)."""
    if ESIZE == 8:
        d = s - p
        raw = s
    else:
        wmask = (1 << (8 * ESIZE)) - 1
        du = (s.to(tl.int64) - p.to(tl.int64)) & wmask
        d = du - ((du >> (8 * ESIZE - 1)) & 1) * (1 << (8 * ESIZE))
        raw = s.to(tl.int64) & wmask
    c = 1 + ((d < -2) | (d >= 2)).to(tl.int64) + ((d < -8) | (d >= 8)).to(tl.int64)
    c += ((d < -128) | (d >= 128)).to(tl.int64) + ((d < -32768) | (d >= 32768)).to(tl.int64)
    c += ((d < -2147483648) | (d >= 2147483648)).to(tl.int64)
    logw = 3 + (ESIZE > 1) + (ESIZE > 2) + (ESIZE > 4)
    code = tl.where(c >= logw, RAW, c)
    return d, raw, code


@triton.jit
def _terms(w, p, mask, coef_ptr):
    """The digest's terms (int64, mod 2**64; 0 where not ``mask``) of values whose bits are ``w`` (zero-extended
    int64) at message byte ``p`` (aligned to their size, inside a whole word): ``w << 8 (p % 8)`` times the
    coefficient of the word's 1 KiB row."""
    c = tl.load(coef_ptr + (p >> 10), mask=mask, other=0)
    return tl.where(mask, c * (w << ((p & 7) * 8)), 0)


@triton.jit
def _total(h):
    """The sum of every int64 term of ``h`` (``tl.sum``: see the module docstring)."""
    return tl.reduce(h, None, tl.standard._sum_combine)


@triton.jit
def _width(code, ESIZE: tl.constexpr):
    """Bits per value of block codes (raw: the element's bits)."""
    return tl.where(code == RAW, 8 * ESIZE, 1 << tl.minimum(code, 5))


@triton.jit(do_not_specialize=("num_blocks",))
def delta2_pack_kernel(
    src_ptr,  # element bits of the sources' base storage
    snap_ptr,  # the same for the snapshots
    val_ptr,  # the message as the element's integer dtype (dense chunks)
    msg_ptr,  # the message as uint8
    m32_ptr,  # the message as int32 (2- and 4-bit values, OR-ed in)
    table_ptr,  # the v1 pack table (P_* fields) of the launch's chunks
    blocks_ptr,  # int64[num_blocks, V_FIELDS]
    num_blocks,
    ESIZE: tl.constexpr,
    STATS: tl.constexpr,  # True: write V_CNT / V_CODE / V_OVER of every block only
    UPDATE: tl.constexpr,  # write the changed values into the snapshot
    BPT: tl.constexpr,
    coef_ptr=None,  # DIGEST: the keyed coefficients (int64)
    sums_ptr=None,  # DIGEST: int64[programs]: each program's digest sum of the bytes it wrote
    DIGEST: tl.constexpr = False,
):
    """Pass 1 (``STATS``): every block's changed elements, width code and over-counts. Pass 2: the bodies of
    dense chunks and the descriptors, positions, values and exceptions of the changed blocks of narrow chunks
    (chunk headers are written by the launcher); with ``UPDATE`` the snapshot takes the changed elements; with
    ``DIGEST`` the digest sum of every byte written (see above)."""
    bid = tl.program_id(0).to(tl.int64) * BPT + tl.arange(0, BPT).to(tl.int64)
    valid = bid < num_blocks
    brow = blocks_ptr + bid * V_FIELDS
    ci = tl.load(brow + V_CHUNK, mask=valid, other=0) * P_FIELDS
    k = tl.load(brow + V_K, mask=valid, other=0)[:, None]
    src0, snap0, start, n = _rows(table_ptr, ci, P_SRC, valid)
    d0, d1, d2, _d3 = _rows(table_ptr, ci, P_SIZE, valid)
    s0, s1, s2, s3 = _rows(table_ptr, ci, P_SSTRIDE, valid)
    p0, p1, p2, p3 = _rows(table_ptr, ci, P_PSTRIDE, valid)
    lane = tl.arange(0, NB).to(tl.int64)[None, :]
    j = k * NB + lane  # element in the chunk
    m = valid[:, None] & (j < n)
    poff = snap0 + _elem_offsets(start + j, d0, d1, d2, p0, p1, p2, p3)
    s = tl.load(src_ptr + src0 + _elem_offsets(start + j, d0, d1, d2, s0, s1, s2, s3), mask=m)
    p = tl.load(snap_ptr + poff, mask=m)
    ch = (s != p) & m
    d, raw, code = _diff_code(s, p, ESIZE)
    if STATS:
        tl.store(brow + V_CNT, tl.reduce(ch.to(tl.int64), 1, tl.standard._sum_combine), mask=valid)
        tl.store(brow + V_CODE, tl.reduce(tl.where(ch, code, 0), 1, tl.standard._elementwise_max), mask=valid)
        tl.store(brow + V_OVER, _over_counts(ch, code), mask=valid)
    else:
        body = tl.load(table_ptr + ci + P_OUT, mask=valid, other=0) + HEADER_BYTES
        kind = tl.load(table_ptr + ci + P_KIND, mask=valid, other=0)
        vdense = body[:, None] // ESIZE + j
        tl.store(val_ptr + vdense, s, mask=m & (kind[:, None] == KIND_DENSE))
        cnt = tl.load(brow + V_CNT, mask=valid, other=0)
        bcode = tl.load(brow + V_CODE, mask=valid, other=0)
        mode = tl.load(brow + V_MODE, mask=valid, other=0)
        nexc = tl.load(brow + V_NEXC, mask=valid, other=0)
        live = valid & (kind == KIND_NARROW) & (cnt > 0)
        desc = body + 2 * tl.load(brow + V_K, mask=valid, other=0)
        first = bcode | (tl.where(nexc > 0, 3 + MAX_EXC * mode + nexc - 1, mode) << 4)  # patched modes: 3..14
        tl.store(msg_ptr + desc, first.to(tl.uint8), mask=live)
        tl.store(msg_ptr + desc + 1, (cnt - 1).to(tl.uint8), mask=live)
        pay = tl.load(brow + V_PAY, mask=live, other=0)[:, None]
        vat = pay + tl.load(brow + V_POSB, mask=live, other=0)[:, None]
        xat = tl.load(brow + V_XAT, mask=live, other=0)[:, None]
        blk = (bcode[:, None], mode[:, None], nexc[:, None], xat)
        h = _encode_block(msg_ptr, m32_ptr, pay, vat, live[:, None], ch, lane, (d, raw, code), blk,
                          tl.minimum(n - k * NB, NB), coef_ptr, ESIZE, BPT, DIGEST)
        if DIGEST:
            h += _total(_terms(raw, vdense * ESIZE, m & (kind[:, None] == KIND_DENSE), coef_ptr))
            two = (first & 255) | (((cnt - 1) & 255) << 8)  # the descriptor's two bytes
            h += _total(_terms(two, desc, live, coef_ptr))
            tl.store(sums_ptr + tl.program_id(0), h)
        if UPDATE:
            tl.store(snap_ptr + poff, s, mask=ch)


@triton.jit
def _encode_block(
    msg_ptr, m32_ptr, pay, vat, live, ch, lane, elems, block, blen, coef_ptr,
    ESIZE: tl.constexpr, BPT: tl.constexpr, DIGEST: tl.constexpr,
):
    """Positions (at byte ``pay``), values (at byte ``vat``) and a patched block's exceptions (at byte ``xat``)
    of the live rows' blocks of ``blen`` elements (``elems``: each element's difference, raw bits and code;
    ``block``: each row's stored code, positions mode, exceptions, ``xat``); the digest sum of the bytes
    written (``DIGEST``), else 0."""
    d, raw, ecode = elems
    code, mode, nexc, xat = block
    rank = tl.associative_scan(ch.to(tl.int64), 1, tl.standard._sum_combine) - 1
    offs = live & ch & (mode == MODE_OFFSETS)
    tl.store(msg_ptr + pay + rank, lane.to(tl.uint8), mask=offs)
    bits = tl.reshape(ch.to(tl.int32), (BPT, NB // 8, 8)) << tl.arange(0, 8)[None, None, :]
    mbytes = tl.reduce(bits, 2, tl.standard._sum_combine)  # (BPT, 32): the bitmask's bytes
    q = tl.arange(0, NB // 8)[None, :]
    bmask = live & (mode == MODE_BITMASK) & (q < (blen + 7) // 8)
    tl.store(msg_ptr + pay + q, mbytes.to(tl.uint8), mask=bmask)
    w = _width(code, ESIZE)
    every = mode == MODE_ALL
    put = live & tl.where(every, lane < blen, ch)
    slot = tl.where(every, lane, rank)
    exc = live & ch & (nexc > 0) & (ecode > code)  # a patched block's exceptions: their base value 0
    v = tl.where(exc, 0, tl.where(code == RAW, raw, d & ((1 << tl.minimum(w, 32)) - 1)))
    bit = vat * 8 + slot * w
    small = put & (w < 8)
    tl.atomic_or(m32_ptr + (bit >> 5), (v << (bit & 31)).to(tl.int32), mask=small, sem="relaxed")
    nb = w // 8
    h = tl.full((BPT, NB), 0, tl.int64)  # not tl.zeros (a jit function: the interpreter refuses it here after a compiled load)
    for b in tl.static_range(8):
        tl.store(msg_ptr + (bit >> 3) + b, ((v >> (8 * b)) & 0xFF).to(tl.uint8), mask=put & (b < nb))
        if DIGEST:
            h += _terms((v >> (8 * b)) & 0xFF, (bit >> 3) + b, put & (b < nb), coef_ptr)
    h = _put_exceptions(msg_ptr, exc, slot, d, nexc, xat, h, coef_ptr, ESIZE, DIGEST)
    total = tl.program_id(0).to(tl.int64) * 0
    if DIGEST:  # an OR-ed value: its bits in its 32-bit word (the word's low byte at ``(bit >> 5) * 4``)
        h += _terms((v << (bit & 31)) & 0xFFFFFFFF, (bit >> 5) * 4, small, coef_ptr)
        h += _terms(lane, pay + rank, offs, coef_ptr)
        total = _total(h) + _total(_terms(mbytes.to(tl.int64), pay + q, bmask, coef_ptr))
    return total


@triton.jit
def _over_counts(ch, code):
    """Per row: its changed elements whose code exceeds c, for c = 1..5, 9 bits each at bit 9 (c - 1)
    (``V_OVER``: a patched block at base code c has that many exceptions)."""
    f = (code > 1).to(tl.int64) + ((code > 2).to(tl.int64) << 9) + ((code > 3).to(tl.int64) << 18)
    f += ((code > 4).to(tl.int64) << 27) + ((code > 5).to(tl.int64) << 36)
    return tl.reduce(tl.where(ch, f, 0), 1, tl.standard._sum_combine)


@triton.jit
def _put_exceptions(msg_ptr, exc, slot, d, nexc, xat, h, coef_ptr, ESIZE: tl.constexpr, DIGEST: tl.constexpr):
    """A patched block's exceptions ``exc`` (ascending slots): each one's slot byte at ``xat`` + its rank, then
    after the ``nexc`` slot bytes its difference modulo 2**(8 ESIZE), little-endian; ``h`` plus the digest terms
    of those bytes (``DIGEST``)."""
    xr = tl.associative_scan(exc.to(tl.int64), 1, tl.standard._sum_combine) - 1
    tl.store(msg_ptr + xat + xr, slot.to(tl.uint8), mask=exc)
    vat = xat + nexc + xr * ESIZE
    for b in tl.static_range(ESIZE):
        byte = (d >> (8 * b)) & 0xFF
        tl.store(msg_ptr + vat + b, byte.to(tl.uint8), mask=exc)
        if DIGEST:
            h += _terms(byte, vat + b, exc, coef_ptr)
    if DIGEST:
        h += _terms(slot, xat + xr, exc, coef_ptr)
    return h


@triton.jit(do_not_specialize=("num_blocks",))
def delta2_unpack_kernel(
    dst_ptr,  # element bits of the destinations' base storage
    msg_ptr,  # the message as uint8
    table_ptr,  # the v1 unpack table (U_* fields) of the launch's chunks
    blocks_ptr,  # int64[num_blocks, V_FIELDS] of the changed blocks of narrow chunks (descriptors checked)
    bad_ptr,  # int32[num_blocks]: set to 1 where a block's positions disagree with its descriptor
    num_blocks,
    ESIZE: tl.constexpr,
    CHECK: tl.constexpr,  # True: check the positions only (offsets ascending inside the block, bitmask popcount)
    BPT: tl.constexpr,
):
    """Pass 1 (``CHECK``): every block's positions against its descriptor, nothing written. Pass 2: every
    changed element of the destination gets the difference added (modulo its width) or the raw bits."""
    bid = tl.program_id(0).to(tl.int64) * BPT + tl.arange(0, BPT).to(tl.int64)
    valid = bid < num_blocks
    brow = blocks_ptr + bid * V_FIELDS
    ci = tl.load(brow + V_CHUNK, mask=valid, other=0) * U_FIELDS
    k = tl.load(brow + V_K, mask=valid, other=0)[:, None]
    cnt = tl.load(brow + V_CNT, mask=valid, other=0)[:, None]
    code = tl.load(brow + V_CODE, mask=valid, other=0)[:, None]
    mode = tl.load(brow + V_MODE, mask=valid, other=0)[:, None]
    pay = tl.load(brow + V_PAY, mask=valid, other=0)[:, None]
    n = tl.load(table_ptr + ci + U_NUMEL, mask=valid, other=0)[:, None]
    blen = tl.minimum(n - k * NB, NB)
    t = tl.arange(0, NB).to(tl.int64)[None, :]
    v2 = valid[:, None]
    isoff = v2 & (mode == MODE_OFFSETS)
    pos = tl.load(msg_ptr + pay + t, mask=isoff & (t < cnt), other=0).to(tl.int64) & 0xFF
    inmask = v2 & (mode == MODE_BITMASK) & ((t >> 3) < (blen + 7) // 8)  # the bitmask's bytes only
    bit = (tl.load(msg_ptr + pay + (t >> 3), mask=inmask, other=0).to(tl.int64) >> (t & 7)) & 1
    if CHECK:
        prev = tl.load(msg_ptr + pay + t - 1, mask=isoff & (t < cnt) & (t > 0), other=0).to(tl.int64) & 0xFF
        bad_o = isoff & (t < cnt) & ((pos >= blen) | ((t > 0) & (pos <= prev)))
        pop = tl.reduce(bit, 1, tl.standard._sum_combine)[:, None]
        bad_b = (mode == MODE_BITMASK) & (
            (pop != cnt) | (tl.reduce(bit * (t >= blen), 1, tl.standard._sum_combine)[:, None] > 0)
        )
        bad = tl.reduce((bad_o | (v2 & bad_b)).to(tl.int32), 1, tl.standard._elementwise_max)
        tl.store(bad_ptr + bid, bad, mask=valid)
    else:
        vat = pay + tl.load(brow + V_POSB, mask=valid, other=0)[:, None]
        slot = tl.where(mode == MODE_BITMASK, tl.associative_scan(bit, 1, tl.standard._sum_combine) - 1, t)
        elem = tl.where(isoff, pos, t)
        act = v2 & tl.where(isoff, t < cnt, tl.where(mode == MODE_BITMASK, bit != 0, t < blen))
        w = _width(code, ESIZE)
        at = vat * 8 + slot * w
        v = (tl.load(msg_ptr + (at >> 3), mask=act, other=0).to(tl.int64) & 0xFF) >> (at & 7)
        for b in tl.static_range(1, 8):
            byte = tl.load(msg_ptr + (at >> 3) + b, mask=act & (b < w // 8), other=0).to(tl.int64) & 0xFF
            v |= byte << (8 * b)
        small = tl.minimum(w, 32)
        v = tl.where(w < 8, v & ((1 << small) - 1), v)
        v = tl.where(code == RAW, v, v - (((v >> (small - 1)) & 1) << small))  # sign-extended difference
        nexc = tl.load(brow + V_NEXC, mask=valid, other=0)[:, None]
        xat = tl.load(brow + V_XAT, mask=valid, other=0)[:, None]
        for x in tl.static_range(MAX_EXC):  # a patched block's exceptions replace their slots' values
            hx = v2 & (x < nexc)
            xs = tl.load(msg_ptr + xat + x, mask=hx, other=0).to(tl.int64) & 0xFF
            xv = xs * 0  # not tl.zeros_like: a jit helper the interpreter refused in the full suite
            for b in tl.static_range(ESIZE):
                byte = tl.load(msg_ptr + xat + nexc + x * ESIZE + b, mask=hx, other=0).to(tl.int64) & 0xFF
                xv |= byte << (8 * b)
            v = tl.where(hx & (slot == xs), xv, v)  # (the add below is modulo the element's width)
        d0, d1, d2, _d3 = _rows(table_ptr, ci, U_SIZE, valid)
        t0, t1, t2, t3 = _rows(table_ptr, ci, U_STRIDE, valid)
        dst0 = tl.load(table_ptr + ci + U_DST, mask=valid, other=0)[:, None]
        start = tl.load(table_ptr + ci + U_START, mask=valid, other=0)[:, None]
        doff = dst0 + _elem_offsets(start + k * NB + elem, d0, d1, d2, t0, t1, t2, t3)
        cur = tl.load(dst_ptr + doff, mask=act)
        new = tl.where(code == RAW, v, cur.to(tl.int64) + v)
        tl.store(dst_ptr + doff, new.to(cur.dtype), mask=act)
