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
