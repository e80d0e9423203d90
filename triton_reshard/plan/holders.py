"""The holder rule on ranks: which source rank sends each piece of a destination box, and how a piece fans out
over relays (``route_piece``: one piece, its holders and receivers as ranks; ``rows`` finds the pieces, their
holders and receivers on the columns, and routes every piece with ``gpus_per_node`` or relays through it; the
pieces without either it routes vectorized by the same rule, ``(salt + i) % h``).

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

from collections.abc import Sequence

from .relay import split_piece

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
# Routing one piece
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


def route_piece(off: tuple, size: tuple, nbytes: int, base: int, holders: Sequence[int], dranks: Sequence[int],
                gpn: int | None, groups: dict[int, int], fan: bool):
    """Route one piece ``off`` + ``size`` (``nbytes`` on the wire) of a destination box of the tensor with salt
    base ``base``: ``holders`` the source ranks holding it, ``dranks`` the ranks of the box (both ascending);
    ``fan``: relays on for this tensor. Returns ``(local, sends, relays)``: the ranks of the box that hold
    the piece (a local copy each), ``(offsets, sizes, holder index, receiver)`` per wire send and
    ``(offsets, sizes, head, receiver)`` per relay (the head relays its part of the piece)."""
    held = set(holders)
    local = [r for r in dranks if r in held]
    recv = [r for r in dranks if r not in held] if local else list(dranks)
    relays: list[tuple] = []
    units: dict[tuple, list[int]] = {}  # sub-box -> the ranks receiving it from a source holder
    if fan and len(recv) > 1:
        plain, fans = _fan_groups(recv, holders, gpn, groups)
        if plain:
            units[(off, size)] = plain
        salt = piece_salt(base, off, size)
        splits: dict[int, list] = {}  # fan size -> the parts of the piece (the same for every fan that big)
        for g in fans:
            k = len(g)
            parts = splits.get(k)
            if parts is None:
                parts = splits[k] = split_piece(off, size, nbytes, k)
            for j, (o, s, _n) in enumerate(parts):
                head = g[(j + salt) % k]
                units.setdefault((o, s), []).append(head)
                relays.extend((o, s, head, r) for r in g if r != head)
        for rcv in units.values():  # plain receivers and heads of parts: in rank order
            rcv.sort()
    elif recv:
        units[(off, size)] = recv
    sends = []
    for (o, s), rcv in units.items():
        sends.extend((o, s, j, d) for d, j in zip(rcv, assign(holders, rcv, piece_salt(base, o, s), gpn),
                                                   strict=True))
    return local, sends, relays
