"""Per-tensor queries on a layout: what a rank plan reads (the tensors of one rank, never every
rank's): the fragments of a tensor overlapping a box, the holders of a box, a rank's fragments."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence

import numpy as np

from ..layout import Fragment, Layout
from ..layout.fragment_table import TensorRows
from .routing import (
    boxes_meet,
    check_dst_overlap,
)

# --------------------------------------------------------------------------------------------------------
# Per-tensor queries on a layout: what a rank plan reads (the tensors of one rank, never every rank's)
# --------------------------------------------------------------------------------------------------------


class DstGroup:
    """The destination fragments of one box of one tensor: their ranks (ascending; one fragment per rank) and
    each rank's fragment on demand (a rank plan builds only the few it writes into or relays from)."""

    __slots__ = ("ranks", "_frag")

    def __init__(self, ranks: list[int], frag: Callable[[int], Fragment]) -> None:
        self.ranks, self._frag = ranks, frag

    def frag(self, rank: int) -> Fragment:
        return self._frag(rank)

    @classmethod
    def of(cls, name: str, frags: Sequence[Fragment]) -> DstGroup:
        by_rank = {f.rank: f for f in frags}
        if len(by_rank) < len(frags):
            check_dst_overlap(name, frags)  # raises: one box twice on one rank
        return cls(sorted(by_rank), by_rank.__getitem__)


class TensorIndex:
    """The nonempty fragments of one tensor of one layout, grouped by box: what the whole plan routes from (it
    reads every fragment, built in one go: ``route_all``). A rank's share queries the rows of its tensors instead
    (``share_queries``), without building other ranks' fragments."""

    __slots__ = ("boxes", "by_box", "_groups")

    def __init__(self, layout: Layout, name: str) -> None:
        self.by_box: dict[tuple, list[Fragment]] = {}
        self._groups: dict[tuple, DstGroup] = {}
        for f in layout.fragments_by_tensor.get(name, ()):
            if 0 not in f.sizes:
                g = self.by_box.get((f.offsets, f.sizes))
                if g is None:
                    self.by_box[(f.offsets, f.sizes)] = [f]
                else:
                    g.append(f)
        self.boxes: list[tuple] = list(self.by_box)  # the distinct nonempty boxes

    def group(self, name: str, box: tuple) -> DstGroup:
        """The fragments whose box is exactly ``box``, as a :class:`DstGroup`."""
        g = self._groups.get(box)
        if g is None:
            g = self._groups[box] = DstGroup.of(name, self.by_box[box])
        return g

    def overlapping(self, off, size) -> list[Fragment]:
        """The fragments sharing an element with the box."""
        out: list[Fragment] = []
        for b in self.boxes:
            if boxes_meet(b[0], b[1], off, size):
                out.extend(self.by_box[b])
        return out


class FragmentRef:
    """A fragment's fields (row ``row`` of a :class:`TensorRows`), for routing; ``local_box`` builds the
    fragment (``build(row)``): the planner builds real fragments only for the transfers it keeps."""

    __slots__ = ("tensor", "rank", "offsets", "sizes", "local", "local_offsets", "_build", "row")

    def __init__(self, tensor, rank, offsets, sizes, local, local_offsets, build, row) -> None:
        self.tensor, self.rank, self.offsets, self.sizes = tensor, rank, offsets, sizes
        self.local, self.local_offsets, self._build, self.row = local, local_offsets, build, row

    def local_box(self, off, size):
        return self._build(self.row).local_box(off, size)


# --------------------------------------------------------------------------------------------------------
# A rank's queries, batched: every (tensor, box) it routes, in a few vectorized passes per batch of tensors
# --------------------------------------------------------------------------------------------------------

QUERY_BATCH = 64  # tensors per batch: bounds the passes' temporaries (~1,000 rows per tensor at 1,024 ranks)


def _pad(boxes: Sequence[tuple], D: int, like: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Query boxes as ``[J, D]`` offsets / sizes, unused dims 0 / 1 (as ``TensorRows`` pads its rows); in the
    dtype of ``like`` (int32 columns) where every value and the sum of two fit it."""
    off, sz = np.zeros((len(boxes), D), np.int64), np.ones((len(boxes), D), np.int64)
    for j, (o, z) in enumerate(boxes):
        off[j, :len(o)], sz[j, :len(z)] = o, z
    if like is not None and like.dtype == np.int32 and (not off.size or max(off.max(), sz.max()) < 1 << 30):
        return off.astype(np.int32), sz.astype(np.int32)
    return off, sz


def hit_rows(rows: TensorRows, ks: Sequence[int], boxes: Sequence[tuple], exact: bool, inside: bool = False):
    """The hits of every query ``j`` (box ``boxes[j]`` of tensor ``rows.names[ks[j]]``) at once: ``(rows, query
    of each)``, query-major, rows ascending within a query: the rows of that tensor whose box is exactly it
    (``exact``), or that share an element with it (nonempty rows); ``inside``: also per hit whether its box
    contains the query's (else None)."""
    st = rows.starts
    k = np.asarray(ks, np.int64)
    lo, counts = st[k], st[k + 1] - st[k]
    owner = np.repeat(np.arange(len(ks)), counts)
    qo, qs = _pad(boxes, rows.offsets.shape[1], rows.offsets if rows.sizes.dtype == rows.offsets.dtype else None)
    if len(ks) == len(rows.names) and (k == np.arange(len(ks))).all():  # one query per tensor, in order (the
        r, ro, rz = np.arange(len(rows)), rows.offsets, rows.sizes   # common case): every row, no gather
    else:
        first = np.concatenate(([0], np.cumsum(counts)))
        r = np.arange(int(first[-1])) - first[:-1][owner] + lo[owner]
        ro, rz = rows.offsets[r], rows.sizes[r]
    # column by column (a reduction over a short last axis costs ten times more); owner ascending: the queries'
    # boxes repeated, not gathered
    keep = inn = None
    for d in range(qo.shape[1]):
        o, z, bo, bz = ro[:, d], rz[:, d], np.repeat(qo[:, d], counts), np.repeat(qs[:, d], counts)
        if exact:
            x = (o == bo) & (z == bz)
        else:
            x = (o < bo + bz) & (o + z > bo) & (z > 0)
            if inside:
                y = (o <= bo) & (o + z >= bo + bz)
                inn = y if inn is None else inn & y
        keep = x if keep is None else keep & x
    if keep is None:  # 0-d tensors only: every row
        keep = inn = np.ones(len(r), bool)
    got, who = r[keep], owner[keep]
    return got, who, (inn[keep] if inside else None)


def _per_query(got: np.ndarray, who: np.ndarray, n: int) -> list[np.ndarray]:
    cuts = np.searchsorted(who, np.arange(n + 1))
    return [got[cuts[j]:cuts[j + 1]] for j in range(n)]


def _hits(rows: TensorRows, ks: Sequence[int], boxes: Sequence[tuple], exact: bool) -> list[np.ndarray]:
    """Per query ``j`` (box ``boxes[j]`` of tensor ``rows.names[ks[j]]``): the rows of that tensor whose box is
    exactly it (``exact``), or that share an element with it (nonempty rows), ascending."""
    got, who, _ = hit_rows(rows, ks, boxes, exact)
    return _per_query(got, who, len(ks))


def _distinct(keys: np.ndarray) -> np.ndarray:
    """``np.unique(keys)``, without its sort where ``keys`` are sorted already (rows in rank order)."""
    if len(keys) > 1 and (keys[1:] < keys[:-1]).any():
        return np.unique(keys)
    head = np.ones(len(keys), bool)
    head[1:] = keys[1:] != keys[:-1]
    return keys[head]


def _first_per(who: np.ndarray, keys: Callable[[], list[np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Positions of the smallest entry (by ``keys()``, the first the primary) of each distinct ``who`` (ascending),
    and those ``who``."""
    if len(who) < 2 or (who[1:] > who[:-1]).all():  # one entry each: nothing to compare
        return np.arange(len(who)), who
    order = np.lexsort([*keys()[::-1], who])
    w = who[order]
    head = np.ones(len(w), bool)
    head[1:] = w[1:] != w[:-1]
    return order[head], w[head]


def _plain_routes(me: int, drows: TensorRows, srows: TensorRows, d: tuple, s: tuple, salts: list[int],
                  ok: np.ndarray) -> dict[int, tuple[list, list]]:
    """``me``'s transfers of the queries whose box is one piece, routed plainly (``holders.route_box``'s shortcut
    for a rank plan without topology or fan-out), for all of them at once: query -> (wire, local), lists of
    (source row, destination row). ``d`` / ``s``: the exact destination hits and the overlapping source hits
    (``hit_rows``, the latter with ``inside``); ``ok``: the queries the caller allows.

    Such a query: every source fragment overlapping the box contains it (one piece, held by all of them), its
    destination ranks appear once each (a box twice on a rank is left to the general path, which raises), and
    ``me`` holds it on one side or both. As in ``route_box``: the receivers are the destination ranks that hold
    no source copy (ascending), the holders the ``h`` source ranks (ascending); receiver ``i`` gets it from
    holder ``(salt + i) % h``, a holder's fragment its first by (local name, box, local offsets)
    (``routing.holders_of``); so ``me`` as the ``i``-th receiver gets it from that holder, and as holder ``j``
    sends it to receivers ``(j - salt) % h``, ``+ h``, ...; as a holder with the box it copies it from its first
    fragment by (box, local name, local offsets)."""
    (dgot, dwho, _), (sgot, swho, inside) = d, s
    J = len(salts)
    dr, sr = drows.ranks[dgot].astype(np.int64), srows.ranks[sgot].astype(np.int64)
    W = int(max(dr.max(initial=0), sr.max(initial=0), me)) + 1
    dk = dwho * W + dr
    if len(dk) > 1 and (dk[1:] < dk[:-1]).any():  # (rows come in rank order per tensor where a layout keeps it)
        o = np.argsort(dk, kind="stable")
        dk, dgot, dwho, dr = dk[o], dgot[o], dwho[o], dr[o]
    dup = np.zeros(J, bool)
    dup[dk[1:][dk[1:] == dk[:-1]] // W] = True
    in_d, in_s = np.bincount(dwho[dr == me], minlength=J) > 0, np.bincount(swho[sr == me], minlength=J) > 0
    fast = (ok & ~dup & (np.bincount(swho, minlength=J) > 0) & (in_d | in_s)
            & (np.bincount(swho[~inside], minlength=J) == 0))
    if not fast.any():
        return {}
    salt = np.asarray(salts, np.int64)
    sk = _distinct(swho * W + sr)  # (query, holder rank), sorted
    h = np.bincount(sk // W, minlength=J)
    hstart = np.searchsorted(sk, np.arange(J) * W)
    pos = np.minimum(np.searchsorted(sk, dk), max(len(sk) - 1, 0))
    held = sk[pos] == dk if len(sk) else np.zeros(len(dk), bool)  # destination ranks holding a source copy
    out: dict[int, tuple[list, list]] = {int(x): ([], []) for x in np.flatnonzero(fast)}
    lo, _ = srows.local_offset_columns

    def first(rows: np.ndarray, who: np.ndarray, box_first: bool) -> dict[int, int]:  # query -> its first row
        def keys():
            box = [*srows.offsets[rows].T, *srows.sizes[rows].T]
            return [*box, srows.local_ids[rows], *lo[rows].T] if box_first else [srows.local_ids[rows], *box, *lo[rows].T]
        at, q = _first_per(who, keys)
        return dict(zip(q.tolist(), rows[at].tolist(), strict=True))

    # me receives: from holder (salt + i) % h, i its place among the receivers
    recv = fast & in_d & ~in_s
    if recv.any():
        i = np.bincount(dwho[(dr < me) & ~held], minlength=J)
        q = np.flatnonzero(recv)
        sender = np.full(J, -1, np.int64)
        sender[q] = sk[hstart[q] + (salt[q] + i[q]) % h[q]] % W
        m = sender[swho] == sr
        src = first(sgot[m], swho[m], False)
        m = recv[dwho] & (dr == me)
        for x, row in zip(dwho[m].tolist(), dgot[m].tolist(), strict=True):
            out[x][0].append((src[x], row))
    # me holds: a local copy where it also has the box, and its share of the receivers
    hold = fast & in_s
    if hold.any():
        m = hold[swho] & (sr == me)
        best, own = first(sgot[m], swho[m], False), first(sgot[m], swho[m], True)
        m = hold[dwho] & (dr == me)
        for x, row in zip(dwho[m].tolist(), dgot[m].tolist(), strict=True):
            out[x][1].append((own[x], row))
        m = hold[dwho] & ~held
        rg, rw = dgot[m], dwho[m]
        cut = np.searchsorted(rw, np.arange(J + 1))
        j = np.searchsorted(sk, np.arange(J) * W + me) - hstart
        for x in np.flatnonzero(hold).tolist():
            rows = rg[cut[x]:cut[x + 1]][(int(j[x]) - int(salt[x])) % int(h[x])::int(h[x])]
            out[x][0].extend((best[x], row) for row in rows.tolist())
    return out


def _group(name: str, rows: TensorRows, k: int, hit: np.ndarray) -> DstGroup:
    rk = rows.ranks[hit]
    order = np.argsort(rk, kind="stable")
    rws, ranks = hit[order].tolist(), rk[order].tolist()
    if len(set(ranks)) < len(ranks):
        DstGroup.of(name, [rows.fragment(i, k) for i in rws])  # raises: one box twice on a rank
    got: dict[int, Fragment] = {}

    def frag(r: int) -> Fragment:  # (closes over the rows, not over anything that holds this group)
        f = got.get(r)
        if f is None:
            f = got[r] = rows.fragment(rws[bisect_left(ranks, r)], k)
        return f

    return DstGroup(ranks, frag)


def _refs(rows: TensorRows, k: int, hit: np.ndarray) -> list[FragmentRef]:
    name, nd, names = rows.names[k], rows.ndims[k], rows.local_names
    build = lambda i: rows.fragment(i, k)  # noqa: E731
    return [FragmentRef(name, r, tuple(o[:nd]), tuple(z[:nd]), names[li], lo, build, i)
            for i, r, o, z, li, lo in zip(hit.tolist(), rows.ranks[hit].tolist(), rows.offsets[hit].tolist(),
                                           rows.sizes[hit].tolist(), rows.local_ids[hit].tolist(),
                                           rows.local_offsets_of(hit), strict=True)]


def boxes_meeting(dst: Layout, frags: Sequence[Fragment]) -> list[tuple[str, tuple]]:
    """The distinct nonempty destination boxes (``(tensor, box)``, in ``frags``' order) sharing an element with
    each of ``frags`` (source fragments of one rank, of tensors ``dst`` has)."""
    out: dict[tuple, None] = {}
    names = list(dict.fromkeys(f.tensor for f in frags))
    for b in range(0, len(names), QUERY_BATCH):
        part = names[b:b + QUERY_BATCH]
        at = {n: i for i, n in enumerate(part)}
        mine = [f for f in frags if f.tensor in at]
        rows = dst.tensor_rows(part)
        for f, hit in zip(mine, _hits(rows, [at[f.tensor] for f in mine], [(f.offsets, f.sizes) for f in mine],
                                      False), strict=True):
            nd = rows.ndims[at[f.tensor]]
            for o, z in zip(rows.offsets[hit].tolist(), rows.sizes[hit].tolist(), strict=True):
                out[(f.tensor, (tuple(o[:nd]), tuple(z[:nd])))] = None
    return list(out)


def _built(routes: dict[int, tuple[list, list]], drows: TensorRows, srows: TensorRows, ks: Sequence[int]
           ) -> dict[int, tuple[list, list]]:
    """``_plain_routes``' rows as fragments (source, destination), every fragment of the batch built at once."""
    pairs = [(q, p) for q, two in routes.items() for x in two for p in x]
    kq = [ks[q] for q, _p in pairs]
    sf = iter(srows.fragments([p[0] for _q, p in pairs], kq))
    df = iter(drows.fragments([p[1] for _q, p in pairs], kq))
    return {q: tuple([(next(sf), next(df)) for _p in x] for x in two) for q, two in routes.items()}


def share_queries(src: Layout, dst: Layout, todo: Sequence[tuple[str, tuple]], me: int | None = None,
                  salt: Callable[[str, tuple], int | None] | None = None):
    """For each ``(tensor, box)`` of ``todo`` (grouped by tensor), in that order: ``(tensor, box, its
    destination group, the source fragments overlapping it)``, found in vectorized passes over the rows of a
    batch of tensors at a time (``Layout.tensor_rows``) instead of one table per tensor and layout.

    With ``me`` and ``salt`` (``(tensor, box)`` -> the box's salt, ``holders.piece_salt``; None for a tensor whose
    boxes do not route plainly: topology, fan-out or the block-quantization pass): a box of one piece that ``me``
    holds on either side (``_plain_routes``) comes as ``(tensor, box, None, (wire, local))``, ``me``'s transfers
    as lists of (source fragment, destination fragment), picked in the batch's passes without building its group
    or a reference per source fragment."""
    names = list(dict.fromkeys(n for n, _b in todo))
    j = 0
    for b in range(0, len(names), QUERY_BATCH):
        part = names[b:b + QUERY_BATCH]
        at = {n: i for i, n in enumerate(part)}
        e = j
        while e < len(todo) and todo[e][0] in at:
            e += 1
        batch, j = todo[j:e], e
        ks, boxes = [at[n] for n, _b in batch], [bx for _n, bx in batch]
        drows, srows = dst.tensor_rows(part), src.tensor_rows(part)
        fast = {}
        salts = [salt(n, bx) for n, bx in batch] if me is not None and salt is not None else None
        d, s = hit_rows(drows, ks, boxes, True), hit_rows(srows, ks, boxes, False, inside=salts is not None)
        if salts is not None:
            ok = np.fromiter((x is not None for x in salts), bool, len(salts))
            if ok.any():
                fast = _built(_plain_routes(me, drows, srows, d, s, [x or 0 for x in salts], ok), drows, srows, ks)
        for q, ((name, box), k, dh, sh) in enumerate(zip(batch, ks, _per_query(*d[:2], len(ks)),
                                                         _per_query(*s[:2], len(ks)), strict=True)):
            got = fast.get(q)
            if got is not None:
                yield name, box, None, got
            else:
                yield name, box, _group(name, drows, k, dh), _refs(srows, k, sh)


def check_own_overlaps(name: str, frags: Sequence[Fragment]) -> None:
    """Destination boxes of tensor ``name`` (``frags``) overlapping on one rank raise
    (``routing.check_dst_overlap``)."""
    if len({f.rank for f in frags}) < len(frags):
        check_dst_overlap(name, frags)


def rank_fragments(layout: Layout, rank: int) -> list[Fragment]:
    """The nonempty fragments ``rank`` holds, in layout order."""
    return [f for f in layout.fragments_on_rank(rank) if 0 not in f.sizes]
