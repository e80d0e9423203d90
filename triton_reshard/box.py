"""Box geometry, written once: a box is ``(offsets, sizes)`` of a tensor (one entry per dim). Slicing,
intersection, overlap, containment, splitting to a byte cap, contiguity, a box cut by others into
pieces (``decompose_box``), a box less another, the union of boxes. Used by layout, plan and execute.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from operator import add, gt, itemgetter, le, lt

import numpy as np

ALIGN = 16  # byte alignment of every chunk inside a message buffer (lets any dtype view the bytes)

Box = tuple[tuple[int, ...], tuple[int, ...]]

_BOX_START = itemgetter(0)


def align_up(n):
    """``n`` (an int, or an int array elementwise) rounded up to a multiple of ``ALIGN``."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def box_slices(offsets: Sequence[int], sizes: Sequence[int]) -> tuple[slice, ...]:
    """The index that selects the box ``offsets``+``sizes`` of a tensor."""
    return tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))


def boxes_overlap(a_off, a_size, b_off, b_size) -> bool:
    """Whether two boxes share an element (raises for boxes of different ranks)."""
    if len(a_off) != len(b_off):
        raise ValueError(f"boxes of different ranks: {a_off} and {b_off}")
    return all(map(gt, map(add, b_off, b_size), a_off)) and all(map(gt, map(add, a_off, a_size), b_off))


def boxes_meet(a_off, a_size, b_off, b_size) -> bool:
    """Whether two nonempty boxes share an element (``intersect(...) is not None``, without building it)."""
    return all(map(lt, a_off, map(add, b_off, b_size))) and all(map(lt, b_off, map(add, a_off, a_size)))


def find_overlap(boxes: list[tuple[tuple[int, ...], tuple[int, ...], object]]):
    """Return the first pair of overlapping boxes (sweep over dim 0), or None. Empty boxes never overlap."""
    items = sorted((b for b in boxes if min(b[1], default=1) > 0), key=_BOX_START)
    active: list[tuple[tuple[int, ...], tuple[int, ...], object]] = []
    for off, size, tag in items:
        if not off:  # 0-d
            if active:
                return active[0][2], tag
            active.append((off, size, tag))
            continue
        active = [a for a in active if a[0][0] + a[1][0] > off[0]]
        for a in active:
            if boxes_overlap(a[0], a[1], off, size):
                return a[2], tag
        active.append((off, size, tag))
    return None


def intersect(a_off, a_size, b_off, b_size) -> Box | None:
    """The box two boxes share, or None."""
    off, size = [], []
    for ao, as_, bo, bs in zip(a_off, a_size, b_off, b_size, strict=True):
        lo, hi = max(ao, bo), min(ao + as_, bo + bs)
        if hi <= lo:
            return None
        off.append(lo)
        size.append(hi - lo)
    return tuple(off), tuple(size)


def intersect_boxes(a: Box, b: Box) -> Box | None:
    """:func:`intersect` of two ``(offsets, sizes)`` pairs."""
    return intersect(a[0], a[1], b[0], b[1])


def contains(outer_off, outer_size, off, size) -> bool:
    """Whether box ``off``+``size`` lies inside box ``outer_off``+``outer_size``."""
    return all(map(le, outer_off, off)) and all(map(le, map(add, off, size), map(add, outer_off, outer_size)))


def split_rows(sizes: tuple[int, ...], itemsize: int, cap: int) -> tuple[int, int]:
    """How :func:`split_box` cuts a box bigger than ``cap``: ``(d, rows)``: dims before ``d`` into single
    indices, dim ``d`` into runs of ``rows`` indices (the last run shorter), dims after it whole."""
    # smallest d such that one slice along dims > d fits
    nd = len(sizes)
    d = nd - 1
    for k in range(nd):
        if align_up(math.prod(sizes[k + 1:]) * itemsize) <= cap:
            d = k
            break
    inner = math.prod(sizes[d + 1:]) * itemsize
    return d, (max(1, cap // inner) if inner else sizes[d])  # cap is a multiple of ALIGN


def split_box(sizes: tuple[int, ...], itemsize: int, cap: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Split a box (relative offsets) into sub-boxes of at most ``cap`` bytes once aligned."""
    if align_up(math.prod(sizes) * itemsize) <= cap or not sizes:
        return [((0,) * len(sizes), tuple(sizes))]
    nd = len(sizes)
    d, rows = split_rows(sizes, itemsize, cap)
    out = []
    for outer in itertools.product(*[range(n) for n in sizes[:d]]):
        for start in range(0, sizes[d], rows):
            n = min(rows, sizes[d] - start)
            out.append((tuple(outer) + (start,) + (0,) * (nd - d - 1), (1,) * d + (n,) + tuple(sizes[d + 1:])))
    return out


def is_contiguous_box(shape: tuple[int, ...], start: tuple[int, ...], off: tuple[int, ...],
                      size: tuple[int, ...]) -> bool:
    """Whether the sub-box ``off``+``size`` of the box starting at ``start`` (local coordinates; a local
    tensor may have extra leading dims, where the box has size 1) is one contiguous run of a contiguous
    tensor of ``shape``: every dim after its first dim of size > 1 is whole. (It depends on ``shape`` and ``size``
    alone, which the schedule's memo of it relies on; ``start`` and ``off`` are the box's place, for the reader.)"""
    full = size if len(size) == len(shape) else (1,) * (len(shape) - len(size)) + tuple(size)
    seen = False
    for n, s in zip(full, shape, strict=True):
        if seen and n != s:
            return False
        if n > 1:
            seen = True
    return True


def right_align(a: np.ndarray, nd: np.ndarray, width: int) -> np.ndarray:
    """Rows of ``a`` (``[m, k]``, row ``i``'s values in its first ``nd[i]`` columns) right-aligned in ``[m, width]``
    int64, padded with 1 on the left: shapes and box sizes laid so that their last dims line up."""
    col = np.arange(width)[None, :] - (width - np.asarray(nd, np.int64))[:, None]  # column c holds value c - pad
    if not a.shape[1]:
        return np.ones((len(nd), width), np.int64)
    return np.where(col >= 0, np.take_along_axis(np.asarray(a, np.int64), np.clip(col, 0, a.shape[1] - 1), 1), 1)


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides (in elements) of a contiguous tensor of ``shape`` (a 0-length dim counts as 1, as torch's)."""
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(out))


def contiguous_boxes(shapes: np.ndarray, sizes: np.ndarray, nd: np.ndarray) -> np.ndarray:
    """:func:`is_contiguous_box` per row, on arrays (the schedule's many chunks at once): ``shapes`` ``[m, S]``
    right-aligned (padded with 1 on the left), ``sizes`` ``[m, D]`` the boxes' first ``nd`` columns (left-aligned):
    every dim after the first dim of size > 1 is whole."""
    m = len(nd)
    W = max(shapes.shape[1], sizes.shape[1])
    sh = np.concatenate([np.ones((m, W - shapes.shape[1]), np.int64), shapes], 1)
    sz = right_align(sizes, nd, W)
    big = sz > 1
    before = np.zeros_like(big)
    before[:, 1:] = np.logical_or.accumulate(big, 1)[:, :-1]
    return ~(before & (sz != sh)).any(1)


def decompose_box(box_off, box_size, cands: Sequence[tuple[tuple[int, ...], tuple[int, ...]]]):
    """Split ``box`` into sub-boxes, each labelled with the set (bitmask) of candidate boxes containing it.

    Cells of the grid made by all candidate boundaries are merged greedily into larger boxes with the same
    label. A label of 0 means no candidate holds that part.
    """
    nd = len(box_off)
    if nd == 0:
        mask = 0
        for i, _ in enumerate(cands):
            mask |= 1 << i
        return [((), (), mask)]
    cuts = []
    for d in range(nd):
        lo, hi = box_off[d], box_off[d] + box_size[d]
        pts = {lo, hi}
        for c_off, c_size in cands:
            for p in (c_off[d], c_off[d] + c_size[d]):
                if lo < p < hi:
                    pts.add(p)
        cuts.append(sorted(pts))
    shape = [len(c) - 1 for c in cuts]
    if math.prod(shape) == 1:
        mask = 0
        for i, (c_off, c_size) in enumerate(cands):
            if contains(c_off, c_size, box_off, box_size):
                mask |= 1 << i
        return [(tuple(box_off), tuple(box_size), mask)]
    cut = [d for d in range(nd) if shape[d] > 1]
    if len(cut) == 1:  # cells along one dim: the greedy below merges runs of equal labels (a plan's usual case)
        return _decompose_1d(box_off, box_size, cands, cut[0], cuts[cut[0]])
    # label every cell
    labels: dict[tuple[int, ...], int] = {}
    for idx in itertools.product(*[range(n) for n in shape]):
        lo = tuple(cuts[d][i] for d, i in enumerate(idx))
        mask = 0
        for ci, (c_off, c_size) in enumerate(cands):
            if all(c_off[d] <= lo[d] < c_off[d] + c_size[d] for d in range(nd)):
                mask |= 1 << ci
        labels[idx] = mask
    done: set[tuple[int, ...]] = set()
    out = []
    for idx in itertools.product(*[range(n) for n in shape]):
        if idx in done:
            continue
        lab = labels[idx]
        hi = list(idx)
        # grow along each dim, last dim first, while every cell of the slab has the same label
        for d in reversed(range(nd)):
            while hi[d] + 1 < shape[d]:
                ranges = [range(idx[k], hi[k] + 1) if k != d else range(hi[d] + 1, hi[d] + 2) for k in range(nd)]
                slab = list(itertools.product(*ranges))
                if all(labels[c] == lab and c not in done for c in slab):
                    hi[d] += 1
                else:
                    break
        for c in itertools.product(*[range(idx[k], hi[k] + 1) for k in range(nd)]):
            done.add(c)
        off = tuple(cuts[d][idx[d]] for d in range(nd))
        size = tuple(cuts[d][hi[d] + 1] - cuts[d][idx[d]] for d in range(nd))
        out.append((off, size, lab))
    return out


def _decompose_1d(box_off, box_size, cands, d0: int, pts: list[int]) -> list:
    """:func:`decompose_box` when only dim ``d0`` is cut (at ``pts``): the same boxes, in the same order."""
    nd = len(box_off)
    # the candidates holding the box's first cell on every other dim (the other dims are whole cells)
    live = [(1 << ci, c_off[d0], c_off[d0] + c_size[d0]) for ci, (c_off, c_size) in enumerate(cands)
            if all(c_off[d] <= box_off[d] < c_off[d] + c_size[d] for d in range(nd) if d != d0)]
    out: list = []
    start, lab = pts[0], None
    for k in range(len(pts) - 1):
        lo = pts[k]
        mask = 0
        for bit, a, z in live:
            if a <= lo < z:
                mask |= bit
        if lab is not None and mask != lab:
            out.append((start, lo, lab))
            start = lo
        lab = mask
    out.append((start, pts[-1], lab))
    head, tail = tuple(box_off[:d0]), tuple(box_off[d0 + 1:])
    shead, stail = tuple(box_size[:d0]), tuple(box_size[d0 + 1:])
    return [(head + (a,) + tail, shead + (z - a,) + stail, m) for a, z, m in out]


def subtract_box(off, size, inner: Box | None) -> list[Box]:
    """Box ``off``+``size`` minus its sub-box ``inner``: disjoint slabs (dims before ``d`` cut to the inner
    range, dim ``d`` outside it, the later dims whole)."""
    if inner is None:
        return [(tuple(off), tuple(size))]
    out = []
    cur_off, cur_size = list(off), list(size)
    for d in range(len(off)):
        io, isz = inner[0][d], inner[1][d]
        lo, hi = cur_off[d], cur_off[d] + cur_size[d]
        if io > lo:
            out.append((tuple(cur_off[:d]) + (lo,) + tuple(cur_off[d + 1:]),
                        tuple(cur_size[:d]) + (io - lo,) + tuple(cur_size[d + 1:])))
        if io + isz < hi:
            out.append((tuple(cur_off[:d]) + (io + isz,) + tuple(cur_off[d + 1:]),
                        tuple(cur_size[:d]) + (hi - io - isz,) + tuple(cur_size[d + 1:])))
        cur_off[d], cur_size[d] = io, isz
    return out


def union_boxes(boxes: Sequence[Box]) -> list[Box]:
    """The union of ``boxes`` as disjoint boxes, in a canonical form: the same set gives the same boxes
    whatever boxes it came from (grid lines where the set does not change are dropped, then the cells are
    merged greedily, last dim first, in row-major order)."""
    boxes = [b for b in boxes if min(b[1], default=1) > 0]
    if len(boxes) <= 1:
        return [(tuple(b[0]), tuple(b[1])) for b in boxes]
    nd = len(boxes[0][0])
    cuts = [sorted({p for o, s in boxes for p in (o[d], o[d] + s[d])}) for d in range(nd)]
    shape = [len(c) - 1 for c in cuts]

    def inside(idx) -> bool:
        lo = [cuts[d][i] for d, i in enumerate(idx)]
        return any(all(o[d] <= lo[d] < o[d] + s[d] for d in range(nd)) for o, s in boxes)

    cells = {idx: inside(idx) for idx in itertools.product(*[range(n) for n in shape])}
    # canonical grid: drop every cut line across which no cell changes
    keep = []
    for d in range(nd):
        k = [0]
        for i in range(1, shape[d]):
            if any(cells[idx] != cells[idx[:d] + (i - 1,) + idx[d + 1:]]
                   for idx in itertools.product(*[range(n) if e != d else (i,) for e, n in enumerate(shape)])):
                k.append(i)
        keep.append(k)
    g_cuts = [[cuts[d][i] for i in keep[d]] + [cuts[d][-1]] for d in range(nd)]
    g_shape = [len(k) for k in keep]
    lab = {idx: cells[tuple(keep[d][i] for d, i in enumerate(idx))]
           for idx in itertools.product(*[range(n) for n in g_shape])}
    done: set = set()
    out = []
    for idx in itertools.product(*[range(n) for n in g_shape]):
        if idx in done or not lab[idx]:
            continue
        hi = list(idx)
        for d in reversed(range(nd)):
            while hi[d] + 1 < g_shape[d]:
                slab = itertools.product(*[range(idx[k], hi[k] + 1) if k != d else (hi[d] + 1,) for k in range(nd)])
                if all(lab[c] and c not in done for c in slab):
                    hi[d] += 1
                else:
                    break
        done.update(itertools.product(*[range(idx[k], hi[k] + 1) for k in range(nd)]))
        out.append((tuple(g_cuts[d][idx[d]] for d in range(nd)),
                    tuple(g_cuts[d][hi[d] + 1] - g_cuts[d][idx[d]] for d in range(nd))))
    return out


def union_numel(boxes: Sequence[Box]) -> int:
    """Elements in the union of ``boxes``."""
    return sum(math.prod(s) for _o, s in union_boxes(boxes))
