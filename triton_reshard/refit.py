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

from .comm.group import RefitGroup, as_transport
from .execute import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_TIMEOUT,
    RefitOptions,
    Resharder,
    ReshardError,
    RunReport,
    VerifyReport,
    refuse,
)
from .execute.delta import NO_VERSION, DeltaRequest
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

    The cache key is ``(src_layout, dst_layout, group, bucket_bytes, timeout, backend, allow_cast,
    gpus_per_node, relay, instances)``: layouts by value (an equal layout rebuilt every step still hits), the
    group by identity (``None``: the default group of now). The tensors are not in the key: passing new tensor
    objects each call is fine as long as they have the layouts' names, shapes and dtypes; when their memory
    (addresses, strides) differs from the last call the Resharder re-binds them (rebuilds its copy lists,
    keeps its staging buffers), same memory is free. Up to 8 entries, least recently used dropped; an entry of
    a failed or destroyed group is never returned. Call :func:`clear_cache` to free the staging memory of
    layouts you no longer refit, or after changing the process groups by hand.

    ``instances``: ``dst_layout`` is one engine's layout and ``instances`` copies of it follow each other
    (see :func:`refit`). Raises what :func:`~triton_reshard.plan_reshard` and ``Resharder`` raise for layouts
    or options that cannot work (``ValueError`` / ``TypeError``, naming the tensor or option)."""
    opts = RefitOptions.of(bucket_bytes, timeout, backend, allow_cast=allow_cast, gpus_per_node=gpus_per_node,
                           relay=relay, instances=instances)
    return resharder_for(src_layout, dst_layout, group, opts)


def resharder_for(src_layout: Layout, dst_layout: Layout, group, opts: RefitOptions) -> Resharder:
    """:func:`get_resharder` with validated options."""
    key = (src_layout, dst_layout, _group_key(group), opts)
    hit = _CACHE.get(key)
    if hit is not None and _usable(hit):
        _CACHE.move_to_end(key)
        return hit
    _CACHE.pop(key, None)
    groups = None
    relay, instances = opts.relay, opts.instances
    if relay is None and dst_layout.quantized and (opts.gpus_per_node is not None or instances != 1):
        relay = False  # block-quantized destinations are not relayed (plan/quant.py): every rank gets its own
    if instances != 1:
        groups = dst_layout.instance_groups(instances)
        dst_layout = dst_layout.instances(instances)
    # this rank's share only (plan/local.py): its transfers and steps, computed from the layouts without
    # planning the other ranks'; its peers compute the matching halves
    plan = plan_reshard(src_layout, dst_layout, opts.allow_cast, opts.gpus_per_node, relay, groups,
                        rank=as_transport(group).rank)
    r = Resharder(plan, group=group, options=opts)
    _CACHE[key] = r
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return r


class _GroupKey:
    """A cache key for a group: equal only for the very same live object. It holds the group, so while the
    entry lives no other group can take the object's id."""

    __slots__ = ("group",)

    def __init__(self, group) -> None:
        self.group = group

    def __hash__(self) -> int:
        return id(self.group)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _GroupKey) and other.group is self.group


def _group_key(group) -> _GroupKey:
    if group is None and dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD  # the default group of now, not of when a Resharder was cached
    return _GroupKey(group)


def _usable(r: Resharder) -> bool:
    """A cached Resharder can be reused: it never failed part way, and its group was not destroyed."""
    if r.broken is not None:
        return False
    g = r.group
    if isinstance(g, RefitGroup):
        return g.pg is not None
    if g is None:
        g = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        return r.transport.key is g
    try:
        dist.get_process_group_ranks(g)
    except Exception:  # destroyed (torch forgets it)
        return False
    return True


@dataclasses.dataclass(frozen=True)
class RefitState:
    """What ``refit`` wrote into one destination (``refit_state(dst_layout)``), on this rank.

    ``version``: the last version fully written (``refit(..., version=v)``; None before the first, or when
    refits pass no version). ``torn``: a refit failed after writing part of the destination: the tensors hold a
    mix of versions until a refit succeeds; do not sample from them. ``torn_tensors``: the destination local
    tensors that may be partly written. ``failed_version``: the version that failed. ``error``: its message.
    ``attempting``: a version whose refit is in progress (None when none is). Ranks are independent: a peer
    may be torn while this rank completed, so agree across the engine (e.g. all-reduce ``torn``) before use.
    """

    version: object = None
    torn: bool = False
    torn_tensors: tuple[str, ...] = ()
    failed_version: object = None
    error: str | None = None
    attempting: object = None


_STATE: dict[tuple, RefitState] = {}


def refit_state(dst_layout: Layout, *, instances: int = 1) -> RefitState:
    """The state of the destination tensors of ``dst_layout`` on this rank (see :class:`RefitState`)."""
    return _STATE.get((dst_layout, instances), RefitState())


def forget_refit_state(dst_layout: Layout, *, instances: int = 1) -> None:
    """The destination tensors of ``dst_layout`` on this rank were replaced by new, unwritten ones (e.g. a
    receiver's staging area allocated again): forget what ``refit`` wrote, so the next delta into them runs
    dense (the fence's "fresh destination") instead of patching bytes that are not there."""
    _STATE.pop((dst_layout, instances), None)


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
            stacklevel=4,
        )
    return {n: t for n, t in dst.items() if n in specs}, ignored


def _prepare(src_layout: Layout, dst_layout: Layout, group, dst_tensors: TensorsLike, strict: bool, what: str,
             timeout, options: dict) -> tuple[Resharder, dict[str, torch.Tensor], tuple[str, ...]]:
    """The preamble ``refit`` and ``verify_refit`` share: validate the options once, get the cached Resharder,
    keep the destination tensors the layout covers. A rejected layout or option is raised after telling the
    peers waiting in the handshake (``refuse``)."""
    try:
        r = resharder_for(src_layout, dst_layout, group, RefitOptions.of(**options))
        dst, ignored = _drop_uncovered(r, _as_dict(dst_tensors, "destination"), strict, what)
    except (ValueError, TypeError) as e:  # tell the peers waiting in the handshake, then raise it here
        refuse(group, e, verify=what == "verify_refit", timeout=timeout)
    return r, dst, ignored


def _delta_request(delta, version) -> DeltaRequest | None:
    """The delta request of ``refit(..., delta=, version=)`` (without the destination's state)."""
    if delta is False or delta is None:
        return None
    if delta is not True and delta != "strict":
        raise ValueError(f"refit: delta must be False, True or 'strict', got {delta!r}")
    if isinstance(version, bool) or not isinstance(version, int):
        raise TypeError(f"refit: delta={delta!r} needs an int version= (the fence compares versions), got {version!r}")
    if not NO_VERSION < version < -NO_VERSION:
        raise ValueError(f"refit: version {version} does not fit in int64")
    return DeltaRequest(version, strict=delta == "strict")


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
    version: object = None,
    delta: bool | str = False,
) -> RunReport:
    """Update this rank's inference tensors in place from the training tensors. Call on every rank of ``group``.

    Plans and staging buffers are cached (see :func:`get_resharder` for the key, when new tensor objects are
    fine and when to call :func:`clear_cache`): the first call plans, later calls with equal layouts only move
    bytes.

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
    engine rank receives everything from the trainer). Block-quantized destinations are never relayed:
    with them ``relay`` defaults to off, and ``relay=True`` raises.

    Failures: every error is a :class:`ReshardError` (or ValueError/TypeError for a rejected input, raised
    before any byte moved). ``version`` (e.g. the training step) fences torn weights:
    :func:`refit_state` ``(dst_layout)`` gives the last version fully written on this rank and whether a failed
    refit left the destination torn (which tensors); a later successful refit clears it. After a failure part
    way (``ReshardTransportError``, ``ReshardAbortedError``) the group is unusable: destroy it, build a new one
    and refit again with the new group (the cache never returns a Resharder of a failed or destroyed group).

    ``delta=True`` (with an int ``version``; every rank passes the same): send only the elements whose bits
    changed since the last refit (docs/delta.md). The first refit, and any refit whose fence fails (a
    destination rank at another version than the senders' snapshots, torn, or fresh / restarted; a
    block-quantized destination; a sender without a snapshot, e.g. after a failure or a refit without
    ``delta``), runs dense on every rank and says why: ``RunReport.mode`` is ``"delta"`` or
    ``"dense-fallback"`` (``fallback``: the reason, ``delta_base``: the version a delta started from).
    ``delta="strict"``: raise :class:`~triton_reshard.execute.delta.DeltaRefusedError` on every rank instead
    of falling back (nothing moved). Cost on each sender: a snapshot of the dense bytes it sends in
    delta-able messages (``Resharder.snapshot_bytes``), kept in the cached Resharder. A failed delta leaves
    the destination torn, as a failed dense refit does; the repair is the next refit (dense, automatically).
    """
    try:
        request = _delta_request(delta, version)
    except (TypeError, ValueError) as e:
        refuse(group, e, timeout=timeout)
    r, dst, ignored = _prepare(src_layout, dst_layout, group, dst_tensors, strict, "refit", timeout,
                               dict(bucket_bytes=bucket_bytes, timeout=timeout, backend=backend, allow_cast=allow_cast,
                                    gpus_per_node=gpus_per_node, relay=relay, instances=instances))
    skey = (dst_layout, instances)
    state = _STATE.get(skey, RefitState())
    _STATE[skey] = dataclasses.replace(state, attempting=version)
    if request is not None:
        request = dataclasses.replace(request, held=state.version if isinstance(state.version, int) else None,
                                      torn=state.torn)
    try:
        report = r.run(_as_dict(src_tensors, "source"), dst, delta=request)
    except BaseException as e:
        torn = tuple(getattr(e, "torn", ()))
        if torn or not isinstance(e, (ReshardError, ValueError, TypeError)):  # unknown: assume the worst
            torn = tuple(sorted(set(torn or dst) | set(state.torn_tensors)))
            _STATE[skey] = RefitState(state.version, True, torn, version, f"{type(e).__name__}: {e}")
        else:  # nothing written: the state stays what it was
            _STATE[skey] = dataclasses.replace(state, attempting=None)
        raise
    _STATE[skey] = RefitState(version if version is not None else state.version)
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
    r, dst, ignored = _prepare(src_layout, dst_layout, group, dst_tensors, strict, "verify_refit", timeout,
                               dict(bucket_bytes=bucket_bytes, timeout=timeout, backend=backend, allow_cast=allow_cast,
                                    gpus_per_node=gpus_per_node, relay=relay, instances=instances))
    report = r.verify(_as_dict(src_tensors, "source"), dst)
    return dataclasses.replace(report, ignored=ignored) if ignored else report


def clear_cache() -> None:
    """Drop cached plans and buffers (a destroyed or failed group's are dropped anyway)."""
    _CACHE.clear()
    plan_reshard.cache_clear()
