"""``refit``: the drop-in replacement for a framework's weight-refit function.

Takes the training side's named local tensors and the inference side's named local tensors (e.g. the
``named_parameters()`` of each model on this rank) plus the two layouts, and updates the inference tensors
in place. Plans and staging buffers are cached across calls: an RL loop pays planning once.

``verify_refit`` runs the same reshard without writing: it proves that the two layouts agree with what the
tensors really hold (e.g. once at startup, after trainer and engine each loaded the same checkpoint).
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

from .execute import DEFAULT_BUCKET_BYTES, DEFAULT_TIMEOUT, Resharder, RunReport, VerifyReport
from .group import RefitGroup
from .layout import Layout
from .plan import plan_reshard

_CACHE: OrderedDict[tuple, Resharder] = OrderedDict()
_CACHE_SIZE = 8
_WARNED: weakref.WeakKeyDictionary[Resharder, set[tuple[str, ...]]] = weakref.WeakKeyDictionary()

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
    group: dist.ProcessGroup | RefitGroup | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    timeout: float | timedelta = DEFAULT_TIMEOUT,
    backend: str | None = None,
    allow_cast: bool = False,
    gpus_per_node: int | None = None,
    relay: bool | None = None,
    instances: int = 1,
) -> Resharder:
    """The cached Resharder for these layouts and options (plan and buffers reused across calls).

    ``instances``: ``dst_layout`` is one engine's layout and ``instances`` copies of it follow each other
    (see :func:`refit`)."""
    key = (src_layout, dst_layout, id(group) if group is not None else None, int(bucket_bytes),
           str(timeout), backend, bool(allow_cast), gpus_per_node, relay, instances)
    hit = _CACHE.get(key)
    if hit is not None:
        _CACHE.move_to_end(key)
        return hit
    groups = None
    if instances != 1:
        groups = dst_layout.instance_groups(instances)
        dst_layout = dst_layout.instances(instances)
    plan = plan_reshard(src_layout, dst_layout, allow_cast, gpus_per_node, relay, groups)
    r = Resharder(plan, group=group, bucket_bytes=bucket_bytes, timeout=timeout, backend=backend)
    _CACHE[key] = r
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return r


def _drop_uncovered(r: Resharder, dst: dict[str, torch.Tensor], strict: bool, what: str):
    """The destination tensors the layout covers on this rank, and the sorted names of the others (ignored,
    with one warning per Resharder and set of names). ``strict``: keep them all (``run`` then rejects them)."""
    if strict:
        return dst, ()
    specs = r.plan.dst.local_specs(r.rank)
    ignored = tuple(sorted(n for n in dst if n not in specs))
    if not ignored:
        return dst, ()
    seen = _WARNED.setdefault(r, set())
    if ignored not in seen:
        seen.add(ignored)
        warnings.warn(
            f"{what}: rank {r.rank}: ignoring {len(ignored)} destination tensor(s) that the destination layout "
            f"does not cover on this rank: {list(ignored)} (strict=True makes this an error)",
            stacklevel=3,
        )
    return {n: t for n, t in dst.items() if n in specs}, ignored


def refit(
    src_tensors: TensorsLike,
    dst_tensors: TensorsLike,
    src_layout: Layout,
    dst_layout: Layout,
    *,
    group: dist.ProcessGroup | RefitGroup | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    timeout: float | timedelta = DEFAULT_TIMEOUT,
    backend: str | None = None,
    allow_cast: bool = False,
    gpus_per_node: int | None = None,
    relay: bool | None = None,
    instances: int = 1,
    strict: bool = False,
) -> RunReport:
    """Update this rank's inference tensors in place from the training tensors. Call on every rank of ``group``.

    ``src_tensors`` / ``dst_tensors``: dicts (or ``named_parameters()`` iterators) of this rank's local tensors
    on each side; ``None`` or ``{}`` for a side this rank has no part in. Local names are the layouts' local
    tensor names. Destination tensors the destination layout does not cover on this rank (e.g. parameters an
    engine derives after loading, like vLLM MLA's ``W_UV`` / ``W_UK_T``) are left alone and listed in
    ``RunReport.ignored``, with a warning the first time; ``strict=True`` rejects them instead. A destination
    tensor of the layout that is not given, and any unknown source tensor, is an error either way.
    ``allow_cast=True`` lets the dtypes differ (e.g. fp32 master weights -> bf16): the copy
    casts, on the sender when that shrinks the bytes on the wire. ``gpus_per_node``: ranks per node (NVLink
    domain) for topology-aware routing (prefer a source in the destination's node; with ``relay``, on by
    default then, fan a piece out inside a node instead of sending it over the network to every rank there).

    ``instances=N``: N independent engines, each a full copy of ``dst_layout`` (one engine's layout): engine
    ``i`` is ``dst_layout`` with every rank shifted by ``i * span``, ``span`` = its highest rank - its lowest
    + 1 (``Layout.instances``), e.g. one engine on ranks 8-11 and ``instances=3``: engines on 8-11, 12-15,
    16-19; every rank of every engine passes its own tensors, named as in ``dst_layout``. ``relay`` (on by
    default then) spreads the trainer's sends over the engines: a piece the same position of several engines
    needs is sent once, in parts, one part to each engine, and each engine's rank relays its part to that
    position in the others, so the trainer sends each byte ~once instead of N times (``relay=False``: every
    engine rank receives everything from the trainer).
    """
    r = get_resharder(src_layout, dst_layout, group=group, bucket_bytes=bucket_bytes, timeout=timeout,
                      backend=backend, allow_cast=allow_cast, gpus_per_node=gpus_per_node, relay=relay,
                      instances=instances)
    dst, ignored = _drop_uncovered(r, _as_dict(dst_tensors, "destination"), strict, "refit")
    report = r.run(_as_dict(src_tensors, "source"), dst)
    return dataclasses.replace(report, ignored=ignored) if ignored else report


def verify_refit(
    src_tensors: TensorsLike,
    dst_tensors: TensorsLike,
    src_layout: Layout,
    dst_layout: Layout,
    *,
    group: dist.ProcessGroup | RefitGroup | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    timeout: float | timedelta = DEFAULT_TIMEOUT,
    backend: str | None = None,
    allow_cast: bool = False,
    gpus_per_node: int | None = None,
    relay: bool | None = None,
    instances: int = 1,
    strict: bool = False,
) -> VerifyReport:
    """Check, without writing anything, that ``refit`` with these arguments would leave ``dst_tensors``
    exactly as they are. Call on every rank of ``group``; the report's ``ok`` is the same on every rank.

    The startup recipe: trainer and engine each load the same checkpoint with their own loaders, then one
    ``verify_refit(train_params, engine_params, train_layout, engine_layout)`` proves the layouts (every
    element of every destination box, bit for bit) before the first real refit. A wrong layout (halves of a
    fused tensor swapped, GQA groups in the wrong order, shards permuted) shows up as a count of differing
    elements per destination tensor and the first differing element (``str(report)``).

    It runs refit's plan and transport (cached like refit's), with every received message staged and the
    unpack and local copies replaced by compares: raw bits, after the cast to the destination dtype where
    the wire dtype differs (``allow_cast``), so NaN payloads and signed zeros count. (One exception: after a
    cast verify performs itself, in a local copy or a widening receive, any NaN matches any NaN, because the
    NaN bits a cast writes depend on the copy path; a narrowing cast happens on the sender, in the same pack
    as refit's, so its bytes compare exactly.) It writes nothing, ever,
    and its memory stays within ``bucket_bytes`` of staging plus one chunk's compare temporaries.

    Relays: a relay forwards what the relaying rank's destination tensor holds, the very thing under test,
    so with ``gpus_per_node`` or ``instances > 1`` verify plans *without* relays (``relay=False``: every piece
    comes from a source rank; the same holders otherwise, more bytes over the network, once). Options and ``strict`` as in
    :func:`refit`; ignored destination tensors are listed in ``VerifyReport.ignored``.
    """
    if gpus_per_node is not None or instances != 1:
        relay = False  # relays would read the tensors under test (relay=True without either still fails)
    r = get_resharder(src_layout, dst_layout, group=group, bucket_bytes=bucket_bytes, timeout=timeout,
                      backend=backend, allow_cast=allow_cast, gpus_per_node=gpus_per_node, relay=relay,
                      instances=instances)
    dst, ignored = _drop_uncovered(r, _as_dict(dst_tensors, "destination"), strict, "verify_refit")
    report = r.verify(_as_dict(src_tensors, "source"), dst)
    return dataclasses.replace(report, ignored=ignored) if ignored else report


def clear_cache() -> None:
    """Drop cached plans and buffers (e.g. after destroying a process group)."""
    _CACHE.clear()
    plan_reshard.cache_clear()
