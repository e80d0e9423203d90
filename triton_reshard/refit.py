"""``refit``: the drop-in replacement for a framework's weight-refit function.

Takes the training side's named local tensors and the inference side's named local tensors (e.g. the
``named_parameters()`` of each model on this rank) plus the two layouts, and updates the inference tensors
in place. Plans and staging buffers are cached across calls: an RL loop pays planning once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

from .execute import DEFAULT_BUCKET_BYTES, DEFAULT_TIMEOUT, Resharder, RunReport
from .layout import Layout
from .plan import plan_reshard

_CACHE: OrderedDict[tuple, Resharder] = OrderedDict()
_CACHE_SIZE = 8

TensorsLike = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | None


def _as_dict(tensors: TensorsLike, side: str) -> dict[str, torch.Tensor]:
    if tensors is None:
        return {}
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    out: dict[str, torch.Tensor] = {}
    for item in items:
        try:
            name, t = item
        except (TypeError, ValueError):
            raise TypeError(f"refit: {side} tensors must be a dict or (name, tensor) pairs, got {item!r}") from None
        if name in out:
            raise ValueError(f"refit: {side} tensor {name!r} is given twice")
        # parameters: write through .data so autograd leaves can be updated in place
        out[name] = t.data if isinstance(t, torch.nn.Parameter) else t
    return out


def get_resharder(
    src_layout: Layout,
    dst_layout: Layout,
    *,
    group: dist.ProcessGroup | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    timeout: float | timedelta = DEFAULT_TIMEOUT,
    backend: str | None = None,
    allow_cast: bool = False,
    gpus_per_node: int | None = None,
    relay: bool | None = None,
) -> Resharder:
    """The cached Resharder for these layouts and options (plan and buffers reused across calls)."""
    key = (src_layout, dst_layout, id(group) if group is not None else None, int(bucket_bytes),
           str(timeout), backend, bool(allow_cast), gpus_per_node, relay)
    hit = _CACHE.get(key)
    if hit is not None:
        _CACHE.move_to_end(key)
        return hit
    plan = plan_reshard(src_layout, dst_layout, allow_cast, gpus_per_node, relay)
    r = Resharder(plan, group=group, bucket_bytes=bucket_bytes, timeout=timeout, backend=backend)
    _CACHE[key] = r
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return r


def refit(
    src_tensors: TensorsLike,
    dst_tensors: TensorsLike,
    src_layout: Layout,
    dst_layout: Layout,
    *,
    group: dist.ProcessGroup | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    timeout: float | timedelta = DEFAULT_TIMEOUT,
    backend: str | None = None,
    allow_cast: bool = False,
    gpus_per_node: int | None = None,
    relay: bool | None = None,
) -> RunReport:
    """Update this rank's inference tensors in place from the training tensors. Call on every rank of ``group``.

    ``src_tensors`` / ``dst_tensors``: dicts (or ``named_parameters()`` iterators) of this rank's local tensors
    on each side; ``None`` or ``{}`` for a side this rank has no part in. Local names are the layouts' local
    tensor names. ``allow_cast=True`` lets the dtypes differ (e.g. fp32 master weights -> bf16): the copy
    casts, on the sender when that shrinks the bytes on the wire. ``gpus_per_node``: ranks per node (NVLink
    domain) for topology-aware routing (prefer a source in the destination's node; with ``relay``, on by
    default then, fan a piece out inside a node instead of sending it over the network to every rank there).
    """
    r = get_resharder(src_layout, dst_layout, group=group, bucket_bytes=bucket_bytes, timeout=timeout,
                      backend=backend, allow_cast=allow_cast, gpus_per_node=gpus_per_node, relay=relay)
    return r.run(_as_dict(src_tensors, "source"), _as_dict(dst_tensors, "destination"))


def clear_cache() -> None:
    """Drop cached plans and buffers (e.g. after destroying a process group)."""
    _CACHE.clear()
    plan_reshard.cache_clear()
