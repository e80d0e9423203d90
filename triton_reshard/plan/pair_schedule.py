"""The schedule of the local rules: transfers cut into chunks and packed into steps pair by pair
(``build_pair_schedule``), and which chunks may travel in place (``contiguity``)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..box import align_up, is_contiguous_box, split_box
from ..layout import Layout, gc_paused, itemsize_of
from . import quant
from .types import ALIGN, Chunk, Message, Schedule, Step, Transfer

_RANK_LOCAL = lambda f: (f.rank, f.local, f.local_offsets)  # noqa: E731


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
    sizes)`` calls direct (asked once per transfer and chunk size: whether a sub-box is one contiguous run of
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
                is_direct = seen[sz] = direct(i, o, sz)
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
            if type(shapes) is not tuple:
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
