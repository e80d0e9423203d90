"""Per-tensor queries on a layout: what a rank plan reads (the tensors of one rank, never every
rank's): the fragments of a tensor overlapping a box, the holders of a box, a rank's fragments."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence

import numpy as np

from ..layout import Fragment, Layout
from .routing import (
    boxes_meet,
    check_dst_overlap,
)

_RANK_LOCAL = lambda f: (f.rank, f.local, f.local_offsets)  # noqa: E731


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
    """The nonempty fragments of one tensor of one layout, grouped by box; built once per tensor and layout,
    lazily: from ``fragments_by_tensor`` on an eager layout, from the per-tensor table (``Layout.table``:
    numpy columns, an interval index) on a columnar one, which then never builds other tensors' fragments."""

    __slots__ = ("_boxes", "by_box", "_table", "_frags", "_groups")

    def __init__(self, layout: Layout, name: str, whole: bool = False, keep: bool = True) -> None:
        self._table = None
        self._boxes: list[tuple] | None = None
        self.by_box: dict[tuple, list[Fragment]] = {}
        self._groups: dict[tuple, DstGroup] = {}
        if layout.lazy_tables:
            if not whole:
                self._table = layout.table(name, keep)
                self._frags: dict[int, Fragment] = {}
                return
            # the whole plan reads every fragment (and its validation builds them all): sliced from the layout's
            # fragments, built in one go (``route_all`` builds them first), instead of a table per tensor
            frags = layout.fragments_by_tensor.get(name, ())
        else:
            frags = layout.fragments_by_tensor.get(name, ())
        for f in frags:
            if 0 not in f.sizes:
                g = self.by_box.get((f.offsets, f.sizes))
                if g is None:
                    self.by_box[(f.offsets, f.sizes)] = [f]
                else:
                    g.append(f)
        self._boxes = list(self.by_box)

    @property
    def boxes(self) -> list[tuple]:
        """The distinct nonempty boxes."""
        if self._boxes is None:
            bo, bs, _ = self._table.boxes()
            self._boxes = [(tuple(o), tuple(z)) for o, z in zip(bo.tolist(), bs.tolist(), strict=True) if 0 not in z]
        return self._boxes

    def _fragment(self, i: int) -> Fragment:
        f = self._frags.get(i)
        if f is None:
            f = self._frags[i] = self._table.fragment(i)
        return f

    def _exact_rows(self, box: tuple) -> np.ndarray:
        """The rows whose box is exactly ``box`` (one pass over the table; an empty box has none)."""
        tb = self._table
        if 0 in box[1]:
            return np.zeros(0, np.int64)
        if not tb.offsets.shape[1]:  # 0-d tensor: every row holds its one element
            return np.arange(tb.n)
        return np.flatnonzero((tb.offsets == box[0]).all(axis=1) & (tb.sizes == box[1]).all(axis=1))

    def group(self, name: str, box: tuple) -> DstGroup:
        """The fragments whose box is exactly ``box``, as a :class:`DstGroup`."""
        g = self._groups.get(box)
        if g is None:
            if self._table is not None:
                rows = self._exact_rows(box)
                rk = self._table.ranks[rows]
                rows = rows[np.argsort(rk, kind="stable")].tolist()
                ranks = sorted(rk.tolist())
                if len(set(ranks)) < len(ranks):
                    DstGroup.of(name, [self._fragment(i) for i in rows])  # raises: one box twice on a rank

                def frag(r: int, rows=rows, ranks=ranks, tb=self._table, got=self._frags) -> Fragment:
                    # (no reference to the index: a cycle through its own groups would outlive it while the
                    # planner runs with the collector paused, a thousand ranks' rows per tensor)
                    i = rows[bisect_left(ranks, r)]
                    f = got.get(i)
                    if f is None:
                        f = got[i] = tb.fragment(i)
                    return f

                g = DstGroup(ranks, frag)
            else:
                g = DstGroup.of(name, self.by_box[box])
            self._groups[box] = g
        return g

    def overlapping(self, off, size) -> list:
        """The fragments sharing an element with the box (on a columnar layout light stand-ins, ``FragmentRef``,
        with a fragment's fields: the planner builds the real one only for the transfers it keeps)."""
        if self._table is not None:  # the rows overlapping only (a box meets a few of a thousand ranks' rows)
            tb = self._table
            rows = tb.overlapping(off, size)
            names, name = tb.local_names, tb.spec.name
            return [FragmentRef(name, r, tuple(o), tuple(z), names[k], lo, self, i) for i, r, o, z, k, lo in zip(
                rows.tolist(), tb.ranks[rows].tolist(), tb.offsets[rows].tolist(), tb.sizes[rows].tolist(),
                tb.local_ids[rows].tolist(), tb.local_offsets_of(rows), strict=True)]
        out: list[Fragment] = []
        for b in self.boxes:
            if boxes_meet(b[0], b[1], off, size):
                out.extend(self.by_box[b])
        return out

    def boxes_overlapping(self, off, size) -> list[tuple]:
        if self._table is not None:
            tb = self._table
            rows = tb.overlapping(off, size)
            offs, sizes = tb.offsets[rows].tolist(), tb.sizes[rows].tolist()
            return list(dict.fromkeys(zip(map(tuple, offs), map(tuple, sizes), strict=True)))
        return [b for b in self.boxes if boxes_meet(b[0], b[1], off, size)]


class FragmentRef:
    """A fragment's fields (row ``row`` of a tensor's table), for routing; ``local_box`` builds the fragment."""

    __slots__ = ("tensor", "rank", "offsets", "sizes", "local", "local_offsets", "_ix", "_row")

    def __init__(self, tensor, rank, offsets, sizes, local, local_offsets, ix, row) -> None:
        self.tensor, self.rank, self.offsets, self.sizes = tensor, rank, offsets, sizes
        self.local, self.local_offsets, self._ix, self._row = local, local_offsets, ix, row

    def local_box(self, off, size):
        return self._ix._fragment(self._row).local_box(off, size)


def check_own_overlaps(name: str, frags: Sequence[Fragment]) -> None:
    """Destination boxes of tensor ``name`` (``frags``) overlapping on one rank raise
    (``routing.check_dst_overlap``)."""
    if len({f.rank for f in frags}) < len(frags):
        check_dst_overlap(name, frags)


def rank_fragments(layout: Layout, rank: int) -> list[Fragment]:
    """The nonempty fragments ``rank`` holds, in layout order."""
    return [f for f in layout.fragments_on_rank(rank) if 0 not in f.sizes]
