"""The schedule of the local rules: transfers cut into chunks and packed into steps pair by pair
(``build_pair_schedule``); which chunks may travel in place is ``contiguity``'s answer."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..box import align_up, split_box, split_rows
from ..layout import Layout, gc_paused, itemsize_of
from . import quant
from .contiguity import Contiguity
from .table import I64, TransferTable
from .types import ALIGN, MIN_STEP_BYTES, Chunk, Message, RankStep, Schedule, Step, StepPairBytes, Transfer

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
    message (its chunks at aligned offsets) followed by one message per chunk ``direct(index, transfer,
    offsets, sizes)`` calls direct (asked once per transfer and chunk size: whether a sub-box is one contiguous run of
    a local tensor depends on its sizes alone, ``is_contiguous_box``). Both ends of the pair build the same
    list."""
    out: list[list[Message]] = []
    cs: list[Chunk] = []
    singles: list[Message] = []
    off = used = 0
    s = d = None
    for i, t in transfers:
        s, d = t.src_rank, t.dst_rank
        if t.quant != "src":  # the common case, inline: a transfer that fits in one chunk is that chunk
            sizes = t.sizes
            n = math.prod(sizes) * itemsize_of(t.wire_dtype)
            a = align_up(n)
            if a <= cap or not sizes:
                pieces = (((0,) * len(sizes), sizes, n),) if n else ()
            else:
                pieces = _chunks(t, cap)
        else:
            pieces = _chunks(t, cap)
        seen: dict[tuple, bool] = {}  # the chunks of a transfer share a few sizes; contiguity reads only those
        for o, sz, n in pieces:
            a = align_up(n)
            if used + a > cap and used:
                out.append([Message(s, d, off, tuple(cs)), *singles] if cs else singles)
                cs, singles, off, used = [], [], 0, 0
            is_direct = seen.get(sz)
            if is_direct is None:
                is_direct = seen[sz] = direct(i, t, o, sz)
            if is_direct:
                singles.append(Message(s, d, a, (Chunk(i, o, sz, n, 0),), True))
            else:
                cs.append(Chunk(i, o, sz, n, off))
                off += a
            used += a
    if used:
        out.append([Message(s, d, off, tuple(cs)), *singles] if cs else singles)
    return out


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


def load_payloads(transfers: Sequence[tuple[int, Transfer]], cap: int,
                  direct: Callable[[int, tuple, tuple], bool], min_bytes: int = 0) -> list[int]:
    """The payload bytes (``Message.payload`` summed over the load's messages) of each load :func:`pair_loads`
    cuts from the same stream: the same next fit over the same chunks, on integers (no chunk or message is
    built; a run of equal chunks each more than half of ``cap`` closes one load per chunk at once). ``direct``
    is not asked for plain chunks under ``min_bytes`` (``direct_min_bytes``: it would answer no)."""
    out: list[int] = []
    used = off = last = dsum = 0  # last: end of the last packed chunk; dsum: bytes of the load's direct chunks
    for i, t in transfers:
        reps, runs = 1, None
        if t.quant != "src":
            sizes = t.sizes
            isz = itemsize_of(t.wire_dtype)
            n = math.prod(sizes) * isz
            if align_up(n) <= cap or not sizes:
                if not n:
                    continue
                runs = (((0,) * len(sizes), sizes, n, 1),)
            else:
                reps, runs = _split_runs(sizes, isz, cap)
        else:
            runs = [(o, sz, n, 1) for o, sz, n in _chunks(t, cap)]
        seen: dict[tuple, bool] = {}
        plain = t.quant != "src"  # (a chunk's bytes are its elements' in the wire dtype)
        for _rep in range(reps):
            for o, sz, n, count in runs:
                a = align_up(n)
                is_direct = seen.get(sz)
                if is_direct is None:
                    is_direct = seen[sz] = False if plain and n < min_bytes else direct(i, t, o, sz)
                if count > 1 and 2 * a > cap:  # each chunk of the run closes the load before it
                    if used + a > cap and used:
                        out.append(last + dsum)
                        used = off = last = dsum = 0
                    out.append(last + dsum + n if is_direct else off + n + dsum)  # the load ending with the first
                    out.extend([n] * (count - 2))
                    used, off, last, dsum = (a, 0, 0, n) if is_direct else (a, a, n, 0)
                    continue
                for _ in range(count):
                    if used + a > cap and used:
                        out.append(last + dsum)
                        used = off = last = dsum = 0
                    if is_direct:
                        dsum += n
                    else:
                        last = off + n
                        off += a
                    used += a
    if used:
        out.append(last + dsum)
    return out


def _in_key_order(ts: list[tuple[int, Transfer]]) -> bool:
    """Whether one pair's transfers are already in ``Transfer.key`` order: within a pair the key starts with
    (tensor, offsets), so a strictly increasing (tensor, offsets) is key order (a plan lists them so)."""
    prev = None
    for _i, t in ts:
        k = (t.tensor, t.offsets)
        if prev is not None and not prev < k:
            return False
        prev = k
    return True


def pair_transfers(table: TransferTable, rows: np.ndarray) -> list[tuple[int, Transfer]]:
    """One pair's ``(row, transfer)`` in ``Transfer.key`` order (rows in plan order; a plan lists a pair's
    transfers in key order, a hand-built one may not)."""
    return _keyed(list(zip(rows.tolist(), table.objects_at(rows), strict=True)))


def _keyed(ts: list[tuple[int, Transfer]]) -> list[tuple[int, Transfer]]:
    """``ts`` in ``Transfer.key`` order (sorted in place only when it is not already)."""
    if not _in_key_order(ts):
        ts.sort(key=lambda it: it[1].key())
    return ts


def build_pair_schedule(transfers: Sequence[Transfer] | TransferTable, bucket_bytes: int, contiguity: Contiguity | None,
                        direct_min_bytes: int, world: int) -> PairSchedule:
    """The steps of ``transfers`` by the pair rule (see the module doc): only the non-empty steps, each with
    its number (``Step.number``), in (phase, number) order, as a :class:`PairSchedule` (columns: the messages
    are built only for the pairs a caller reads).

    The loads are cut on the columns (``_column_payloads``: chunks, contiguity and the next fit as arrays, the
    same as :func:`load_payloads` over the objects); a pair whose rows are not in key order, or that carries
    source-quantized rows, is cut over its objects."""
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

        def direct(i: int, t: Transfer, off, size) -> bool:
            if contiguity is None:
                return False
            if math.prod(size) * itemsize_of(t.wire_dtype) < direct_min_bytes:
                return False
            return contiguity.direct(t, off, size)

        # per pair its first step number (then one every ``windows``): the pair's offset d - s round the world
        k = (pairs.dst - pairs.src) % world - 1
        firsts = k % windows if STEP_GROUPING == "strided" else k // peers
        # the loads' payloads: the columns' pairs at once, the others over their objects
        lp, pays = _column_payloads(table, pairs, cap, contiguity, direct_min_bytes)
        slow = np.flatnonzero(~pairs.fast).tolist()
        if slow:
            extra_p, extra_b = [], []
            for j in slow:
                got = load_payloads(pairs.transfers(table, j), cap, direct, direct_min_bytes)
                extra_p.extend([j] * len(got))
                extra_b.extend(got)
            lp = np.concatenate([lp, np.array(extra_p, I64)])
            pays = np.concatenate([pays, np.array(extra_b, I64)])
            o = np.argsort(lp, kind="stable")  # a pair's loads stay in their order
            lp, pays = lp[o], pays[o]
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
        return PairSchedule(bucket_bytes, numbers, bounds, (src, dst, nb), table, pairs, firsts, windows, cap, direct)


class _Pairs:
    """A table's rows grouped by pair ``(phase, src, dst)`` (phase: 1 for relays), pairs in that order, each
    pair's rows in plan order: ``order`` (rows), ``edges`` (pair ``j``'s rows are ``order[edges[j]:edges[j+1]]``),
    per pair ``phase`` / ``src`` / ``dst`` and ``fast`` (its rows in ``Transfer.key`` order and none
    source-quantized: cut on the columns)."""

    __slots__ = ("order", "edges", "phase", "src", "dst", "fast", "codes", "world", "_by")

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
        self.order, self.edges = order, np.append(heads, n).astype(I64)
        self.codes, self.phase, self.src, self.dst = codes[heads], ph[heads], ss[heads], dd[heads]
        # key order inside a pair: (tensor name, offsets) strictly increasing from row to row
        bad = np.zeros(n, np.bool_)
        if n > 1:
            name_rank = np.empty(len(table.names), I64)
            name_rank[np.argsort(np.array(table.names, dtype=object), kind="stable")] = np.arange(len(table.names))
            keys = np.concatenate([name_rank[table.tensor[order]][:, None], table.offsets[order]], 1)
            dk = keys[1:] - keys[:-1]
            nz = dk != 0
            first = np.argmax(nz, 1)
            up = nz.any(1) & (dk[np.arange(n - 1), first] > 0)
            bad[1:] = ~up & ~new[1:]
        bad |= table.quant[order] == QUANT_CODES_SRC
        pair_of = np.cumsum(new) - 1
        fast = np.ones(len(heads), np.bool_)
        fast[pair_of[bad]] = False
        self.fast = fast
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

    def transfers(self, table: TransferTable, j: int) -> list[tuple[int, Transfer]]:
        return pair_transfers(table, self.rows(j))

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
        return np.unique(np.concatenate(got)).tolist()


QUANT_CODES_SRC = TransferTable.QUANT_CODES["src"]


def _column_payloads(table: TransferTable, pairs: _Pairs, cap: int, contiguity, min_bytes: int
                     ) -> tuple[np.ndarray, np.ndarray]:
    """The loads of the fast pairs (``_Pairs.fast``), from the columns: ``(pair of each load, its payload)``,
    a pair's loads in order. The same as :func:`load_payloads` over the pair's objects: each row cut into chunks
    of at most ``cap`` aligned bytes (one chunk when it fits, else ``split_box``'s, by ``_split_runs``), each
    chunk direct when it has ``min_bytes`` or more and is contiguous in a local tensor (``direct_columns``),
    then the next fit: a load takes chunks while their aligned bytes stay within ``cap``; its payload is its
    direct chunks' bytes plus the end of its last packed one."""
    fast_rows = np.repeat(pairs.fast, np.diff(pairs.edges))
    rows = pairs.order[fast_rows]
    pair_of = np.repeat(np.arange(len(pairs), dtype=I64), np.diff(pairs.edges))[fast_rows]
    nb = table.nbytes[rows]
    fits = (align_up(nb) <= cap) | (table.ndim[rows] == 0)
    keep = nb > 0
    # chunks: one per fitting row, a template's per big row (grouped by sizes and itemsize)
    counts = np.where(fits, 1, 0) * keep
    big = np.flatnonzero(~fits & keep)
    D = table.sizes.shape[1]
    tmpl_n: list[np.ndarray] = []
    tmpl_sz: list[np.ndarray] = []
    tstart = [0]
    if len(big):
        isz = table.itemsizes[table.wdt[rows[big]]]
        keyrows = np.concatenate([table.sizes[rows[big]], table.ndim[rows[big]][:, None].astype(I64), isz[:, None]], 1)
        uniq, big_t = _unique_rows(keyrows)
        for u in uniq.tolist():
            nd, it = u[D], u[D + 1]
            reps, runs = _split_runs(tuple(u[:nd]), it, cap)
            ns = [n for _o, _sz, n, c in runs for _ in range(c)] * reps
            szs = [tuple(sz) + (1,) * (D - nd) for _o, sz, _n, c in runs for _ in range(c)] * reps
            tmpl_n.append(np.array(ns, I64))
            tmpl_sz.append(np.array(szs, I64).reshape(len(szs), D))
            tstart.append(tstart[-1] + len(ns))
        counts[big] = np.diff(tstart)[big_t]
    ci = np.repeat(np.arange(len(rows), dtype=I64), counts)  # chunk -> its row among ``rows``
    cn = nb[ci]
    del fast_rows, nb, keep  # (at 1,024 ranks every full-length column here is ~19 MB: dead ones go early)
    fidx = None
    if len(big):
        flat_n = np.concatenate(tmpl_n)
        is_big = ~fits[ci]
        first = np.cumsum(counts) - counts  # each row's first chunk
        within = np.arange(len(ci), dtype=I64) - first[ci]
        tpos = np.asarray(tstart, I64)[:-1]
        fidx = np.zeros(len(ci), I64)
        bt = np.zeros(len(rows), I64)
        bt[big] = big_t
        fidx[is_big] = tpos[bt[ci[is_big]]] + within[is_big]
        cn = np.where(is_big, flat_n[fidx], cn)
        del flat_n, first, within, bt
    # direct chunks: at least min_bytes, contiguous in a local tensor (on either end)
    cd = np.zeros(len(ci), np.bool_)
    cand = np.flatnonzero(cn >= min_bytes) if contiguity is not None else np.zeros(0, I64)
    flat_sz = np.concatenate(tmpl_sz) if len(big) else None
    for lo in range(0, len(cand), _DIRECT_BLOCK):  # in blocks: the contiguity test's [m, D] temporaries stay small
        cb = cand[lo:lo + _DIRECT_BLOCK]
        csz = table.sizes[rows[ci[cb]]]
        if flat_sz is not None:
            b = is_big[cb]
            csz[b] = flat_sz[fidx[cb[b]]]
        cd[cb] = contiguity.direct_columns(table, rows[ci[cb]], csz)
    del cand, fidx
    cp = pair_of[ci]
    del rows, ci, pair_of, fits, counts
    # the next fit, every pair at once: a load from chunk j takes chunks while the aligned bytes stay <= cap
    ca = align_up(cn)
    nch = len(cp)
    cum = np.concatenate(([0], np.cumsum(ca)))  # cum[j]: aligned bytes before chunk j (over all pairs)
    packed = ~cd
    pa = np.concatenate(([0], np.cumsum(np.where(packed, ca, 0))))
    dn = np.concatenate(([0], np.cumsum(np.where(cd, cn, 0))))
    lastp = np.maximum.accumulate(np.where(packed, np.arange(nch, dtype=I64), -1)) if nch else np.zeros(0, I64)
    pstart = np.searchsorted(cp, np.arange(len(pairs)))
    pend = np.searchsorted(cp, np.arange(len(pairs)), side="right")
    cur = pstart[pstart < pend]
    stop = pend[pstart < pend]
    # runs of equal chunks (a big row's chunks): a load starting inside one, with more of the run after its k-th
    # chunk, takes exactly k = cap // a chunks, so such loads are taken at once (one round per run, not per load)
    brk = np.flatnonzero((np.diff(ca) != 0) | (np.diff(cp) != 0)) + 1
    run_end = np.append(brk, nch)[np.searchsorted(brk, np.arange(nch, dtype=I64), side="right")]
    loads_a: list[np.ndarray] = []
    loads_b: list[np.ndarray] = []
    while len(cur):
        k = cap // ca[cur]
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
    if not loads_a:
        return np.zeros(0, I64), np.zeros(0, I64)
    la, lb = np.concatenate(loads_a), np.concatenate(loads_b)
    o = np.argsort(la, kind="stable")  # chunk order = pair order, then the loads' order inside a pair
    la, lb = la[o], lb[o]
    q = lastp[lb - 1]
    has = q >= la
    qq = np.maximum(q, 0)
    pay = dn[lb] - dn[la] + np.where(has, pa[qq] - pa[la] + cn[qq], 0)
    return cp[la], pay


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
    pair's messages (``pair_loads``) the first time a step or ``for_rank`` reads them, so a whole plan's
    prediction (``pair_bytes``) and one rank's part (``for_rank``) never build every message."""

    def __init__(self, bucket_bytes: int, numbers: tuple[tuple[int, int], ...], bounds: list[int],
                 columns: tuple[np.ndarray, np.ndarray, np.ndarray], table: TransferTable,
                 pairs: _Pairs, firsts: np.ndarray, windows: int, cap: int, direct: Callable) -> None:
        object.__setattr__(self, "bucket_bytes", bucket_bytes)
        object.__setattr__(self, "numbers", numbers)  # per step: (phase, number)
        object.__setattr__(self, "_bounds", bounds)  # step i's loads: rows bounds[i]:bounds[i + 1] of the columns
        object.__setattr__(self, "_columns", columns)  # per load, by (phase, number, src, dst): src, dst, payload
        object.__setattr__(self, "_table", table)
        object.__setattr__(self, "_pairs", pairs)  # the pairs and their rows of the table
        object.__setattr__(self, "_firsts", firsts)  # per pair the number of its first step
        object.__setattr__(self, "_windows", windows)
        object.__setattr__(self, "_cap", cap)
        object.__setattr__(self, "_direct", direct)
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
        got = self._loads.get(j)
        if got is None:
            got = self._loads[j] = pair_loads(self._pairs.transfers(self._table, j), self._cap, self._direct)
        return got

    def _load(self, phase: int, number: int, s: int, d: int) -> list[Message]:
        j = self._pairs.find(phase, s, d)
        return self._pair_loads(j)[(number - int(self._firsts[j])) // self._windows]

    def _step(self, i: int) -> NumberedStep:
        phase, number = self.numbers[i]
        src, dst, _nb = self._columns
        a, b = self._bounds[i], self._bounds[i + 1]
        with gc_paused():
            msgs = [m for s, d in zip(src[a:b].tolist(), dst[a:b].tolist(), strict=True)
                    for m in self._load(phase, number, s, d)]
        return NumberedStep(tuple(msgs), phase, number)

    def _for_rank(self, rank: int) -> tuple[tuple[RankStep, ...], int, int]:
        pairs = self._pairs
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
