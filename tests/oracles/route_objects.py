"""The routing rule over the objects: every destination box of every tensor routed one at a time by
:func:`route_box` into :class:`~triton_reshard.plan.types.Transfer` objects (what the package's ``route_all``
and ``holders.route_box`` were). The package routes on the columns (``plan/rows.py:route_tables``, the whole
plan and a rank's share; pieces with ``gpus_per_node`` or relays through ``holders.route_piece`` on ranks);
``tests/test_plan_rows.py`` compares the two on the presets and on random layouts. Only the holder rule's
arithmetic (``holders.assign``, ``holders.piece_salt``) and the cuts (``routing.cover_pieces``,
``relay.split_piece``) are the package's; which ranks hold, receive, fan out and relay is worked out here on
fragments."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from triton_reshard.layout import Fragment, Layout, itemsize_of
from triton_reshard.plan.holders import assign, piece_salt
from triton_reshard.plan.index import DstGroup, TensorIndex, check_own_overlaps
from triton_reshard.plan.relay import relay_dtype, split_piece
from triton_reshard.plan.routing import cover_pieces, no_holder, wire_dtype_of
from triton_reshard.plan.types import Transfer


def route_all(src: Layout, dst: Layout, gpn: int | None, relay: bool, groups: dict[int, int],
              names: Sequence[str] | None = None) -> tuple[list[Transfer], list[Transfer]]:
    """Every rank's ``(local copies, wire transfers)`` as lists of objects: ``route_box`` over every destination
    box of every tensor (``names``: of those tensors only)."""
    local: list[Transfer] = []
    wire: list[Transfer] = []
    order = dst.tensor_order()
    for name in (names if names is not None else [spec.name for spec in dst.tensors]):
        dix = TensorIndex(dst, name)
        if not dix.boxes:
            continue
        check_own_overlaps(name, [f for b in dix.boxes for f in dix.by_box[b]])
        spec, sspec = dst.specs[name], src.specs[name]
        wdt = wire_dtype_of(sspec, spec)
        rdt = relay_dtype(sspec.dtype, spec.dtype, wdt) if relay else None
        six = TensorIndex(src, name)
        for box in dix.boxes:
            route_box(name, box, dix.group(name, box), six.overlapping(*box), wdt, rdt, gpn, groups, local, wire,
                      base=order[name])
    return local, wire


def route_box(name: str, box: tuple, dgroup: DstGroup, sfrags: list[Fragment], wdt: torch.dtype,
              rdt: torch.dtype | None, gpn: int | None, groups: dict[int, int], local: list, wire: list,
              base: int = 0) -> None:
    """Route destination box ``box`` of tensor ``name``: ``dgroup`` its destination fragments (one per rank),
    ``sfrags`` every nonempty source fragment of the tensor overlapping it. Appends the local copies to
    ``local`` and the wire transfers (relays included) to ``wire``. Per piece (the box cut by the source boxes
    holding it): a rank of the box holding it copies it locally from its first fragment; the others receive it
    from a holder's best fragment (``assign``), or, in fan groups (relays on: ``rdt``), one part each from a
    holder, relayed by that head to the rest of its group."""
    dranks, frag = dgroup.ranks, dgroup.frag
    sboxes: dict[tuple, list[Fragment]] = {}
    for f in sfrags:
        sboxes.setdefault((f.offsets, f.sizes), []).append(f)
    order = sorted(sboxes)
    sgroups = [sorted(sboxes[b], key=lambda f: (f.rank, f.local, f.local_offsets)) for b in order]
    for p_off, p_size, mask in cover_pieces(box[0], box[1], order):
        if mask == 0:
            raise no_holder(name, p_off, p_size, dranks[0])
        first, (ranks, best, _f) = holders_of([sgroups[i] for i in range(len(order)) if mask >> i & 1])
        for r in dranks:
            if r in first:
                local.append(make_transfer(name, p_off, p_size, first[r], frag(r), wdt))
        recv = [r for r in dranks if r not in first]
        if not recv:
            continue
        units: dict[tuple, list[int]] = {(p_off, p_size): recv}  # sub-box -> its receivers from a holder
        if rdt is not None and len(recv) > 1:
            plain, fans = fan_groups(recv, ranks, gpn, groups)
            units = {(p_off, p_size): plain} if plain else {}
            salt = piece_salt(base, p_off, p_size)
            for g in fans:
                parts = split_piece(p_off, p_size, math.prod(p_size) * itemsize_of(wdt), len(g))
                for j, (o, s, _n) in enumerate(parts):
                    head = g[(j + salt) % len(g)]
                    units.setdefault((o, s), []).append(head)
                    wire.extend(make_transfer(name, o, s, frag(head), frag(r), rdt, True) for r in g if r != head)
            for rcv in units.values():
                rcv.sort()
        for (o, s), rcv in units.items():
            for d, j in zip(rcv, assign(ranks, rcv, piece_salt(base, o, s), gpn), strict=True):
                wire.append(make_transfer(name, o, s, best[ranks[j]], frag(d), wdt))


def fan_groups(recv: list[int], holders: Sequence[int], gpn: int | None,
               groups: dict[int, int]) -> tuple[list[int], list[list[int]]]:
    """Split the wire receivers (ranks, ascending) of one piece into plain receivers and fan groups (each >= 2
    ranks, ascending): first per node without a holder, then per relay group among the ranks left."""
    fans: list[list[int]] = []
    rest = recv
    if gpn is not None:
        held = {r // gpn for r in holders}
        by_node: dict[int, list[int]] = {}
        for r in recv:
            if r // gpn not in held:
                by_node.setdefault(r // gpn, []).append(r)
        fans += [g for g in by_node.values() if len(g) > 1]
    taken = {r for g in fans for r in g}
    by_group: dict[int, list[int]] = {}
    for r in rest:
        if r not in taken and groups.get(r) is not None:
            by_group.setdefault(groups[r], []).append(r)
    fans += [g for g in by_group.values() if len(g) > 1]
    taken = {r for g in fans for r in g}
    return [r for r in recv if r not in taken], fans


def holders_of(frag_lists: Iterable[Sequence[Fragment]]) -> tuple[dict[int, Fragment], tuple]:
    """Per rank, its first holder fragment (local copies read from it); and (holder ranks ascending, per rank
    the holder with the smallest local name, the first holder): what the choice of a sender needs."""
    first: dict[int, Fragment] = {}
    best: dict[int, Fragment] = {}
    for frs in frag_lists:
        for h in frs:
            b = best.get(h.rank)
            if b is None:
                first[h.rank] = best[h.rank] = h
            elif h.local < b.local:
                best[h.rank] = h
    return first, (tuple(sorted(best)), best, next(iter(first.values())))


def make_transfer(name, off, size, sf: Fragment, df: Fragment, wdt: torch.dtype, relay: bool = False) -> Transfer:
    """``sf`` is a source fragment, or for a relay the destination fragment of the rank that relays."""
    s_off = sf.local_offsets if off == sf.offsets else sf.local_box(off, size)[0]
    d_off = df.local_offsets if off == df.offsets else df.local_box(off, size)[0]
    return Transfer(name, off, size, sf.rank, sf.local, s_off, df.rank, df.local, d_off, wdt, relay)
