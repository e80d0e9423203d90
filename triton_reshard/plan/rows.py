"""Routing as rows: the whole plan's transfers emitted as numpy columns per batch of tensors, straight from the
layouts' fragment rows (``Layout.tensor_rows``), never as one Python object per transfer.

The rules are ``local``'s (see its module doc); this module evaluates them on arrays. Per batch of tensors:

* the distinct nonempty destination boxes and source boxes (``np.unique`` over ``(tensor, offsets, sizes)``),
  every (destination box, source box) pair of one tensor that shares an element;
* a destination box every meeting source box contains is one piece held by all their fragments (the common
  case: replicas of one shard, or a larger shard); a box some meeting source box does not contain is cut into
  pieces (``routing.cover_pieces``), each held by the source boxes of its mask;
* without topology or relays a piece's transfers are computed vectorized: per holder rank its first fragment
  (local copies read it: the smallest source box, then local name, then local offsets) and its best one
  (senders read it: the smallest local name, then box, then local offsets), local copies where a destination
  rank holds the piece, and receiver ``i`` of the others (ascending ranks) gets holder ``(salt + i) % h``
  (``holders.assign`` without ``gpus_per_node``);
* the pieces of a tensor with relays, or any piece with ``gpus_per_node``, are routed one by one by
  ``holders.route_piece`` on ranks (their holders, first and best rows as above), so the rules stay one code;
* the rows become a :class:`~triton_reshard.plan.table.TransferTable` (local offsets from the fragments' local
  offsets plus the piece's offset in the fragment, as ``Fragment.local_box``).

The one router of the package: the whole plan routes every box, a rank's share (``local.route_rank``) the boxes
it touches (its queries' rows, 64 tensors a batch) and keeps its own rows. The object form, every box routed
on fragments into ``Transfer`` objects, is ``tests/oracles/route_objects.py``, compared with this one.

Bad input (overlapping destination boxes on a rank, an element no source holds) is detected here and raised
by a box-by-box check of the same tensor (``index.raise_bad_input``) in the words routing box by box used.
"""

from __future__ import annotations

import math
from collections.abc import Container

import numpy as np
import torch

from ..box import boxes_meet
from ..layout import Layout, gc_paused, itemsize_of
from ..layout.fragment_table import distinct
from .holders import route_piece
from .index import ShareQuery, raise_bad_input
from .quant import scale_lower_bound, unpack_fragment
from .relay import relay_dtype
from .routing import cover_pieces, held_numel, wire_dtype_of
from .table import I64, TransferTable, widen

ROW_BATCH = 2048  # tensors per batch: bounds the pair and row temporaries
SHARE_BATCH = 64  # a share's tensors per batch (~1,000 rows per tensor at 1,024 ranks)


def _dtypes(layout: Layout) -> dict[str, torch.dtype]:
    return {n: dt for n, (_shape, dt) in layout.shapes_and_dtypes().items()}


def route_tables(src: Layout, dst: Layout, gpn: int | None, relay: bool, groups: dict[int, int],
                 order: dict[str, int], todo: dict[str, list] | None = None, me: int | None = None,
                 whole: Container[str] = ()) -> tuple[TransferTable, TransferTable]:
    """Every rank's ``(local copies, wire transfers)`` as tables, unsorted. ``order``: tensor name -> its index
    among ``dst``'s tensors (the salt's base, and the order tensors are checked in).

    A rank's share: ``todo`` (tensor name -> the destination boxes to route, each ``(offsets, sizes)``, nonempty)
    routes only those boxes, and ``me`` keeps only the transfers with rank ``me`` on either end (local copies:
    into ``me``), except for the tensors in ``whole``, whose boxes keep every transfer (the block-quantization
    post-pass cuts them by the regions all of them make)."""
    if todo is None:
        sdt, ddt = _dtypes(src), _dtypes(dst)
        names = [n for n in sorted(order, key=order.__getitem__) if n in sdt]
    else:  # a share: the specs of its tensors only
        sspecs, dspecs = src.specs, dst.specs
        names = sorted((n for n in todo if n in sspecs), key=order.__getitem__)
        sdt, ddt = {n: sspecs[n].dtype for n in names}, {n: dspecs[n].dtype for n in names}
    opts: dict[tuple, tuple] = {}
    locals_, wires = [], []
    step = ROW_BATCH if todo is None else SHARE_BATCH
    for b in range(0, len(names), step):
        part = names[b:b + step]
        kinds = []
        for n in part:
            key = (sdt[n], ddt[n])
            o = opts.get(key)
            if o is None:
                w = wire_dtype_of_dtypes(*key)
                o = opts[key] = (w, relay_dtype(key[0], key[1], w) if relay else None)
            kinds.append(o)
        share = None if todo is None else ShareQuery(me, [todo[n] for n in part], [n in whole for n in part])
        lt, wt = _route_batch(src, dst, part, kinds, [order[n] for n in part], gpn, groups, share)
        locals_.append(lt)
        wires.append(wt)
    return TransferTable.concat(locals_), TransferTable.concat(wires)


def wire_dtype_of_dtypes(s: torch.dtype, d: torch.dtype) -> torch.dtype:
    """``routing.wire_dtype_of`` of a source and destination dtype: the narrower, the source's on a tie."""
    return d if itemsize_of(d) < itemsize_of(s) else s


def _boxes(k: np.ndarray, off: np.ndarray, sz: np.ndarray):
    """Distinct ``(tensor, offsets, sizes)`` (sorted: tensor, then the box as tuples compare) and each row's
    (one lexsort of the columns: ``np.unique(axis=0)`` sorts row views, several times slower)."""
    cols = [k, *off.T, *sz.T]
    o = np.lexsort(cols[::-1])
    new = np.ones(len(o), bool)
    for c in cols:
        cs = c[o]
        new[1:] &= cs[1:] == cs[:-1]
    new = ~new
    new[:1] = True
    inv = np.empty(len(o), I64)
    inv[o] = np.cumsum(new) - 1
    u = o[new]
    return k[u], off[u], sz[u], inv


def _segments(sorted_ids: np.ndarray, n: int) -> np.ndarray:
    return np.searchsorted(sorted_ids, np.arange(n + 1))


def _expand(starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(segment of each element, starts[segment] + position in it)`` for segments of ``counts``."""
    seg = np.repeat(np.arange(len(counts)), counts)
    first = np.concatenate(([0], np.cumsum(counts)[:-1])) if len(counts) else np.zeros(0, I64)
    pos = np.arange(int(counts.sum())) - first[seg]
    return seg, starts[seg] + pos


def _batch_rows(src: Layout, dst: Layout, part: list[str]):
    """Both layouts' rows of the tensors ``part``, widened to one ndim ``D``: ``(dr, sr, D, doff, dsz, soff,
    ssz, dk, sk, dn, sn)``: each row's tensor index in ``part`` (``dk`` / ``sk``) and the nonempty rows
    (``dn`` / ``sn``)."""
    dr, sr = dst.tensor_rows(part), src.tensor_rows(part)
    D = max(dr.offsets.shape[1], sr.offsets.shape[1])
    doff, dsz = widen(dr.offsets, D, 0), widen(dr.sizes, D, 1)
    soff, ssz = widen(sr.offsets, D, 0), widen(sr.sizes, D, 1)
    dk = np.repeat(np.arange(len(part)), np.diff(dr.starts))
    sk = np.repeat(np.arange(len(part)), np.diff(sr.starts))
    return (dr, sr, D, doff, dsz, soff, ssz, dk, sk, np.flatnonzero((dsz > 0).all(1)),
            np.flatnonzero((ssz > 0).all(1)))


def _nonempty(rows) -> np.ndarray:
    return np.flatnonzero((rows.sizes > 0).all(1))


def _tensor_of(rows, at: np.ndarray) -> np.ndarray:
    """The tensor (index in the batch) of each row ``at``."""
    return np.searchsorted(rows.starts, at, side="right") - 1


def _dst_rows(dr, sr, D: int, W: int, share):
    """The destination boxes routed (``(tensor, offsets, sizes)``, ``[B]`` / ``[B, D]``), their rows by (box, rank)
    and each box's first, the tensors with two boxes on one rank (the whole plan: they must not overlap, checked
    on objects; a share: a box twice on one rank), and the source rows to read (the nonempty ones; a share's:
    those meeting its boxes)."""
    drank = np.asarray(dr.ranks, I64)
    if share is None:
        dn = _nonempty(dr)
        dk = _tensor_of(dr, dn)
        bk, boff, bsz, binv = _boxes(dk, widen(dr.offsets[dn], D, 0), widen(dr.sizes[dn], D, 1))
        kr = np.sort(dk * W + drank[dn])
        flagged = set((kr[1:][kr[1:] == kr[:-1]] // W).tolist())
        sn = _nonempty(sr)
    else:  # a rank's share: its boxes (each the box of its rows), the source rows meeting them
        bk, boff, bsz, dn, binv, sn = share.rows(dr, sr, D)
    rk = drank[dn]
    if len(dn) > 1 and ((binv[1:] < binv[:-1]) | ((binv[1:] == binv[:-1]) & (rk[1:] < rk[:-1]))).any():
        o = np.lexsort((rk, binv))  # (a share's rows come by box, in rank order where the layout keeps it)
        dn, binv, rk = dn[o], binv[o], rk[o]
    if share is not None:
        twice = (binv[1:] == binv[:-1]) & (rk[1:] == rk[:-1])
        flagged = set(bk[binv[1:][twice]].tolist())
    return bk, boff, bsz, dn, _segments(binv, len(bk)), flagged, sn


def _src_rows(sr, sn: np.ndarray, D: int):
    """The source boxes of the rows ``sn`` (``_boxes``), those rows by (box, rank, local name, local offsets),
    each box's first, and the rows' local ids."""
    sbk, sboff, sbsz, sinv = _boxes(_tensor_of(sr, sn), widen(sr.offsets[sn], D, 0), widen(sr.sizes[sn], D, 1))
    loff, _lnd = sr.local_offset_columns
    lid = np.asarray(sr.local_ids, I64)
    keys = [loff[sn, j] for j in range(loff.shape[1] - 1, -1, -1)]
    o = np.lexsort((*keys, lid[sn], np.asarray(sr.ranks, I64)[sn], sinv))
    return sbk, sboff, sbsz, sn[o], _segments(sinv[o], len(sbk)), lid


def _route_batch(src, dst, part, kinds, bases, gpn, groups, share):
    K = len(part)
    dr, sr = dst.tensor_rows(part), src.tensor_rows(part)
    D = max(dr.offsets.shape[1], sr.offsets.shape[1])
    drank, srank = np.asarray(dr.ranks, I64), np.asarray(sr.ranks, I64)
    W = int(max(drank.max(initial=0), srank.max(initial=0))) + 1
    bk, boff, bsz, drows, dstart, flagged, sn = _dst_rows(dr, sr, D, W, share)
    B = len(bk)
    dranks = drank[drows]
    sbk, sboff, sbsz, srows, sstart, lid = _src_rows(sr, sn, D)

    # (destination box, source box) pairs of one tensor sharing an element
    sA = _segments(sbk, K)
    ns = (sA[1:] - sA[:-1])[bk]
    pd, ps = _expand(sA[bk], ns)
    bend, send = boff + bsz, sboff + sbsz
    meet = ((sboff[ps] < bend[pd]) & (send[ps] > boff[pd])).all(1)
    pd, ps = pd[meet], ps[meet]
    cont = ((sboff[ps] <= boff[pd]) & (send[ps] >= bend[pd])).all(1)
    nmeet = np.bincount(pd, minlength=B)
    ncont = np.bincount(pd[cont], minlength=B)
    uncovered = nmeet == 0
    simple = ~uncovered & (nmeet == ncont)

    out = _Rows(share)
    # the pieces: a simple box is one piece; a box some meeting source box does not contain is cut
    # (``routing.cover_pieces``, per box in Python: few boxes), each piece held by the source boxes of its mask
    pieces, pairs = _simple_pieces(simple, pd, ps, boff, bsz)
    cut = np.flatnonzero(~uncovered & ~simple)
    if len(cut):
        more, more_pairs, bad = _cut_pieces(cut, pd, ps, boff, bsz, sboff, sbsz, bk, dr.ndims, len(pieces[0]))
        out.bad |= bad
        pieces = tuple(np.concatenate([a, b]) for a, b in zip(pieces, more, strict=True))
        pairs = tuple(np.concatenate([a, b]) for a, b in zip(pairs, more_pairs, strict=True))
    # pieces of tensors with relays, or any with ``gpus_per_node``: by ``holders.route_piece``; the others on arrays
    fan = np.array([rdt is not None for _w, rdt in kinds], bool)
    topo = np.ones(len(pieces[0]), bool) if gpn is not None else fan[bk[pieces[0]]]
    if not topo.all():
        (pbox, poff, psz), fpairs = _subset(pieces, pairs, ~topo) if topo.any() else (pieces, pairs)
        salt = np.asarray(bases, I64)[bk[pbox]] + (poff // psz).sum(1)
        out.pieces = (bk[pbox], poff, psz)
        _route_pieces(out, pbox, salt, fpairs, sstart, srows, srank, lid, drows, dranks, dstart, W)
    if topo.any():
        _route_topo(out, *_subset(pieces, pairs, topo), (sstart, srows, srank, lid, W), (drows, dranks, dstart), bk,
                    dr.ndims, kinds, bases, gpn, groups)
    uncov = set(bk[uncovered].tolist())
    for k in sorted(flagged | uncov | out.bad):  # bad input: raised in the words of routing box by box
        raise_bad_input(part[k], dst, src, None if share is None else share.boxes[k])
        if k in uncov or k in out.bad or share is not None:
            raise RuntimeError(f"tensor {part[k]!r}: the row router found an element no source rank holds, "
                               f"the box by box check none")
    return out.tables(part, kinds, dr, sr, D)


def _simple_pieces(simple, pd, ps, boff, bsz):
    """The boxes ``simple`` as pieces ``(box, offsets, sizes)`` and their ``(piece, source box)`` pairs."""
    fast = np.flatnonzero(simple)
    at = np.full(len(simple), -1, I64)
    at[fast] = np.arange(len(fast))
    sel = simple[pd]
    return (fast, boff[fast], bsz[fast]), (at[pd[sel]], ps[sel])


def _cut_pieces(cut, pd, ps, boff, bsz, sboff, sbsz, bk, ndims, base):
    """The pieces of the boxes ``cut`` (``routing.cover_pieces`` on the meeting source boxes, sorted as tuples:
    their ids' order), numbered from ``base``, their pairs, and the tensors with an element no source holds."""
    D = boff.shape[1]
    pstart = _segments(pd, len(boff))
    pb, po, pz, qp, qs = [], [], [], [], []
    bad: set[int] = set()
    for b in cut.tolist():
        nd = ndims[int(bk[b])]
        cands = ps[pstart[b]:pstart[b + 1]].tolist()
        boxes = [(tuple(sboff[c, :nd].tolist()), tuple(sbsz[c, :nd].tolist())) for c in cands]
        for p_off, p_size, mask in cover_pieces(tuple(boff[b, :nd].tolist()), tuple(bsz[b, :nd].tolist()), boxes):
            if not mask:
                bad.add(int(bk[b]))
                continue
            j = base + len(pb)
            pb.append(b)
            po.append(p_off + (0,) * (D - nd))
            pz.append(p_size + (1,) * (D - nd))
            for i, c in enumerate(cands):
                if mask >> i & 1:
                    qp.append(j)
                    qs.append(c)
    arr = lambda x: np.array(x, I64).reshape(len(x), -1) if x else np.zeros((0, D), I64)  # noqa: E731
    return ((np.array(pb, I64), arr(po), arr(pz)), (np.array(qp, I64), np.array(qs, I64)), bad)


def _route_pieces(out, pbox, salt, pairs, sstart, srows, srank, lid, drows, dranks, dstart, W):
    """Route the pieces (``pbox``: each one's destination box; ``pairs``: ``(piece, source box)`` ascending, the
    source boxes holding it), without topology or relays: local copies from each holder rank's first fragment
    where a destination rank holds the piece, and receiver ``i`` of the others gets holder ``(salt + i) % h``'s
    best fragment (``holders.assign``). Appends them to ``out`` (a share: only its own)."""
    fpd, fps = pairs
    cnt = sstart[fps + 1] - sstart[fps]
    seg, at = _expand(sstart[fps], cnt)
    eb, er = fpd[seg], srows[at]  # (piece, source row): piece, source box, rank, local, local offsets order
    ekey = eb * W + srank[er]
    hkey = _distinct(ekey)  # (piece, holder rank), ascending
    P = len(pbox)
    hstart = _segments(hkey // W, P)
    h = hstart[1:] - hstart[:-1]
    # destination rows of the pieces (those of their box)
    nd = dstart[pbox + 1] - dstart[pbox]
    db, dat = _expand(dstart[pbox], nd)
    drow, drk = drows[dat], dranks[dat]
    dkey = db * W + drk  # ascending (pieces in order, a box's rows in rank order)
    held = _members(dkey, hkey)
    recv = ~held
    c = np.cumsum(recv) - recv  # receivers before each row
    first = np.concatenate(([0], np.cumsum(nd)[:-1]))
    lone, wone = held, recv
    if out.share is not None:  # a share: the rows into it, and every receiver of a piece it holds
        into, k = drk == out.share.me, out.pieces[0]
        ours = out.share.whole[k] | np.isin(np.arange(P), hkey[hkey % W == out.share.me] // W)
        lone, wone = held & (into | out.share.whole[k][db]), recv & (into | ours[db])
    i = c[wone] - c[first][db[wone]]
    rb = db[wone]
    send = hkey[hstart[rb] + (salt[rb] + i) % h[rb]]  # each receiver's holder: (piece, rank)
    lb, lkey, ldrow, ldrk = db[lone], dkey[lone], drow[lone], drk[lone]
    wdrow, wdrk = drow[wone], drk[wone]
    if out.share is not None:  # a share: its own rows only
        m = out.share.kept(False, k[rb], send % W, wdrk)
        rb, send, wdrow, wdrk = rb[m], send[m], wdrow[m], wdrk[m]
    hs = _holder_rows(ekey, er, None, lkey)  # local copies read the first fragment
    out.add_fast(True, lb, hs, ldrow, srank[hs], ldrk)
    ws = _holder_rows(ekey, er, lid, send)  # senders read the best one
    out.add_fast(False, rb, ws, wdrow, srank[ws], wdrk)


def _members(keys: np.ndarray, of: np.ndarray) -> np.ndarray:
    """Which of ``keys`` (ascending, distinct) are in ``of``: each of ``of`` looked up (a piece has few holders
    and many destination ranks)."""
    out = np.zeros(len(keys), bool)
    pos = np.searchsorted(keys, of)
    ok = pos < len(keys)
    pos = pos[ok]
    out[pos[keys[pos] == of[ok]]] = True
    return out


def _holder_rows(ekey: np.ndarray, er: np.ndarray, lid: np.ndarray | None, want: np.ndarray) -> np.ndarray:
    """Per ``(piece, holder rank)`` key of ``want``, that holder's first source row of the piece in the order of
    ``er`` (source box, local name, local offsets), or with ``lid`` its first by local name (then that order)."""
    if not len(want):
        return np.zeros(0, I64)
    u = _distinct(np.sort(want))
    p = np.minimum(np.searchsorted(u, ekey), len(u) - 1)
    sel = u[p] == ekey
    k, r = ekey[sel], er[sel]
    o = np.argsort(k, kind="stable") if lid is None else np.lexsort((lid[r], k))
    ks = k[o]
    head = np.ones(len(ks), bool)
    head[1:] = ks[1:] != ks[:-1]
    return r[o][head][np.searchsorted(u, want)]


def _distinct(keys: np.ndarray) -> np.ndarray:
    """``np.unique(keys)``, without its sort where ``keys`` are sorted already."""
    if len(keys) > 1 and (keys[1:] < keys[:-1]).any():
        return distinct(keys)
    head = np.ones(len(keys), bool)
    head[1:] = keys[1:] != keys[:-1]
    return keys[head]


def _subset(pieces, pairs, keep: np.ndarray):
    """The pieces ``keep`` (a mask over them) and their pairs, numbered again from 0 in the same order."""
    at = np.cumsum(keep) - 1
    sel = keep[pairs[0]]
    return tuple(x[keep] for x in pieces), (at[pairs[0][sel]], pairs[1][sel])


def _route_topo(out, pieces, pairs, srcs, dsts, bk, ndims, kinds, bases, gpn, groups) -> None:
    """Route the pieces one by one by ``holders.route_piece`` (``gpus_per_node``, relays): per piece its holder
    ranks with their first and best source rows (as ``_route_pieces`` picks them), the ranks and rows of its
    box. Appends the rows to ``out`` (a share: only its own), a batch's pieces in box order."""
    sstart, srows, srank, lid, W = srcs
    drows, dranks, dstart = (x.tolist() for x in dsts)
    pbox, poff, psz = pieces
    fpd, fps = pairs
    seg, at = _expand(sstart[fps], sstart[fps + 1] - sstart[fps])
    er = srows[at]
    ekey = fpd[seg] * W + srank[er]
    hkey = _distinct(ekey)  # (piece, holder rank), ascending
    hstart = _segments(hkey // W, len(pbox)).tolist()
    hrank = (hkey % W).tolist()
    first, best = _holder_rows(ekey, er, None, hkey).tolist(), _holder_rows(ekey, er, lid, hkey).tolist()
    boxes, isz = pbox.tolist(), {}
    for p in np.argsort(pbox, kind="stable").tolist():
        b = boxes[p]
        k = int(bk[b])
        nd, (wdt, rdt) = ndims[k], kinds[k]
        off, size = tuple(poff[p, :nd].tolist()), tuple(psz[p, :nd].tolist())
        a, e = hstart[p], hstart[p + 1]
        hs, da, de = hrank[a:e], dstart[b], dstart[b + 1]
        row = dict(zip(dranks[da:de], drows[da:de], strict=True))
        n = math.prod(size) * (isz.get(wdt) or isz.setdefault(wdt, itemsize_of(wdt)))
        local, sends, relays = route_piece(off, size, n, bases[k], hs, dranks[da:de], gpn, groups, rdt is not None)
        keep = None if out.share is None else out.share.keep(k)[0]
        lo = [(off, size, first[a + hs.index(r)], row[r], wdt, False) for r in local if keep is None or keep(r, r)]
        wi = [(o, s, best[a + j], row[d], wdt, False) for o, s, j, d in sends if keep is None or keep(hs[j], d)]
        wi += [(o, s, row[h], row[d], rdt, True) for o, s, h, d in relays if keep is None or keep(h, d)]
        out.add_slow(k, lo, wi)


class _Rows:
    """Rows gathered for one batch: fast ones as arrays (a box's piece), slow ones as tuples."""

    def __init__(self, share: ShareQuery | None) -> None:
        self.share = share  # a rank's share: only its rows kept
        self.fast: dict[bool, list] = {True: [], False: []}
        self.slow: dict[bool, list] = {True: [], False: []}
        self.bad: set[int] = set()
        self.pieces = None  # (tensor, offsets, sizes) per piece of the fast rows

    def add_fast(self, local: bool, box, srow, drow, sranks, dranks) -> None:
        if len(box):
            self.fast[local].append((box, srow, drow, sranks, dranks))

    def add_slow(self, k: int, lo: list, wi: list) -> None:
        self.slow[True].extend((k, *t) for t in lo)
        self.slow[False].extend((k, *t) for t in wi)

    def tables(self, part, kinds, dr, sr, D):
        return tuple(self._table(local, part, kinds, dr, sr, D) for local in (True, False))

    def _table(self, local, part, kinds, dr, sr, D):
        fast, slow = self.fast[local], self.slow[local]
        if not fast and not slow:
            return TransferTable.empty()
        dts: dict[torch.dtype, int] = {}
        wcode = np.array([dts.setdefault(w, len(dts)) for w, _r in kinds], np.int8)
        fb = np.concatenate([f[0] for f in fast]) if fast else np.zeros(0, I64)
        pk, poff, psz = self.pieces if fast else (np.zeros(0, I64), np.zeros((0, D), I64), np.ones((0, D), I64))
        k = [pk[fb]]
        off, sz = [poff[fb]], [psz[fb]]
        srow = [np.concatenate([f[1] for f in fast]) if fast else np.zeros(0, I64)]
        drow = [np.concatenate([f[2] for f in fast]) if fast else np.zeros(0, I64)]
        rel = [np.zeros(len(fb), bool)]
        wdt = [wcode[pk[fb]]]
        if slow:
            n = len(slow)
            ks, offs, szs, srs, drs, dtl, rls = zip(*slow, strict=True)
            ka = np.array(ks, I64)
            k.append(ka)
            o2, z2 = np.zeros((n, D), I64), np.ones((n, D), I64)
            for i, (a, z) in enumerate(zip(offs, szs, strict=True)):
                o2[i, :len(a)], z2[i, :len(z)] = a, z
            off.append(o2)
            sz.append(z2)
            srow.append(np.array(srs, I64))
            drow.append(np.array(drs, I64))
            rel.append(np.array(rls, bool))
            wdt.append(np.array([dts.setdefault(d, len(dts)) for d in dtl], np.int8))
        k, off, sz = np.concatenate(k), np.concatenate(off), np.concatenate(sz)
        srow, drow, rel, wdt = (np.concatenate(x) for x in (srow, drow, rel, wdt))
        return _build(part, tuple(dts), k, off, sz, srow, drow, rel, wdt, dr, sr)


def _build(part, dtypes, k, off, sz, srow, drow, rel, wdt, dr, sr) -> TransferTable:
    """The table of the rows: tensor ``k`` (batch index), piece ``off`` / ``sz`` ([n, D] padded 0 / 1), source row
    (of ``sr``, of ``dr`` for relays), destination row (of ``dr``), relay flag, wire dtype code."""
    n = len(k)
    ndim = np.array(dr.ndims, np.int8)[k] if n else np.zeros(0, np.int8)
    D = off.shape[1]
    # the trailing dims of a local tensor hold the box: only the tensor's own dims count (pad dims are 0 / +0)
    dD = widen(dr.offsets, D, 0)
    sD = widen(sr.offsets, D, 0)
    plain = ~rel
    s_lid, s_m = np.zeros(n, I64), np.zeros(n, I64)
    parts = []
    for mask, rows, origin in ((plain, sr, sD), (rel, dr, dD)):
        at = srow[mask]
        parts.append((mask, *_local_fields_nd(rows, at, off[mask], origin[at], ndim[mask])))
    L = max([p[2].shape[1] for p in parts] + [0])
    s_lo = np.zeros((n, L), I64)
    for mask, lid, lo, m in parts:
        s_lid[mask], s_m[mask] = lid, m
        s_lo[mask, :lo.shape[1]] = lo
    d_lid, d_lo, d_m = _local_fields_nd(dr, drow, off, dD[drow], ndim)
    # local names of both layouts as one sorted tuple of the names used
    sl, dl = np.asarray(sr.local_names, object), np.asarray(dr.local_names, object)
    used_s, inv_s = np.unique(s_lid[plain], return_inverse=True)
    used_r, inv_r = np.unique(s_lid[rel], return_inverse=True)
    used_d, inv_d = np.unique(d_lid, return_inverse=True)
    names = sorted(set(sl[used_s].tolist()) | set(dl[used_r].tolist()) | set(dl[used_d].tolist()))
    at = {x: i for i, x in enumerate(names)}
    src_local = np.zeros(n, np.int32)
    src_local[plain] = np.array([at[x] for x in sl[used_s].tolist()] or [0], np.int32)[inv_s.reshape(-1)]
    src_local[rel] = np.array([at[x] for x in dl[used_r].tolist()] or [0], np.int32)[inv_r.reshape(-1)]
    dst_local = np.array([at[x] for x in dl[used_d].tolist()] or [0], np.int32)[inv_d.reshape(-1)]
    src = np.zeros(n, I64)
    src[plain], src[rel] = np.asarray(sr.ranks, I64)[srow[plain]], np.asarray(dr.ranks, I64)[srow[rel]]
    item = np.array([itemsize_of(d) for d in dtypes] or [0], I64)
    cols = dict(tensor=np.asarray(k, np.int32), ndim=ndim, offsets=np.asarray(off, I64), sizes=np.asarray(sz, I64),
                src=np.asarray(src, I64), src_local=src_local, src_ndim=s_m.astype(np.int8), src_offsets=s_lo,
                dst=np.asarray(dr.ranks, I64)[drow], dst_local=dst_local, dst_ndim=d_m.astype(np.int8),
                dst_offsets=d_lo, wdt=np.asarray(wdt, np.int8), relay=np.asarray(rel, np.bool_),
                quant=np.zeros(n, np.int8), nbytes=np.asarray(sz, I64).prod(axis=1, dtype=I64) * item[wdt])
    return TransferTable(tuple(part), tuple(names), dtypes, cols, {})


def _local_fields_nd(rows, at, off, origin, ndim):
    """``_local_fields`` with per-row tensor dims ``ndim`` (the pad dims of a box are not the local tensor's)."""
    loff, lnd = rows.local_offset_columns
    lo = np.array(loff[at], I64)
    m = np.asarray(lnd[at], I64)
    n, L = lo.shape
    lo[np.arange(L)[None, :] >= m[:, None]] = 0
    D = off.shape[1]
    if n and D:
        nd = np.asarray(ndim, I64)
        j = np.arange(D)[None, :]
        col = (m - nd)[:, None] + j
        ok = j < nd[:, None]
        ii = np.broadcast_to(np.arange(n)[:, None], col.shape)
        lo[ii[ok], col[ok]] += (off - origin)[ok]
    return np.asarray(rows.local_ids[at], I64), lo, m



# --------------------------------------------------------------------------------------------------------
# The lower bound of the wire bytes, from the rows
# --------------------------------------------------------------------------------------------------------


def lower_bound_bytes(src: Layout, dst: Layout) -> int:
    """Least possible wire bytes: for each destination fragment, the bytes its rank does not hold as source.

    Computed from the layouts alone (independently of the transfers a plan chose).
    """
    total = 0
    with gc_paused():
        quantized = dst.quantized
        have = {n: dt for n, (_s, dt) in src.shapes_and_dtypes().items()}
        plain = [(n, dt) for n, (_s, dt) in dst.shapes_and_dtypes().items() if n in have and n not in quantized]
        if plain:  # as rows, vectorized: every tensor but the block-quantized ones
            isz = np.array([itemsize_of(wire_dtype_of_dtypes(have[n], dt)) for n, dt in plain], np.int64)
            total += int((missing_elements(src, dst, [n for n, _dt in plain]) * isz).sum())
        for spec in quantized.values():
            sspec = src.specs.get(spec.name)
            if sspec is None:
                continue
            isz = itemsize_of(wire_dtype_of(sspec, spec))
            pack, bits = 1, 8 * isz
            if spec.quant is not None and sspec.quant is None and spec.quant.format.pack > 1:
                pack, bits = spec.quant.format.pack, spec.quant.format.value_bits  # packed: logical elements
            own: dict[int, dict[tuple, None]] = {}  # rank -> its distinct nonempty boxes, in layout order
            for f in src.fragments_by_tensor.get(spec.name, ()):
                if min(f.sizes, default=1) > 0:
                    own.setdefault(f.rank, {})[(f.offsets, f.sizes)] = None
            missing = 0
            for df in dst.fragments_by_tensor.get(spec.name, ()):
                df = unpack_fragment(df, pack)
                mine = own.get(df.rank)
                n = df.numel
                if not n:
                    continue
                if mine:
                    boxes = [b for b in mine if boxes_meet(b[0], b[1], df.offsets, df.sizes)]
                    if boxes:
                        n -= held_numel(df.offsets, df.sizes, boxes)
                missing += n
            total += missing * isz if pack == 1 else -(-missing * bits // 8)
        if dst.quantized:  # block-quantized destinations: plus one fp32 scale per block with a missing element
            total += scale_lower_bound(src, dst)
    return total


def missing_elements(src: Layout, dst: Layout, names: list[str]) -> np.ndarray:
    """Per tensor of ``names`` (each in both layouts), the elements of its destination fragments that their
    rank does not hold as source: each fragment's elements less those inside the union of its rank's distinct
    source boxes of the tensor (``routing.held_numel``; a fragment meeting several of them, rare, is counted
    by it)."""
    out = np.zeros(len(names), I64)
    for b in range(0, len(names), ROW_BATCH):
        part = names[b:b + ROW_BATCH]
        K = len(part)
        dr, sr, D, doff, dsz, soff, ssz, dk, sk, dn, sn = _batch_rows(src, dst, part)
        drank, srank = np.asarray(dr.ranks, I64)[dn], np.asarray(sr.ranks, I64)[sn]
        W = int(max(drank.max(initial=0), srank.max(initial=0))) + 1
        dkey = dk[dn] * W + drank
        # each rank's distinct source boxes of each tensor, by (tensor, rank)
        u = np.unique(np.concatenate([(sk[sn] * W + srank)[:, None], soff[sn], ssz[sn]], 1), axis=0)
        ukey, uoff, usz = u[:, 0], u[:, 1:1 + D], u[:, 1 + D:]
        lo, hi = np.searchsorted(ukey, dkey), np.searchsorted(ukey, dkey, side="right")
        seg, at = _expand(lo, hi - lo)
        o, e = doff[dn][seg], doff[dn][seg] + dsz[dn][seg]
        io, ie = np.maximum(o, uoff[at]), np.minimum(e, uoff[at] + usz[at])
        meet = (ie > io).all(1)
        n = dsz[dn].prod(1, dtype=I64)
        nmeet = np.bincount(seg[meet], minlength=len(dn))
        one = meet & (nmeet[seg] == 1)
        held = np.zeros(len(dn), I64)
        held[seg[one]] = (ie[one] - io[one]).prod(1, dtype=I64)
        for i in np.flatnonzero(nmeet > 1).tolist():  # several boxes: their union
            nd = dr.ndims[int(dk[dn][i])]
            sel = at[(seg == i) & meet]
            held[i] = held_numel(tuple(doff[dn][i, :nd].tolist()), tuple(dsz[dn][i, :nd].tolist()),
                                 [(tuple(uoff[j, :nd].tolist()), tuple(usz[j, :nd].tolist())) for j in sel.tolist()])
        out[b:b + K] = _sum_by(dk[dn], n - held, K)
    return out


def _sum_by(k: np.ndarray, v: np.ndarray, K: int) -> np.ndarray:
    out = np.zeros(K, I64)
    np.add.at(out, k, v)
    return out
