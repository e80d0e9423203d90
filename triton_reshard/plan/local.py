"""Locally computable routing and steps: what every rank can decide for its own sends and receives from the
two layouts alone, identically to its peers (``plan_reshard``'s default ``routing="local"``).

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

import hashlib
import math
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..box import align_up, find_overlap, is_contiguous_box, split_box
from ..layout import Fragment, Layout, gc_paused, itemsize_of
from ..layout_index import ColumnarLayout
from . import quant
from .core import Plan
from .relay import relay_dtype, split_piece
from .routing import (
    LOCAL_ORDER,
    WIRE_ORDER,
    boxes_meet,
    check_dst_overlap,
    cover_pieces,
    holders_of,
    wire_dtype_of,
)
from .types import ALIGN, DIRECT_MIN_BYTES, Chunk, Message, Schedule, Step, Transfer, make_transfer
from .validate import quant_scales, reading_fragment

_RANK_LOCAL = lambda f: (f.rank, f.local, f.local_offsets)  # noqa: E731


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
# Per-tensor queries on a layout: what a rank plan reads (the tensors of one rank, never every rank's)
# --------------------------------------------------------------------------------------------------------


class _TensorIndex:
    """The nonempty fragments of one tensor of one layout, grouped by box; built once per tensor and layout,
    lazily: from ``fragments_by_tensor`` on an eager layout, from the per-tensor table (``Layout.table``:
    numpy columns, an interval index) on a columnar one, which then never builds other tensors' fragments."""

    __slots__ = ("_boxes", "by_box", "_table", "_frags", "_groups", "_cols")

    def __init__(self, layout: Layout, name: str, whole: bool = False) -> None:
        self._table = None
        self._boxes: list[tuple] | None = None
        self.by_box: dict[tuple, list[Fragment]] = {}
        self._groups: dict[tuple, _Group] = {}
        self._cols = None
        if _is_columnar(layout):
            if not whole:
                self._table = layout.table(name)
                self._frags: dict[int, Fragment] = {}
                return
            frags = layout.table(name).fragments  # the whole plan reads every fragment: built in one go
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
        tb = self._table
        rows = tb.overlapping(*box)
        if len(rows):
            off, size = np.asarray(box[0], np.int64), np.asarray(box[1], np.int64)
            rows = rows[(tb.offsets[rows] == off).all(axis=1) & (tb.sizes[rows] == size).all(axis=1)]
        return rows

    def group(self, name: str, box: tuple) -> _Group:
        """The fragments whose box is exactly ``box``, as a :class:`_Group`."""
        g = self._groups.get(box)
        if g is None:
            if self._table is not None:
                rows = self._exact_rows(box)
                rk = self._table.ranks[rows]
                rows = rows[np.argsort(rk, kind="stable")].tolist()
                ranks = sorted(rk.tolist())
                if len(set(ranks)) < len(ranks):
                    _Group.of(name, [self._fragment(i) for i in rows])  # raises: one box twice on a rank

                def frag(r: int, rows=rows, ranks=ranks) -> Fragment:
                    return self._fragment(rows[bisect_left(ranks, r)])

                g = _Group(ranks, frag)
            else:
                g = _Group.of(name, self.by_box[box])
            self._groups[box] = g
        return g

    def overlapping(self, off, size) -> list:
        """The fragments sharing an element with the box (on a columnar layout light stand-ins, ``_Ref``,
        with a fragment's fields: the planner builds the real one only for the transfers it keeps)."""
        if self._table is not None:
            cols = self._cols
            if cols is None:
                tb = self._table
                cols = self._cols = (tb.ranks.tolist(), [tuple(o) for o in tb.offsets.tolist()],
                                     [tuple(z) for z in tb.sizes.tolist()],
                                     [tb.local_names[k] for k in tb.local_ids.tolist()], tb.local_offsets)
            rk, of, sz, lc, lo = cols
            name = self._table.spec.name
            return [_Ref(name, rk[i], of[i], sz[i], lc[i], lo[i], self, i)
                    for i in self._table.overlapping(off, size).tolist()]
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


class _Ref:
    """A fragment's fields (row ``row`` of a tensor's table), for routing; ``local_box`` builds the fragment."""

    __slots__ = ("tensor", "rank", "offsets", "sizes", "local", "local_offsets", "_ix", "_row")

    def __init__(self, tensor, rank, offsets, sizes, local, local_offsets, ix, row) -> None:
        self.tensor, self.rank, self.offsets, self.sizes = tensor, rank, offsets, sizes
        self.local, self.local_offsets, self._ix, self._row = local, local_offsets, ix, row

    def local_box(self, off, size):
        return self._ix._fragment(self._row).local_box(off, size)


def _check_own_overlaps(layout: Layout, name: str, frags: Sequence[Fragment] | None = None) -> None:
    """Destination boxes of tensor ``name`` overlapping on one rank raise (``routing.check_dst_overlap``):
    ``frags`` (one rank's), or every rank's (read from the table's ranks first: nothing is built unless a
    rank holds two boxes)."""
    if frags is None:
        ix = _index(layout, name)
        if ix._table is not None:
            tb = ix._table
            ranks = tb.ranks[(tb.sizes > 0).all(axis=1)]
            if len(np.unique(ranks)) == len(ranks):
                return
            frags = [f for f in tb.fragments if 0 not in f.sizes]
        else:
            frags = [f for b in ix.boxes for f in ix.by_box[b]]
    if len({f.rank for f in frags}) < len(frags):
        check_dst_overlap(name, frags)


def _is_columnar(layout: Layout) -> bool:
    return isinstance(layout, ColumnarLayout)


def _index(layout: Layout, name: str, whole: bool = False) -> _TensorIndex:
    """The tensor's index (cached on the layout); ``whole``: for planning every rank (all its fragments built
    at once) rather than one rank's share (a columnar layout's table, rows built on demand)."""
    key = "_local_index_all" if whole and _is_columnar(layout) else "_local_index"
    cache = layout.__dict__.get(key)
    if cache is None:
        cache = {}
        object.__setattr__(layout, key, cache)
    ix = cache.get(name)
    if ix is None:
        ix = cache[name] = _TensorIndex(layout, name, whole)
    return ix


def rank_fragments(layout: Layout, rank: int) -> list[Fragment]:
    """The nonempty fragments ``rank`` holds, in layout order."""
    on_rank = getattr(layout, "fragments_on_rank", None)
    if on_rank is not None:
        return [f for f in on_rank(rank) if 0 not in f.sizes]
    by_rank = layout.__dict__.get("_local_by_rank")
    if by_rank is None:
        by_rank = defaultdict(list)
        for f in layout.fragments:
            if 0 not in f.sizes:
                by_rank[f.rank].append(f)
        object.__setattr__(layout, "_local_by_rank", by_rank)
    return by_rank.get(rank, [])


# --------------------------------------------------------------------------------------------------------
# Routing one destination box
# --------------------------------------------------------------------------------------------------------


class _Group:
    """The destination fragments of one box of one tensor: their ranks (ascending; one fragment per rank) and
    each rank's fragment on demand (a rank plan builds only the few it writes into or relays from)."""

    __slots__ = ("ranks", "_frag")

    def __init__(self, ranks: list[int], frag: Callable[[int], Fragment]) -> None:
        self.ranks, self._frag = ranks, frag

    def frag(self, rank: int) -> Fragment:
        return self._frag(rank)

    @classmethod
    def of(cls, name: str, frags: Sequence[Fragment]) -> _Group:
        by_rank = {f.rank: f for f in frags}
        if len(by_rank) < len(frags):
            check_dst_overlap(name, frags)  # raises: one box twice on one rank
        return cls(sorted(by_rank), by_rank.__getitem__)


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


def route_box(name: str, box: tuple, dgroup: _Group, sfrags: list[Fragment], wdt: torch.dtype,
              rdt: torch.dtype | None, gpn: int | None, groups: dict[int, int], local: list, wire: list,
              keep: Callable[[int, int], bool] | None = None, base: int = 0, me: int | None = None) -> None:
    """Route destination box ``box`` of tensor ``name``: ``dgroup`` its destination fragments (one per rank),
    ``sfrags`` every nonempty source fragment of the tensor overlapping it. Appends the local copies to
    ``local`` and the wire transfers (relays included) to ``wire``; ``keep(src_rank, dst_rank)``: only those
    (None: all); ``me``: the rank ``keep`` keeps (a rank plan's), for the shortcut that computes only its own
    transfers. The result depends on the sets ``dgroup`` and ``sfrags``, not on their order."""
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
            raise ValueError(
                f"tensor {name!r}: element {p_off} (box {p_off}+{p_size}) needed on destination rank "
                f"{dranks[0]} is held by no source rank"
            )
        first, (ranks, best, _f) = holders_of([sgroups[i] for i in range(len(order)) if mask >> i & 1])
        if len(first) * 4 < len(dranks):  # few holders: look them up instead of testing every receiver
            mine_at = [r for r in first if _has(dranks, r)]
            held = set(mine_at)
            recv = [r for r in dranks if r not in held] if held else dranks
        else:
            mine_at = [r for r in dranks if r in first]
            recv = [r for r in dranks if r not in first] if mine_at else dranks
        for r in mine_at:
            if keep is None or keep(r, r):
                local.append(make_transfer(name, p_off, p_size, first[r], frag(r), wdt))
        if not recv:
            continue
        if me is not None and gpn is None and (rdt is None or len(recv) < 2 or not groups):
            # a rank plan without topology or fan-out: only this rank's own receive and sends, by the index
            # arithmetic of ``assign`` ((salt + i) % h) instead of assigning every receiver
            salt, h = piece_salt(base, p_off, p_size), len(ranks)
            i = bisect_left(recv, me)
            if i < len(recv) and recv[i] == me:
                r = ranks[(salt + i) % h]
                wire.append(make_transfer(name, p_off, p_size, best[r], frag(me), wdt))
            j = bisect_left(ranks, me)
            if j < h and ranks[j] == me:
                for d in recv[(j - salt) % h::h]:
                    wire.append(make_transfer(name, p_off, p_size, best[me], frag(d), wdt))
            continue
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
                                wire.append(make_transfer(name, o, s, frag(head), frag(r), rdt, True))
                    else:
                        wire.append(make_transfer(name, o, s, frag(head), frag(me), rdt, True))
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
                    wire.append(make_transfer(name, o, s, best[ranks[(usalt + i) % h]], frag(me), wdt))
                j = bisect_left(ranks, me)
                if j < h and ranks[j] == me:
                    for d in rcv[(j - usalt) % h::h]:
                        wire.append(make_transfer(name, o, s, best[me], frag(d), wdt))
                continue
            picks = assign(ranks, rcv, piece_salt(base, o, s), gpn)
            if keep is None:
                for d, j in zip(rcv, picks, strict=True):
                    wire.append(make_transfer(name, o, s, best[ranks[j]], frag(d), wdt))
                continue
            for d, j in zip(rcv, picks, strict=True):
                if keep(ranks[j], d):
                    wire.append(make_transfer(name, o, s, best[ranks[j]], frag(d), wdt))


def _has(sorted_ranks: list[int], r: int) -> bool:
    i = bisect_left(sorted_ranks, r)
    return i < len(sorted_ranks) and sorted_ranks[i] == r


def _tensor_order(layout: Layout) -> dict[str, int]:
    """Tensor name -> its index in the layout's (sorted) tensors: the base of every piece's salt."""
    got = layout.__dict__.get("_local_order")
    if got is None:
        lt = getattr(layout, "_lt", None)  # a columnar layout: its sorted names, without building the specs
        got = lt.index if lt is not None else {t.name: i for i, t in enumerate(layout.tensors)}
        object.__setattr__(layout, "_local_order", got)
    return got


def _options(src: Layout, dst: Layout, name: str, relay: bool):
    spec, sspec = dst.specs[name], src.specs[name]
    wdt = wire_dtype_of(sspec, spec)
    return wdt, (relay_dtype(sspec.dtype, spec.dtype, wdt) if relay else None), _tensor_order(dst)[name]


def route_all(src: Layout, dst: Layout, gpn: int | None, relay: bool, groups: dict[int, int]):
    """Every rank's transfers: ``route_box`` over every destination box of every tensor."""
    local: list[Transfer] = []
    wire: list[Transfer] = []
    for spec in dst.tensors:
        dix = _index(dst, spec.name, True)
        if not dix.boxes:
            continue
        _check_own_overlaps(dst, spec.name, [f for b in dix.boxes for f in dix.by_box[b]])
        wdt, rdt, base = _options(src, dst, spec.name, relay)
        six = _index(src, spec.name, True)
        for box in dix.boxes:
            route_box(spec.name, box, dix.group(spec.name, box), six.overlapping(*box), wdt, rdt, gpn, groups, local, wire,
                      base=base)
    return local, wire


def route_rank(src: Layout, dst: Layout, rank: int, gpn: int | None, relay: bool, groups: dict[int, int],
               whole: Container[str] = ()):
    """Rank ``rank``'s transfers only (its sends, receives, relays and local copies), from the boxes of its
    own tensors: the destination boxes it holds and those overlapping the source boxes it holds. Tensors in
    ``whole`` get every transfer of those boxes (the block-quantization post-pass cuts a destination
    fragment's transfers by the regions all of them make)."""
    todo: dict[tuple, None] = {}
    mine: dict[str, list[Fragment]] = {}
    for df in rank_fragments(dst, rank):
        todo[(df.tensor, (df.offsets, df.sizes))] = None
        mine.setdefault(df.tensor, []).append(df)
    for name, frs in mine.items():
        if len(frs) > 1:
            _check_own_overlaps(dst, name, frs)
    for sf in rank_fragments(src, rank):
        if sf.tensor in dst.specs:
            for box in _index(dst, sf.tensor).boxes_overlapping(sf.offsets, sf.sizes):
                todo[(sf.tensor, box)] = None
    local: list[Transfer] = []
    wire: list[Transfer] = []

    def keep(s: int, d: int) -> bool:
        return s == rank or d == rank

    opts: dict[str, tuple] = {}
    for name, box in todo:
        o = opts.get(name)
        if o is None:
            o = opts[name] = _options(src, dst, name, relay)
        route_box(name, box, _index(dst, name).group(name, box), _index(src, name).overlapping(*box), o[0], o[1], gpn,
                  groups, local, wire, None if name in whole else keep, o[2], None if name in whole else rank)
    return local, wire


# --------------------------------------------------------------------------------------------------------
# Steps
# --------------------------------------------------------------------------------------------------------


def _chunks(t: Transfer, cap: int) -> list[tuple[tuple, tuple, int]]:
    """A transfer cut for the schedule: ``[(offsets relative to it, sizes, bytes)]``, each at most ``cap`` once
    aligned (a source-quantized transfer only at block multiples, ``quant.split_src_chunks``)."""
    if getattr(t, "quant", "") == "src":
        return quant.split_src_chunks(t, cap)
    isz = itemsize_of(t.wire_dtype)
    out = []
    for o, sz in split_box(t.sizes, isz, cap):
        n = math.prod(sz) * isz
        if n:
            out.append((o, sz, n))
    return out


@dataclass(frozen=True, slots=True)
class NumberedStep(Step):
    """A step of the pair rule with its number: ``(phase, number)`` orders the steps, and both ends of every
    message (in the whole plan and in the rank plans) have it in the step of the same number."""

    number: int = -1


def pair_loads(transfers: Sequence[tuple[int, Transfer]], cap: int,
               direct: Callable[[int, tuple, tuple], bool]) -> list[list[Message]]:
    """One pair's stream cut into step loads: ``transfers`` ((index, transfer), in key order) cut into chunks
    of at most ``cap`` bytes, taken in order into loads of at most ``cap`` aligned bytes; a load is one packed
    message (its chunks at aligned offsets) followed by one message per chunk ``direct(index, offsets,
    sizes)`` calls direct. Both ends of the pair build the same list."""
    out: list[list[Message]] = []
    cs: list[Chunk] = []
    singles: list[Message] = []
    off = used = 0
    s = d = None

    def close() -> None:
        nonlocal cs, singles, off, used
        load = [Message(s, d, off, tuple(cs))] if cs else []
        out.append(load + singles)
        cs, singles, off, used = [], [], 0, 0

    for i, t in transfers:
        s, d = t.src_rank, t.dst_rank
        for o, sz, n in _chunks(t, cap):
            a = align_up(n)
            if used + a > cap and used:
                close()
            if direct(i, o, sz):
                singles.append(Message(s, d, a, (Chunk(i, o, sz, n, 0),), direct=True))
            else:
                cs.append(Chunk(i, o, sz, n, off))
                off += a
            used += a
    if used:
        close()
    return out


# peers a rank sends to (and receives from) per step, each load within a 1/STEP_PEERS share of half a bucket: all
# peers at once up to 129 ranks (DeepSeek-V3 128 -> 128, 1 GiB bucket, H100 model: 0.54 s predicted vs 0.51 s for
# the greedy's first fit; 16 peers: 2.1 s, 64: 0.79 s); beyond, windows of 128 offsets
STEP_PEERS = 128
STEP_GROUPING = "strided"


def build_pair_schedule(transfers: Sequence[Transfer], bucket_bytes: int, contiguity: Sequence[tuple] | None,
                        direct_min_bytes: int, world: int) -> Schedule:
    """The steps of ``transfers`` by the pair rule (see the module doc): only the non-empty steps, each with
    its number (``Step.number``), in (phase, number) order."""
    if bucket_bytes < 16 * ALIGN:
        raise ValueError(f"bucket_bytes={bucket_bytes} is too small (at least {16 * ALIGN})")
    if direct_min_bytes < 0:
        raise ValueError(f"direct_min_bytes={direct_min_bytes} must be >= 0")
    peers = max(1, min(STEP_PEERS, world - 1))  # offsets 1 .. world-1 (a wire transfer never stays on its rank)
    windows = -(-(world - 1) // peers) if world > 1 else 1
    cap = max(ALIGN, bucket_bytes // 2 // peers // ALIGN * ALIGN)
    with gc_paused():
        pairs: dict[tuple[int, int, int], list[tuple[int, Transfer]]] = defaultdict(list)
        for i, t in enumerate(transfers):
            pairs[(1 if t.relay else 0, t.src_rank, t.dst_rank)].append((i, t))

        def direct(i: int, off, size) -> bool:
            if contiguity is None:
                return False
            shapes = contiguity[i]
            if shapes is None:
                return False
            t = transfers[i]
            if math.prod(size) * itemsize_of(t.wire_dtype) < direct_min_bytes:
                return False
            if isinstance(shapes, _Contiguity):
                return shapes.direct(t, off, size)
            s_shape, d_shape = shapes
            return (s_shape is not None and is_contiguous_box(s_shape, t.src_offsets, off, size)) or (
                d_shape is not None and is_contiguous_box(d_shape, t.dst_offsets, off, size))

        steps: dict[tuple[int, int], list[Message]] = defaultdict(list)
        for (phase, s, d), ts in pairs.items():
            ts.sort(key=lambda it: it[1].key())
            k = (d - s) % world - 1
            w = k % windows if STEP_GROUPING == "strided" else k // peers
            for m, load in enumerate(pair_loads(ts, cap, direct)):
                steps[(phase, m * windows + w)].extend(load)
        out = []
        for (phase, number) in sorted(steps):
            msgs = sorted(steps[(phase, number)], key=lambda m: (m.src, m.dst, m.direct))  # stable
            out.append(NumberedStep(tuple(msgs), phase, number))
        return Schedule(bucket_bytes, tuple(out))


def contiguity(transfers: Sequence[Transfer], src: Layout, dst: Layout, min_bytes: int,
               rank: int | None = None) -> Sequence:
    """Per transfer, where its bytes could move in place (``Plan._contiguity``'s answer), looked up lazily from
    per-rank local specs: a rank plan (``rank``) tests its own side first and reads a peer's local tensor only
    when its own side is not contiguous (the answer, "contiguous on either side", is the same on both ends)."""
    return _Contiguity(transfers, src, dst, min_bytes, rank)


class _Contiguity:
    __slots__ = ("_ts", "_src", "_dst", "_min", "_rank", "_cache")

    def __init__(self, transfers, src, dst, min_bytes, rank) -> None:
        self._ts, self._src, self._dst, self._min, self._rank = transfers, src, dst, min_bytes, rank
        self._cache: dict[tuple[int, int], object] = {}

    def _shape(self, k: int, rank: int, local: str, wdt) -> tuple | None:
        got = self._cache.get((k, rank))
        if got is None:
            layout = self._dst if k else self._src
            one = getattr(layout, "local_spec", None)
            got = self._cache[(k, rank)] = _OneSpec(one, rank) if one is not None else layout.local_specs(rank)
        spec = got.get(local)
        return spec.shape if spec is not None and spec.dtype == wdt else None

    def __len__(self) -> int:
        return len(self._ts)

    def __getitem__(self, i: int):
        t = self._ts[i]  # a source-quantized transfer is quantized by the pack: never direct
        return None if t.nbytes < self._min or getattr(t, "quant", "") == "src" else self

    def direct(self, t: Transfer, off, size) -> bool:
        """Whether sub-box ``off``+``size`` of ``t`` is contiguous in its source or its destination local tensor
        (in the wire dtype), this rank's side tested first."""
        sides = [(1 if t.relay else 0, t.src_rank, t.src_local, t.src_offsets),
                 (1, t.dst_rank, t.dst_local, t.dst_offsets)]
        if self._rank is not None and t.dst_rank == self._rank:
            sides.reverse()
        for k, r, local, start in sides:
            shape = self._shape(k, r, local, t.wire_dtype)
            if shape is not None and is_contiguous_box(shape, start, off, size):
                return True
        return False


class _OneSpec:
    """``local_specs(rank)``'s ``get`` through a layout's ``local_spec(rank, name)`` (one local tensor at a time)."""

    __slots__ = ("_one", "_rank")

    def __init__(self, one, rank: int) -> None:
        self._one, self._rank = one, rank

    def get(self, name: str):
        return self._one(self._rank, name)


def world_of(src: Layout, dst: Layout) -> int:
    """``W`` of the step rule: one more than the largest rank of either layout."""
    return max(src.ranks + dst.ranks, default=0) + 1


# --------------------------------------------------------------------------------------------------------
# Rank plans
# --------------------------------------------------------------------------------------------------------

RULE_VERSION = "local-1"  # in the rank plans' digest: ranks running different rules must not agree


def _fingerprint(layout: Layout) -> str:
    fp = getattr(layout, "fingerprint", None)
    return fp if isinstance(fp, str) else layout.digest


def identity_digest(src: Layout, dst: Layout, options: tuple) -> str:
    """What every rank of a rank-planned reshard computes alike: the two layouts, the planner options and the
    rule version (the plan is a pure function of them)."""
    h = hashlib.sha256()
    h.update(_fingerprint(src).encode())
    h.update(_fingerprint(dst).encode())
    h.update(repr((RULE_VERSION,) + options).encode())
    return h.hexdigest()[:16]


@dataclass(frozen=True, eq=False, repr=False)
class RankPlan:
    """Rank ``rank``'s share of a plan (``plan_reshard(..., rank=r)``): its wire transfers (sends, receives and
    relays, in the whole plan's order) and its local copies, decided by the local rules, so that the rank
    plans of all ranks are exactly the whole plan (``plan_reshard`` without ``rank``) cut by rank.

    Validated on construction, cheaply: every transfer has this rank at one end; what it sends lies inside its
    own source fragments (relays: its destination fragments); what it receives lies inside its own
    destination fragments and covers each of them exactly once. ``schedule`` gives this rank's steps, numbered
    as in the whole plan's schedule. ``digest``: the same on every rank of one reshard (see
    ``identity_digest``), what the executor's handshake compares."""

    src: Layout
    dst: Layout
    rank: int
    transfers: tuple[Transfer, ...]
    local_copies: tuple[Transfer, ...]
    options: tuple = ()
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _validate_rank_plan(self)

    @property
    def digest(self) -> str:
        if "digest" not in self._cache:
            self._cache["digest"] = identity_digest(self.src, self.dst, self.options)
        return self._cache["digest"]

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.src.ranks) | set(self.dst.ranks)))

    @property
    def sent_bytes(self) -> int:
        return sum(t.nbytes for t in self.transfers if t.src_rank == self.rank)

    @property
    def recv_bytes(self) -> int:
        return sum(t.nbytes for t in self.transfers if t.dst_rank == self.rank)

    def schedule(self, bucket_bytes: int, direct_min_bytes: int = DIRECT_MIN_BYTES) -> Schedule:
        """This rank's steps (only those it takes part in), by the pair rule: the same messages, at the same
        step numbers, as the whole plan's ``schedule`` gives its pairs (cached)."""
        key = ("schedule", int(bucket_bytes), int(direct_min_bytes))
        if key not in self._cache:
            with gc_paused():
                self._cache[key] = build_pair_schedule(
                    self.transfers, int(bucket_bytes),
                    contiguity(self.transfers, self.src, self.dst, int(direct_min_bytes), self.rank),
                    int(direct_min_bytes),
                    world_of(self.src, self.dst))
        return self._cache[key]

    def __repr__(self) -> str:
        return (f"RankPlan(rank={self.rank}, digest={self.digest}, {len(self.transfers)} wire transfers "
                f"(sends {self.sent_bytes} B, receives {self.recv_bytes} B), {len(self.local_copies)} local copies)")

    describe = Plan.describe  # the same listing: it reads only repr, transfers and local_copies
    __str__ = describe


def _validate_rank_plan(p: RankPlan) -> None:
    """The cheap self-check of a rank plan: see ``RankPlan``. (Whether a relay this rank receives reads a box
    its sender got from a non-relay is the sender's check; the whole plan checks everything at once.)"""
    r = p.rank
    mine_s: dict[tuple[str, str], list[Fragment]] = defaultdict(list)
    mine_d: dict[tuple[str, str], list[Fragment]] = defaultdict(list)
    for f in rank_fragments(p.src, r):
        mine_s[(f.tensor, f.local)].append(f)
    dfrags = rank_fragments(p.dst, r)
    for f in dfrags:
        mine_d[(f.tensor, f.local)].append(f)
    written: dict[int, list[Transfer]] = {}
    with gc_paused():
        for t in p.transfers + p.local_copies:
            local = t.src_rank == t.dst_rank
            if t.src_rank != r and t.dst_rank != r:
                raise ValueError(f"rank plan of rank {r}: transfer {t} does not involve rank {r}")
            if local and t not in p.local_copies:
                raise ValueError(f"rank plan of rank {r}: wire transfer {t} stays on one rank")
            if t.src_rank == r:
                frs = (mine_d if t.relay else mine_s).get((t.tensor, t.src_local), ())
                if reading_fragment(frs, t.offsets, t.sizes, t.src_offsets) is None:
                    side = "destination" if t.relay else "source"
                    raise ValueError(f"rank plan of rank {r}: transfer {t} reads a box outside rank {r}'s {side} "
                                     f"fragments of tensor {t.tensor!r}")
            if t.dst_rank == r:
                df = reading_fragment(mine_d.get((t.tensor, t.dst_local), ()), t.offsets, t.sizes, t.dst_offsets)
                if df is None:
                    raise ValueError(f"rank plan of rank {r}: transfer {t} writes outside rank {r}'s destination "
                                     f"fragments of tensor {t.tensor!r}")
                if 0 not in t.sizes:
                    written.setdefault(id(df), []).append(t)
        for t in p.local_copies:
            if t.src_rank != r or t.dst_rank != r:
                raise ValueError(f"rank plan of rank {r}: local copy {t} is not on rank {r}")
        scales = quant_scales(p)  # block-quantized destinations: their scales are checked by validate_quant
        for f in dfrags:
            ts = written.get(id(f))
            if ts is None:
                exact = f.tensor in scales
            elif len(ts) == 1:
                exact = ts[0].sizes == f.sizes
            else:
                exact = (sum(t.numel for t in ts) == f.numel
                         and find_overlap([(t.offsets, t.sizes, t) for t in ts]) is None)
            if not exact:
                raise ValueError(f"rank plan of rank {r}: destination fragment {f} (tensor {f.tensor!r}) is not "
                                 f"covered exactly once by its receives and local copies")
    if scales:
        quant.validate_quant(p, ranks=(r,))


# --------------------------------------------------------------------------------------------------------
# Entry points (``plan_reshard(..., routing="local")``)
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False, repr=False)
class LocalPlan(Plan):
    """A whole plan by the local rules (``plan_reshard``'s default): a :class:`Plan` (validated the same way)
    whose ``schedule`` follows the pair rule, so its rank ``r`` part is exactly ``plan_reshard(..., rank=r)``."""

    def schedule(self, bucket_bytes: int, direct_min_bytes: int = DIRECT_MIN_BYTES) -> Schedule:
        """The wire transfers in steps by the pair rule (see ``plan/local.py``; cached): per step each rank
        sends at most one message and receives at most one, each within ``bucket_bytes // 2``. Steps carry
        their rule number (``Step.number``); the rank plans' steps have the same numbers."""
        key = ("schedule", int(bucket_bytes), int(direct_min_bytes))
        if key not in self._cache:
            with gc_paused():
                self._cache[key] = build_pair_schedule(
                    self.transfers, int(bucket_bytes), self._contiguity(int(direct_min_bytes)),
                    int(direct_min_bytes), world_of(self.src, self.dst))
        return self._cache[key]


def plan_local(src: Layout, dst: Layout, routed: Layout, targets: dict, gpus_per_node: int | None, relay: bool,
               groups: dict[int, int], options: tuple, rank: int | None):
    """The whole plan (``rank=None``: a :class:`LocalPlan`) or rank ``rank``'s :class:`RankPlan`, routed by the
    local rules on ``routed`` (``dst`` as routing sees it: see ``quant.routing_view``), then block-quantized
    (``targets``) transfer by transfer."""
    with gc_paused():
        if rank is None:
            local, wire = route_all(src, routed, gpus_per_node, relay, groups)
        else:
            local, wire = route_rank(src, routed, rank, gpus_per_node, relay, groups, targets)
        if targets:
            mine = targets if rank is None else {n: s for n, s in targets.items()
                                                 if any(t.tensor == n for t in local + wire)}
            local, wire = quant.quantize_transfers(src, dst, mine, local, wire)
            if rank is not None:
                local = [t for t in local if t.dst_rank == rank]
                wire = [t for t in wire if t.src_rank == rank or t.dst_rank == rank]
        wire.sort(key=WIRE_ORDER)
        local.sort(key=LOCAL_ORDER)
        if rank is None:
            return LocalPlan(src, dst, tuple(wire), tuple(local))
        return RankPlan(src, dst, rank, tuple(wire), tuple(local), options)
