"""The first-fit schedule of earlier versions, a reference the tests compare against (not part of the package):
wire transfers cut into memory-bounded steps of per-pair messages (first-fit decreasing). The package's plans
are scheduled by the pair rule (``plan/pair_schedule.py``, ``Plan.schedule``)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

from triton_reshard.box import align_up, is_contiguous_box, split_box
from triton_reshard.layout import gc_paused, itemsize_of
from triton_reshard.plan.quant import split_src_chunks
from triton_reshard.plan.types import (
    ALIGN,
    DIRECT_MIN_BYTES,
    MIN_STEP_BYTES,
    Chunk,
    Message,
    Schedule,
    Step,
    Transfer,
)


def build_schedule(transfers: Sequence[Transfer], bucket_bytes: int, contiguity: Sequence[tuple] | None = None,
                   direct_min_bytes: int = DIRECT_MIN_BYTES) -> Schedule:
    """First-fit-decreasing packing of chunks into steps with per-rank send and receive caps.

    Relay transfers get steps of their own after all others (phase 1). ``contiguity``: per transfer, the
    (source, destination) local tensor shapes where its bytes could move in place (see
    ``Plan._contiguity``); chunks of at least ``direct_min_bytes`` contiguous on one of those sides become
    direct messages. None: every message is packed.
    """
    if bucket_bytes < MIN_STEP_BYTES:
        raise ValueError(f"bucket_bytes={bucket_bytes} is too small (at least {MIN_STEP_BYTES})")
    if direct_min_bytes < 0:
        raise ValueError(f"direct_min_bytes={direct_min_bytes} must be >= 0")
    with gc_paused():
        return _build_schedule(transfers, bucket_bytes, contiguity, direct_min_bytes)


def first_fit(chunks: Sequence[tuple], order: Sequence[int], cap: int) -> list[list[int]]:
    """First fit of ``chunks`` (taken in ``order``, aligned sizes non-increasing) into steps where each rank
    sends at most ``cap`` and receives at most ``cap`` bytes: chunk k goes to the first step with room.

    Exact first fit, without rescanning: while the aligned size stays the same, a step with no room for a
    rank's sends (or receives) never gets room again (loads only grow), so each rank keeps a pointer past
    the prefix of steps known to be full for it.
    """
    send: dict[int, list[int]] = defaultdict(list)  # rank -> bytes sent per step (steps past the end: 0)
    recv: dict[int, list[int]] = defaultdict(list)
    past_s: dict[int, int] = {}  # rank -> steps before it have no room to send `size` bytes
    past_d: dict[int, int] = {}
    placed: list[list[int]] = []
    size = None
    for k in order:
        _i, _o, _s, n, s, d = chunks[k]
        a = (n + ALIGN - 1) // ALIGN * ALIGN
        if a != size:
            size = a
            past_s.clear()
            past_d.clear()
        lim = cap - a
        ss, rr = send[s], recv[d]
        ps, pd = past_s.get(s, 0), past_d.get(d, 0)
        step, nsteps = max(ps, pd), len(placed)
        while step < nsteps:
            full_s = step < len(ss) and ss[step] > lim
            full_d = step < len(rr) and rr[step] > lim
            if not (full_s or full_d):
                break
            if full_s and ps == step:
                ps += 1
            if full_d and pd == step:
                pd += 1
            step += 1
        past_s[s], past_d[d] = ps, pd
        if step == nsteps:
            placed.append([])
        placed[step].append(k)
        if len(ss) <= step:
            ss.extend([0] * (step + 1 - len(ss)))
        if len(rr) <= step:
            rr.extend([0] * (step + 1 - len(rr)))
        ss[step] += a
        rr[step] += a
    return placed


def _build_schedule(transfers: Sequence[Transfer], bucket_bytes: int, contiguity: Sequence[tuple] | None,
                    direct_min_bytes: int) -> Schedule:
    cap = bucket_bytes // 2 // ALIGN * ALIGN
    chunks: list[tuple[int, tuple, tuple, int, int, int]] = []  # (transfer, off, size, nbytes, src, dst)
    phase_of: list[int] = []
    for i, t in enumerate(transfers):
        if t.quant == "src":  # fp8 + scales, cut at block multiples only (plan/quant.py)
            for off, size, n in split_src_chunks(t, cap):
                chunks.append((i, off, size, n, t.src_rank, t.dst_rank))
                phase_of.append(0)
            continue
        isz = itemsize_of(t.wire_dtype)
        for off, size in split_box(t.sizes, isz, cap):
            n = math.prod(size) * isz
            if n:
                chunks.append((i, off, size, n, t.src_rank, t.dst_rank))
                phase_of.append(1 if t.relay else 0)

    def direct(k: int) -> bool:
        i, off, size, n, _s, _d = chunks[k]
        if contiguity is None or n < direct_min_bytes:
            return False
        t = transfers[i]
        shapes = contiguity.shapes(t)
        if shapes is None:
            return False
        s_shape, d_shape = shapes
        return (s_shape is not None and is_contiguous_box(s_shape, t.src_offsets, off, size)) or (
            d_shape is not None and is_contiguous_box(d_shape, t.dst_offsets, off, size)
        )

    steps = []
    for phase in (0, 1):
        mine = [k for k in range(len(chunks)) if phase_of[k] == phase]
        order = sorted(mine, key=lambda k: (-align_up(chunks[k][3]), k))
        for ks in first_fit(chunks, order, cap):
            by_pair: dict[tuple[int, int], list[int]] = defaultdict(list)
            for k in sorted(ks):
                by_pair[(chunks[k][4], chunks[k][5])].append(k)
            msgs = []
            for (s, d), kk in sorted(by_pair.items()):
                off, cs, singles = 0, [], []
                for k in kk:
                    i, o, sz, n, _s, _d = chunks[k]
                    if direct(k):
                        singles.append(Message(s, d, align_up(n), (Chunk(i, o, sz, n, 0),), direct=True))
                        continue
                    cs.append(Chunk(i, o, sz, n, off))
                    off += align_up(n)
                if cs:
                    msgs.append(Message(s, d, off, tuple(cs)))
                msgs.extend(singles)
            steps.append(Step(tuple(msgs), phase))
    return Schedule(bucket_bytes, tuple(steps))
