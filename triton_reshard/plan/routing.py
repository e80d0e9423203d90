"""Routing helpers of the planner (``holders``, ``rows``, ``local``): the decomposition of destination boxes
into pieces that the same source ranks hold, wire dtypes and the input checks. Fan-out (relays) is in
``relay``; the lower bound of the wire bytes in ``rows``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from operator import attrgetter

import torch

from ..box import boxes_meet, contains, decompose_box, find_overlap, intersect
from ..layout import Fragment, Layout, TensorSpec, dtype_name, itemsize_of

# --------------------------------------------------------------------------------------------------------
# Geometry helpers
# --------------------------------------------------------------------------------------------------------


def cover_pieces(box_off, box_size, cands: Sequence[tuple[tuple[int, ...], tuple[int, ...]]]):
    """``decompose_box``, with a fast path for the common case: every candidate contains the box (replicas of one
    shard, or a larger shard), so the box is one piece held by all of them."""
    for c_off, c_size in cands:
        if not contains(c_off, c_size, box_off, box_size):
            return decompose_box(box_off, box_size, cands)
    return [(box_off, box_size, (1 << len(cands)) - 1)]


def held_numel(box_off, box_size, boxes: Sequence[tuple[tuple[int, ...], tuple[int, ...]]]) -> int:
    """Elements of ``box`` inside the union of ``boxes`` (distinct boxes, each intersecting ``box``)."""
    parts = [intersect(o, s, box_off, box_size) for o, s in boxes]
    if len(parts) == 1:
        return math.prod(parts[0][1])
    if len(parts) <= 16 and not any(
        boxes_meet(a[0], a[1], b[0], b[1]) for i, a in enumerate(parts) for b in parts[i + 1:]
    ):  # disjoint: the union is the sum
        return sum(math.prod(p[1]) for p in parts)
    return sum(math.prod(s) for _, s, mask in decompose_box(box_off, box_size, boxes) if mask)


def no_holder(name: str, p_off, p_size, rank: int) -> ValueError:
    """The error of an element of a destination box (the piece ``p_off`` + ``p_size`` of it, needed on
    destination rank ``rank``) that no source rank holds."""
    return ValueError(f"tensor {name!r}: element {p_off} (box {p_off}+{p_size}) needed on destination rank "
                      f"{rank} is held by no source rank")


def wire_dtype_of(src: TensorSpec, dst: TensorSpec) -> torch.dtype:
    return dst.dtype if itemsize_of(dst.dtype) < itemsize_of(src.dtype) else src.dtype


# --------------------------------------------------------------------------------------------------------
# Planning
# --------------------------------------------------------------------------------------------------------


def check_gpus_per_node(gpus_per_node, where: str) -> None:
    if gpus_per_node is not None and (
        not isinstance(gpus_per_node, int) or isinstance(gpus_per_node, bool) or gpus_per_node < 1
    ):
        raise ValueError(f"{where}: gpus_per_node={gpus_per_node!r} must be an int >= 1 or None")


def check_specs(src: Layout, dst: Layout, allow_cast: bool) -> None:
    for spec in dst.tensors:
        frags = dst.fragments_by_tensor.get(spec.name, ())
        where = f"rank {frags[0].rank}" if frags else "no rank"
        s = src.specs.get(spec.name)
        if s is None:
            if any(f.numel for f in frags):
                raise ValueError(
                    f"tensor {spec.name!r} (needed on destination {where}) is not in the source layout"
                )
            continue
        if s.shape != spec.shape:
            raise ValueError(
                f"tensor {spec.name!r}: source global shape {s.shape} != destination global shape {spec.shape} "
                f"(destination {where})"
            )
        if s.dtype != spec.dtype and not allow_cast:
            raise ValueError(
                f"tensor {spec.name!r}: source dtype {dtype_name(s.dtype)} != destination dtype "
                f"{dtype_name(spec.dtype)} (destination {where}); pass allow_cast=True to cast in the copy"
            )


def check_dst_overlap(name: str, frags: Sequence[Fragment]) -> None:
    by_rank: dict[int, list[Fragment]] = defaultdict(list)
    for f in frags:
        by_rank[f.rank].append(f)
    for rank, fs in by_rank.items():
        if len(fs) > 1:
            hit = find_overlap([(f.offsets, f.sizes, f) for f in fs])
            if hit is not None:
                a, b = hit
                raise ValueError(
                    f"overlapping destination boxes of tensor {name!r} on rank {rank}: {a.offsets}+{a.sizes} "
                    f"(local {a.local!r}) and {b.offsets}+{b.sizes} (local {b.local!r})"
                )


WIRE_ORDER = attrgetter("src_rank", "dst_rank", "tensor", "offsets")
LOCAL_ORDER = attrgetter("dst_rank", "tensor", "offsets", "dst_local")


def check_relay_groups(relay_groups) -> dict[int, int]:
    """``plan_reshard``'s ``relay_groups`` checked: rank -> index of its group (groups of one rank left out)."""
    if relay_groups is None:
        return {}
    if not isinstance(relay_groups, tuple) or not all(isinstance(g, tuple) for g in relay_groups):
        raise TypeError(f"plan_reshard: relay_groups must be a tuple of tuples of ranks, got {relay_groups!r}")
    out: dict[int, int] = {}
    for i, g in enumerate(relay_groups):
        for r in g:
            if not isinstance(r, int) or isinstance(r, bool) or r < 0:
                raise TypeError(f"plan_reshard: relay_groups: rank {r!r} of group {g} must be an int >= 0")
            if r in out:
                raise ValueError(f"plan_reshard: relay_groups: rank {r} is in two groups ({relay_groups[out[r]]} "
                                 f"and {g}); the groups must be disjoint")
            out[r] = i
        if len(g) < 2:
            for r in g:
                del out[r]
    return out
