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


def _pad(boxes: Sequence[tuple], D: int) -> tuple[np.ndarray, np.ndarray]:
    """Query boxes as ``[J, D]`` offsets / sizes, unused dims 0 / 1 (as ``TensorRows`` pads its rows)."""
    off, sz = np.zeros((len(boxes), D), np.int64), np.ones((len(boxes), D), np.int64)
    for j, (o, z) in enumerate(boxes):
        off[j, :len(o)], sz[j, :len(z)] = o, z
    return off, sz


def _hits(rows: TensorRows, ks: Sequence[int], boxes: Sequence[tuple], exact: bool) -> list[np.ndarray]:
    """Per query ``j`` (box ``boxes[j]`` of tensor ``rows.names[ks[j]]``): the rows of that tensor whose box is
    exactly it (``exact``), or that share an element with it (nonempty rows), ascending."""
    st = rows.starts
    k = np.asarray(ks, np.int64)
    lo, counts = st[k], st[k + 1] - st[k]
    owner = np.repeat(np.arange(len(ks)), counts)
    qo, qs = _pad(boxes, rows.offsets.shape[1])
    if len(ks) == len(rows.names) and (k == np.arange(len(ks))).all():  # one query per tensor, in order (the
        r, ro, rz = np.arange(len(rows)), rows.offsets, rows.sizes   # common case): every row, no gather
    else:
        first = np.concatenate(([0], np.cumsum(counts)))
        r = np.arange(int(first[-1])) - first[:-1][owner] + lo[owner]
        ro, rz = rows.offsets[r], rows.sizes[r]
    bo, bz = qo[owner], qs[owner]
    if exact:
        keep = (ro == bo).all(axis=1) & (rz == bz).all(axis=1)
    else:
        keep = (ro < bo + bz).all(axis=1) & (ro + rz > bo).all(axis=1) & (rz > 0).all(axis=1)
    got, who = r[keep], owner[keep]
    cuts = np.searchsorted(who, np.arange(len(ks) + 1))
    return [got[cuts[j]:cuts[j + 1]] for j in range(len(ks))]


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


def share_queries(src: Layout, dst: Layout, todo: Sequence[tuple[str, tuple]]):
    """For each ``(tensor, box)`` of ``todo`` (grouped by tensor), in that order: ``(tensor, box, its
    destination group, the source fragments overlapping it)``, found in vectorized passes over the rows of a
    batch of tensors at a time (``Layout.tensor_rows``) instead of one table per tensor and layout."""
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
        for (name, box), k, dh, sh in zip(batch, ks, _hits(drows, ks, boxes, True), _hits(srows, ks, boxes, False),
                                          strict=True):
            yield name, box, _group(name, drows, k, dh), _refs(srows, k, sh)


def check_own_overlaps(name: str, frags: Sequence[Fragment]) -> None:
    """Destination boxes of tensor ``name`` (``frags``) overlapping on one rank raise
    (``routing.check_dst_overlap``)."""
    if len({f.rank for f in frags}) < len(frags):
        check_dst_overlap(name, frags)


def rank_fragments(layout: Layout, rank: int) -> list[Fragment]:
    """The nonempty fragments ``rank`` holds, in layout order."""
    return [f for f in layout.fragments_on_rank(rank) if 0 not in f.sizes]
