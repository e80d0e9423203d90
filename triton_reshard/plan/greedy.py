"""The greedy router, kept for comparison (``plan_reshard(..., routing="greedy")``): every destination piece
from its least-loaded holder, the whole plan at once. The default planner is the local rules (``local``)."""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from itertools import compress
from operator import attrgetter

import torch

from ..box import boxes_meet
from ..layout import Fragment, Layout, itemsize_of
from .relay import choose_heads, group_fans, relay_dtype
from .routing import (
    LOCAL_ORDER,
    WIRE_ORDER,
    check_dst_overlap,
    cover_pieces,
    distinct_boxes,
    holders_of,
    wire_dtype_of,
)
from .types import Transfer, make_transfer

_RANK = attrgetter("rank")
_DST_ORDER = attrgetter("rank", "local")


def route_greedy(src: Layout, dst: Layout, gpus_per_node: int | None, relay: bool = False,
           groups: dict[int, int] | None = None) -> tuple[list[Transfer], list[Transfer]]:
    """The local copies and wire transfers (relays included) of ``plan_reshard``, sorted as the plan lists
    them. ``groups``: rank -> relay group (see ``check_relay_groups``)."""
    world = max(src.ranks + dst.ranks, default=0) + 1
    gpn = gpus_per_node
    local, remote, nbytes, fans = _route_pieces(src, dst, gpn, relay, groups)
    # a relayed part is charged to its source holder as what it replaces (the part once per destination of
    # its group): holders are balanced as in the plan without relays, so relays take bytes off the network
    # without moving other pieces to farther holders
    weight = list(nbytes)
    relays = choose_heads(fans, remote, nbytes, gpn, world, weight) if fans else []
    chosen = _choose_holders(remote, nbytes, weight, relays, gpn, world)
    wire = [make_transfer(df.tensor, o, s, chosen[i], df, w) for i, (df, o, s, _h, w) in enumerate(remote)]
    wire += relays
    wire.sort(key=WIRE_ORDER)
    local.sort(key=LOCAL_ORDER)
    return local, wire


def _route_pieces(src: Layout, dst: Layout, gpn: int | None, relay: bool, groups: dict[int, int] | None):
    """Every destination box cut into pieces by the source boxes covering it: (local copies, remote pieces
    (dst fragment, piece offsets, piece sizes, holders (see holders_of), wire dtype), their bytes, fan-out
    groups for the relays)."""
    local: list[Transfer] = []
    # remote pieces: (dst fragment, piece offsets, piece sizes, holders (see holders_of), wire dtype)
    remote: list[tuple[Fragment, tuple, tuple, tuple, torch.dtype]] = []
    nbytes: list[int] = []  # of each remote piece
    # fan-out groups (relay): (piece offsets, sizes, holders, wire dtype, relay dtype, bytes, {rank: [dst frags]})
    fans: list[tuple] = []
    src_by_tensor = src.fragments_by_tensor
    for spec in dst.tensors:
        dfrags = [f for f in dst.fragments_by_tensor.get(spec.name, ()) if 0 not in f.sizes]
        if not dfrags:
            continue
        if len(dfrags) > 1 and len(set(map(_RANK, dfrags))) < len(dfrags):
            check_dst_overlap(spec.name, dfrags)
        sspec = src.specs[spec.name]
        wdt = wire_dtype_of(sspec, spec)
        isz = itemsize_of(wdt)
        rdt = relay_dtype(sspec.dtype, spec.dtype, wdt) if relay else None
        sboxes = list(distinct_boxes(src_by_tensor.get(spec.name, ())).items())
        summaries: dict[int, tuple] = {}  # source box -> holders_of of its fragments
        for (d_off, d_size), dgroup in distinct_boxes(dfrags).items():
            cand = [i for i, (b, _) in enumerate(sboxes) if boxes_meet(b[0], b[1], d_off, d_size)]
            pieces = cover_pieces(d_off, d_size, [sboxes[i][0] for i in cand])
            routed = []
            for p_off, p_size, mask in pieces:
                if mask == 0:
                    raise ValueError(
                        f"tensor {spec.name!r}: element {p_off} (box {p_off}+{p_size}) needed on destination "
                        f"rank {dgroup[0].rank} is held by no source rank"
                    )
                if mask & (mask - 1) == 0:  # one source box holds the piece
                    i = cand[mask.bit_length() - 1]
                    h = summaries.get(i)
                    if h is None:
                        h = summaries[i] = holders_of((sboxes[i][1],))
                else:
                    h = holders_of([sboxes[i][1] for j, i in enumerate(cand) if mask >> j & 1])
                routed.append((p_off, p_size, h[0], h[1], math.prod(p_size) * isz))
            if rdt is not None and len(dgroup) > 1:
                group_fans(spec.name, sorted(dgroup, key=_DST_ORDER), routed, gpn, groups, wdt, rdt, local,
                            remote, nbytes, fans)
                continue
            for df in sorted(dgroup, key=_DST_ORDER) if len(dgroup) > 1 else dgroup:
                for p_off, p_size, first, holders, n in routed:
                    mine = first.get(df.rank)
                    if mine is not None:
                        local.append(make_transfer(spec.name, p_off, p_size, mine, df, wdt))
                    else:
                        remote.append((df, p_off, p_size, holders, wdt))
                        nbytes.append(n)
    return local, remote, nbytes, fans


def _choose_holders(remote: list[tuple], nbytes: list[int], weight: list[int], relays: list[Transfer],
                    gpn: int | None, world: int) -> list[Fragment | None]:
    """The source fragment that sends each remote piece: fixed holders first, then largest first onto the
    least loaded holder (one in the destination's node with ``gpn``, within the fair share)."""
    load = [0] * world
    chosen: list[Fragment | None] = [None] * len(remote)
    flexible = []
    for i, (_df, _o, _s, (ranks, _best, first_holder), _w) in enumerate(remote):
        if len(ranks) == 1:
            chosen[i] = first_holder
            load[ranks[0]] += weight[i]
        else:
            flexible.append(i)
    flexible.sort(key=nbytes.__getitem__, reverse=True)  # largest first; stable: ties keep their order
    if gpn:  # a holder in the destination's node sends, unless that takes it past its fair share
        senders = {r for _df, _o, _s, (ranks, _b, _f), _w in remote for r in ranks}
        # relayed bytes count as if sent from a source: the threshold stays the one without relays, so relays
        # do not make the near holders refuse pieces they would send otherwise
        fair = -(-(sum(nbytes) + sum(t.nbytes for t in relays)) // max(1, len(senders)))
    for i in flexible:
        df, _o, _s, (ranks, best, _first), _w = remote[i]
        r = _least_loaded(ranks, load, df.rank)
        if gpn and r // gpn != df.rank // gpn:
            near = [h for h in ranks if h // gpn == df.rank // gpn]
            if near:
                rn = _least_loaded(near, load, df.rank)
                if load[rn] + weight[i] <= max(fair, load[r] + weight[i]):
                    r = rn
        chosen[i] = best[r]
        load[r] += weight[i]
    return chosen


def _least_loaded(ranks: Sequence[int], load: list[int], dst_rank: int) -> int:
    """The rank of ``ranks`` (ascending) with the least ``load``; ties go to the first at or after ``dst_rank``
    in the cyclic order (the least ``(rank - dst_rank) % world``)."""
    loads = list(map(load.__getitem__, ranks))
    m = min(loads)
    if loads.count(m) == 1:
        return ranks[loads.index(m)]
    ties = list(compress(ranks, map(m.__eq__, loads)))
    k = bisect_left(ties, dst_rank)
    return ties[k] if k < len(ties) else ties[0]
