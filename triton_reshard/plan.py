"""Plan: two layouts in, transfers out. Pure, deterministic, immutable, printable.

``plan_reshard(src, dst)`` decides, for every element of every destination fragment, which source rank
sends it (or that the destination rank copies it locally because it already holds it). ``Plan.schedule``
then cuts the wire transfers into memory-bounded steps, each step grouping the bytes of one
(source rank, destination rank) pair into one contiguous message at fixed buffer offsets.

Every rank computes the same plan and schedule with no communication; ``digest`` lets ranks check that.
"""

from __future__ import annotations

import hashlib
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from .layout import Fragment, Layout, TensorSpec, _dtype_name, _find_overlap

ALIGN = 16  # byte alignment of every chunk inside a message buffer (lets any dtype view the bytes)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


# --------------------------------------------------------------------------------------------------------
# Plan values
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Transfer:
    """One box of one logical tensor from a source local tensor to a destination local tensor.

    ``offsets``/``sizes``: the box in the logical tensor. ``src_offsets``/``dst_offsets``: where it starts in
    the source/destination local tensor (local dims; extra leading dims have size 1). ``wire_dtype``: the
    dtype the bytes travel in (the smaller of the two when they differ; cast on the sender when it shrinks).
    """

    tensor: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    src_rank: int
    src_local: str
    src_offsets: tuple[int, ...]
    dst_rank: int
    dst_local: str
    dst_offsets: tuple[int, ...]
    wire_dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.wire_dtype)

    @property
    def is_local(self) -> bool:
        return self.src_rank == self.dst_rank

    def key(self) -> tuple:
        return (
            self.tensor, self.offsets, self.sizes, self.src_rank, self.src_local, self.src_offsets,
            self.dst_rank, self.dst_local, self.dst_offsets, _dtype_name(self.wire_dtype),
        )

    def __str__(self) -> str:
        box = ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.sizes, strict=True))
        return (
            f"{self.tensor}[{box}] rank {self.src_rank}:{self.src_local}@{self.src_offsets} -> "
            f"rank {self.dst_rank}:{self.dst_local}@{self.dst_offsets} ({self.nbytes} B {_dtype_name(self.wire_dtype)})"
        )


@dataclass(frozen=True, slots=True)
class Chunk:
    """A sub-box of a wire transfer placed at ``buffer_offset`` bytes inside its message."""

    transfer: int  # index into Plan.transfers
    offsets: tuple[int, ...]  # sub-box start, relative to the transfer's box
    sizes: tuple[int, ...]
    nbytes: int
    buffer_offset: int


@dataclass(frozen=True, slots=True)
class Message:
    """All bytes ``src`` sends ``dst`` in one step: one contiguous buffer on each side."""

    src: int
    dst: int
    nbytes: int  # aligned size of the buffer
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True, slots=True)
class Step:
    messages: tuple[Message, ...]


@dataclass(frozen=True, slots=True)
class RankStep:
    """What one rank does in one step: its sends and receives, at offsets in its staging areas."""

    sends: tuple[tuple[int, int, Message], ...]  # (peer, offset in the send area, message)
    recvs: tuple[tuple[int, int, Message], ...]  # (peer, offset in the receive area, message)


@dataclass(frozen=True)
class Schedule:
    """Wire transfers cut into steps; per step each rank sends at most ``bucket_bytes // 2`` bytes and
    receives at most ``bucket_bytes // 2`` bytes, so its staging memory stays within ``bucket_bytes``."""

    bucket_bytes: int
    steps: tuple[Step, ...]

    def for_rank(self, rank: int) -> tuple[tuple[RankStep, ...], int, int]:
        """This rank's steps, plus the sizes of the send and receive staging areas it needs."""
        out, send_area, recv_area = [], 0, 0
        for step in self.steps:
            sends, recvs, s_off, r_off = [], [], 0, 0
            for m in step.messages:  # messages are sorted by (src, dst)
                if m.src == rank:
                    sends.append((m.dst, s_off, m))
                    s_off += m.nbytes
            for m in sorted(step.messages, key=lambda m: (m.dst, m.src)):
                if m.dst == rank:
                    recvs.append((m.src, r_off, m))
                    r_off += m.nbytes
            send_area, recv_area = max(send_area, s_off), max(recv_area, r_off)
            out.append(RankStep(tuple(sends), tuple(recvs)))
        return tuple(out), send_area, recv_area

    def peak_staging_bytes(self) -> int:
        """The largest staging memory (send + receive areas) any rank allocates."""
        ranks = {m.src for s in self.steps for m in s.messages} | {m.dst for s in self.steps for m in s.messages}
        return max((sum(self.for_rank(r)[1:]) for r in ranks), default=0)


@dataclass(frozen=True, slots=True)
class PlanStats:
    wire_bytes: int
    local_bytes: int
    lower_bound_bytes: int
    sent_bytes: dict[int, int]
    recv_bytes: dict[int, int]
    num_transfers: int
    num_local_copies: int

    @property
    def max_sent_bytes(self) -> int:
        return max(self.sent_bytes.values(), default=0)

    @property
    def max_recv_bytes(self) -> int:
        return max(self.recv_bytes.values(), default=0)

    def __getitem__(self, key: str):
        return getattr(self, key)

    def as_dict(self) -> dict:
        return {
            "wire_bytes": self.wire_bytes,
            "local_bytes": self.local_bytes,
            "lower_bound_bytes": self.lower_bound_bytes,
            "sent_bytes": dict(self.sent_bytes),
            "recv_bytes": dict(self.recv_bytes),
            "max_sent_bytes": self.max_sent_bytes,
            "max_recv_bytes": self.max_recv_bytes,
            "num_transfers": self.num_transfers,
            "num_local_copies": self.num_local_copies,
        }


@dataclass(frozen=True, eq=False)
class Plan:
    """Who sends which box to whom. Validated on construction: every destination element covered exactly once,
    every transfer read from a box its source rank really holds."""

    src: Layout
    dst: Layout
    transfers: tuple[Transfer, ...]  # over the wire (src_rank != dst_rank)
    local_copies: tuple[Transfer, ...]  # src_rank == dst_rank, never on the wire
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for t in self.transfers:
            if t.is_local:
                raise ValueError(f"plan: wire transfer {t} stays on one rank")
        for t in self.local_copies:
            if not t.is_local:
                raise ValueError(f"plan: local copy {t} crosses ranks")
        _validate_plan(self)

    @property
    def digest(self) -> str:
        if "digest" not in self._cache:
            h = hashlib.sha256()
            h.update(self.src.digest.encode())
            h.update(self.dst.digest.encode())
            for t in self.transfers + self.local_copies:
                h.update(repr(t.key()).encode())
            self._cache["digest"] = h.hexdigest()[:16]
        return self._cache["digest"]

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.src.ranks) | set(self.dst.ranks)))

    def stats(self) -> PlanStats:
        if "stats" not in self._cache:
            sent: dict[int, int] = defaultdict(int)
            recv: dict[int, int] = defaultdict(int)
            for t in self.transfers:
                sent[t.src_rank] += t.nbytes
                recv[t.dst_rank] += t.nbytes
            for r in self.ranks:
                sent.setdefault(r, 0)
                recv.setdefault(r, 0)
            self._cache["stats"] = PlanStats(
                wire_bytes=sum(t.nbytes for t in self.transfers),
                local_bytes=sum(t.nbytes for t in self.local_copies),
                lower_bound_bytes=lower_bound_bytes(self.src, self.dst),
                sent_bytes=dict(sorted(sent.items())),
                recv_bytes=dict(sorted(recv.items())),
                num_transfers=len(self.transfers),
                num_local_copies=len(self.local_copies),
            )
        return self._cache["stats"]

    def schedule(self, bucket_bytes: int) -> Schedule:
        """Cut the wire transfers into steps within ``bucket_bytes`` of staging per rank (cached)."""
        key = ("schedule", int(bucket_bytes))
        if key not in self._cache:
            self._cache[key] = build_schedule(self.transfers, int(bucket_bytes))
        return self._cache[key]

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"Plan(digest={self.digest}, {len(self.transfers)} wire transfers ({s.wire_bytes} B, lower bound "
            f"{s.lower_bound_bytes} B), {len(self.local_copies)} local copies ({s.local_bytes} B), ranks "
            f"{list(self.ranks)})"
        )

    def describe(self, max_rows: int = 40) -> str:
        """A readable listing of the plan, for debugging."""
        lines = [repr(self)]
        rows = [("wire", t) for t in self.transfers] + [("local", t) for t in self.local_copies]
        for kind, t in rows[:max_rows]:
            lines.append(f"  {kind:5s} {t}")
        if len(rows) > max_rows:
            lines.append(f"  ... {len(rows) - max_rows} more")
        return "\n".join(lines)

    __str__ = describe


# --------------------------------------------------------------------------------------------------------
# Geometry helpers
# --------------------------------------------------------------------------------------------------------


def _intersect(a_off, a_size, b_off, b_size):
    off, size = [], []
    for ao, as_, bo, bs in zip(a_off, a_size, b_off, b_size, strict=True):
        lo, hi = max(ao, bo), min(ao + as_, bo + bs)
        if hi <= lo:
            return None
        off.append(lo)
        size.append(hi - lo)
    return tuple(off), tuple(size)


def _contains(outer_off, outer_size, off, size) -> bool:
    return all(
        oo <= o and o + s <= oo + os_ for oo, os_, o, s in zip(outer_off, outer_size, off, size, strict=True)
    )


def _decompose(box_off, box_size, cands: Sequence[tuple[tuple[int, ...], tuple[int, ...]]]):
    """Split ``box`` into sub-boxes, each labelled with the set (bitmask) of candidate boxes containing it.

    Cells of the grid made by all candidate boundaries are merged greedily into larger boxes with the same
    label. A label of 0 means no candidate holds that part.
    """
    nd = len(box_off)
    if nd == 0:
        mask = 0
        for i, _ in enumerate(cands):
            mask |= 1 << i
        return [((), (), mask)]
    cuts = []
    for d in range(nd):
        lo, hi = box_off[d], box_off[d] + box_size[d]
        pts = {lo, hi}
        for c_off, c_size in cands:
            for p in (c_off[d], c_off[d] + c_size[d]):
                if lo < p < hi:
                    pts.add(p)
        cuts.append(sorted(pts))
    shape = [len(c) - 1 for c in cuts]
    if math.prod(shape) == 1:
        mask = 0
        for i, (c_off, c_size) in enumerate(cands):
            if _contains(c_off, c_size, box_off, box_size):
                mask |= 1 << i
        return [(tuple(box_off), tuple(box_size), mask)]
    # label every cell
    import itertools

    labels: dict[tuple[int, ...], int] = {}
    for idx in itertools.product(*[range(n) for n in shape]):
        lo = tuple(cuts[d][i] for d, i in enumerate(idx))
        mask = 0
        for ci, (c_off, c_size) in enumerate(cands):
            if all(c_off[d] <= lo[d] < c_off[d] + c_size[d] for d in range(nd)):
                mask |= 1 << ci
        labels[idx] = mask
    done: set[tuple[int, ...]] = set()
    out = []
    for idx in itertools.product(*[range(n) for n in shape]):
        if idx in done:
            continue
        lab = labels[idx]
        hi = list(idx)
        # grow along each dim, last dim first, while every cell of the slab has the same label
        for d in reversed(range(nd)):
            while hi[d] + 1 < shape[d]:
                ranges = [range(idx[k], hi[k] + 1) if k != d else range(hi[d] + 1, hi[d] + 2) for k in range(nd)]
                slab = list(itertools.product(*ranges))
                if all(labels[c] == lab and c not in done for c in slab):
                    hi[d] += 1
                else:
                    break
        for c in itertools.product(*[range(idx[k], hi[k] + 1) for k in range(nd)]):
            done.add(c)
        off = tuple(cuts[d][idx[d]] for d in range(nd))
        size = tuple(cuts[d][hi[d] + 1] - cuts[d][idx[d]] for d in range(nd))
        out.append((off, size, lab))
    return out


def _distinct_boxes(frags: Iterable[Fragment]) -> dict[tuple, list[Fragment]]:
    out: dict[tuple, list[Fragment]] = {}
    for f in frags:
        if f.numel:
            out.setdefault((f.offsets, f.sizes), []).append(f)
    return out


def _wire_dtype(src: TensorSpec, dst: TensorSpec) -> torch.dtype:
    return dst.dtype if _itemsize(dst.dtype) < _itemsize(src.dtype) else src.dtype


# --------------------------------------------------------------------------------------------------------
# Planning
# --------------------------------------------------------------------------------------------------------


def _check_specs(src: Layout, dst: Layout, allow_cast: bool) -> None:
    for spec in dst.tensors:
        frags = dst.fragments_by_tensor.get(spec.name, ())
        where = f"rank {frags[0].rank}" if frags else "no rank"
        s = src.specs.get(spec.name)
        if s is None:
            if any(f.numel for f in frags):
                raise ValueError(
                    f"tensor {spec.name!r} (needed on destination {where}) is not in the source layout"
                )
            continue
        if s.shape != spec.shape:
            raise ValueError(
                f"tensor {spec.name!r}: source global shape {s.shape} != destination global shape {spec.shape} "
                f"(destination {where})"
            )
        if s.dtype != spec.dtype and not allow_cast:
            raise ValueError(
                f"tensor {spec.name!r}: source dtype {_dtype_name(s.dtype)} != destination dtype "
                f"{_dtype_name(spec.dtype)} (destination {where}); pass allow_cast=True to cast in the copy"
            )


def _check_dst_overlap(name: str, frags: Sequence[Fragment]) -> None:
    by_rank: dict[int, list[Fragment]] = defaultdict(list)
    for f in frags:
        by_rank[f.rank].append(f)
    for rank, fs in by_rank.items():
        if len(fs) > 1:
            hit = _find_overlap([(f.offsets, f.sizes, f) for f in fs])
            if hit is not None:
                a, b = hit
                raise ValueError(
                    f"overlapping destination boxes of tensor {name!r} on rank {rank}: {a.offsets}+{a.sizes} "
                    f"(local {a.local!r}) and {b.offsets}+{b.sizes} (local {b.local!r})"
                )


@lru_cache(maxsize=64)
def plan_reshard(src: Layout, dst: Layout, allow_cast: bool = False) -> Plan:
    """Plan the reshard from ``src`` to ``dst`` (pure, deterministic, cached on the two layouts).

    Every destination element is covered exactly once. If the destination rank holds a source copy of an
    element, it is copied locally (never on the wire); otherwise one source holder sends it, holders chosen
    so that bytes sent are spread evenly (fixed sources first, then the rest largest first onto the least
    loaded holder).
    """
    if not isinstance(src, Layout) or not isinstance(dst, Layout):
        raise TypeError(f"plan_reshard takes two Layouts, got {type(src).__name__} and {type(dst).__name__}")
    _check_specs(src, dst, allow_cast)
    world = max(src.ranks + dst.ranks, default=0) + 1
    local: list[Transfer] = []
    # (dst fragment, piece offsets, piece sizes, holder fragments, wire dtype, nbytes)
    remote: list[tuple[Fragment, tuple, tuple, list[Fragment], torch.dtype, int]] = []
    for spec in dst.tensors:
        dfrags = [f for f in dst.fragments_by_tensor.get(spec.name, ()) if f.numel]
        if not dfrags:
            continue
        _check_dst_overlap(spec.name, dfrags)
        sspec = src.specs[spec.name]
        wdt = _wire_dtype(sspec, spec)
        isz = _itemsize(wdt)
        sboxes = list(_distinct_boxes(src.fragments_by_tensor.get(spec.name, ())).items())
        for (d_off, d_size), dgroup in _distinct_boxes(dfrags).items():
            cand = [(i, b) for i, (b, _) in enumerate(sboxes) if _intersect(b[0], b[1], d_off, d_size)]
            pieces = _decompose(d_off, d_size, [b for _, b in cand])
            for p_off, p_size, mask in pieces:
                if mask == 0:
                    raise ValueError(
                        f"tensor {spec.name!r}: element {p_off} (box {p_off}+{p_size}) needed on destination "
                        f"rank {dgroup[0].rank} is held by no source rank"
                    )
            for df in sorted(dgroup, key=lambda f: (f.rank, f.local)):
                for p_off, p_size, mask in pieces:
                    holders = [
                        f for j, (i, _) in enumerate(cand) if mask >> j & 1 for f in sboxes[i][1]
                    ]
                    mine = [f for f in holders if f.rank == df.rank]
                    if mine:
                        local.append(_make_transfer(spec.name, p_off, p_size, mine[0], df, wdt))
                    else:
                        remote.append((df, p_off, p_size, holders, wdt, math.prod(p_size) * isz))
    # choose holders: fixed ones first, then largest first onto the least loaded holder
    load: dict[int, int] = defaultdict(int)
    chosen: list[Fragment | None] = [None] * len(remote)
    flexible = []
    for i, (_df, _o, _s, holders, _w, nbytes) in enumerate(remote):
        ranks = {h.rank for h in holders}
        if len(ranks) == 1:
            chosen[i] = holders[0]
            load[holders[0].rank] += nbytes
        else:
            flexible.append(i)
    flexible.sort(key=lambda i: -remote[i][5])
    for i in flexible:
        df, _o, _s, holders, _w, nbytes = remote[i]
        best = min(holders, key=lambda h: (load[h.rank], (h.rank - df.rank) % world, h.local))
        chosen[i] = best
        load[best.rank] += nbytes
    wire = [
        _make_transfer(df.tensor, o, s, chosen[i], df, w) for i, (df, o, s, _h, w, _n) in enumerate(remote)
    ]
    wire.sort(key=lambda t: (t.src_rank, t.dst_rank, t.tensor, t.offsets))
    local.sort(key=lambda t: (t.dst_rank, t.tensor, t.offsets, t.dst_local))
    return Plan(src, dst, tuple(wire), tuple(local))


def _make_transfer(name, off, size, sf: Fragment, df: Fragment, wdt: torch.dtype) -> Transfer:
    s_off, _ = sf.local_box(off, size)
    d_off, _ = df.local_box(off, size)
    return Transfer(name, tuple(off), tuple(size), sf.rank, sf.local, s_off, df.rank, df.local, d_off, wdt)


def lower_bound_bytes(src: Layout, dst: Layout) -> int:
    """Least possible wire bytes: for each destination fragment, the bytes its rank does not hold as source.

    Computed from the layouts alone (independently of the transfers a plan chose).
    """
    total = 0
    for spec in dst.tensors:
        sspec = src.specs.get(spec.name)
        if sspec is None:
            continue
        isz = _itemsize(_wire_dtype(sspec, spec))
        own: dict[int, list[tuple]] = defaultdict(list)
        for f in src.fragments_by_tensor.get(spec.name, ()):
            if f.numel:
                own[f.rank].append((f.offsets, f.sizes))
        for df in dst.fragments_by_tensor.get(spec.name, ()):
            if not df.numel:
                continue
            boxes = [b for b in dict.fromkeys(own.get(df.rank, ())) if _intersect(b[0], b[1], df.offsets, df.sizes)]
            held = sum(
                math.prod(s) for _, s, mask in _decompose(df.offsets, df.sizes, boxes) if mask
            ) if boxes else 0
            total += (df.numel - held) * isz
    return total


# --------------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------------


def _validate_plan(plan: Plan) -> None:
    """Exact cover of every destination fragment; every transfer reads what its source rank holds."""
    src, dst = plan.src, plan.dst
    s_index: dict[tuple[str, int, str], list[Fragment]] = defaultdict(list)
    for f in src.fragments:
        s_index[(f.tensor, f.rank, f.local)].append(f)
    d_index: dict[tuple[str, int, str], list[Fragment]] = defaultdict(list)
    for f in dst.fragments:
        d_index[(f.tensor, f.rank, f.local)].append(f)
    covered: dict[tuple[int, str], list] = defaultdict(list)
    for t in plan.transfers + plan.local_copies:
        sf = [
            f for f in s_index.get((t.tensor, t.src_rank, t.src_local), ())
            if _contains(f.offsets, f.sizes, t.offsets, t.sizes) and f.local_box(t.offsets, t.sizes)[0] == t.src_offsets
        ]
        if not sf:
            raise ValueError(f"plan: transfer {t} reads a box source rank {t.src_rank} does not hold")
        df = [
            f for f in d_index.get((t.tensor, t.dst_rank, t.dst_local), ())
            if _contains(f.offsets, f.sizes, t.offsets, t.sizes) and f.local_box(t.offsets, t.sizes)[0] == t.dst_offsets
        ]
        if not df:
            raise ValueError(f"plan: transfer {t} writes outside the destination fragments of rank {t.dst_rank}")
        if t.numel:
            loc_off, loc_size = df[0].local_box(t.offsets, t.sizes)
            covered[(t.dst_rank, t.dst_local)].append((loc_off, loc_size, t))
    for (rank, local), boxes in covered.items():
        hit = _find_overlap(boxes)
        if hit is not None:
            raise ValueError(
                f"plan: tensor {hit[0].tensor!r} on destination rank {rank} ({local!r}) is written twice: "
                f"{hit[0]} and {hit[1]}"
            )
    need: dict[tuple[int, str], int] = defaultdict(int)
    for f in dst.fragments:
        need[(f.rank, f.local)] += f.numel
    got = {k: sum(math.prod(b[1]) for b in v) for k, v in covered.items()}
    for key, n in need.items():
        if got.get(key, 0) != n:
            raise ValueError(
                f"plan: destination local tensor {key[1]!r} on rank {key[0]} gets {got.get(key, 0)} of its "
                f"{n} elements"
            )


# --------------------------------------------------------------------------------------------------------
# Schedule
# --------------------------------------------------------------------------------------------------------


def _split_box(sizes: tuple[int, ...], itemsize: int, cap: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Split a box (relative offsets) into sub-boxes of at most ``cap`` bytes once aligned."""
    if _align(math.prod(sizes) * itemsize) <= cap or not sizes:
        return [((0,) * len(sizes), tuple(sizes))]
    nd = len(sizes)
    # smallest d such that one slice along dims > d fits; split dims < d into single indices
    d = nd - 1
    for k in range(nd):
        if _align(math.prod(sizes[k + 1:]) * itemsize) <= cap:
            d = k
            break
    inner = math.prod(sizes[d + 1:]) * itemsize
    rows = max(1, cap // inner) if inner else sizes[d]  # cap is a multiple of ALIGN
    out = []
    import itertools

    for outer in itertools.product(*[range(n) for n in sizes[:d]]):
        for start in range(0, sizes[d], rows):
            n = min(rows, sizes[d] - start)
            out.append((tuple(outer) + (start,) + (0,) * (nd - d - 1), (1,) * d + (n,) + tuple(sizes[d + 1:])))
    return out


def build_schedule(transfers: Sequence[Transfer], bucket_bytes: int) -> Schedule:
    """First-fit-decreasing packing of chunks into steps with per-rank send and receive caps."""
    if bucket_bytes < 16 * ALIGN:
        raise ValueError(f"bucket_bytes={bucket_bytes} is too small (at least {16 * ALIGN})")
    cap = bucket_bytes // 2 // ALIGN * ALIGN
    chunks: list[tuple[int, tuple, tuple, int, int, int]] = []  # (transfer, off, size, nbytes, src, dst)
    for i, t in enumerate(transfers):
        isz = _itemsize(t.wire_dtype)
        for off, size in _split_box(t.sizes, isz, cap):
            n = math.prod(size) * isz
            if n:
                chunks.append((i, off, size, n, t.src_rank, t.dst_rank))
    order = sorted(range(len(chunks)), key=lambda k: (-_align(chunks[k][3]), k))
    send_load: list[dict[int, int]] = []
    recv_load: list[dict[int, int]] = []
    placed: list[list[int]] = []
    for k in order:
        _i, _o, _s, n, s, d = chunks[k]
        a = _align(n)
        step = 0
        while step < len(placed) and (send_load[step].get(s, 0) + a > cap or recv_load[step].get(d, 0) + a > cap):
            step += 1
        if step == len(placed):
            placed.append([])
            send_load.append({})
            recv_load.append({})
        placed[step].append(k)
        send_load[step][s] = send_load[step].get(s, 0) + a
        recv_load[step][d] = recv_load[step].get(d, 0) + a
    steps = []
    for ks in placed:
        by_pair: dict[tuple[int, int], list[int]] = defaultdict(list)
        for k in sorted(ks):
            by_pair[(chunks[k][4], chunks[k][5])].append(k)
        msgs = []
        for (s, d), kk in sorted(by_pair.items()):
            off, cs = 0, []
            for k in kk:
                i, o, sz, n, _s, _d = chunks[k]
                cs.append(Chunk(i, o, sz, n, off))
                off += _align(n)
            msgs.append(Message(s, d, off, tuple(cs)))
        steps.append(Step(tuple(msgs)))
    return Schedule(bucket_bytes, tuple(steps))
