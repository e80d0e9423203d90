"""The approach we replace: all-gather every source tensor to full size, then slice.

``allgather_refit`` is what a typical RL refit does today (gather each weight to full size on every rank,
then let each inference rank copy out its shard). It works for any pair of layouts: for each logical tensor,
each distinct source box is broadcast from one holder to every rank of the group, assembled into a full
tensor, and every destination fragment is sliced from it. It is used by the tests and by ``perf/`` so every
claim about the reshard collective is measured side by side with it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..execute import ReshardTimeoutError, to_timedelta
from ..layout import Layout, box_slices


@dataclass(frozen=True, slots=True)
class BaselineReport:
    rank: int
    recv_bytes: int  # bytes this rank received (every box it did not hold itself)
    peak_extra_bytes: int  # largest full tensor + box buffer it held at once
    seconds: float


def allgather_refit(
    src_tensors: Mapping[str, torch.Tensor],
    dst_tensors: Mapping[str, torch.Tensor],
    src_layout: Layout,
    dst_layout: Layout,
    group: dist.ProcessGroup | None = None,
    timeout: float | timedelta = 300.0,
) -> BaselineReport:
    """All-gather to full size, then slice. Call on every rank of ``group``; updates ``dst_tensors`` in place."""
    t0 = time.perf_counter()
    timeout = to_timedelta(timeout)
    rank = dist.get_rank()
    device = next(iter(src_tensors.values()), next(iter(dst_tensors.values()), torch.empty(0))).device
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    recv = peak = 0
    with torch.no_grad():
        for spec in dst_layout.tensors:
            if spec.name not in src_layout.specs:
                continue
            boxes: dict[tuple, object] = {}
            for f in src_layout.fragments_by_tensor.get(spec.name, ()):
                if f.numel:
                    boxes.setdefault((f.offsets, f.sizes), f)  # one holder per distinct box: the lowest rank
            sdt = src_layout.specs[spec.name].dtype
            full = torch.empty(spec.shape, dtype=sdt, device=device)
            isz = full.element_size()
            box_peak = 0
            for (off, size), f in sorted(boxes.items()):
                buf = torch.empty(size, dtype=sdt, device=device)
                box_peak = max(box_peak, buf.numel() * isz)
                if f.rank == rank:
                    loff, lsize = f.local_box(off, size)
                    buf.copy_(src_tensors[f.local][box_slices(loff, lsize)].reshape(size))
                else:
                    recv += buf.numel() * isz
                work = dist.broadcast(buf, src=f.rank, group=group, async_op=True)
                try:
                    work.wait(timeout=timeout)
                except RuntimeError as e:
                    raise ReshardTimeoutError(f"rank {rank}: baseline broadcast of {spec.name!r} timed out: {e}") from e
                full[box_slices(off, size)].copy_(buf)
            peak = max(peak, math.prod(spec.shape) * isz + box_peak)
            for df in dst_layout.fragments_by_tensor.get(spec.name, ()):
                if df.rank != rank or not df.numel:
                    continue
                loff, lsize = df.local_box(df.offsets, df.sizes)
                dst_tensors[df.local][box_slices(loff, lsize)].copy_(full[box_slices(df.offsets, df.sizes)].reshape(lsize))
            del full
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return BaselineReport(rank, recv, peak, time.perf_counter() - t0)


_BCAST_GROUPS: dict[tuple[int, ...], object] = {}


def gather_broadcast_refit(
    src_tensors: Mapping[str, torch.Tensor],
    dst_tensors: Mapping[str, torch.Tensor],
    src_layout: Layout,
    dst_layout: Layout,
    timeout: float | timedelta = 300.0,
) -> BaselineReport:
    """Gather every tensor to full size on one trainer rank, then broadcast it to every destination rank, which
    slices its part: what SGLang's ``update_weights_from_distributed``, TRL and OpenRLHF do (their broadcast
    group: the root + every engine rank). The root is the lowest source rank. Call on every rank of the default
    group (the broadcast group is made here, once, by all of them); updates ``dst_tensors`` in place."""
    t0 = time.perf_counter()
    timeout = to_timedelta(timeout)
    rank = dist.get_rank()
    root = min(src_layout.ranks)
    members = tuple(sorted({root, *dst_layout.ranks}))
    if members not in _BCAST_GROUPS:
        _BCAST_GROUPS[members] = dist.new_group(list(members), timeout=timeout)
    group = _BCAST_GROUPS[members]
    recv = peak = 0

    def wait(work, what: str) -> None:
        try:
            work.wait(timeout=timeout)
        except RuntimeError as e:
            raise ReshardTimeoutError(f"rank {rank}: gather-broadcast baseline: {what} timed out: {e}") from e

    with torch.no_grad():
        for spec in dst_layout.tensors:
            if spec.name not in src_layout.specs:
                continue
            sdt = src_layout.specs[spec.name].dtype
            boxes: dict[tuple, object] = {}
            for f in src_layout.fragments_by_tensor.get(spec.name, ()):
                if f.numel:
                    boxes.setdefault((f.offsets, f.sizes), f)
            if rank not in members and all(f.rank != rank for f in boxes.values()):
                continue
            full = torch.empty(spec.shape, dtype=sdt) if rank in members else None
            for (off, size), f in sorted(boxes.items()):  # 1. gather onto the root
                if f.rank == rank:
                    loff, lsize = f.local_box(off, size)
                    part = src_tensors[f.local][box_slices(loff, lsize)]
                    if rank == root:
                        full[box_slices(off, size)].copy_(part.reshape(size))
                    else:
                        wait(dist.isend(part.contiguous(), root), f"send of {spec.name!r} to the root")
                elif rank == root:
                    buf = torch.empty(size, dtype=sdt)
                    wait(dist.irecv(buf, f.rank), f"receive of {spec.name!r} from rank {f.rank}")
                    full[box_slices(off, size)].copy_(buf)
                    recv += buf.numel() * buf.element_size()
            if rank not in members:
                continue
            # 2. broadcast the full tensor to every engine rank
            wait(dist.broadcast(full, src=root, group=group, async_op=True), f"broadcast of {spec.name!r}")
            if rank != root:
                recv += full.numel() * full.element_size()
            peak = max(peak, full.numel() * full.element_size())
            for df in dst_layout.fragments_by_tensor.get(spec.name, ()):
                if df.rank != rank or not df.numel:
                    continue
                loff, lsize = df.local_box(df.offsets, df.sizes)
                dst_tensors[df.local][box_slices(loff, lsize)].copy_(full[box_slices(df.offsets, df.sizes)].reshape(lsize))
    return BaselineReport(rank, recv, peak, time.perf_counter() - t0)
