"""Per-tensor queries on a layout: what a rank plan reads (the tensors of one rank, never every
rank's): the rows of a batch of tensors hitting boxes (``hit_rows``), the destination boxes meeting a rank's
source fragments, a rank's fragments; and the objects the error of bad input is worded from."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ..layout import Fragment, Layout
from ..layout.fragment_table import TensorRows
from .routing import boxes_meet, check_dst_overlap, cover_pieces, no_holder

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
    """The nonempty fragments of one tensor of one layout, grouped by box (objects: what the error of bad input
    is worded from, ``raise_bad_input``, and the object router of ``tests/oracles``)."""

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


# --------------------------------------------------------------------------------------------------------
# A rank's queries, batched: the rows of a batch of tensors hitting boxes, in a few vectorized passes
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


def hit_rows(rows: TensorRows, ks: Sequence[int], boxes: Sequence[tuple], exact: bool):
    """The hits of every query ``j`` (box ``boxes[j]`` of tensor ``rows.names[ks[j]]``) at once: ``(rows, query
    of each)``, query-major, rows ascending within a query: the rows of that tensor whose box is exactly it
    (``exact``), or that share an element with it (nonempty rows)."""
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
    keep = None
    for d in range(qo.shape[1]):
        o, z, bo, bz = ro[:, d], rz[:, d], np.repeat(qo[:, d], counts), np.repeat(qs[:, d], counts)
        x = (o == bo) & (z == bz) if exact else (o < bo + bz) & (o + z > bo) & (z > 0)
        keep = x if keep is None else keep & x
    if keep is None:  # 0-d tensors only: every row
        keep = np.ones(len(r), bool)
    return r[keep], owner[keep]


def _per_query(got: np.ndarray, who: np.ndarray, n: int) -> list[np.ndarray]:
    cuts = np.searchsorted(who, np.arange(n + 1))
    return [got[cuts[j]:cuts[j + 1]] for j in range(n)]


def _hits(rows: TensorRows, ks: Sequence[int], boxes: Sequence[tuple], exact: bool) -> list[np.ndarray]:
    """Per query ``j`` (box ``boxes[j]`` of tensor ``rows.names[ks[j]]``): the rows of that tensor whose box is
    exactly it (``exact``), or that share an element with it (nonempty rows), ascending."""
    return _per_query(*hit_rows(rows, ks, boxes, exact), len(ks))


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


def raise_bad_input(name: str, dst: Layout, src: Layout, boxes: list | None) -> None:
    """Raise the error of bad input of tensor ``name`` in the words of routing it box by box: its destination
    boxes overlapping on one rank (the whole plan's ``boxes=None``: every box, in layout order), a box twice on
    one rank, an element of a box no source rank holds (``routing.no_holder``)."""
    dix, six = TensorIndex(dst, name), TensorIndex(src, name)
    if boxes is None:
        check_own_overlaps(name, [f for b in dix.boxes for f in dix.by_box[b]])
        boxes = dix.boxes
    for box in boxes:
        group = DstGroup.of(name, sorted(dix.by_box[box], key=lambda f: f.rank))
        cands = sorted({(f.offsets, f.sizes) for f in six.overlapping(*box)})
        for p_off, p_size, mask in cover_pieces(box[0], box[1], cands):
            if not mask:
                raise no_holder(name, p_off, p_size, group.ranks[0])


class ShareQuery:
    """A rank's share of a batch of tensors: its rank ``me``, per tensor the destination boxes it routes
    (``boxes``) and whether every transfer of them is kept (``whole``)."""

    __slots__ = ("me", "boxes", "whole")

    def __init__(self, me: int, boxes: list[list], whole: list[bool]) -> None:
        self.me, self.boxes, self.whole = me, boxes, np.array(whole, bool)

    def rows(self, dr, sr, D: int):
        """The boxes routed (``(tensor, offsets, sizes)``, ``[B]`` / ``[B, D]`` padded 0 / 1), the rows of ``dr``
        whose box is one of them and the box of each, and the rows of ``sr`` sharing an element with one."""
        ks = np.array([k for k, bs in enumerate(self.boxes) for _b in bs], np.int64)
        flat = [b for bs in self.boxes for b in bs]
        off, sz = np.zeros((len(flat), D), np.int64), np.ones((len(flat), D), np.int64)
        for j, (o, z) in enumerate(flat):
            off[j, :len(o)], sz[j, :len(z)] = o, z
        got, who = hit_rows(dr, ks, flat, True)
        sgot, _who = hit_rows(sr, ks, flat, False)
        hit = np.zeros(len(sr.ranks), bool)
        hit[sgot] = True
        return ks, off, sz, got, who, np.flatnonzero(hit)

    def kept(self, local: bool, k, sranks, dranks) -> np.ndarray:
        """Which of the rows (tensors ``k``, ranks ``sranks`` -> ``dranks``) the share keeps."""
        m = dranks == self.me
        if not local:
            m |= sranks == self.me
        return m | self.whole[k]

    def keep(self, k: int):
        """Tensor ``k``'s filter of the rows ``(source rank, destination rank)`` kept (None: all) and ``me``."""
        if self.whole[k]:
            return None, None
        me = self.me
        return (lambda s, d: s == me or d == me), me


def check_own_overlaps(name: str, frags: Sequence[Fragment]) -> None:
    """Destination boxes of tensor ``name`` (``frags``) overlapping on one rank raise
    (``routing.check_dst_overlap``)."""
    if len({f.rank for f in frags}) < len(frags):
        check_dst_overlap(name, frags)


def rank_fragments(layout: Layout, rank: int) -> list[Fragment]:
    """The nonempty fragments ``rank`` holds, in layout order."""
    return [f for f in layout.fragments_on_rank(rank) if 0 not in f.sizes]
