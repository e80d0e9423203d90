"""The schedule of the local rules: transfers cut into chunks and packed into steps pair by pair
(``build_pair_schedule``), and which chunks may travel in place (``contiguity``)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..box import align_up, is_contiguous_box, split_box, split_rows
from ..layout import Layout, gc_paused, itemsize_of
from . import quant
from .table import TransferTable
from .types import ALIGN, Chunk, Message, RankStep, Schedule, Step, StepPairBytes, Transfer

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
_OBJECT_BLOCK = 1 << 16  # rows whose objects the schedule builds at once


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


def build_pair_schedule(transfers: Sequence[Transfer] | TransferTable, bucket_bytes: int, contiguity: Sequence[tuple] | None,
                        direct_min_bytes: int, world: int) -> PairSchedule:
    """The steps of ``transfers`` by the pair rule (see the module doc): only the non-empty steps, each with
    its number (``Step.number``), in (phase, number) order, as a :class:`PairSchedule` (columns: the messages
    are built only for the pairs a caller reads)."""
    if bucket_bytes < 16 * ALIGN:
        raise ValueError(f"bucket_bytes={bucket_bytes} is too small (at least {16 * ALIGN})")
    if direct_min_bytes < 0:
        raise ValueError(f"direct_min_bytes={direct_min_bytes} must be >= 0")
    peers = max(1, min(STEP_PEERS, world - 1))  # offsets 1 .. world-1 (a wire transfer never stays on its rank)
    windows = -(-(world - 1) // peers) if world > 1 else 1
    cap = max(ALIGN, bucket_bytes // 2 // peers // ALIGN * ALIGN)
    table = TransferTable.of(transfers)
    with gc_paused():
        # the pairs from the columns: per (phase, source, destination), its rows in plan order (the objects of a
        # pair are built when its loads are cut, and dropped after: a schedule keeps row numbers, not objects)
        n = len(table)
        order = np.lexsort((table.dst, table.src, table.relay)) if n else np.zeros(0, np.int64)
        ph, ss, dd = table.relay[order].astype(np.int64), table.src[order], table.dst[order]
        cut = np.flatnonzero((np.diff(ph) != 0) | (np.diff(ss) != 0) | (np.diff(dd) != 0)) + 1 if n else []
        edges = np.concatenate(([0], cut, [n])).astype(np.int64).tolist() if n else [0]
        heads = order[np.asarray(edges[:-1], np.int64)] if n else order
        pairs: dict[tuple[int, int, int], np.ndarray] = {
            (int(p), int(a), int(b)): order[edges[k]:edges[k + 1]]
            for k, (p, a, b) in enumerate(zip(table.relay[heads].tolist(), table.src[heads].tolist(),
                                              table.dst[heads].tolist(), strict=True))}

        seen: dict[tuple, bool] = {}  # (local shapes, chunk sizes) -> contiguous (``is_contiguous_box`` reads no more)

        def direct(i: int, t: Transfer, off, size) -> bool:
            if contiguity is None:
                return False
            if math.prod(size) * itemsize_of(t.wire_dtype) < direct_min_bytes:
                return False
            shapes = contiguity.shapes(t)
            if shapes is None:
                return False
            if type(shapes) is not tuple:
                return shapes.direct(t, off, size)
            got = seen.get((shapes, size))
            if got is None:
                s_shape, d_shape = shapes
                got = seen[(shapes, size)] = (
                    (s_shape is not None and is_contiguous_box(s_shape, t.src_offsets, off, size))
                    or (d_shape is not None and is_contiguous_box(d_shape, t.dst_offsets, off, size)))
            return got

        cols: tuple[list[int], ...] = ([], [], [], [], [])  # per load: phase, step number, src, dst, payload
        firsts: dict[tuple[int, int, int], int] = {}  # pair -> the number of its first step (then every windows)
        # the objects built a block of pairs at a time (one gather per ~65,536 rows, not one per pair: a
        # 1,024-rank plan has ~a million pairs), each pair's list a slice of its block
        edge_arr = np.asarray(edges, np.int64)
        blk_lo = blk_hi = 0
        objs: list[Transfer] = []
        for k, (key, rows) in enumerate(pairs.items()):
            phase, s, d = key
            a, b = edges[k], edges[k + 1]
            if b > blk_hi:
                blk_lo = a
                blk_hi = edges[min(max(int(np.searchsorted(edge_arr, a + _OBJECT_BLOCK)), k + 1), len(edges) - 1)]
                objs = table.objects_at(order[blk_lo:blk_hi])
            ts = _keyed(list(zip(rows.tolist(), objs[a - blk_lo:b - blk_lo], strict=True)))
            k = (d - s) % world - 1
            w = k % windows if STEP_GROUPING == "strided" else k // peers
            firsts[key] = w
            pays = load_payloads(ts, cap, direct, direct_min_bytes)
            c = len(pays)
            cols[0].extend([phase] * c)
            cols[1].extend(range(w, w + c * windows, windows))
            cols[2].extend([s] * c)
            cols[3].extend([d] * c)
            cols[4].extend(pays)
        ph, num, src, dst, nb = (np.array(c, dtype=np.int64) for c in cols)
        order = np.lexsort((dst, src, num, ph))
        ph, num, src, dst, nb = ph[order], num[order], src[order], dst[order], nb[order]
        cuts = np.flatnonzero((np.diff(ph) != 0) | (np.diff(num) != 0)) + 1
        starts = np.concatenate(([0], cuts)).astype(np.int64) if len(nb) else np.zeros(0, np.int64)
        numbers = tuple(zip(ph[starts].tolist(), num[starts].tolist(), strict=True))
        bounds = np.append(starts, len(nb)).tolist()
        return PairSchedule(bucket_bytes, numbers, bounds, (src, dst, nb), table, pairs, firsts, windows, cap, direct)


class PairSchedule(Schedule):
    """A schedule of the pair rule held as columns: per step, its (phase, number) and its pairs' ``(src, dst,
    payload bytes)``; per pair, its transfers. ``steps`` (a lazy sequence of :class:`NumberedStep`) builds a
    pair's messages (``pair_loads``) the first time a step or ``for_rank`` reads them, so a whole plan's
    prediction (``pair_bytes``) and one rank's part (``for_rank``) never build every message."""

    def __init__(self, bucket_bytes: int, numbers: tuple[tuple[int, int], ...], bounds: list[int],
                 columns: tuple[np.ndarray, np.ndarray, np.ndarray], table: TransferTable,
                 pairs: dict[tuple[int, int, int], np.ndarray], firsts: dict[tuple, int],
                 windows: int, cap: int, direct: Callable) -> None:
        object.__setattr__(self, "bucket_bytes", bucket_bytes)
        object.__setattr__(self, "numbers", numbers)  # per step: (phase, number)
        object.__setattr__(self, "_bounds", bounds)  # step i's loads: rows bounds[i]:bounds[i + 1] of the columns
        object.__setattr__(self, "_columns", columns)  # per load, by (phase, number, src, dst): src, dst, payload
        object.__setattr__(self, "_table", table)
        object.__setattr__(self, "_pairs", pairs)  # per pair its rows of the table
        object.__setattr__(self, "_firsts", firsts)
        object.__setattr__(self, "_windows", windows)
        object.__setattr__(self, "_cap", cap)
        object.__setattr__(self, "_direct", direct)
        object.__setattr__(self, "_loads", {})
        object.__setattr__(self, "_by_rank", None)
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

    def _pair_loads(self, key: tuple[int, int, int]) -> list[list[Message]]:
        got = self._loads.get(key)
        if got is None:
            got = self._loads[key] = pair_loads(pair_transfers(self._table, self._pairs[key]), self._cap,
                                                self._direct)
        return got

    def _load(self, phase: int, number: int, s: int, d: int) -> list[Message]:
        return self._pair_loads((phase, s, d))[(number - self._firsts[(phase, s, d)]) // self._windows]

    def _step(self, i: int) -> NumberedStep:
        phase, number = self.numbers[i]
        src, dst, _nb = self._columns
        a, b = self._bounds[i], self._bounds[i + 1]
        with gc_paused():
            msgs = [m for s, d in zip(src[a:b].tolist(), dst[a:b].tolist(), strict=True)
                    for m in self._load(phase, number, s, d)]
        return NumberedStep(tuple(msgs), phase, number)

    def _for_rank(self, rank: int) -> tuple[tuple[RankStep, ...], int, int]:
        by_rank = self._by_rank
        if by_rank is None:
            by_rank = defaultdict(list)
            for (phase, s, d) in self._pairs:
                by_rank[s].append((phase, s, d))
                by_rank[d].append((phase, s, d))
            object.__setattr__(self, "_by_rank", by_rank)
        pos = {k: i for i, k in enumerate(self.numbers)}
        sends: dict[int, list] = defaultdict(list)  # step index -> [(peer, load)]
        recvs: dict[int, list] = defaultdict(list)
        for key in by_rank.get(rank, ()):
            phase, s, d = key
            w = self._firsts[key]
            for m, load in enumerate(self._pair_loads(key)):
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
        self._cache: dict[tuple[int, int, str], object] = {}  # (destination side?, rank, local) -> its spec

    def _shape(self, k: int, rank: int, local: str, wdt) -> tuple | None:
        key = (k, rank, local)
        spec = self._cache.get(key, self)
        if spec is self:
            spec = self._cache[key] = (self._dst if k else self._src).local_spec(rank, local)
        return spec.shape if spec is not None and spec.dtype == wdt else None

    def __len__(self) -> int:
        return len(self._ts)

    def shapes(self, t: Transfer):
        """None when ``t`` is never direct (under the minimum, or source-quantized: the pack quantizes it), else
        this object (its ``direct`` answers per sub-box)."""
        return None if t.nbytes < self._min or t.quant == "src" else self

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


def world_of(src: Layout, dst: Layout) -> int:
    """``W`` of the step rule: one more than the largest rank of either layout."""
    return max(src.ranks + dst.ranks, default=0) + 1
