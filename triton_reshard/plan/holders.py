"""The holder rule, one destination box at a time: which source rank sends each piece of a box, and how a piece
fans out over relays (``route_box``; ``local`` routes a rank's share with it, ``rows`` the boxes its array path
leaves over, with its ``make`` emitting rows).

**Holders.** A destination box ``B`` of tensor ``T`` is cut into pieces, each held by the same source ranks
``H`` (``routing.cover_pieces``). The ranks that need a piece over the wire (``R``: the ranks with box ``B`` that
hold no source copy of it, ascending) get their holders by :func:`assign`, a function of ``(H, R, salt,
gpus_per_node)`` only: every holder a quota of ``|R| // |H|`` receivers, ``|R| % |H|`` of them one more
(which ones rotates with a per-piece ``salt``: a CRC of the tensor name plus the piece's position on its
grid, so different pieces load different replicas), receivers taken in rank order; with ``gpus_per_node``,
first the receivers with holders in their own node go to those (round robin, within their quotas), then
the rest to the holders with quota left. A receiver evaluates it for itself, a holder for the receivers of
the pieces it holds: both only need the fragments of ``T`` that overlap ``B`` (both layouts).

**Fan-out (relays).** With relays on, the ranks of ``R`` in one node with no holder in that node (then, among
the others, the ranks of ``R`` in one relay group) form a fan group ``G`` of at least two: the piece is cut
into ``m <= |G|`` parts (``relay.split_piece``), part ``j`` goes over the wire to its head
``G[(j + salt) % |G|]`` and the head relays it to the rest of ``G`` (phase 1). Heads take part in
:func:`assign` like plain receivers, per part box.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Sequence

import torch

from ..layout import Fragment, itemsize_of
from .index import DstGroup
from .relay import split_piece
from .routing import cover_pieces, holders_of, no_holder
from .types import make_transfer

_RANK_LOCAL = lambda f: (f.rank, f.local, f.local_offsets)  # noqa: E731
_FIRST = lambda kv: kv[0]  # noqa: E731


# --------------------------------------------------------------------------------------------------------
# The holder rule
# --------------------------------------------------------------------------------------------------------


def piece_salt(base: int, off: tuple[int, ...], size: tuple[int, ...]) -> int:
    """A per-piece rotation both ends compute: ``base`` (the tensor's index among the destination layout's
    tensors, sorted by name) plus the piece's index on the grid of boxes of its size (consecutive shards of
    one tensor, and consecutive tensors, start their rotation one holder further)."""
    s = base
    for o, n in zip(off, size, strict=True):
        if n:
            s += o // n
    return s


def assign(holders: Sequence[int], receivers: Sequence[int], salt: int, gpus_per_node: int | None = None) -> list[int]:
    """The index into ``holders`` (ascending ranks) of the holder that sends one piece to each of ``receivers``
    (ascending ranks, none of them a holder): a pure function of its arguments, so a receiver and the holders
    compute the same answer.

    Quotas: with ``n`` receivers and ``h`` holders, each holder sends the piece ``n // h`` times, and the
    ``n % h`` holders from ``salt % h`` on (cyclically) once more; so per piece no holder sends more than
    ``ceil(n / h)``, and the extra copies move to other holders from piece to piece (the salt). Without
    ``gpus_per_node``: receiver ``i`` gets holder ``(salt + i) % h``. With it: first every receiver whose node
    holds the piece takes the next holder of its node (round robin from ``salt``) with quota left, then the
    others, in order, the next holder (cyclically from ``salt``) with quota left. (A near holder never takes
    more than its quota: preferring it beyond that would load the same replicas piece after piece, which a
    rule that sees one piece at a time cannot balance.)
    """
    h, n = len(holders), len(receivers)
    s = salt % h
    if h == 1:
        return [0] * n
    if not gpus_per_node:
        return [(s + i) % h for i in range(n)]
    q, rem = divmod(n, h)
    left = [q + ((j - s) % h < rem) for j in range(h)]
    out = [-1] * n
    near: dict[int, list[int]] = {}
    for j, r in enumerate(holders):
        near.setdefault(r // gpus_per_node, []).append(j)
    cursor: dict[int, int] = {}
    for i, r in enumerate(receivers):
        node = r // gpus_per_node
        ns = near.get(node)
        if ns is None:
            continue
        c = cursor.get(node, s)
        for k in range(len(ns)):
            j = ns[(c + k) % len(ns)]
            if left[j]:
                left[j] -= 1
                out[i] = j
                cursor[node] = c + k + 1
                break
    j = s
    for i in range(n):
        if out[i] < 0:
            while not left[j]:
                j = (j + 1) % h
            out[i] = j
            left[j] -= 1
            j = (j + 1) % h
    return out


# --------------------------------------------------------------------------------------------------------
# Routing one destination box
# --------------------------------------------------------------------------------------------------------


def _fan_groups(recv: list[int], holders: Sequence[int], gpn: int | None,
                groups: dict[int, int]) -> tuple[list[int], list[list[int]]]:
    """Split the wire receivers (ranks, ascending) of one piece into plain receivers and fan groups (each >= 2
    ranks, ascending): first per node without a holder, then per relay group among the ranks left."""
    fans: list[list[int]] = []
    rest = recv
    if gpn is not None:
        held = {r // gpn for r in holders}
        by_node: dict[int, list[int]] = {}
        for r in recv:
            node = r // gpn
            if node not in held:
                by_node.setdefault(node, []).append(r)
        taken: set[int] = set()
        for g in by_node.values():
            if len(g) > 1:
                fans.append(g)
                taken.update(g)
        if taken:
            rest = [r for r in recv if r not in taken]
    if groups:
        by_group: dict[int, list[int]] = {}
        for r in rest:
            g = groups.get(r)
            if g is not None:
                by_group.setdefault(g, []).append(r)
        taken = set()
        for g in by_group.values():
            if len(g) > 1:
                fans.append(g)
                taken.update(g)
        if taken:
            rest = [r for r in rest if r not in taken]
    return rest, fans


def route_box(name: str, box: tuple, dgroup: DstGroup, sfrags: list[Fragment], wdt: torch.dtype,
              rdt: torch.dtype | None, gpn: int | None, groups: dict[int, int], local: list, wire: list,
              keep: Callable[[int, int], bool] | None = None, base: int = 0, me: int | None = None,
              make: Callable = make_transfer) -> None:
    """Route destination box ``box`` of tensor ``name``: ``dgroup`` its destination fragments (one per rank),
    ``sfrags`` every nonempty source fragment of the tensor overlapping it. Appends the local copies to
    ``local`` and the wire transfers (relays included) to ``wire``; ``keep(src_rank, dst_rank)``: only those
    (None: all); ``me``: the rank ``keep`` keeps (a rank plan's), for the shortcut that computes only its own
    transfers. The result depends on the sets ``dgroup`` and ``sfrags``, not on their order. ``make(name, off, size,
    source, destination, dtype, relay)`` builds each appended entry (:func:`make_transfer`; ``rows`` emits rows)."""
    d_off, d_size = box
    dranks, frag = dgroup.ranks, dgroup.frag
    sboxes: dict[tuple, list[Fragment]] = {}
    for f in sfrags:
        sboxes.setdefault((f.offsets, f.sizes), []).append(f)
    order = sorted(sboxes)
    sgroups = [sorted(sboxes[b], key=_RANK_LOCAL) for b in order]
    isz = itemsize_of(wdt)
    for p_off, p_size, mask in cover_pieces(d_off, d_size, order):
        if mask == 0:
            raise no_holder(name, p_off, p_size, dranks[0])
        first, (ranks, best, _f) = holders_of([sgroups[i] for i in range(len(order)) if mask >> i & 1])
        few = len(first) * 4 < len(dranks)  # few holders: look them up instead of testing every receiver
        mine_at = [r for r in first if _has(dranks, r)] if few else [r for r in dranks if r in first]
        for r in mine_at:
            if keep is None or keep(r, r):
                local.append(make(name, p_off, p_size, first[r], frag(r), wdt))
        if len(mine_at) == len(dranks):  # no receiver
            continue
        if me is not None and gpn is None and (rdt is None or len(dranks) - len(mine_at) < 2 or not groups):
            # a rank plan without topology or fan-out: only this rank's own receive and sends, by the index
            # arithmetic of ``assign`` ((salt + i) % h) instead of assigning every receiver; the receivers
            # (``dranks`` less ``mine_at``) listed only where this rank sends to some of them
            salt, h = piece_salt(base, p_off, p_size), len(ranks)
            j = bisect_left(ranks, me)
            if j < h and ranks[j] == me:  # a holder (so not a receiver)
                recv = _without(dranks, mine_at) if few else [r for r in dranks if r not in first]
                for d in recv[(j - salt) % h::h]:
                    wire.append(make(name, p_off, p_size, best[me], frag(d), wdt))
            elif _has(dranks, me):  # a receiver: the i-th, i counting the receivers below it
                i = bisect_left(dranks, me) - sum(r < me for r in mine_at)
                wire.append(make(name, p_off, p_size, best[ranks[(salt + i) % h]], frag(me), wdt))
            continue
        recv = (_without(dranks, mine_at) if few else [r for r in dranks if r not in first]) if mine_at else dranks
        units: dict[tuple, list[int]] = {}  # sub-box -> the ranks receiving it from a source holder
        if rdt is not None and len(recv) > 1:
            plain, fans = _fan_groups(recv, ranks, gpn, groups)
            if plain:
                units[(p_off, p_size)] = plain
            salt = piece_salt(base, p_off, p_size)
            n = math.prod(p_size) * isz
            splits: dict[int, list] = {}  # fan size -> the parts of the piece (the same for every fan that big)
            for g in fans:
                k = len(g)
                parts = splits.get(k)
                if parts is None:
                    parts = splits[k] = split_piece(p_off, p_size, n, k)
                mine = me is None or _has(g, me)  # a rank plan: only the relays of its own fan
                for j, (o, s, _pn) in enumerate(parts):
                    head = g[(j + salt) % k]
                    units.setdefault((o, s), []).append(head)
                    if not mine:
                        continue
                    if me is None or head == me:
                        for r in g:
                            if r != head:
                                wire.append(make(name, o, s, frag(head), frag(r), rdt, True))
                    else:
                        wire.append(make(name, o, s, frag(head), frag(me), rdt, True))
        else:
            units[(p_off, p_size)] = recv
        fanned = rdt is not None and len(recv) > 1
        for (o, s), rcv in units.items():
            if fanned:  # plain receivers and heads of parts: in rank order
                rcv.sort()
            if me is not None and gpn is None:  # only this rank's receive and sends (see above)
                usalt, h = piece_salt(base, o, s), len(ranks)
                i = bisect_left(rcv, me)
                if i < len(rcv) and rcv[i] == me:
                    wire.append(make(name, o, s, best[ranks[(usalt + i) % h]], frag(me), wdt))
                j = bisect_left(ranks, me)
                if j < h and ranks[j] == me:
                    for d in rcv[(j - usalt) % h::h]:
                        wire.append(make(name, o, s, best[me], frag(d), wdt))
                continue
            picks = assign(ranks, rcv, piece_salt(base, o, s), gpn)
            if keep is None:
                for d, j in zip(rcv, picks, strict=True):
                    wire.append(make(name, o, s, best[ranks[j]], frag(d), wdt))
                continue
            for d, j in zip(rcv, picks, strict=True):
                if keep(ranks[j], d):
                    wire.append(make(name, o, s, best[ranks[j]], frag(d), wdt))


def _without(sorted_ranks: list[int], some: list[int]) -> list[int]:
    """``sorted_ranks`` less ``some`` (a few of its members, any order), by slicing between them: at a thousand
    receivers per piece a filtering comprehension was half of a rank plan's routing."""
    out: list[int] = []
    i = 0
    for j in sorted(bisect_left(sorted_ranks, r) for r in some):
        out += sorted_ranks[i:j]
        i = j + 1
    out += sorted_ranks[i:]
    return out


def _has(sorted_ranks: list[int], r: int) -> bool:
    i = bisect_left(sorted_ranks, r)
    return i < len(sorted_ranks) and sorted_ranks[i] == r
