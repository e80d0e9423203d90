"""The schedule of the local rules: transfers cut into chunks and packed into steps pair by pair
(``build_pair_schedule``); which chunks may travel in place is ``contiguity``'s answer.

The step rule is coded once, on the columns (:func:`_cut`): each row of a pair (in ``Transfer.key`` order) is cut
into chunks of at most ``cap`` aligned bytes (one chunk when it fits, else ``split_box``'s, by ``_split_runs``; a
source-quantized row only at block multiples, ``quant.split_src_chunks``); a chunk is direct when it has
``direct_min_bytes`` or more and is contiguous in a local tensor (``direct_columns``; never for a
source-quantized row); then the next fit: a load takes the pair's chunks in order while their aligned bytes stay
within ``cap``, and is one packed message (its packed chunks at aligned offsets) followed by one message per direct
chunk. The whole plan's loads are cut for their payloads alone; a pair's messages are built from the same cut when
a step or ``for_rank`` reads them. (``tests/oracles/pair_loads.py`` keeps the rule over the objects.)"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..box import align_up, split_rows
from ..layout import Layout, gc_paused
from ..layout.fragment_table import distinct
from . import quant
from .contiguity import Contiguity
from .table import I64, TransferTable
from .types import ALIGN, MIN_STEP_BYTES, Chunk, Message, RankStep, Schedule, Step, StepPairBytes, Transfer

# --------------------------------------------------------------------------------------------------------
# Steps
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NumberedStep(Step):
    """A step of the pair rule with its number: ``(phase, number)`` orders the steps, and both ends of every
    message (in the whole plan and in the rank plans) have it in the step of the same number."""

    number: int = -1


# peers a rank sends to (and receives from) per step, each load within a 1/STEP_PEERS share of half a bucket: all
# peers at once up to 129 ranks (DeepSeek-V3 128 -> 128, 1 GiB bucket, H100 model: 0.54 s predicted vs 0.51 s for
# the greedy's first fit; 16 peers: 2.1 s, 64: 0.79 s); beyond, windows of 128 offsets
STEP_PEERS = 128
STEP_GROUPING = "strided"
_DIRECT_BLOCK = 1 << 18  # chunks whose contiguity is tested at once


@lru_cache(maxsize=1 << 14)  # tensors of one model share a few shapes
def _split_runs(sizes: tuple[int, ...], isz: int, cap: int) -> tuple[int, tuple[tuple[tuple, tuple, int, int], ...]]:
    """``split_box(sizes, isz, cap)`` (a box bigger than ``cap``) as runs: ``(repeats, [(offsets of its first
    chunk, chunk sizes, chunk bytes, count)])``: the chunk list is the runs' chunks in order, ``repeats`` times
    (once per index of the dims split into single indices; only the first repeat's offsets are given)."""
    nd = len(sizes)
    d, rows = split_rows(sizes, isz, cap)
    tail = tuple(sizes[d + 1:])
    inner = math.prod(tail) * isz
    q, rem = divmod(sizes[d], rows)
    lead, zeros = (1,) * d, (0,) * (nd - d - 1)
    runs = []
    if q:
        runs.append(((0,) * (d + 1) + zeros, lead + (rows,) + tail, rows * inner, q))
    if rem:
        runs.append(((0,) * d + (q * rows,) + zeros, lead + (rem,) + tail, rem * inner, 1))
    return math.prod(sizes[:d]), tuple(runs)


@lru_cache(maxsize=1 << 12)
def _split_template(sizes: tuple[int, ...], isz: int, cap: int, width: int, offsets: bool):
    """The chunks ``split_box(sizes, isz, cap)`` cuts a box bigger than ``cap`` into, as read-only arrays, from
    :func:`_split_runs`: ``(bytes [k], sizes [k, width] padded with 1, offsets [k, width] padded with 0)``
    (offsets None unless asked)."""
    reps, runs = _split_runs(sizes, isz, cap)
    nd = len(sizes)
    ns = np.tile(np.array([n for _o, _sz, n, c in runs for _ in range(c)], I64), reps)
    one = [tuple(sz) + (1,) * (width - nd) for _o, sz, _n, c in runs for _ in range(c)]
    szs = np.tile(np.array(one, I64).reshape(len(one), width), (reps, 1))
    off = None
    if offsets:  # the dims before d single indices (one repeat each, in C order), dim d the runs' starts
        d, _rows = split_rows(sizes, isz, cap)
        starts = np.array([o[d] + j * sz[d] for o, sz, _n, c in runs for j in range(c)], I64)
        off = np.zeros((reps, len(starts), width), I64)
        if d:
            off[:, :, :d] = np.stack(np.unravel_index(np.arange(reps), sizes[:d]), 1)[:, None, :]
        off[:, :, d] = starts[None, :]
        off = off.reshape(len(ns), width)
        off.setflags(write=False)
    ns.setflags(write=False)
    szs.setflags(write=False)
    return ns, szs, off


class _Chunks:
    """The chunks of ``rows`` (rows of a table, a pair's rows consecutive and in ``Transfer.key`` order), row by
    row: ``row`` (per chunk its index into ``rows``), ``nbytes``; ``tmpl`` (per chunk its index into the flat
    templates ``t_sizes`` / ``t_offsets``, -1 for a row that is one chunk); ``src_q`` per row."""

    __slots__ = ("table", "rows", "row", "nbytes", "tmpl", "t_sizes", "t_offsets", "src_q")

    def __init__(self, table: TransferTable, rows: np.ndarray, cap: int, offsets: bool) -> None:
        self.table = table
        D = table.sizes.shape[1]
        nb = table.nbytes[rows]
        src_q = table.quant[rows] == QUANT_CODES_SRC
        one = ((align_up(nb) <= cap) | (table.ndim[rows] == 0)) & (nb > 0) & ~src_q
        big = np.flatnonzero((nb > 0) & ~one & ~src_q)
        row_t = np.full(len(rows), -1, I64)
        t_n: list[np.ndarray] = []
        t_sz: list[np.ndarray] = []
        t_off: list[np.ndarray] = []
        if len(big):  # a big row's chunks: one template per (sizes, itemsize)
            isz = table.itemsizes[table.wdt[rows[big]]]
            keyrows = np.concatenate([table.sizes[rows[big]], table.ndim[rows[big]][:, None].astype(I64),
                                      isz[:, None]], 1)
            uniq, row_t[big] = _unique_rows(keyrows)
            for u in uniq.tolist():
                n, sz, off = _split_template(tuple(u[:u[D]]), u[D + 1], cap, D, offsets)
                t_n.append(n)
                t_sz.append(sz)
                t_off.append(off)
        qrows = np.flatnonzero(src_q)
        for k, t in zip(qrows.tolist(), table.objects_at(rows[qrows]), strict=True):  # only at block multiples
            got = quant.split_src_chunks(t, cap)
            pad = D - len(t.sizes)
            row_t[k] = len(t_n)
            t_n.append(np.array([n for _o, _sz, n in got], I64))
            t_sz.append(np.array([sz + (1,) * pad for _o, sz, _n in got], I64).reshape(len(got), D))
            t_off.append(np.array([o + (0,) * pad for o, _sz, _n in got], I64).reshape(len(got), D))
        counts = one.astype(I64)
        has_t = row_t >= 0
        tlen = np.array([len(n) for n in t_n], I64)
        counts[has_t] = tlen[row_t[has_t]]
        self.rows, self.src_q = rows, src_q
        self.row = ci = np.repeat(np.arange(len(rows), dtype=I64), counts)
        self.nbytes = nb[ci]
        self.tmpl = None
        if t_n:
            is_t = has_t[ci]
            within = np.arange(len(ci), dtype=I64) - (np.cumsum(counts) - counts)[ci]
            tmpl = np.full(len(ci), -1, I64)
            tmpl[is_t] = (np.cumsum(tlen) - tlen)[row_t[ci[is_t]]] + within[is_t]
            self.tmpl = tmpl
            self.nbytes[is_t] = np.concatenate(t_n)[tmpl[is_t]]
            self.t_sizes = np.concatenate(t_sz)
            self.t_offsets = np.concatenate(t_off) if offsets else None

    def sizes(self, chunks: np.ndarray) -> np.ndarray:
        """``[m, D]`` sizes of ``chunks`` (padded with 1)."""
        out = self.table.sizes[self.rows[self.row[chunks]]]
        if self.tmpl is not None:
            t = self.tmpl[chunks]
            b = t >= 0
            out[b] = self.t_sizes[t[b]]
        return out

    def offsets(self, chunks: np.ndarray) -> np.ndarray:
        """``[m, D]`` offsets of ``chunks`` relative to their rows' boxes (built with ``offsets``)."""
        out = np.zeros((len(chunks), self.table.sizes.shape[1]), I64)
        if self.tmpl is not None:
            t = self.tmpl[chunks]
            b = t >= 0
            out[b] = self.t_offsets[t[b]]
        return out

    def direct(self, contiguity: Contiguity | None, min_bytes: int) -> np.ndarray:
        """Per chunk whether it travels in place: ``min_bytes`` or more, not source-quantized, and contiguous in
        its source or its destination local tensor (``Contiguity.direct_columns``, in blocks: its ``[m, D]``
        temporaries stay small)."""
        out = np.zeros(len(self.row), np.bool_)
        if contiguity is None:
            return out
        cand = np.flatnonzero((self.nbytes >= min_bytes) & ~self.src_q[self.row])
        for lo in range(0, len(cand), _DIRECT_BLOCK):
            cb = cand[lo:lo + _DIRECT_BLOCK]
            out[cb] = contiguity.direct_columns(self.table, self.rows[self.row[cb]], self.sizes(cb))
        return out


def _next_fit(cp: np.ndarray, ca: np.ndarray, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """The next fit, every pair at once: chunks ``[a, b)`` of each load (``cp``: per chunk its pair, pairs
    consecutive; ``ca``: its aligned bytes), loads in chunk order. A load from chunk ``a`` takes the pair's
    chunks while their aligned bytes stay within ``cap`` (at least one)."""
    nch = len(cp)
    if not nch:
        return np.zeros(0, I64), np.zeros(0, I64)
    cum = np.concatenate(([0], np.cumsum(ca)))  # cum[j]: aligned bytes before chunk j (over all pairs)
    new = np.ones(nch, np.bool_)
    new[1:] = cp[1:] != cp[:-1]
    cur = np.flatnonzero(new)
    stop = np.append(cur[1:], nch)
    # runs of equal chunks (a big row's chunks): a load starting inside one, with more of the run after its k-th
    # chunk, takes exactly k = cap // a chunks, so such loads are taken at once (one round per run, not per load)
    brk = np.flatnonzero((np.diff(ca) != 0) | new[1:]) + 1
    run_end = np.append(brk, nch)[np.searchsorted(brk, np.arange(nch, dtype=I64), side="right")]
    loads_a: list[np.ndarray] = []
    loads_b: list[np.ndarray] = []
    while len(cur):
        k = np.maximum(cap // ca[cur], 1)  # (a chunk bigger than cap, one quantized block, is a load alone)
        q = (run_end[cur] - cur - 1) // k
        ff = np.flatnonzero(q > 1)
        if len(ff):
            c0, kk, qq = cur[ff], k[ff], q[ff]
            first = np.cumsum(qq) - qq
            step = np.arange(int(qq.sum()), dtype=I64) - np.repeat(first, qq)
            a = np.repeat(c0, qq) + step * np.repeat(kk, qq)
            loads_a.append(a)
            loads_b.append(a + np.repeat(kk, qq))
            cur = cur.copy()
            cur[ff] = c0 + qq * kk  # still inside the run (< run_end <= stop)
        end = np.minimum(np.searchsorted(cum, cum[cur] + cap, side="right") - 1, stop)
        end = np.maximum(end, cur + 1)
        loads_a.append(cur)
        loads_b.append(end)
        more = end < stop
        cur, stop = end[more], stop[more]
    la, lb = np.concatenate(loads_a), np.concatenate(loads_b)
    o = np.argsort(la, kind="stable")
    return la[o], lb[o]


def _cut(table: TransferTable, pairs: _Pairs, sel: np.ndarray | None, cap: int, contiguity: Contiguity | None,
         min_bytes: int, messages: bool):
    """The step rule (see the module doc) for pairs ``sel`` (increasing indices into ``pairs``; None: every
    pair): ``(pair of each load, its payload)``, a pair's loads in order; with ``messages``, ``{pair: its loads
    as messages}`` instead."""
    rows, pair_of = pairs.rows_of(sel)
    ch = _Chunks(table, rows, cap, messages)
    cd = ch.direct(contiguity, min_bytes)
    cp = pair_of[ch.row]
    cn = ch.nbytes
    ca = align_up(cn)
    del pair_of
    la, lb = _next_fit(cp, ca, cap)
    packed = ~cd
    pa = np.concatenate(([0], np.cumsum(np.where(packed, ca, 0))))
    if messages:
        return _messages(pairs, ch, cd, cp, la, lb, pa)
    # a load's payload: its direct chunks' bytes plus the end of its last packed chunk
    dn = np.concatenate(([0], np.cumsum(np.where(cd, cn, 0))))
    lastp = np.maximum.accumulate(np.where(packed, np.arange(len(cp), dtype=I64), -1)) if len(cp) else cp
    q = lastp[lb - 1]
    qq = np.maximum(q, 0)
    pay = dn[lb] - dn[la] + np.where(q >= la, pa[qq] - pa[la] + cn[qq], 0)
    return cp[la], pay


def _messages(pairs: _Pairs, ch: _Chunks, cd: np.ndarray, cp: np.ndarray, la: np.ndarray, lb: np.ndarray,
              pa: np.ndarray) -> dict[int, list[list[Message]]]:
    """The loads ``_cut`` found, as messages per pair: a load is one packed message (its packed chunks at aligned
    offsets, its size their aligned bytes) followed by one message per direct chunk."""
    nch = len(cp)
    table = ch.table
    every = np.arange(nch, dtype=I64)
    rows = ch.rows[ch.row]
    load_of = np.repeat(np.arange(len(la), dtype=I64), lb - la)  # the loads cover the chunks in order
    boff = (pa[:-1] - pa[la][load_of]).tolist()
    size_of = (pa[lb] - pa[la]).tolist()
    nd = table.ndim[rows].tolist()
    offs, szs = ch.offsets(every).tolist(), ch.sizes(every).tolist()
    ns, rl, dl, pl = ch.nbytes.tolist(), rows.tolist(), cd.tolist(), cp.tolist()
    src, dst = pairs.src.tolist(), pairs.dst.tolist()
    out: dict[int, list[list[Message]]] = defaultdict(list)
    for li, (a, b) in enumerate(zip(la.tolist(), lb.tolist(), strict=True)):
        j = pl[a]
        s, d = src[j], dst[j]
        cs, singles = [], []
        for c in range(a, b):
            k, n = nd[c], ns[c]
            o, sz = tuple(offs[c][:k]), tuple(szs[c][:k])
            if dl[c]:
                singles.append(Message(s, d, align_up(n), (Chunk(rl[c], o, sz, n, 0),), True))
            else:
                cs.append(Chunk(rl[c], o, sz, n, boff[c]))
        out[j].append([Message(s, d, size_of[li], tuple(cs)), *singles] if cs else singles)
    return out


def build_pair_schedule(transfers: Sequence[Transfer] | TransferTable, bucket_bytes: int, contiguity: Contiguity | None,
                        direct_min_bytes: int, world: int) -> PairSchedule:
    """The steps of ``transfers`` by the pair rule (see the module doc): only the non-empty steps, each with
    its number (``Step.number``), in (phase, number) order, as a :class:`PairSchedule` (columns: the messages
    are built only for the pairs a caller reads)."""
    if bucket_bytes < MIN_STEP_BYTES:
        raise ValueError(f"bucket_bytes={bucket_bytes} is too small (at least {MIN_STEP_BYTES})")
    if direct_min_bytes < 0:
        raise ValueError(f"direct_min_bytes={direct_min_bytes} must be >= 0")
    peers = max(1, min(STEP_PEERS, world - 1))  # offsets 1 .. world-1 (a wire transfer never stays on its rank)
    windows = -(-(world - 1) // peers) if world > 1 else 1
    cap = max(ALIGN, bucket_bytes // 2 // peers // ALIGN * ALIGN)
    table = TransferTable.of(transfers)
    with gc_paused():
        pairs = _Pairs.of(table, world)
        # per pair its first step number (then one every ``windows``): the pair's offset d - s round the world
        k = (pairs.dst - pairs.src) % world - 1
        firsts = k % windows if STEP_GROUPING == "strided" else k // peers
        lp, pays = _cut(table, pairs, None, cap, contiguity, direct_min_bytes, False)
        # per load: its index among its pair's loads -> its step number
        first_load = np.searchsorted(lp, lp, side="left") if len(lp) else lp
        m = np.arange(len(lp), dtype=I64) - first_load
        ph = pairs.phase[lp]
        num = firsts[lp] + m * windows
        src, dst, nb = pairs.src[lp], pairs.dst[lp], pays
        order = np.lexsort((dst, src, num, ph))
        ph, num, src, dst, nb = ph[order], num[order], src[order], dst[order], nb[order]
        cuts = np.flatnonzero((np.diff(ph) != 0) | (np.diff(num) != 0)) + 1
        starts = np.concatenate(([0], cuts)).astype(I64) if len(nb) else np.zeros(0, I64)
        numbers = tuple(zip(ph[starts].tolist(), num[starts].tolist(), strict=True))
        bounds = np.append(starts, len(nb)).tolist()
        return PairSchedule(bucket_bytes, numbers, bounds, (src, dst, nb), table, pairs, firsts, windows, cap,
                            contiguity, direct_min_bytes)


class _Pairs:
    """A table's rows grouped by pair ``(phase, src, dst)`` (phase: 1 for relays), pairs in that order, each
    pair's rows in ``Transfer.key`` order (plan order, which a plan keeps so; a hand-built table's pair whose rows
    are not is sorted by its objects' keys): ``order`` (rows), ``edges`` (pair ``j``'s rows are
    ``order[edges[j]:edges[j+1]]``), per pair ``phase`` / ``src`` / ``dst``."""

    __slots__ = ("order", "edges", "phase", "src", "dst", "codes", "world", "_by")

    @classmethod
    def of(cls, table: TransferTable, world: int) -> _Pairs:
        self = cls()
        n = len(table)
        # pair codes need every rank below ``world`` (else two pairs could share a code)
        self.world = max(world, 1, int(table.src.max()) + 1 if n else 0, int(table.dst.max()) + 1 if n else 0)
        order = np.lexsort((table.dst, table.src, table.relay)) if n else np.zeros(0, I64)
        ph, ss, dd = table.relay[order].astype(I64), table.src[order], table.dst[order]
        codes = (ph * self.world + ss) * self.world + dd  # increasing along the pairs
        new = np.ones(n, np.bool_)
        if n:
            new[1:] = codes[1:] != codes[:-1]
        heads = np.flatnonzero(new)
        self.edges = np.append(heads, n).astype(I64)
        self.codes, self.phase, self.src, self.dst = codes[heads], ph[heads], ss[heads], dd[heads]
        self.order = _key_order(table, order, new, self.edges)
        self._by = {}
        return self

    def __len__(self) -> int:
        return len(self.codes)

    def find(self, phase: int, s: int, d: int) -> int:
        """The index of pair ``(phase, s, d)`` (``KeyError`` if it has no rows)."""
        code = (phase * self.world + s) * self.world + d
        j = int(np.searchsorted(self.codes, code))
        if j == len(self.codes) or int(self.codes[j]) != code:
            raise KeyError((phase, s, d))
        return j

    def rows(self, j: int) -> np.ndarray:
        return self.order[self.edges[j]:self.edges[j + 1]]

    def rows_of(self, sel: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """The rows of pairs ``sel`` (None: every pair) in pair order, and per row its pair."""
        lens = np.diff(self.edges)
        if sel is None:
            return self.order, np.repeat(np.arange(len(self), dtype=I64), lens)
        sel = np.asarray(sel, I64)
        lens = lens[sel]
        before = np.cumsum(lens) - lens
        idx = np.repeat(self.edges[sel] - before, lens) + np.arange(int(lens.sum()), dtype=I64)
        return self.order[idx], np.repeat(sel, lens)

    def of_rank(self, rank: int) -> list[int]:
        """The pairs with ``rank`` at one end, in pair order."""
        got = []
        for side in ("src", "dst"):
            by = self._by.get(side)
            if by is None:
                col = getattr(self, side)
                o = np.argsort(col, kind="stable")
                by = self._by[side] = (o, col[o])
            o, col = by
            got.append(o[np.searchsorted(col, rank):np.searchsorted(col, rank, side="right")])
        return distinct(np.concatenate(got)).tolist()


def _key_order(table: TransferTable, order: np.ndarray, new: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """``order`` (rows grouped by pair, ``new`` marks each pair's first row) with each pair's rows in
    ``Transfer.key`` order: within a pair the key starts with (tensor, offsets), so a strictly increasing
    (tensor, offsets) from row to row is key order (checked on the columns); a pair that is not is sorted by its
    objects' keys (stable)."""
    n = len(order)
    if n < 2:
        return order
    name_rank = np.empty(len(table.names), I64)
    name_rank[np.argsort(np.array(table.names, dtype=object), kind="stable")] = np.arange(len(table.names))
    keys = np.concatenate([name_rank[table.tensor[order]][:, None], table.offsets[order]], 1)
    dk = keys[1:] - keys[:-1]
    nz = dk != 0
    first = np.argmax(nz, 1)
    up = nz.any(1) & (dk[np.arange(n - 1), first] > 0)
    bad = np.flatnonzero(~up & ~new[1:]) + 1
    if not len(bad):
        return order
    order = order.copy()
    for j in distinct(np.searchsorted(edges, bad, side="right") - 1).tolist():
        rs = order[edges[j]:edges[j + 1]]
        objs = table.objects_at(rs)
        order[edges[j]:edges[j + 1]] = rs[sorted(range(len(rs)), key=lambda k: objs[k].key())]
    return order


QUANT_CODES_SRC = TransferTable.QUANT_CODES["src"]


def _unique_rows(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(a, axis=0, return_inverse=True)`` for int rows, by a 64-bit hash of each row (one 1-D sort
    instead of a sort of row records), checked: a collision falls back to the row sort."""
    if not len(a):
        return a[:0], np.zeros(0, I64)
    h = np.zeros(len(a), np.uint64)
    with np.errstate(over="ignore"):
        for j in range(a.shape[1]):
            h = (h ^ a[:, j].astype(np.uint64)) * np.uint64(0x100000001B3)
    _, first, inv = np.unique(h, return_index=True, return_inverse=True)
    inv = inv.reshape(-1)
    if not (a[first][inv] == a).all():
        uniq, inv = np.unique(a, axis=0, return_inverse=True)
        return uniq, inv.reshape(-1)
    return a[first], inv


class PairSchedule(Schedule):
    """A schedule of the pair rule held as columns: per step, its (phase, number) and its pairs' ``(src, dst,
    payload bytes)``; per pair, its transfers. ``steps`` (a lazy sequence of :class:`NumberedStep`) builds a
    pair's messages (``_cut``) the first time a step or ``for_rank`` reads them, so a whole plan's
    prediction (``pair_bytes``) and one rank's part (``for_rank``) never build every message."""

    def __init__(self, bucket_bytes: int, numbers: tuple[tuple[int, int], ...], bounds: list[int],
                 columns: tuple[np.ndarray, np.ndarray, np.ndarray], table: TransferTable,
                 pairs: _Pairs, firsts: np.ndarray, windows: int, cap: int, contiguity: Contiguity | None,
                 direct_min_bytes: int) -> None:
        object.__setattr__(self, "bucket_bytes", bucket_bytes)
        object.__setattr__(self, "numbers", numbers)  # per step: (phase, number)
        object.__setattr__(self, "_bounds", bounds)  # step i's loads: rows bounds[i]:bounds[i + 1] of the columns
        object.__setattr__(self, "_columns", columns)  # per load, by (phase, number, src, dst): src, dst, payload
        object.__setattr__(self, "_table", table)
        object.__setattr__(self, "_pairs", pairs)  # the pairs and their rows of the table
        object.__setattr__(self, "_firsts", firsts)  # per pair the number of its first step
        object.__setattr__(self, "_windows", windows)
        object.__setattr__(self, "_cap", cap)
        object.__setattr__(self, "_contiguity", contiguity)
        object.__setattr__(self, "_min_bytes", direct_min_bytes)
        object.__setattr__(self, "_loads", {})
        object.__setattr__(self, "steps", _LazySteps(self))

    def __eq__(self, other) -> bool:  # as a Schedule: the same bucket and steps (builds the messages)
        if not isinstance(other, Schedule):
            return NotImplemented
        return self.bucket_bytes == other.bucket_bytes and tuple(self.steps) == tuple(other.steps)

    def __hash__(self) -> int:
        return hash((self.bucket_bytes, tuple(self.steps)))

    def __repr__(self) -> str:
        return f"PairSchedule(bucket_bytes={self.bucket_bytes}, {len(self.numbers)} steps)"

    def pair_bytes(self) -> list[StepPairBytes]:
        """Per step, ``{(src, dst): payload bytes}`` (``topology.schedule_pair_bytes``), from the columns."""
        src, dst, nb = self._columns
        b = self._bounds
        return [StepPairBytes(src[b[i]:b[i + 1]], dst[b[i]:b[i + 1]], nb[b[i]:b[i + 1]]) for i in range(len(b) - 1)]

    def step_phase(self, i: int) -> int:
        return self.numbers[i][0]

    def _pair_loads(self, j: int) -> list[list[Message]]:
        """Pair ``j``'s loads as messages (built on first read)."""
        self._build([j])
        return self._loads[j]

    def _build(self, js: list[int]) -> None:
        """The messages of pairs ``js`` not built yet, cut at once."""
        todo = sorted(set(js).difference(self._loads))
        if todo:
            with gc_paused():
                got = _cut(self._table, self._pairs, np.array(todo, I64), self._cap, self._contiguity,
                           self._min_bytes, True)
            for j in todo:
                self._loads[j] = got.get(j, [])

    def _step(self, i: int) -> NumberedStep:
        phase, number = self.numbers[i]
        src, dst, _nb = self._columns
        a, b = self._bounds[i], self._bounds[i + 1]
        pairs = self._pairs
        js = [pairs.find(phase, s, d) for s, d in zip(src[a:b].tolist(), dst[a:b].tolist(), strict=True)]
        self._build(js)
        w = self._windows
        msgs = [m for j in js for m in self._loads[j][(number - int(self._firsts[j])) // w]]
        return NumberedStep(tuple(msgs), phase, number)

    def _for_rank(self, rank: int) -> tuple[tuple[RankStep, ...], int, int]:
        pairs = self._pairs
        self._build(pairs.of_rank(rank))
        pos = {k: i for i, k in enumerate(self.numbers)}
        sends: dict[int, list] = defaultdict(list)  # step index -> [(peer, load)]
        recvs: dict[int, list] = defaultdict(list)
        for j in pairs.of_rank(rank):
            phase, s, d = int(pairs.phase[j]), int(pairs.src[j]), int(pairs.dst[j])
            w = int(self._firsts[j])
            for m, load in enumerate(self._pair_loads(j)):
                i = pos[(phase, m * self._windows + w)]
                if s == rank:
                    sends[i].append((d, load))
                if d == rank:
                    recvs[i].append((s, load))
        out, send_area, recv_area = [], 0, 0
        empty = RankStep((), ())
        for i in range(len(self.numbers)):
            ss, rr = sends.get(i), recvs.get(i)
            if not ss and not rr:
                out.append(empty)
                continue
            s_list, s_off = _place(sorted(ss, key=_PEER) if ss else ())
            r_list, r_off = _place(sorted(rr, key=_PEER) if rr else ())
            send_area, recv_area = max(send_area, s_off), max(recv_area, r_off)
            out.append(RankStep(s_list, r_list))
        return tuple(out), send_area, recv_area


_PEER = lambda pl: pl[0]  # noqa: E731


def _place(loads) -> tuple[tuple[tuple[int, int, Message], ...], int]:
    """One side of a rank's step (``Schedule.for_rank``): its packed messages by peer, then its direct ones,
    each at the next offset of the staging area; and the area's size."""
    out, off = [], 0
    for direct in (False, True):
        for peer, load in loads:
            for m in load:
                if m.direct == direct:
                    out.append((peer, off, m))
                    off += m.nbytes
    return tuple(out), off


class _LazySteps(Sequence):
    """``PairSchedule.steps``: the steps, each built (with its pairs' messages) when first read."""

    __slots__ = ("_sched", "_built")

    def __init__(self, sched: PairSchedule) -> None:
        self._sched, self._built = sched, {}

    def __len__(self) -> int:
        return len(self._sched.numbers)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(len(self))))
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"step {i} out of range ({n} steps)")
        i %= n
        st = self._built.get(i)
        if st is None:
            st = self._built[i] = self._sched._step(i)
        return st

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __repr__(self) -> str:
        return f"<{len(self)} steps>"


def world_of(src: Layout, dst: Layout) -> int:
    """``W`` of the step rule: one more than the largest rank of either layout."""
    return max(src.ranks + dst.ranks, default=0) + 1
