"""The delta op on CPU tensors (``ops/delta.py``'s ``torch_pack`` / ``torch_unpack`` run these): the same
messages, byte for byte, and the same checks and errors, with numpy, headers and directory included.

At the sizes of a refit's messages the per-call cost of torch's small ops dominates the header work: a
message of ~50 chunks took ~0.5 ms in torch's layout, header and directory ops against ~0.05 ms here
(issue 32: a delta refit of a small model is bound by its fixed costs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .delta_format import (
    ALIGN,
    DIRECTORY_ENTRY_BYTES,
    HEADER_BYTES,
    INT_DTYPES,
    KIND_BITMASK,
    KIND_DENSE,
    KIND_NAMES,
    KIND_NARROW,
    KIND_OFFSETS,
    MAGIC,
    MAX_CHUNK_ELEMS,
    VERSION,
    VERSION2,
    Pair,
    chunk_list,
    name_of,
    pad,
    write_flat,
)
from .delta_v2 import decode_chunks, narrow_want, write_changes
from .launcher import bits


def chunks_start_np(nc: int) -> int:
    return HEADER_BYTES + pad(DIRECTORY_ENTRY_BYTES * nc)


def message_layout_np(numel: np.ndarray, count: np.ndarray, esize: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """``delta._message_layout`` in numpy: (kind, nbytes, byte offset per chunk, message length); the
    smallest encoding per chunk, ties to offsets, then bitmask, then dense (``np.argmin`` takes the first)."""
    values = pad(count * esize)
    sizes = np.stack([HEADER_BYTES + pad(2 * count) + values,
                      HEADER_BYTES + pad(4 * ((numel + 31) // 32)) + values,
                      HEADER_BYTES + pad(numel * esize)])
    pick = sizes.argmin(0) if numel.size else np.zeros(0, dtype=np.int64)
    kind = np.array([KIND_OFFSETS, KIND_BITMASK, KIND_DENSE], dtype=np.int64)[pick]
    nbytes = sizes[pick, np.arange(numel.size)]
    start = chunks_start_np(numel.size)
    offsets = start + np.cumsum(nbytes) - nbytes
    return kind, nbytes, offsets, start + int(nbytes.sum())


def write_headers_np(mn: np.ndarray, chunk_elems: int, numel: np.ndarray, count: np.ndarray, esize: np.ndarray,
                     kind: np.ndarray, nbytes: np.ndarray, offsets: np.ndarray) -> None:
    """``delta._write_headers`` in numpy (``mn``: the zeroed message's bytes)."""
    nc = numel.size
    m32 = mn.view(np.int32)
    m32[:4] = (MAGIC, VERSION, nc, chunk_elems)
    if nc:
        mn[HEADER_BYTES:HEADER_BYTES + 8 * nc].view(np.int64)[:] = offsets
        words = np.stack([kind | (esize << 8), numel, count, nbytes], 1).astype(np.int32)
        m32[((offsets // 4)[:, None] + np.arange(4)).reshape(-1)] = words.reshape(-1)


def value_base_np(kind: np.ndarray, body: np.ndarray, count: np.ndarray, numel: np.ndarray) -> np.ndarray:
    """``delta._value_base`` in numpy: byte offset of each chunk's values."""
    return np.where(kind == KIND_OFFSETS, body + pad(2 * count),
                    np.where(kind == KIND_BITMASK, body + pad(4 * ((numel + 31) // 32)), body))


@dataclass(frozen=True, slots=True)
class DirectoryNp:
    """A received message's chunks, checked against the destinations (numpy, message order), and the
    destinations' integer views and element sizes."""

    chunks: list[tuple[int, int, int]]  # (destination index, first element, length)
    owner: np.ndarray
    start: np.ndarray
    numel: np.ndarray
    offsets: np.ndarray  # int64 byte offset of each chunk header
    kind: np.ndarray
    count: np.ndarray
    bit_views: list
    esizes: list[int]
    nbytes: np.ndarray | None = None  # each chunk's bytes (header included)
    version: int = VERSION


class DstFacts:
    """What :func:`read_directory_np` checks a message against that depends only on the destinations: element
    sizes, devices, integer views and, per ``chunk_elems``, the chunk list and its columns (owner, first
    element, length, element size). A receiver keeps it per message while its destination views stay the same
    objects (``ops.delta_cached.UnpackPlan``)."""

    def __init__(self, dsts: Sequence[torch.Tensor]) -> None:
        self.esizes = [d.element_size() for d in dsts]
        self.devices = [d.device for d in dsts]
        self.numels = [d.numel() for d in dsts]
        self.bit_views = [bits(d.detach()) if e in INT_DTYPES else None for d, e in zip(dsts, self.esizes, strict=True)]
        self._last: tuple | None = None  # (chunk_elems, its chunks and columns): the last one asked for

    def chunks(self, chunk_elems: int) -> tuple[list[tuple[int, int, int]], tuple[np.ndarray, ...]]:
        """The chunk list of ``chunk_elems`` and its columns (owner, first element, length, element size)."""
        if self._last is None or self._last[0] != chunk_elems:
            chunks = chunk_list(self.numels, chunk_elems)
            cinfo = np.asarray(chunks, dtype=np.int64).reshape(len(chunks), 3)
            esize_d = np.asarray(self.esizes, dtype=np.int64)[cinfo[:, 0]] if chunks else cinfo[:, 0]
            self._last = (chunk_elems, chunks, (cinfo[:, 0], cinfo[:, 1], cinfo[:, 2], esize_d))
        return self._last[1], self._last[2]


def read_directory_np(msg: torch.Tensor, dsts: Sequence[torch.Tensor], names: Sequence[str] | None = None,
                      facts=None) -> DirectoryNp:
    """``delta.read_directory`` for CPU tensors in numpy: the same checks in the same order, the same
    ``ValueError`` messages. ``facts``: the destinations' :class:`DstFacts` kept by the caller (built for
    these ``dsts``), else built here."""
    if msg.dtype != torch.uint8 or msg.dim() != 1 or not msg.is_contiguous():
        raise ValueError(f"a delta message is a contiguous 1-D uint8 tensor, got {msg.dtype} {tuple(msg.shape)}")
    length = msg.numel()
    if length < HEADER_BYTES or length % ALIGN:
        raise ValueError(f"delta message of {length} bytes: shorter than its header or not a multiple of {ALIGN}")
    facts = facts if facts is not None else DstFacts(dsts)
    esizes = facts.esizes
    for i, dev in enumerate(facts.devices):
        if esizes[i] not in INT_DTYPES or dev != msg.device:
            raise ValueError(f"destination {name_of(names, i)}: {dsts[i].dtype} on {dev} (message on {msg.device})")
    mn = msg.numpy()
    magic, version, nc, chunk_elems = (int(x) & 0xFFFFFFFF for x in mn[:16].view(np.int32).tolist())
    if magic != MAGIC or version not in (VERSION, VERSION2):
        raise ValueError(f"not a delta message of version {VERSION} (magic {magic:#x}, version {version})")
    if not 1 <= chunk_elems <= MAX_CHUNK_ELEMS:
        raise ValueError(f"delta message: chunk_elems {chunk_elems} out of range")
    chunks, cinfo = facts.chunks(chunk_elems)
    if nc != len(chunks):
        raise ValueError(f"delta message has {nc} chunks; the destinations {[tuple(d.shape) for d in dsts]} "
                         f"cut into chunks of {chunk_elems} elements make {len(chunks)}")
    start = chunks_start_np(nc)
    bit_views = facts.bit_views
    if not nc:
        e = np.zeros(0, dtype=np.int64)
        return DirectoryNp(chunks, e, e, e, e, e, e, bit_views, esizes, e, version)
    if length < start:
        raise ValueError(f"delta message of {length} bytes is shorter than its directory ({start} bytes)")
    owner, first, numel, esize_d = cinfo
    offsets = mn[HEADER_BYTES:HEADER_BYTES + 8 * nc].view(np.int64).copy()
    ok_off = (offsets >= start) & (offsets % ALIGN == 0) & (offsets <= length - HEADER_BYTES)
    safe = np.where(ok_off, offsets, start if start < length else 0)
    words = mn.view(np.int32)[((safe // 4)[:, None] + np.arange(4)).reshape(-1)].reshape(nc, 4).astype(np.int64)
    words &= 0xFFFFFFFF
    kind, esize, numel_m, count, nbytes = words[:, 0] & 0xFF, words[:, 0] >> 8, words[:, 1], words[:, 2], words[:, 3]
    values = pad(np.minimum(count, numel) * esize_d)
    want = np.stack([HEADER_BYTES + pad(numel * esize_d),
                     HEADER_BYTES + pad(4 * ((numel + 31) // 32)) + values,
                     HEADER_BYTES + pad(2 * np.minimum(count, numel)) + values])[np.clip(kind, 0, 2), np.arange(nc)]
    top = KIND_OFFSETS
    if version == VERSION2:  # narrow chunks: their bytes are checked exactly with their bodies (ops/delta_v2.py)
        top = KIND_NARROW
        want = np.where(kind == KIND_NARROW, narrow_want(numel, esize_d, nbytes), want)
    good = (ok_off & (kind <= top) & (esize == esize_d) & (numel_m == numel) & (count <= numel)
            & (nbytes == want) & (safe + nbytes <= length))
    if not good.all():
        c = int(np.argmin(good))
        i, a, n = chunks[c]
        raise ValueError(
            f"delta message: chunk {c} (destination {name_of(names, i)}, elements {a}..{a + n - 1}) is "
            f"inconsistent: offset {int(offsets[c])}, kind {int(kind[c])}, elem_size {int(esize[c])} "
            f"(want {int(esize_d[c])}), numel {int(numel_m[c])} (want {n}), count {int(count[c])}, "
            f"nbytes {int(nbytes[c])} (want {int(want[c])}), message {length} bytes")
    return DirectoryNp(chunks, owner, first, numel, offsets, kind, count, bit_views, esizes, nbytes, version)


# CPU: the same messages, byte for byte, with numpy. Its compare, nonzero, take and put are 5-10x faster
# than torch's CPU kernels of the same ops at these sizes (torch's ``ne`` on int16 0.63 ns/element against
# numpy's 0.07, an index gather ~10 ns/element against ~1: perf/HISTORY.md, issue 32), and a delta refit on a
# CPU rank is bound by exactly these passes. ``torch_pack`` / ``torch_unpack`` use them for CPU tensors;
# ``_tensor_pack`` / ``_tensor_unpack`` (torch ops only) stay the reference for other devices.


def flat_np(t: torch.Tensor) -> tuple[np.ndarray, np.ndarray | None]:
    """``t``'s element bits as a numpy array of its shape and strides (its own memory, no copy), and the same
    as a 1-D row-major view when ``t`` is contiguous (else None)."""
    b = bits(t.detach())
    if b.is_contiguous():
        return b.numpy(), b.reshape(-1).numpy()
    return b.numpy(), None


_NP_BLOCK = 1 << 18  # elements per pass of the CPU pack over a contiguous pair (2 MiB L2 per core here)


def _ragged_np(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`ragged` in numpy."""
    seg = np.repeat(np.arange(lengths.size, dtype=np.int64), lengths)
    first = np.cumsum(lengths) - lengths
    return seg, np.arange(seg.size, dtype=np.int64) - first[seg]


def np_int(e: int):
    return {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[e]


def numpy_pack(pairs: Sequence[Pair], ce: int, update: bool | list) -> torch.Tensor:
    """:func:`torch_pack` for CPU tensors (validated by the caller): one compare and one nonzero per pair
    (numpy, on the views' own strides: no flattening copy), the changed values taken once, and with
    ``update`` only the changed elements written into the snapshot (its other elements already hold the
    source's bits). ``update`` a list: the snapshot writes are appended to it instead, for
    :func:`commit_updates` later (``ops.delta_cached.pack_deferred``)."""
    defer = update if isinstance(update, list) else None
    flats = [(flat_np(s), flat_np(p)) for s, p in pairs]
    numels = [sf[0].size for sf, _ in flats]
    esizes = [s.element_size() for s, _ in pairs]
    nchs = [-(-n // ce) for n in numels]
    c0s = np.zeros(len(pairs) + 1, dtype=np.int64)
    np.cumsum(nchs, out=c0s[1:])
    nc = int(c0s[-1])
    shift = ce.bit_length() - 1 if ce & (ce - 1) == 0 else None
    strided = [n for n, ((_s, sf), (_p, pf)) in zip(numels, flats, strict=True) if sf is None or pf is None]
    mbuf = np.empty(max([min(n, _NP_BLOCK) for n in numels] + strided, default=0), dtype=bool)
    idxs, vals, puts = [], [], []
    for i, ((snd, sn), (pnd, pn)) in enumerate(flats):
        n = snd.size
        if not n:
            idxs.append(np.zeros(0, dtype=np.int64))
            vals.append(snd.reshape(-1))
            continue
        base = int(c0s[i]) * ce
        if sn is not None and pn is not None:
            # contiguous: in blocks that stay in cache while compared, searched, read and updated (~25 %
            # less time than whole-tensor passes on 32M elements)
            bi, bv = [], []
            for a in range(0, n, _NP_BLOCK):
                z = min(n, a + _NP_BLOCK)
                m = mbuf[:z - a]
                np.not_equal(sn[a:z], pn[a:z], out=m)
                ii = np.flatnonzero(m)
                v = sn[a:z][ii]
                if defer is not None:
                    defer.append((pn[a:z], ii, v))
                elif update:  # only the changed elements: the others already hold the source's bits
                    pn[a:z][ii] = v
                bi.append(ii + (base + a) if base + a else ii)
                bv.append(v)
            idxs.append(bi[0] if len(bi) == 1 else np.concatenate(bi))
            vals.append(bv[0] if len(bv) == 1 else np.concatenate(bv))
            continue
        # strided views are compared and read in place (numpy walks their strides): no staging copy
        m = mbuf[:n].reshape(snd.shape)
        np.not_equal(snd, pnd, out=m)
        ii = np.flatnonzero(m)
        v = snd[np.unravel_index(ii, snd.shape)]
        if defer is not None or update:
            puts.append((pnd, np.unravel_index(ii, pnd.shape), v))
        idxs.append(ii + base if base else ii)
        vals.append(v)
    gidx = np.concatenate(idxs) if idxs else np.zeros(0, dtype=np.int64)
    ch = gidx >> shift if shift is not None else gidx // ce
    numel = np.full(nc, ce, dtype=np.int64)
    last = [(int(c0s[i + 1]) - 1, n - (nch - 1) * ce) for i, (n, nch) in enumerate(zip(numels, nchs, strict=True))
            if nch]
    if last:
        li, ln = zip(*last, strict=True)
        numel[list(li)] = ln
    count = np.bincount(ch, minlength=nc).astype(np.int64) if nc else numel
    esize = np.repeat(np.asarray(esizes, dtype=np.int64), nchs)
    kind, nbytes, offsets, total = message_layout_np(numel, count, esize)
    msg = torch.zeros(total, dtype=torch.uint8)
    mn = msg.numpy()
    write_headers_np(mn, ce, numel, count, esize, kind, nbytes, offsets)
    if nc:
        _bodies_np(mn, ce, shift, (kind, offsets, count, numel, nchs, c0s, ch, gidx), (flats, esizes, idxs, vals))
    if defer is not None:
        defer.extend(puts)
        return msg
    for pn, at, v in puts:  # only the changed elements: the others already hold the source's bits
        pn[at] = v
    return msg


def _bodies_np(mn: np.ndarray, ce: int, shift: int | None, layout: tuple, views: tuple) -> None:
    """:func:`numpy_pack`'s chunk bodies: dense chunks' values, bitmasks, offsets and the changed values."""
    kind, offsets, count, numel, nchs, c0s, ch, gidx = layout
    flats, esizes, idxs, vals = views
    nc = numel.size
    body = offsets + HEADER_BYTES
    vbase = value_base_np(kind, body, count, numel)
    owner = np.repeat(np.arange(len(flats), dtype=np.int64), nchs)
    keep = None  # the changed elements of dense chunks leave the sparse list
    dense = np.flatnonzero(kind == KIND_DENSE)
    for c in dense.tolist():
        i = int(owner[c])
        a, n, e = (c - int(c0s[i])) * ce, int(numel[c]), esizes[i]
        o = int(body[c]) // e
        sn = flats[i][0][1] if flats[i][0][1] is not None else flats[i][0][0].reshape(-1)
        mn.view(np_int(e))[o:o + n] = sn[a:a + n]
    if dense.size:
        keep = kind[ch] != KIND_DENSE
    local = gidx & (ce - 1) if shift is not None else gidx - ch * ce
    r = np.arange(gidx.size, dtype=np.int64) - (np.cumsum(count) - count)[ch]  # rank in its chunk
    bc = np.flatnonzero(kind == KIND_BITMASK)
    if bc.size:  # bitmask words (little-endian, LSB first), rebuilt from the indices
        nw = -(-ce // 32)
        row_of = np.full(nc, -1, dtype=np.int64)
        row_of[bc] = np.arange(bc.size)
        isb = kind[ch] == KIND_BITMASK
        rows = np.zeros((bc.size, 32 * nw), dtype=bool)
        rows[row_of[ch[isb]], local[isb]] = True
        wbytes = np.packbits(rows, axis=1, bitorder="little")
        col = np.arange(4 * nw)
        ok = col[None, :] < (4 * ((numel[bc] + 31) // 32))[:, None]
        mn[(body[bc][:, None] + col[None, :])[ok]] = wbytes[ok]
    off = kind[ch] == KIND_OFFSETS
    every = bool(off.all())
    at16 = body[ch] // 2 + r
    mn.view(np.uint16)[at16 if every else at16[off]] = local if every else local[off]
    cuts = np.zeros(len(flats) + 1, dtype=np.int64)
    np.cumsum([x.size for x in idxs], out=cuts[1:])
    for e in sorted(set(esizes)):
        members = [i for i in range(len(flats)) if esizes[i] == e and idxs[i].size]
        if not members:
            continue
        if len(members) == len(flats):
            sel, v = slice(None), np.concatenate(vals)
        else:
            sel = np.concatenate([np.arange(cuts[i], cuts[i + 1]) for i in members])
            v = np.concatenate([vals[i] for i in members])
        pos = vbase[ch[sel]] // e + r[sel]
        if keep is not None:
            k = keep[sel]
            pos, v = pos[k], v[k]
        mn.view(np_int(e))[pos] = v


def commit_updates(updates: list) -> None:
    """Make the snapshot writes ``ops.delta_cached.pack_deferred`` collected (each: a view, its positions, the
    values; or a callable, the native codec's ``Deferred``: it completes the update its pack began)."""
    for u in updates:
        if callable(u):
            u()
        else:
            view, at, v = u
            view[at] = v


def undo_updates(updates: list) -> None:
    """The message of ``pack_deferred`` will not be used: restore the snapshot. The numpy codec wrote nothing
    (its writes wait in ``updates``); the native codec's ``Deferred`` undoes what its pack wrote."""
    for u in updates:
        if hasattr(u, "undo"):
            u.undo()


def body_error(dr: DirectoryNp, c: int, names: Sequence[str] | None) -> ValueError:
    """The error of chunk ``c`` whose body disagrees with its header (an offset past the chunk, a bitmask
    whose popcount is not ``count`` or with a bit past the chunk)."""
    j, a0, n0 = dr.chunks[c]
    return ValueError(f"delta message: chunk {c} (destination {name_of(names, j)}, elements {a0}..{a0 + n0 - 1}): "
                      f"{KIND_NAMES[int(dr.kind[c])]} body inconsistent with its header (count {int(dr.count[c])})")


def numpy_unpack(msg: torch.Tensor, dsts: Sequence[torch.Tensor], names: Sequence[str] | None,
                 facts: DstFacts | None = None) -> None:
    """:func:`torch_unpack` for CPU tensors: the same checks (every header, then every body) before the first
    write, then per destination one numpy put (a torch scatter into a non-contiguous one) and a slice copy
    per dense chunk. ``facts``: as :func:`read_directory_np`'s."""
    dr = read_directory_np(msg, dsts, names, facts)
    if not dr.chunks:
        return
    nc = len(dr.chunks)
    owner, start, nel = dr.owner, dr.start, dr.numel
    mn = msg.numpy()
    k, cnt = dr.kind, dr.count
    body = dr.offsets + HEADER_BYTES
    vbase = value_base_np(k, body, cnt, nel)
    bad = np.zeros(nc, dtype=bool)
    seg, r = _ragged_np(np.where(k == KIND_OFFSETS, cnt, 0))
    o = mn.view(np.uint16)[body[seg] // 2 + r].astype(np.int64)
    bad[seg[o >= nel[seg]]] = True
    groups = [(seg, o, r)]  # (chunk, element in the chunk, index among its values) per item
    isb = k == KIND_BITMASK
    if isb.any():
        segw, w = _ragged_np(np.where(isb, 4 * ((nel + 31) // 32), 0))  # the bitmask bytes
        bitsm = np.unpackbits(mn[body[segw] + w], bitorder="little")
        pop = np.bincount(segw, weights=bitsm.reshape(-1, 8).sum(1), minlength=nc).astype(np.int64)
        flat_bits = np.flatnonzero(bitsm)
        row = flat_bits >> 3
        sb = segw[row]
        jb = w[row] * 8 + (flat_bits & 7)
        bad |= isb & (pop != cnt)
        bad[sb[jb >= nel[sb]]] = True  # a bit past the chunk's last element
        groups.append((sb, jb, np.arange(sb.size, dtype=np.int64) - (np.cumsum(pop) - pop)[sb]))
    narrow = np.flatnonzero(k == KIND_NARROW)
    if narrow.size:  # version 2: every narrow body checked and decoded before the first write
        nbad, decoded = decode_chunks(mn, body[narrow], nel[narrow], cnt[narrow], dr.nbytes[narrow],
                                      np.asarray(dr.esizes, dtype=np.int64)[owner[narrow]])
        bad[narrow] |= nbad
    if bad.any():
        raise body_error(dr, int(np.argmax(bad)), names)
    bit_views = dr.bit_views
    contiguous = np.array([d.is_contiguous() for d in bit_views], dtype=bool)
    esizes = dr.esizes
    isd = k == KIND_DENSE
    dense = []
    if isd.any():
        scatter = isd & ~contiguous[owner]
        segd, jd = _ragged_np(np.where(scatter, nel, 0))
        groups.append((segd, jd, jd))
        dense = np.flatnonzero(isd & ~scatter).tolist()
    flat = [d.view(-1).numpy() if c else None for d, c in zip(bit_views, contiguous.tolist(), strict=True)]
    bounds = np.arange(len(dsts) + 1, dtype=np.int64)
    for chunk, elem, ridx in groups:  # items sorted by chunk, chunks by destination: one range per destination
        if not chunk.size:
            continue
        cut = np.searchsorted(owner[chunk], bounds).tolist()
        pos = start[chunk] + elem  # element index in the destination (row-major)
        at = vbase[chunk]
        for i, (lo, hi) in enumerate(zip(cut[:-1], cut[1:], strict=True)):
            if hi == lo:
                continue
            e = esizes[i]
            vals = mn.view(np_int(e))[at[lo:hi] // e + ridx[lo:hi]]
            if flat[i] is not None:
                flat[i][pos[lo:hi]] = vals
            else:
                write_flat(bit_views[i], torch.from_numpy(pos[lo:hi]), torch.from_numpy(vals))
    for c in dense:
        i, a0, n0 = dr.chunks[c]
        e = esizes[i]
        ob = int(body[c]) // e
        flat[i][a0:a0 + n0] = mn.view(np_int(e))[ob:ob + n0]
    if narrow.size:
        write_changes(flat, [b.numpy() for b in bit_views], owner[narrow], start[narrow], decoded)



