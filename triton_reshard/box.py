"""Box geometry, written once: a box is ``(offsets, sizes)`` of a tensor (one entry per dim). Slicing,
intersection, overlap, containment, splitting to a byte cap, contiguity. Used by layout, plan and execute.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from operator import add, gt, itemgetter, le, lt

ALIGN = 16  # byte alignment of every chunk inside a message buffer (lets any dtype view the bytes)

Box = tuple[tuple[int, ...], tuple[int, ...]]

_BOX_START = itemgetter(0)


def align_up(n: int) -> int:
    """``n`` rounded up to a multiple of ``ALIGN``."""
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
