"""Delta format v2 (issue 44): narrow lossless values. The numpy reference of the encoding; the native codec
(``ops/delta_native.py``, ``csrc/delta_codec.c``) writes and reads the same bytes.

A v2 message is a v1 message (``ops/delta.py``: header, directory, 16-byte chunk headers, every chunk a
multiple of 16 bytes) with ``VERSION`` 2 in its header and one more chunk kind, ``KIND_NARROW`` (3). The v2
packer writes, per chunk: nothing changed: ``KIND_OFFSETS`` with ``count`` 0 (its 16-byte header); else the
narrow encoding when it is smaller than the dense one, else ``KIND_DENSE``; so a v2 message is never larger
than ``max_message_bytes``. The v1 kinds keep their v1 meaning (raw values).

Narrow chunk
------------
The chunk's ``numel`` elements are cut into *blocks* of ``BLOCK`` (256) elements (the last one shorter):
``nb = ceil(numel / 256)``. After the chunk header: ``nb`` descriptors of 2 bytes, then each block's payload,
back to back (no padding), then zero padding to 16 bytes. Descriptor: byte 0 = ``code | mode << 4``, byte 1 =
``count - 1`` (the block's changed elements, 1..256) or 0 for an unchanged block (code 0, mode 0, no payload).

- ``code`` 1..5: every changed element is stored as ``d = new - old`` (the bit patterns as unsigned integers of
  the element's width, modulo 2**width, read as a signed two's complement number) in ``w = 2**code`` bits
  (2, 4, 8, 16, 32): the smallest width holding every ``d`` of the block, and only widths below the element's
  (a bf16 block's widths are 2, 4, 8). ``code`` 6 (*raw*): the new bit patterns, ``w`` = the element's bits
  (an escape for blocks whose differences need the full width: sign flips, NaN payloads, ...).
- ``mode`` 0 (offsets): ``count`` bytes, the changed elements' indices in the block, ascending; then ``count``
  values. ``mode`` 1 (bitmask): ``ceil(blen / 8)`` bytes, bit ``k`` (LSB first) of byte ``j`` set iff element
  ``8 j + k`` changed; then ``count`` values in index order. ``mode`` 2 (all): ``blen`` values, one per
  element (``d`` = 0, or the unchanged raw bits, for an unchanged one). The smallest of the three (ties:
  offsets, bitmask, all).
- ``mode`` 3..14 (*patched*, ``ops/delta_patch.py``): ``3 + 4 pmode + (nexc - 1)``, positions as ``pmode``
  (0..2 above), the values at the base width of ``code`` (1..5, never raw) with each of the ``nexc`` (1..4)
  exceptions' slots holding 0, then ``nexc`` bytes (the exceptions' slots among the values, ascending) and
  ``nexc`` full-width differences (the element's size, little-endian) that replace those slots' values. The
  packer takes a patched layout only when strictly smaller than the unpatched ones (its rule there).
- Values: a little-endian bit stream, value ``s`` at bits ``[s w, (s + 1) w)``; ``ceil(n w / 8)`` bytes.

The receiver adds ``d`` to its destination's element (modulo 2**width) or writes the raw bits: a v2 delta
assumes every destination holds the snapshot, as a delta refit's fence guarantees (v1 assumed it for the
unchanged elements). Why differences: an AdamW step at an RL learning rate moves a bf16 weight by an ulp or a
few, ``d`` in [-2, 1] (2 bits) against 16 for the value.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .delta_format import (
    ALIGN,
    DIRECTORY_ENTRY_BYTES,
    HEADER_BYTES,
    KIND_DENSE,
    KIND_NARROW,
    KIND_OFFSETS,
    MAGIC,
    VERSION2,
    Pair,
)
from .delta_patch import LAST_PATCHED, choose_layout, exception_writes, read_exceptions, split_mode
from .launcher import bits

BLOCK = 256
RAW = 6
MODE_OFFSETS, MODE_BITMASK, MODE_ALL = 0, 1, 2
MODE_NAMES = {MODE_OFFSETS: "offsets", MODE_BITMASK: "bitmask", MODE_ALL: "all"}
_LIMITS = np.array([2, 8, 128, 1 << 15, 1 << 31], dtype=np.int64)  # 2**(w-1) for w = 2, 4, 8, 16, 32
_NP_INT = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
_NP_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _pad(n):
    return (n + (ALIGN - 1)) // ALIGN * ALIGN


def width_bits(code: np.ndarray, esize: int) -> np.ndarray:
    """Bits per value of block codes (raw: the element's bits)."""
    return np.where(code == RAW, 8 * esize, np.left_shift(1, np.minimum(code, 5)))


def element_codes(d: np.ndarray, esize: int) -> np.ndarray:
    """Per signed difference (int64), the code of the narrowest width holding it (``RAW`` at the full width)."""
    c = np.ones(d.shape, dtype=np.int64)
    for lim in _LIMITS.tolist():
        c += (d < -lim) | (d >= lim)
    return np.where(np.left_shift(1, c) >= 8 * esize, RAW, c)


def _vbytes(n, w):
    return (n * w + 7) // 8


def block_layout(cnt: np.ndarray, code: np.ndarray, blen: np.ndarray, esize: int):
    """(mode, payload bytes, position bytes) of changed blocks: the smallest mode (ties: offsets, bitmask, all)."""
    w = width_bits(code, esize)
    vb = _vbytes(cnt, w)
    off, bm, al = cnt + vb, (blen + 7) // 8 + vb, _vbytes(blen, w)
    mode = np.where((off <= bm) & (off <= al), MODE_OFFSETS, np.where(bm <= al, MODE_BITMASK, MODE_ALL))
    size = np.where(mode == MODE_OFFSETS, off, np.where(mode == MODE_BITMASK, bm, al))
    posb = np.where(mode == MODE_OFFSETS, cnt, np.where(mode == MODE_BITMASK, (blen + 7) // 8, 0))
    return mode, size, posb


def _runs(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Starts and lengths of the runs of equal values of a sorted array."""
    if not keys.size:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    st = np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1])))
    return st, np.diff(np.append(st, keys.size))


def _put_bits(buf: np.ndarray, at: np.ndarray, v: np.ndarray, w: int) -> None:
    """OR ``w``-bit values ``v`` (uint64) into ``buf`` at absolute bit positions ``at`` (ascending, disjoint)."""
    if w >= 8:
        for k in range(w // 8):
            buf[(at >> 3) + k] = ((v >> np.uint64(8 * k)) & np.uint64(0xFF)).astype(np.uint8)
        return
    byte = at >> 3
    part = (v & np.uint64((1 << w) - 1)) << (at & 7).astype(np.uint64)
    st, _ = _runs(byte)
    if st.size:
        buf[byte[st]] |= np.bitwise_or.reduceat(part, st).astype(np.uint8)


def _get_bits(buf: np.ndarray, at: np.ndarray, w: int) -> np.ndarray:
    """``w``-bit values (uint64) at absolute bit positions ``at`` of ``buf``."""
    if w >= 8:
        v = np.zeros(at.shape, dtype=np.uint64)
        for k in range(w // 8):
            v |= buf[(at >> 3) + k].astype(np.uint64) << np.uint64(8 * k)
        return v
    return (buf[at >> 3].astype(np.uint64) >> (at & 7).astype(np.uint64)) & np.uint64((1 << w) - 1)


def encode_pair(
    idx: np.ndarray, new: np.ndarray, old: np.ndarray, numel: int, ce: int, sflat: np.ndarray, patch: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The v2 chunks of one view: ``idx`` the changed elements (ascending, row-major), ``new`` / ``old`` their
    bits (numpy ints of the element's size), ``sflat`` the source's bits (1-D, row-major; dense chunks read
    it); ``patch``: patched blocks allowed. Returns the chunks back to back (uint8, headers included), each
    one's bytes and changed count."""
    e = new.dtype.itemsize
    nch = -(-numel // ce)
    clen = np.minimum(ce, numel - np.arange(nch, dtype=np.int64) * ce)
    nbk = -(-clen // BLOCK)
    b0 = np.concatenate(([0], np.cumsum(nbk)))
    ch = idx // ce
    local = idx - ch * ce
    gb = b0[ch] + (local >> 8)
    d = (new - old).astype(np.int64)  # wraps modulo the element's width, then sign-extended
    ecode = element_codes(d, e)
    st, cnt = _runs(gb)
    blk = gb[st]
    bcode = np.maximum.reduceat(ecode, st) if st.size else np.zeros(0, dtype=np.int64)
    bch = ch[st]
    blen = np.minimum(BLOCK, clen[bch] - (blk - b0[bch]) * BLOCK)
    unpatched = block_layout(cnt, bcode, blen, e)
    code, mode, size, posb, nexc = choose_layout(ecode, st, cnt, bcode, blen, e, unpatched, patch)
    count = np.bincount(ch, minlength=nch).astype(np.int64)
    narrow = HEADER_BYTES + 2 * nbk + np.bincount(bch, weights=size, minlength=nch).astype(np.int64)
    dense = HEADER_BYTES + _pad(clen * e)
    kind = np.where(count == 0, KIND_OFFSETS, np.where(_pad(narrow) < dense, KIND_NARROW, KIND_DENSE))
    nbytes = np.where(kind == KIND_OFFSETS, HEADER_BYTES, np.where(kind == KIND_NARROW, _pad(narrow), dense))
    cstart = np.concatenate(([0], np.cumsum(nbytes)))
    buf = np.zeros(int(cstart[-1]), dtype=np.uint8)
    hdr = buf.view(np.uint32)
    for k, val in enumerate((kind | (e << 8), clen, count, nbytes)):
        hdr[cstart[:-1] // 4 + k] = val
    for c in np.flatnonzero(kind == KIND_DENSE).tolist():
        a = int(cstart[c]) + HEADER_BYTES
        buf[a : a + int(clen[c]) * e] = sflat[c * ce : c * ce + int(clen[c])].view(np.uint8)
    live = kind[bch] == KIND_NARROW
    if live.any():
        _encode_blocks(
            buf,
            cstart,
            nbk,
            b0,
            (blk, bch, cnt, code, mode, size, posb, st, live, nexc),
            (local, d, new, ecode),
            e,
            (sflat, ce, blen),
        )
    return buf, nbytes, count


def _encode_blocks(buf, cstart, nbk, b0, blocks, elems, e: int, source) -> None:
    """Descriptors, positions and values of the changed blocks of narrow chunks (``live``)."""
    blk, bch, cnt, bcode, dmode, size, posb, st, live, nexc = blocks
    local, d, new, ecode = elems
    mode, _ = split_mode(dmode)
    sflat, ce, blen = source
    desc = cstart[bch] + HEADER_BYTES + 2 * (blk - b0[bch])  # the block's descriptor
    buf[desc[live]] = (bcode | (dmode << 4))[live].astype(np.uint8)
    buf[desc[live] + 1] = (cnt - 1)[live].astype(np.uint8)
    # payload start: the chunk's payloads begin after its descriptors; blocks of a chunk are back to back
    csum = np.cumsum(size) - size
    first = np.zeros(len(nbk), dtype=np.int64)
    cst, _ = _runs(bch)
    first[bch[cst]] = csum[cst]  # each chunk's first changed block's exclusive sum
    pstart = cstart[bch] + HEADER_BYTES + 2 * nbk[bch] + csum - first[bch]
    for k in np.flatnonzero(
        live & (mode == MODE_ALL) & (bcode == RAW)
    ).tolist():  # every raw value, changed or not
        a, n, v = int(bch[k]) * ce + int(blk[k] - b0[bch[k]]) * BLOCK, int(blen[k]), int(pstart[k])
        buf[v : v + n * e] = sflat[a : a + n].view(np.uint8)
    row = np.repeat(np.arange(st.size), cnt)  # each element's block (run)
    keep = live[row]
    row, lo, dd, nv, ec = row[keep], (local & (BLOCK - 1))[keep], d[keep], new[keep], ecode[keep]
    r = np.arange(keep.size)[keep] - st[row]  # rank in its block
    m = mode[row]
    isoff = m == MODE_OFFSETS
    buf[pstart[row][isoff] + r[isoff]] = lo[isoff].astype(np.uint8)
    isbm = m == MODE_BITMASK
    _put_bits(buf, (pstart[row][isbm] << 3) + lo[isbm], np.ones(int(isbm.sum()), dtype=np.uint64), 1)
    slot = np.where(m == MODE_ALL, lo, r)
    vstart = (pstart + posb)[row]
    code = bcode[row]
    raw = nv.view(_NP_UINT[e]).astype(np.uint64)
    val = np.where(code == RAW, raw, dd.astype(np.uint64))
    w = width_bits(code, e)
    xat = pstart + posb + _vbytes(np.where(mode == MODE_ALL, blen, cnt), width_bits(bcode, e))
    exc, at_slot, xslot, at_val, xval = exception_writes(row, slot, ec, bcode, nexc, xat, dd, e)
    val = np.where(exc, np.uint64(0), val)  # an exception's slot holds 0; its value follows the base values
    buf[at_slot] = xslot.astype(np.uint8)
    for k in range(e):
        buf[at_val + k] = ((xval >> np.uint64(8 * k)) & np.uint64(0xFF)).astype(np.uint8)
    for wb in np.unique(w).tolist():
        s = w == wb
        _put_bits(buf, (vstart[s] << 3) + slot[s] * wb, val[s], wb)


def decode_chunks(
    mn: np.ndarray,
    body: np.ndarray,
    numel: np.ndarray,
    count: np.ndarray,
    nbytes: np.ndarray,
    esize: np.ndarray,
) -> tuple[np.ndarray, tuple | None]:
    """Check the bodies of narrow chunks (``body``: each one's byte offset after its header) and decode them.
    Returns (bad: per chunk, whether its body disagrees with its header; the decoded changes or None when any
    chunk is bad): per changed element, ``(chunk, element in the chunk, value (uint64), raw?)``."""
    n = body.size
    bad = np.zeros(n, dtype=bool)
    if not n:
        return bad, (np.zeros(0, dtype=np.int64),) * 2 + (
            np.zeros(0, dtype=np.uint64),
            np.zeros(0, dtype=bool),
        )
    nbk = -(-numel // BLOCK)
    seg, j = _ragged(nbk)  # every block: its chunk and index in it
    at = body[seg] + 2 * j
    b0, cm1 = mn[at].astype(np.int64), mn[at + 1].astype(np.int64)
    code, dmode = b0 & 0x0F, b0 >> 4
    mode, nexc = split_mode(dmode)
    blen = np.minimum(BLOCK, numel[seg] - j * BLOCK)
    e = esize[seg]
    changed = code > 0
    cnt = np.where(changed, cm1 + 1, 0)
    nv = np.where(mode == MODE_ALL, blen, cnt)
    ok_code = (code == 0) & (dmode == 0) & (cm1 == 0) | changed & (code <= RAW) & (dmode <= LAST_PATCHED) & (
        (code == RAW) & (nexc == 0) | (np.left_shift(1, np.minimum(code, 6)) < 8 * e)
    ) & (cnt <= blen) & (nexc <= nv)
    bad |= np.bincount(seg, weights=(~ok_code).astype(np.float64), minlength=n) > 0
    cnt = np.where(ok_code, cnt, 0)
    w = np.where(code == RAW, 8 * e, np.left_shift(1, np.minimum(code, 5)))
    mode = np.where(ok_code & changed, mode, MODE_OFFSETS)
    nexc = np.where(ok_code & changed, nexc, 0)
    vb = _vbytes(cnt, w)
    size = np.where(
        mode == MODE_OFFSETS, cnt + vb, np.where(mode == MODE_BITMASK, (blen + 7) // 8 + vb, _vbytes(blen, w))
    )
    size = np.where(cnt > 0, size + nexc * (1 + e), 0)
    total = np.bincount(seg, weights=size, minlength=n).astype(np.int64)
    bad |= _pad(HEADER_BYTES + 2 * nbk + total) != nbytes
    bad |= np.bincount(seg, weights=cnt, minlength=n).astype(np.int64) != count
    if bad.any():
        return bad, None
    csum = np.cumsum(size) - size
    first = np.concatenate(([0], np.cumsum(nbk)))[:-1]
    pstart = body[seg] + 2 * nbk[seg] + csum - csum[first][seg]
    return _decode_blocks(mn, bad, (seg, j, cnt, code, mode, blen, w, pstart, nexc, e))


def _decode_blocks(mn, bad, blocks):
    seg, j, cnt, code, mode, blen, w, pstart, nexc, e = blocks
    parts = []
    isoff = (mode == MODE_OFFSETS) & (cnt > 0)
    rb, r = _ragged(np.where(isoff, cnt, 0))
    pos = mn[pstart[rb] + r].astype(np.int64)
    prev = np.where(r > 0, mn[pstart[rb] + r - 1].astype(np.int64), -1)
    bad[seg[rb[(pos <= prev) | (pos >= blen[rb])]]] = True
    parts.append((rb, pos, r))
    isbm = (mode == MODE_BITMASK) & (cnt > 0)
    if isbm.any():
        sb, k = _ragged(np.where(isbm, (blen + 7) // 8, 0))
        bits = np.unpackbits(mn[pstart[sb] + k], bitorder="little")
        fb = np.flatnonzero(bits)
        bb, pb = sb[fb >> 3], k[fb >> 3] * 8 + (fb & 7)
        pop = np.bincount(bb, minlength=seg.size)
        bad[seg[isbm & (pop != cnt)]] = True
        bad[seg[bb[pb >= blen[bb]]]] = True
        parts.append((bb, pb, np.arange(bb.size) - (np.cumsum(pop) - pop)[bb]))
    isall = (mode == MODE_ALL) & (cnt > 0)
    if isall.any():
        ab, ak = _ragged(np.where(isall, blen, 0))
        parts.append((ab, ak, ak))
    if bad.any():
        return bad, None
    b = np.concatenate([p[0] for p in parts])
    pos = np.concatenate([p[1] for p in parts])
    slot = np.concatenate([p[2] for p in parts])
    posb = np.where(mode == MODE_OFFSETS, cnt, np.where(mode == MODE_BITMASK, (blen + 7) // 8, 0))
    bitat = ((pstart + posb)[b] << 3) + slot * w[b]
    val = np.zeros(b.size, dtype=np.uint64)
    for wb in np.unique(w[b]).tolist():
        s = w[b] == wb
        val[s] = _get_bits(mn, bitat[s], wb)
    val = np.where(code[b] == RAW, val, sign_extend(val, w[b]))
    order = np.lexsort((pos, b))
    b, pos, val = b[order], pos[order], val[order]
    if nexc.any():  # patched blocks: each exception's value replaces its slot's (slots follow positions)
        nv = np.where(mode == MODE_ALL, blen, cnt)
        xbad, xb, xslot, xval = read_exceptions(mn, nexc, pstart + posb + _vbytes(nv, w), nv, e)
        if xbad.any():
            bad[seg[xbad]] = True
            return bad, None
        val[(np.cumsum(nv) - nv)[xb] + xslot] = xval
    return bad, (seg[b], j[b] * BLOCK + pos, val, code[b] == RAW)


def _ragged(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    seg = np.repeat(np.arange(lengths.size, dtype=np.int64), lengths)
    first = np.cumsum(lengths) - lengths
    return seg, np.arange(seg.size, dtype=np.int64) - first[seg]


def apply_values(cur: np.ndarray, val: np.ndarray, raw: np.ndarray) -> np.ndarray:
    """New bits of elements whose current bits are ``cur`` (numpy ints of the element's size): the raw value
    where ``raw``, else ``cur`` + the sign-extended difference (modulo the element's width)."""
    e = cur.dtype.itemsize
    u = _NP_UINT[e]
    out = cur.view(u) + val.astype(u)  # a difference stored in w < 8e bits was sign-extended by the decoder
    return np.where(raw, val.astype(u), out).view(cur.dtype)


def sign_extend(val: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``w``-bit two's complement values (uint64) sign-extended to 64 bits (as uint64)."""
    w64 = w.astype(np.uint64)
    top = np.uint64(1) << (w64 - np.uint64(1))
    return np.where((val & top) != 0, val | ~((top << np.uint64(1)) - np.uint64(1)), val)


def _chunks(msgs: Sequence[np.ndarray]):
    """Every chunk of ``msgs`` with changes: (kind, the narrow chunk's block descriptors' first bytes or None),
    the walk both histograms share."""
    for mn in msgs:
        nc = int(mn[8:12].view(np.int32)[0])
        offs = mn[HEADER_BYTES : HEADER_BYTES + 8 * nc].view(np.int64)
        for o in offs.tolist():
            w = mn[o : o + 16].view(np.uint32)
            kind = int(w[0]) & 0xFF
            if not int(w[2]):
                continue
            desc = None
            if kind == KIND_NARROW:
                nb = -(-int(w[1]) // BLOCK)
                desc = mn[o + 16 : o + 16 + 2 * nb : 2].astype(np.int64)
            yield kind, desc


def block_histogram(msgs: Sequence[np.ndarray]) -> dict[str, int]:
    """Changed blocks per value width over messages (``"2"``, ``"4"``, ... bits; ``"raw"``; a patched block
    by its base width, ``"2p"``, ``"4p"``, ...; ``"exceptions"``: the patched blocks' exceptions; ``"dense"``:
    chunks sent dense): for reports (the bits real steps needed)."""
    out: dict[str, int] = {}
    for kind, desc in _chunks(msgs):
        if desc is None:
            if kind == KIND_DENSE:
                out["dense"] = out.get("dense", 0) + 1
            continue
        code, (_pm, nexc) = desc & 0x0F, split_mode(desc >> 4)
        for c, x in zip(code[code > 0].tolist(), nexc[code > 0].tolist(), strict=True):
            key = ("raw" if c == RAW else str(1 << c)) + ("p" if x else "")
            out[key] = out.get(key, 0) + 1
            if x:
                out["exceptions"] = out.get("exceptions", 0) + x
    return out


def chunk_histogram(msgs: Sequence[np.ndarray]) -> dict[str, int]:
    """Changed chunks by the bits their widest difference needed (``"2"``, ``"4"``, ... : the widest block
    width of a narrow chunk, a patched block counted at its base width; ``"raw"``: a block of it sent raw;
    ``"dense"``: the chunk sent dense) over messages: for reports (issue 44 asks it per chunk;
    :func:`block_histogram` gives it per block)."""
    out: dict[str, int] = {}
    for kind, desc in _chunks(msgs):
        if desc is None:
            key = "dense" if kind == KIND_DENSE else "v1"
        else:
            top = int((desc & 0x0F).max())
            key = "raw" if top == RAW else str(1 << top)
        out[key] = out.get(key, 0) + 1
    return out


def view_bits(t: torch.Tensor) -> tuple[np.ndarray, np.ndarray, bool]:
    """(``t``'s bits as numpy of its shape and strides, 1-D row-major bits, contiguous?): no copy when
    contiguous; the 1-D array is a copy otherwise."""
    b = bits(t.detach())
    nd = b.numpy()
    if b.is_contiguous():
        return nd, nd.reshape(-1), True
    # reshape(-1) of a strided 1-D view is a strided view, which dense chunks cannot reinterpret as bytes
    return nd, np.ascontiguousarray(nd).reshape(-1), False


def pack_v2_numpy(pairs: Sequence[Pair], ce: int, update: bool | list, patch: bool = True) -> torch.Tensor:
    """The v2 message of CPU ``pairs`` (validated by the caller) with numpy: per pair one compare, the
    changed elements' bits, :func:`encode_pair`; ``update``: True writes the changed elements into the
    snapshot, a list collects those writes (``commit_updates``), False leaves it; ``patch`` False: no patched
    blocks (the Triton pack's bytes)."""
    bufs, sizes, puts = [], [], []
    for src, snap in pairs:
        snd, sn, _ = view_bits(src)
        pnd, pn, pc = view_bits(snap)
        n = sn.size
        if not n:
            continue
        idx = np.flatnonzero(sn != pn)
        new = sn[idx]
        buf, nbytes, _count = encode_pair(idx, new, pn[idx], n, ce, sn, patch)
        bufs.append(buf)
        sizes.append(nbytes)
        if idx.size:
            puts.append((pn, idx, new) if pc else (pnd, np.unravel_index(idx, pnd.shape), new))
    nbytes = np.concatenate(sizes) if sizes else np.zeros(0, dtype=np.int64)
    nc = nbytes.size
    start = HEADER_BYTES + _pad(DIRECTORY_ENTRY_BYTES * nc)
    mn = np.zeros(start + int(nbytes.sum()), dtype=np.uint8)
    mn[:16].view(np.uint32)[:] = (MAGIC, VERSION2, nc, ce)
    mn[HEADER_BYTES : HEADER_BYTES + 8 * nc].view(np.int64)[:] = start + np.cumsum(nbytes) - nbytes
    if bufs:
        mn[start:] = np.concatenate(bufs)
    if isinstance(update, list):
        update.extend(puts)
    elif update:
        for view, at, v in puts:
            view[at] = v
    return torch.from_numpy(mn)


def narrow_want(numel: np.ndarray, esize: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """The bytes a narrow chunk's header may claim (checked exactly with its body): ``nbytes`` when it is a
    multiple of 16 between its descriptors and its dense size, else -1."""
    lo = HEADER_BYTES + 2 * (-(-numel // BLOCK))
    hi = HEADER_BYTES + _pad(numel * esize)
    return np.where((nbytes % ALIGN == 0) & (nbytes >= lo) & (nbytes < hi), nbytes, -1)


def write_changes(
    views: Sequence[np.ndarray | None],
    nds: Sequence[np.ndarray],
    owner: np.ndarray,
    start: np.ndarray,
    decoded: tuple,
) -> None:
    """Apply decoded narrow changes (:func:`decode_chunks`) to the destinations: ``views`` their 1-D
    contiguous bits (None: strided, then ``nds``, their bits of their shape and strides)."""
    chunk, elem, val, raw = decoded
    if not chunk.size:
        return
    dst = owner[chunk]
    pos = start[chunk] + elem
    order = np.argsort(dst, kind="stable")
    dst, pos, val, raw = dst[order], pos[order], val[order], raw[order]
    st, ln = _runs(dst)
    for a, n in zip(st.tolist(), ln.tolist(), strict=True):
        i = int(dst[a])
        p, v, r = pos[a : a + n], val[a : a + n], raw[a : a + n]
        if views[i] is not None:
            views[i][p] = apply_values(views[i][p], v, r)
        else:
            at = np.unravel_index(p, nds[i].shape)
            nds[i][at] = apply_values(nds[i][at], v, r)
