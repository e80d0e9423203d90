"""The greedy router of earlier versions, a reference the tests compare the planner against (not part of the
package): every destination piece from its least-loaded holder, the whole plan at once (fixed sources first,
then the rest largest first onto the least loaded holder), relays by ``group_fans`` / ``choose_heads``.
:func:`greedy_plan` is what ``plan_reshard(..., routing="greedy")`` was; its steps, by first fit, are
``first_fit.build_schedule``'s. Both it and the planner send exactly the lower bound of wire bytes."""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from itertools import compress
from operator import attrgetter

import torch

from triton_reshard.box import boxes_meet
from triton_reshard.layout import Fragment, Layout, gc_paused, itemsize_of
from triton_reshard.plan import quant as _quant
from triton_reshard.plan.core import Plan
from triton_reshard.plan.options import PlanOptions
from triton_reshard.plan.relay import relay_dtype, split_piece
from triton_reshard.plan.routing import (
    LOCAL_ORDER,
    WIRE_ORDER,
    check_dst_overlap,
    check_specs,
    cover_pieces,
    wire_dtype_of,
)
from triton_reshard.plan.types import Transfer

from .route_objects import holders_of, make_transfer

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


def distinct_boxes(frags: Iterable[Fragment]) -> dict[tuple, list[Fragment]]:
    out: dict[tuple, list[Fragment]] = {}
    for f in frags:
        if 0 not in f.sizes:
            key = (f.offsets, f.sizes)
            group = out.get(key)
            if group is None:
                out[key] = [f]
            else:
                group.append(f)
    return out


def greedy_plan(src: Layout, dst: Layout, allow_cast: bool = False, gpus_per_node: int | None = None,
                relay: bool | None = None, relay_groups: tuple[tuple[int, ...], ...] | None = None) -> Plan:
    """The whole plan by the greedy router (``plan_reshard``'s arguments, no ``rank``), block-quantized
    destinations routed in the source dtype and cut on the block grid after, as the planner does."""
    targets = _quant.quant_targets(src, dst) if dst.quantized else {}
    routed = _quant.routing_view(src, dst, targets) if targets else dst
    check_specs(src, routed, allow_cast)
    opts = PlanOptions.of(allow_cast, gpus_per_node, relay, relay_groups)
    with gc_paused():
        local, wire = route_greedy(src, routed, gpus_per_node, opts.relay, opts.groups)
        if targets:
            local, wire = _quant.quantize_transfers(src, dst, targets, local, wire)
        return Plan(src, dst, tuple(wire), tuple(local))


def group_fans(name: str, dgroup: list[Fragment], routed: list[tuple], gpn: int | None, groups: dict[int, int],
                wdt: torch.dtype, rdt: torch.dtype, local: list, remote: list, nbytes: list, fans: list) -> None:
    """Route the pieces of one replicated destination box (``dgroup``, in destination order) with relays on.

    A piece that at least two ranks of a node need over the wire, while no source rank of that node holds it,
    becomes a fan-out group of that node; then, among the ranks left, a piece that at least two ranks of one
    relay group (``groups``: rank -> group) need over the wire becomes a fan-out group of those ranks (both
    appended to ``fans``; their parts and the ranks receiving them are chosen later, with the loads known). Everything else is
    routed exactly as without relays and in the same order (local copies where the destination rank holds the
    piece, remote pieces otherwise), so a plan without fan-out groups is the plan without relays.
    """
    fan_of: dict[tuple[int, int], dict[int, list[Fragment]]] = {}  # (piece, rank) -> {rank: its fragments}
    for k, (p_off, p_size, first, holders, n) in enumerate(routed):
        taken = None  # the ranks a node fans this piece out to
        if gpn is not None:
            need_n: dict[int, set[int]] = {}  # node -> the ranks in it that need the piece over the wire
            for df in dgroup:
                if df.rank not in first:
                    need_n.setdefault(df.rank // gpn, set()).add(df.rank)
            held = None
            for node, ranks in need_n.items():
                if len(ranks) > 1:
                    if held is None:
                        held = {r // gpn for r in holders[0]}
                    if node not in held:
                        by_rank: dict[int, list[Fragment]] = {}
                        fans.append((p_off, p_size, holders, wdt, rdt, n, by_rank))
                        taken = taken or set()
                        taken.update(ranks)
                        for r in ranks:
                            fan_of[(k, r)] = by_rank
        if not groups:
            continue
        need: dict[int, list[int]] = {}  # group -> the ranks left in it that need the piece over the wire
        for df in dgroup:
            g = groups.get(df.rank)
            if g is not None and df.rank not in first and (taken is None or df.rank not in taken):
                ranks = need.setdefault(g, [])
                if df.rank not in ranks:
                    ranks.append(df.rank)
        for ranks in need.values():
            if len(ranks) > 1:
                by_rank = {}
                fans.append((p_off, p_size, holders, wdt, rdt, n, by_rank))
                for r in ranks:
                    fan_of[(k, r)] = by_rank
    for df in dgroup:
        for k, (p_off, p_size, first, holders, n) in enumerate(routed):
            mine = first.get(df.rank)
            if mine is not None:
                local.append(make_transfer(name, p_off, p_size, mine, df, wdt))
                continue
            by_rank = fan_of.get((k, df.rank)) if fan_of else None
            if by_rank is not None:
                by_rank.setdefault(df.rank, []).append(df)
            else:
                remote.append((df, p_off, p_size, holders, wdt))
                nbytes.append(n)


def choose_heads(fans: list[tuple], remote: list, nbytes: list[int], gpn: int | None, world: int,
                  weight: list[int]) -> list[Transfer]:
    """Route every fan-out group: split its piece (``split_piece``), give each part a rank of the group that
    receives it over the network (appended to ``remote``: it gets a source holder like any other piece), and
    return the relay transfers by which that rank forwards its part to the other ranks of the group.
    ``weight`` gets, per appended part, what the part replaces: its bytes once per destination of the group.

    So a piece of a group of k ranks is scattered over the network (each rank ~1/k of it) and all-gathered
    over NVLink (each rank relays its ~1/k to the k-1 others), as NCCL M2N's ring does; a piece too small to
    split has one part, and its one rank (the head) relays all of it. Largest group piece first, and within a
    group largest part first, a part goes to the rank of the group, among those without a part of this piece,
    with the fewest bytes received over the network so far (counting the remote pieces no holder in the
    rank's node can send, which surely cross the network), then the fewest bytes relayed, then the lowest
    rank. So the parts' order rotates from piece to piece, and each rank's network receive (its share of the
    first phase) and its relay sends (the second phase) stay balanced.
    """
    net_recv = [0] * world  # with no node size: every byte received from a source
    for (df, _o, _s, (ranks, _b, _f), _w), n in zip(remote, nbytes, strict=True):
        if gpn is None:
            net_recv[df.rank] += n
            continue
        node = df.rank // gpn
        if all(r // gpn != node for r in ranks):
            net_recv[df.rank] += n
    relayed = [0] * world
    relays: list[Transfer] = []
    for k in sorted(range(len(fans)), key=lambda k: -fans[k][5]):  # stable: ties keep their order
        p_off, p_size, holders, wdt, rdt, n, by_rank = fans[k]
        free = set(by_rank)
        dests = sum(map(len, by_rank.values()))
        for o, s, pn in split_piece(p_off, p_size, n, len(by_rank)):
            head = min(free, key=lambda r: (net_recv[r], relayed[r], r))
            free.discard(head)
            heads = by_rank[head]
            for df in heads:
                remote.append((df, o, s, holders, wdt))
                nbytes.append(pn)
                weight.append(pn * dests // len(heads))
            net_recv[head] += pn * len(heads)
            for r, dfs in by_rank.items():
                if r != head:
                    for df in dfs:
                        relays.append(make_transfer(df.tensor, o, s, heads[0], df, rdt, True))
                        relayed[head] += pn
    return relays
