"""``refit``: the drop-in replacement for a framework's weight-refit function.

Takes the training side's named local tensors and the inference side's named local tensors (e.g. the
``named_parameters()`` of each model on this rank) plus the two layouts, and updates the inference tensors
in place. Plans and staging buffers are cached across calls: an RL loop pays planning once.

``verify_refit`` runs the same reshard without writing: it proves that the two layouts agree with what the
tensors really hold (e.g. once at startup, after trainer and engine each loaded the same checkpoint).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

from .comm.group import RefitGroup
from .execute import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_TIMEOUT,
    RefitOptions,
    Resharder,
    RunReport,
    VerifyReport,
    refuse,
)
from .execute.delta import NO_VERSION, DeltaRequest
from .execute.delta_cost import MEASURED
from .execute.session import SESSIONS, RefitSession, RefitState
from .layout import Layout
from .plan import plan_reshard

__all__ = ["RefitState", "clear_cache", "forget_refit_state", "get_resharder", "refit", "refit_state",
           "verify_refit"]

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
    digest: bool = True,
    allow_cast: bool = False,
    gpus_per_node: int | None = None,
    relay: bool | None = None,
    instances: int = 1,
) -> Resharder:
    """The cached Resharder for these layouts and options (plan and buffers reused across calls).

    The cache key is ``(src_layout, dst_layout, group, bucket_bytes, timeout, backend, digest, allow_cast,
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
    options = RefitOptions.of(bucket_bytes=bucket_bytes, timeout=timeout, backend=backend, digest=digest,
                              allow_cast=allow_cast, gpus_per_node=gpus_per_node, relay=relay, instances=instances)
    return SESSIONS.get(src_layout, dst_layout, group, options).resharder


def refit_state(dst_layout: Layout, *, instances: int = 1) -> RefitState:
    """The state of the destination tensors of ``dst_layout`` on this rank (see :class:`RefitState`)."""
    return SESSIONS.state(dst_layout, instances)


def forget_refit_state(dst_layout: Layout, *, instances: int = 1) -> None:
    """The destination tensors of ``dst_layout`` on this rank were replaced by new, unwritten ones (e.g. a
    receiver's staging area allocated again): forget what ``refit`` wrote, so the next delta into them runs
    dense (the fence's "fresh destination") instead of patching bytes that are not there."""
    SESSIONS.forget(dst_layout, instances)


def _prepare(src_layout: Layout, dst_layout: Layout, group, dst_tensors: TensorsLike, strict: bool, what: str,
             options: dict) -> tuple[RefitSession, dict[str, torch.Tensor], tuple[str, ...]]:
    """The preamble ``refit`` and ``verify_refit`` share: validate the options once, get the cached session,
    keep the destination tensors the layout covers. A rejected layout or option is raised after telling the
    peers waiting in the handshake (``refuse``)."""
    try:
        s = SESSIONS.get(src_layout, dst_layout, group, RefitOptions.of(**options), verify=what == "verify_refit")
        dst, ignored = s.covered(_as_dict(dst_tensors, "destination"), strict, what)
    except (ValueError, TypeError) as e:  # tell the peers waiting in the handshake, then raise it here
        refuse(group, e, verify=what == "verify_refit", timeout=options["timeout"])
    return s, dst, ignored


_TOPOLOGY_FIELDS = ("gpus_per_node", "nvlink_GBps", "net_GBps", "shared_nic", "same_node")


def delta_request(delta, version, topology=None) -> DeltaRequest | None:
    """The delta request of ``refit(..., delta=, version=, topology=)`` (without the destination's state); raises
    ``TypeError`` / ``ValueError`` for options no refit can run (the plug-ins call it on the trainer, before any
    engine call: issue 42).

    ``delta=True`` (with an int ``version``; every rank passes the same): send only the elements whose bits
    changed since the last refit (docs/delta.md). The first refit, and any refit whose fence fails (a
    destination rank at another version than the senders' snapshots, torn, or fresh / restarted; a
    block-quantized destination; a sender without a snapshot, e.g. after a failure or a refit without
    ``delta``), runs dense on every rank and says why: ``RunReport.mode`` is ``"delta"`` or
    ``"dense-fallback"`` (``fallback``: the reason, ``delta_base``: the version a delta started from).
    ``delta="strict"``: raise :class:`~triton_reshard.execute.delta.DeltaRefusedError` on every rank instead
    of falling back (nothing moved). Cost on each sender: a snapshot of the dense bytes it sends in
    delta-able messages (``Resharder.snapshot_bytes``), kept with the cached Resharder in its refit session
    (``execute/session.py``). A failed delta leaves the destination torn, as a failed dense refit does; the
    repair is the next refit (dense, automatically). ``topology`` (a
    :class:`~triton_reshard.tools.topology.Topology`: ranks per node, link rates; the same on every rank): with
    ``delta``, every rank predicts from what its last delta refit measured whether a delta beats a dense refit,
    and a refit predicted slower as a delta runs dense (``fallback`` starts "predicted faster dense"; one refit
    in a few probes a delta again). Without it every refit whose fence passes is a delta.
    ``delta="auto"``: a delta where it is faster here. With a ``topology`` as above; without one every rank
    compares what its own runs took (``execute.delta_cost.MEASURED``): the last dense refits' step loops against
    the last deltas' (the first refit is dense, the second a delta, both measured); a refit whose delta the
    slowest rank measured slower than its dense runs goes dense without a snapshot (``fallback`` "predicted
    faster dense"), one in ``PROBE_EVERY`` (8) probes a delta again, and after 8 deltas in a row one refit goes
    dense to measure it again (``fallback`` "measuring dense again"). Right on any link and any CPU, with no
    model of either; what it costs: that probe refit now and then.
    """
    if topology is not None and not all(hasattr(topology, a) for a in _TOPOLOGY_FIELDS):
        raise TypeError(f"refit: topology={topology!r} must be a triton_reshard.tools.topology.Topology or None")
    if delta is False or delta is None:
        return None
    if delta is not True and delta not in ("strict", "auto"):
        raise ValueError(f"refit: delta must be False, True, 'strict' or 'auto', got {delta!r}")
    if isinstance(version, bool) or not isinstance(version, int):
        raise TypeError(f"refit: delta={delta!r} needs an int version= (the fence compares versions), got {version!r}")
    if not NO_VERSION < version < -NO_VERSION:
        raise ValueError(f"refit: version {version} does not fit in int64")
    if delta == "auto" and topology is None:
        topology = MEASURED
    return DeltaRequest(version, strict=delta == "strict", topology=topology)


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
    digest: bool = True,
    allow_cast: bool = False,
    gpus_per_node: int | None = None,
    relay: bool | None = None,
    instances: int = 1,
    strict: bool = False,
    version: object = None,
    delta: bool | str = False,
    topology: object = None,
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

    ``digest`` (on by default): every message is digested on both ends and the digests, keyed with the job's
    secret, compared before the refit returns; a message that landed other than it was sent raises
    :class:`~triton_reshard.execute.integrity.ReshardIntegrityError` on every rank (docs/integrity.md).

    Failures: every error is a :class:`ReshardError` (or ValueError/TypeError for a rejected input, raised
    before any byte moved). ``version`` (e.g. the training step) fences torn weights:
    :func:`refit_state` ``(dst_layout)`` gives the last version fully written on this rank and whether a failed
    refit left the destination torn (which tensors); a later successful refit clears it. After a failure part
    way (``ReshardTransportError``, ``ReshardAbortedError``) the group is unusable: destroy it, build a new one
    and refit again with the new group (the cache never returns a Resharder of a failed or destroyed group).

    ``delta=True`` / ``"strict"`` (with an int ``version``; every rank passes the same): send only the elements
    whose bits changed since the last refit, falling back to dense (or refusing) where the fence fails, and
    ``topology`` to predict which is faster: see :func:`delta_request` and docs/delta.md.
    """
    try:
        request = delta_request(delta, version, topology)
    except (TypeError, ValueError) as e:
        refuse(group, e, timeout=timeout)
    options = dict(bucket_bytes=bucket_bytes, timeout=timeout, backend=backend, digest=digest, allow_cast=allow_cast,
                   gpus_per_node=gpus_per_node, relay=relay, instances=instances)
    session, dst, ignored = _prepare(src_layout, dst_layout, group, dst_tensors, strict, "refit", options)
    report = session.run(_as_dict(src_tensors, "source"), dst, version, request)
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
    digest: bool = True,
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
    options = dict(bucket_bytes=bucket_bytes, timeout=timeout, backend=backend, digest=digest, allow_cast=allow_cast,
                   gpus_per_node=gpus_per_node, relay=relay, instances=instances)
    session, dst, ignored = _prepare(src_layout, dst_layout, group, dst_tensors, strict, "verify_refit", options)
    report = session.verify(_as_dict(src_tensors, "source"), dst)
    return dataclasses.replace(report, ignored=ignored) if ignored else report


def clear_cache() -> None:
    """Drop cached plans and buffers (a destroyed or failed group's are dropped anyway); what ``refit_state``
    says of each destination stays."""
    SESSIONS.clear()
    plan_reshard.cache_clear()
