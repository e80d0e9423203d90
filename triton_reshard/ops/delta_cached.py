"""Per-message plans of the numpy delta op (``ops/delta_cpu.py``): what packing or unpacking one message needs
that depends only on its views (the chunk table, the layout's constant terms, the numpy views and their slices,
a reusable mask), built once per (message, bound views) and kept by the caller (a delta refit keeps them on its
``Bound``: new tensors, a new plan or a new snapshot make new ones). The messages are byte for byte those of
``numpy_pack`` / ``torch_pack`` and the checks and errors those of ``numpy_unpack`` (``read_directory_np``).

Why (issue 32): on a small model a delta refit's CPU was mostly per-call bookkeeping and per-changed-element
index passes, not the compare: 2.4 ms to pack a 1.65M-element bf16 message at 2 % changed, of which ~0.85 ms
in ``np.flatnonzero`` alone (numpy's sparse path takes a mispredicted branch per set element: ~25 ns each
here). The plans cut it to one compare per view into a padded mask (each view starts at a chunk boundary, so a
chunk is ``index // chunk_elems``), a nonzero over 8-element groups (:func:`flatnonzero_sparse`), one gather
per view and vectorized header, offset and value writes; the unpack writes chunk by chunk from the message's
own slices (offsets and values are contiguous per chunk) into cached destination slices.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .delta_cpu import (
    DstFacts,
    body_error,
    flat_np,
    np_int,
    numpy_pack,
    read_directory_np,
    value_base_np,
    write_headers_np,
)
from .delta_format import (
    DIRECTORY_ENTRY_BYTES,
    HEADER_BYTES,
    KIND_BITMASK,
    KIND_DENSE,
    KIND_OFFSETS,
    VERSION2,
    Pair,
    check_chunk_elems,
    pad,
    validate_pairs,
)
from .delta_native import header_word, pack_v2, unpack_v2

BLOCK = 1 << 20  # padded elements compared and searched per pass in messages over MASK_CAP
MASK_CAP = 1 << 22  # messages up to this many padded elements: one pass, one mask (its gaps zeroed once)


def flatnonzero_sparse(m: np.ndarray) -> np.ndarray:
    """``np.flatnonzero(m)`` of a contiguous 1-D bool array, faster when few elements are set: numpy's
    nonzero takes a branch per set element below 10 % set (~25 ns each here, mispredicted on random masks:
    0.85 ms for 33k of 1.65M); here the set bits are packed into bytes, the nonzero bytes found (dense enough
    for numpy's branch-free path) and expanded. Above ~11 % set numpy's own branch-free path is faster."""
    p = np.packbits(m, bitorder="little")
    nzb = np.flatnonzero(p != 0)
    if nzb.size * 8 > p.size * 5:
        return np.flatnonzero(m)
    k = np.flatnonzero(np.unpackbits(p[nzb], bitorder="little").view(bool))
    return (nzb[k >> 3] << 3) | (k & 7)


class PackPlan:
    """One message's pack: ``pairs`` ((source, snapshot) views) cut into chunks of ``ce`` elements. Views
    that are all contiguous with one element size take the fast path (``fast``); others are packed by
    :func:`~triton_reshard.ops.delta_cpu.numpy_pack` (the same bytes). Reuse it only for the same view
    objects (:meth:`fits`): it holds numpy views of their memory."""

    def __init__(self, pairs: Sequence[Pair], ce: int) -> None:
        check_chunk_elems(ce)
        if validate_pairs(pairs).type != "cpu":
            raise ValueError("PackPlan: CPU tensors only")
        self.pairs, self.ce = [(s, p) for s, p in pairs], ce
        flats = [(flat_np(s)[1], flat_np(p)[1]) for s, p in self.pairs]
        self.fast = len({s.element_size() for s, _p in pairs}) == 1 and all(
            a is not None and b is not None for a, b in flats)
        if self.fast:
            self._build(flats)

    def fits(self, pairs: Sequence[Pair], ce: int) -> bool:
        """Built for exactly these views (the same tensor objects, in order) and chunk size?"""
        return ce == self.ce and len(pairs) == len(self.pairs) and all(
            s is a and p is b for (s, p), (a, b) in zip(pairs, self.pairs, strict=True))

    def _build(self, flats) -> None:
        ce, e = self.ce, self.pairs[0][0].element_size()
        numels = [a.size for a, _ in flats]
        nchs = [-(-n // ce) for n in numels]
        c0s = np.zeros(len(numels) + 1, dtype=np.int64)
        np.cumsum(nchs, out=c0s[1:])
        nc = self.nc = int(c0s[-1])
        self.e, self.flats = e, flats
        owner = np.repeat(np.arange(len(numels), dtype=np.int64), nchs)
        first = (np.arange(nc, dtype=np.int64) - c0s[owner]) * ce
        numel = np.minimum(ce, np.asarray(numels, dtype=np.int64)[owner] - first)
        self.owner, self.first, self.numel = owner.tolist(), first.tolist(), numel
        self.esize = np.full(nc, e, dtype=np.int64)
        self.bm_base = HEADER_BYTES + pad(4 * ((numel + 31) // 32))  # the bitmask's bytes before its values
        self.dense = HEADER_BYTES + pad(numel * e)
        self.start = HEADER_BYTES + pad(DIRECTORY_ENTRY_BYTES * nc)
        self.bounds = np.arange(nc + 1, dtype=np.int64) * ce  # chunk c: padded elements [c ce, (c + 1) ce)
        self.shift = ce.bit_length() - 1 if ce & (ce - 1) == 0 else None
        total = nc * ce
        self.reuse = total <= MASK_CAP
        # a message up to MASK_CAP elements in one pass (numpy's per-call costs); larger ones in blocks
        step = max(1, total) if self.reuse else max(ce, BLOCK // ce * ce)
        self.mask = np.zeros(min(total, step), dtype=bool)
        spans = [(int(c0s[k]) * ce, int(c0s[k]) * ce + n, k) for k, n in enumerate(numels) if n]
        self.blocks = []
        for b0 in range(0, total, step):
            b1 = min(total, b0 + step)
            pieces, gaps, at = [], [], b0
            for lo, hi, k in spans:
                lo2, hi2 = max(lo, b0), min(hi, b1)
                if lo2 >= hi2:
                    continue
                if lo2 > at:
                    gaps.append((at - b0, lo2 - b0))
                sn, pn = flats[k]
                m0 = (lo2 if self.reuse else lo2 - b0)
                pieces.append((sn[lo2 - lo:hi2 - lo], pn[lo2 - lo:hi2 - lo], lo2 - b0, self.mask[m0:m0 + hi2 - lo2]))
                at = hi2
            if at < b1:
                gaps.append((at - b0, b1 - b0))
            cuts = np.asarray([o for _s, _p, o, _m in pieces] + [b1 - b0], dtype=np.int64)
            self.blocks.append((b0, b1 - b0, pieces, gaps, cuts))

    def pack(self, update: bool | list) -> torch.Tensor:
        """The delta message (``numpy_pack``'s bytes); ``update``: True writes the changed elements into the
        snapshot, a list collects those writes (``commit_updates``), False leaves it."""
        if not self.fast:
            return numpy_pack(self.pairs, self.ce, update)
        idxs, vals, puts = [], [], []
        for b0, n, pieces, gaps, cuts in self.blocks:
            m = self.mask[b0:b0 + n] if self.reuse else self.mask[:n]
            if not self.reuse:
                for lo, hi in gaps:
                    m[lo:hi] = False
            for sn, pn, _o, mo in pieces:
                np.not_equal(sn, pn, out=mo)
            ii = flatnonzero_sparse(m)
            if not ii.size:
                continue
            cut = np.searchsorted(ii, cuts).tolist()
            for (sn, pn, o, _mo), lo, hi in zip(pieces, cut[:-1], cut[1:], strict=True):
                if hi > lo:
                    sel = ii[lo:hi] - o if o else ii[lo:hi]
                    v = sn[sel]
                    puts.append((pn, sel, v))
                    vals.append(v)
            idxs.append(ii + b0 if b0 else ii)
        idx = np.concatenate(idxs) if len(idxs) > 1 else idxs[0] if idxs else np.zeros(0, dtype=np.int64)
        msg = self._message(idx, vals)
        if isinstance(update, list):
            update.extend(puts)
        elif update:
            for pn, sel, v in puts:  # after the message: a bitmask chunk compares its views again
                pn[sel] = v
        return msg

    def _message(self, idx: np.ndarray, vals: list) -> torch.Tensor:
        e, ce, nc, numel = self.e, self.ce, self.nc, self.numel
        count = np.diff(np.searchsorted(idx, self.bounds))
        vb = pad(count * e)
        off, bm = HEADER_BYTES + pad(2 * count) + vb, self.bm_base + vb
        kind = np.where((off <= bm) & (off <= self.dense), KIND_OFFSETS, np.where(bm <= self.dense, KIND_BITMASK,
                                                                                   KIND_DENSE))
        nbytes = np.where(kind == KIND_OFFSETS, off, np.where(kind == KIND_BITMASK, bm, self.dense))
        offsets = self.start + np.cumsum(nbytes) - nbytes
        mn = np.zeros(self.start + int(nbytes.sum()), dtype=np.uint8)
        msg = torch.from_numpy(mn)
        write_headers_np(mn, ce, numel, count, self.esize, kind, nbytes, offsets)
        if not nc:
            return msg
        body = offsets + HEADER_BYTES
        first = np.cumsum(count) - count  # each chunk's first entry in idx / vals
        me = mn.view(np_int(e))
        if idx.size:  # offsets and values: contiguous per chunk in the message, one slice each
            v = np.concatenate(vals) if len(vals) > 1 else vals[0]
            u16 = mn.view(np.uint16)
            vbase = body + np.where(kind == KIND_OFFSETS, pad(2 * count),
                                    np.where(kind == KIND_BITMASK, self.bm_base - HEADER_BYTES, 0))
            live = np.flatnonzero((count > 0) & (kind != KIND_DENSE))
            rows = zip(live.tolist(), (kind[live] == KIND_OFFSETS).tolist(), (body[live] // 2).tolist(),
                       (vbase[live] // e).tolist(), first[live].tolist(), count[live].tolist(), strict=True)
            for c, isoff, a16, av, f, n in rows:
                if isoff:  # the chunk's offsets: its padded indices less its first one
                    np.subtract(idx[f:f + n], c * ce, out=u16[a16:a16 + n], casting="unsafe")
                me[av:av + n] = v[f:f + n]
        for c in np.flatnonzero(kind != KIND_OFFSETS).tolist():  # rare at a few % changed
            sn, pn = self.flats[self.owner[c]]
            a, n, b = self.first[c], int(numel[c]), int(body[c])
            if kind[c] == KIND_DENSE:
                me[b // e:b // e + n] = sn[a:a + n]
            else:  # the bitmask (LSB first), from the views (the snapshot is written after the message)
                wb = np.packbits(sn[a:a + n] != pn[a:a + n], bitorder="little")
                mn[b:b + wb.size] = wb
        return msg


def pack_deferred(pairs: Sequence[Pair], chunk_elems: int, updates: list, cache: dict | None = None,
                  version: int = VERSION2) -> torch.Tensor:
    """The delta message of CPU ``pairs`` (``torch_pack``'s bytes) with the snapshot left as it was: its
    writes (the changed elements) are appended to ``updates``, to be made by ``commit_updates`` once the
    message is known to be used (a delta refit diffs while its handshake is in flight, before the fence
    says whether the refit goes as a delta: a refused one must leave the snapshot untouched). ``cache``: as
    ``ops.pack_delta``'s (the message's :class:`PackPlan` kept there, its checks made once). ``version``: as
    ``ops.pack_delta``'s (2: the native or numpy v2 codec, ``ops/delta_native.py``)."""
    if version == VERSION2:
        plan = cache.get("pack2") if cache is not None else None
        if plan is None or not plan.fits(pairs, chunk_elems):  # (a plan built for these views checked them)
            check_chunk_elems(chunk_elems)
            if validate_pairs(pairs).type != "cpu":
                raise ValueError("pack_deferred: CPU tensors only")
        return pack_v2(pairs, chunk_elems, updates, cache)
    plan = cache.get("pack") if cache is not None else None
    if plan is not None and plan.fits(pairs, chunk_elems):
        return plan.pack(updates)
    check_chunk_elems(chunk_elems)
    if validate_pairs(pairs).type != "cpu":
        raise ValueError("pack_deferred: CPU tensors only")
    if cache is not None:
        return pack_plan(cache, pairs, chunk_elems).pack(updates)
    return numpy_pack(pairs, chunk_elems, updates)


def pack_plan(cache: dict, pairs: Sequence[Pair], ce: int) -> PackPlan:
    """``cache["pack"]`` if it was built for these views, else a new :class:`PackPlan` (kept there)."""
    plan = cache.get("pack")
    if plan is None or not plan.fits(pairs, ce):
        plan = cache["pack"] = PackPlan(pairs, ce)
    return plan


class UnpackPlan:
    """One message's destination views: their :class:`~triton_reshard.ops.delta_cpu.DstFacts` and, when all
    are contiguous (``fast``), each chunk's 1-D numpy slice of its destination. Reuse it only for the same
    view objects (:meth:`fits`)."""

    def __init__(self, dsts: Sequence[torch.Tensor]) -> None:
        self.given = dsts  # the caller's list: passed again (a refit's receive), it fits without a walk
        self.dsts = list(dsts)
        self.cpu = all(d.device.type == "cpu" for d in self.dsts)
        self.facts = DstFacts(self.dsts)
        self.flat = [b.reshape(-1).numpy() if b is not None and b.is_contiguous() and b.device.type == "cpu" else None
                     for b in self.facts.bit_views]
        self.fast = all(f is not None for f in self.flat)
        self._slices: tuple | None = None

    def fits(self, dsts: Sequence[torch.Tensor]) -> bool:
        """Built for exactly these views (the same tensor objects, in order)? A list is not changed in place
        between calls by its callers (a refit keeps its receive's list as made): the same list fits at once."""
        if len(dsts) != len(self.dsts):
            return False
        return dsts is self.given or all(a is b for a, b in zip(dsts, self.dsts, strict=True))

    def slices(self, ce: int) -> list[np.ndarray]:
        """Each chunk's destination elements (1-D numpy views), for chunks of ``ce`` elements."""
        if self._slices is None or self._slices[0] != ce:
            chunks, _cols = self.facts.chunks(ce)
            self._slices = (ce, [self.flat[i][a:a + n] for i, a, n in chunks])
        return self._slices[1]


def unpack_plan(cache: dict, dsts: Sequence[torch.Tensor]) -> UnpackPlan:
    """``cache["unpack"]`` if it was built for these views, else a new :class:`UnpackPlan` (kept there)."""
    plan = cache.get("unpack")
    if plan is None or not plan.fits(dsts):
        plan = cache["unpack"] = UnpackPlan(dsts)
    return plan


def unpack_with(plan: UnpackPlan, msg: torch.Tensor, names: Sequence[str] | None) -> None:
    """``numpy_unpack(msg, plan.dsts, names)``: the same checks (every header, then every body) before the
    first write and the same result, written chunk by chunk (a chunk's offsets and values are contiguous
    slices of the message) into the plan's destination slices."""
    if not plan.fast or header_word(msg, 1) == VERSION2:
        return unpack_v2(msg, plan.dsts, names, plan.facts)
    dr = read_directory_np(msg, plan.dsts, names, plan.facts)
    nc = len(dr.chunks)
    if not nc:
        return None
    mn = msg.numpy()
    u16 = mn.view(np.uint16)
    k, cnt, nel = dr.kind, dr.count, dr.numel
    body = dr.offsets + HEADER_BYTES
    bad = np.zeros(nc, dtype=bool)
    oc = np.flatnonzero((k == KIND_OFFSETS) & (cnt > 0))
    if oc.size:  # the largest offset of each chunk (its values follow its offsets: every bound is inside; the
        # directory need not be ascending: a pair (end, next start) out of order reduces one element, unused)
        at = np.empty(2 * oc.size, dtype=np.int64)
        at[0::2] = body[oc] // 2
        at[1::2] = at[0::2] + cnt[oc]
        bad[oc] = np.maximum.reduceat(u16[:int(at.max()) + 1], at)[0::2] >= nel[oc]
    marks = {}
    for c in np.flatnonzero(k == KIND_BITMASK).tolist():
        n, b = int(nel[c]), int(body[c])
        pos = np.flatnonzero(np.unpackbits(mn[b:b + 4 * ((n + 31) // 32)], bitorder="little").view(bool))
        bad[c] = pos.size != cnt[c] or (pos.size and pos[-1] >= n)
        marks[c] = pos
    if bad.any():
        raise body_error(dr, int(np.argmax(bad)), names)
    ce = int(mn[12:16].view(np.int32)[0])
    dst = plan.slices(ce)
    esize = plan.facts.chunks(ce)[1][3]
    vb = value_base_np(k, body, cnt, nel)
    todo = np.flatnonzero((cnt > 0) | (k == KIND_DENSE))
    typed = {e: mn.view(np_int(e)) for e in set(plan.facts.esizes)}
    for c, kc, b, v, n, e in zip(todo.tolist(), k[todo].tolist(), body[todo].tolist(), vb[todo].tolist(),
                                 cnt[todo].tolist(), esize[todo].tolist(), strict=True):
        me = typed[e]
        if kc == KIND_OFFSETS:
            dst[c][u16[b // 2:b // 2 + n].astype(np.intp)] = me[v // e:v // e + n]  # (intp: 2x faster put)
        elif kc == KIND_BITMASK:
            dst[c][marks[c]] = me[v // e:v // e + n]
        else:
            d = dst[c]
            d[:] = me[b // e:b // e + d.size]
    return None
