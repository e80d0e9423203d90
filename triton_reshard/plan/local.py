"""Locally computable routing and steps: what every rank can decide for its own sends and receives from the
two layouts alone, identically to its peers (``plan_reshard``'s routing).

**Holders and fan-out** (:mod:`.holders`): which source rank sends each piece, and relays (the salt's base: a
tensor's index in ``dst.tensor_order()``).

**Steps.** The wire transfers of one (phase, source, destination) pair, in key order, are cut into chunks and
taken in that order into *loads* of at most ``c = bucket_bytes // 2 // P`` aligned bytes (``P =
min(STEP_PEERS, W - 1)``, ``W``: one more than the largest rank); a load is one packed message plus one
message per direct chunk (at least ``direct_min_bytes``, contiguous on one side). Both ends list the same
transfers, so they cut the same loads. Load ``m`` of pair ``(s, d)`` goes to step ``(phase, m * G + w)`` with
``k = (d - s) % W - 1`` and window ``w = k % G`` (``G = ceil((W - 1) / P)`` windows of ``P`` offsets each,
strided): in one step a rank sends to at most ``P`` peers (``s + 1 + w + j * G``) and receives from at most
``P``, each load within ``c``, so its staging stays within one bucket; and since both ends agree on every
message's step and every rank walks its steps in increasing order, no rank waits forever (the smallest step
still pending always has both ends of its messages posted).
"""

from __future__ import annotations

from collections.abc import Container

from ..layout import Fragment, Layout, gc_paused
from . import quant
from .core import Plan
from .index import boxes_meeting, check_own_overlaps, rank_fragments
from .routing import LOCAL_ORDER, WIRE_ORDER
from .rows import route_tables


def route_rank(src: Layout, dst: Layout, rank: int, gpn: int | None, relay: bool, groups: dict[int, int],
               whole: Container[str] = ()):
    """Rank ``rank``'s transfers only (its sends, receives, relays and local copies), from the boxes of its
    own tensors: the destination boxes it holds and those overlapping the source boxes it holds, routed by the
    whole plan's router (``rows.route_tables``) and cut to the rank. Tensors in ``whole`` get every transfer of
    those boxes (the block-quantization post-pass cuts a destination fragment's transfers by the regions all of
    them make). As objects: :func:`route_rank_tables` gives the same rows as tables."""
    local, wire = route_rank_tables(src, dst, rank, gpn, relay, groups, whole)
    return list(local), list(wire)


def route_rank_tables(src: Layout, dst: Layout, rank: int, gpn: int | None, relay: bool, groups: dict[int, int],
                      whole: Container[str] = ()):
    """:func:`route_rank` as ``(local copies, wire transfers)`` tables, unsorted (no object per transfer)."""
    todo: dict[tuple, None] = {}
    mine: dict[str, list[Fragment]] = {}
    for df in rank_fragments(dst, rank):
        todo[(df.tensor, (df.offsets, df.sizes))] = None
        mine.setdefault(df.tensor, []).append(df)
    for name, frs in mine.items():
        if len(frs) > 1:
            check_own_overlaps(name, frs)
    for key in boxes_meeting(dst, [sf for sf in rank_fragments(src, rank) if sf.tensor in dst.specs]):
        todo[key] = None
    boxes: dict[str, list[tuple]] = {}
    for name, box in todo:
        boxes.setdefault(name, []).append(box)
    return route_tables(src, dst, gpn, relay, groups, dst.tensor_order(), boxes, rank, whole)


# --------------------------------------------------------------------------------------------------------
# Entry point (``plan_reshard``)
# --------------------------------------------------------------------------------------------------------


def plan_local(src: Layout, dst: Layout, routed: Layout, targets: dict, gpus_per_node: int | None, relay: bool,
               groups: dict[int, int], options: tuple, rank: int | None):
    """The whole plan (``rank=None``) or rank ``rank``'s share, a :class:`Plan`, routed by the local rules on
    ``routed`` (``dst`` as routing sees it: see ``quant.routing_view``), then block-quantized
    (``targets``) transfer by transfer."""
    with gc_paused():
        if rank is None:  # as rows, never one object per transfer
            local, wire = route_tables(src, routed, gpus_per_node, relay, groups, routed.tensor_order())
        else:  # a rank's share: its few transfers (the rows of every box it touches would cost it more)
            local, wire = route_rank_tables(src, routed, rank, gpus_per_node, relay, groups, targets)
        if not targets:  # sorted as columns (the order ``list.sort`` by WIRE_ORDER / LOCAL_ORDER gives)
            return Plan(src, dst, wire.sorted("wire"), local.sorted("local"), rank, options)
        local, wire = list(local), list(wire)  # the block-quantization post-pass reads objects
        mine = targets if rank is None else {n: s for n, s in targets.items()
                                             if any(t.tensor == n for t in local + wire)}
        local, wire = quant.quantize_transfers(src, dst, mine, local, wire)
        if rank is not None:
            local = [t for t in local if t.dst_rank == rank]
            wire = [t for t in wire if t.src_rank == rank or t.dst_rank == rank]
        wire.sort(key=WIRE_ORDER)
        local.sort(key=LOCAL_ORDER)
        return Plan(src, dst, tuple(wire), tuple(local), rank, options)
