"""``plan_reshard``: two layouts in, a :class:`~triton_reshard.plan.core.Plan` (or a rank's share) out,
routed by the local rules (``local``, ``holders``, ``rows``)."""

from __future__ import annotations

from functools import lru_cache

from ..layout import Layout
from . import quant as _quant
from .core import Plan
from .local import plan_local
from .options import PlanOptions
from .routing import check_specs


@lru_cache(maxsize=64)
def plan_reshard(src: Layout, dst: Layout, allow_cast: bool = False, gpus_per_node: int | None = None,
                 relay: bool | None = None, relay_groups: tuple[tuple[int, ...], ...] | None = None, *,
                 rank: int | None = None, options: PlanOptions | None = None) -> Plan:
    """Plan the reshard from ``src`` to ``dst`` (pure, deterministic, cached on the two layouts).

    Every destination element is covered exactly once. If the destination rank holds a source copy of an
    element, it is copied locally (never on the wire); otherwise one source holder sends it.

    Routing (``plan/rows.py``, ``plan/holders.py``): every choice is a rule a rank evaluates for its own
    transfers from the two layouts alone, and its peers evaluate identically: a piece's receivers are spread
    over its holders by quotas (``holders.assign``, same-node holders first with ``gpus_per_node``), fan-out
    parts go to heads in rotation. ``rank=r`` then returns rank ``r``'s share alone, a :class:`Plan` with
    ``rank=r`` (its transfers and schedule, without planning anyone else's; the
    :class:`~triton_reshard.execute.Resharder` runs from it); the shares of all ranks are exactly the whole plan
    cut by rank. Every plan's steps follow the pair rule (``Plan.schedule``: per step each rank sends to at most
    ``STEP_PEERS`` peers and receives from as many, within the bucket). The wire bytes are exactly the lower bound (the
    greedy router of earlier versions, which the tests compare against, is in ``tests/oracles``).

    ``gpus_per_node`` (ranks ``[k*n, (k+1)*n)`` share a node: same-node holders first), ``relay`` (fan a piece
    out inside a node or a relay group: it crosses the network once, in parts, and is relayed over NVLink;
    needs ``gpus_per_node`` or ``relay_groups``; ``None``: on exactly when one is given) and ``relay_groups``
    (groups of destination ranks that need the same pieces, e.g. ``Layout.instance_groups``): see
    :class:`~triton_reshard.plan.options.PlanOptions`. Whatever they say, the wire bytes are the lower bound.

    Raises ``TypeError`` for arguments of the wrong type (not two Layouts, a non-bool ``relay``), and
    ``ValueError``, naming the tensor, when the layouts cannot be resharded: a destination tensor the source
    lacks, shapes that differ, dtypes that differ without ``allow_cast``, a destination element no source rank
    holds, destination boxes that overlap on one rank; also for ``relay=True`` without ``gpus_per_node`` or
    ``relay_groups``, a ``gpus_per_node`` < 1 and relay groups that overlap.

    ``options``: the four options above resolved already (a :class:`~triton_reshard.plan.options.PlanOptions`,
    e.g. ``refit``'s, from ``PlanOptions.for_instances``), instead of passing them one by one; the same plan.

    Block-quantized destination tensors (``TensorSpec.quant``, e.g. from ``block_quant_layout``) with a plain
    float source are quantized on the way (``plan/quant.py``): whole blocks a source rank holds travel as fp8 +
    fp32 scales (``Transfer.quant="src"``, quantized in the sender's pack), blocks straddling source fragments in
    the source dtype (``"dst"``, quantized by the receiver once the block is complete); their scale tensors
    need no source. Relays of such tensors raise ``ValueError`` (plan with ``relay=False``).
    """
    if not isinstance(src, Layout) or not isinstance(dst, Layout):
        raise TypeError(f"plan_reshard takes two Layouts, got {type(src).__name__} and {type(dst).__name__}")
    opts = _options(options, allow_cast, gpus_per_node, relay, relay_groups)
    # block-quantized destinations (plan/quant.py): routed in the source dtype, without their scales, then
    # every routed piece is cut on the block grid into source- and destination-quantized transfers
    targets = _quant.quant_targets(src, dst) if dst.quantized else {}
    routed = _quant.routing_view(src, dst, targets) if targets else dst
    if not _specs_agree(src, routed, opts.allow_cast):
        check_specs(src, routed, opts.allow_cast)  # (the full check also words the error)
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 0):
        raise TypeError(f"plan_reshard: rank={rank!r} must be an int >= 0 or None")
    return plan_local(src, dst, routed, targets, opts.gpus_per_node, opts.relay, opts.groups, opts.key, rank)


def _options(options: PlanOptions | None, *given) -> PlanOptions:
    """``plan_reshard``'s options resolved: ``options`` as resolved already, or the four given one by one."""
    if options is None:
        return PlanOptions.of(*given)
    if not isinstance(options, PlanOptions):
        raise TypeError(f"plan_reshard: options={options!r} must be a PlanOptions or None")
    if given != (False, None, None, None):
        raise TypeError("plan_reshard: pass options= or allow_cast / gpus_per_node / relay / relay_groups, not both")
    return options


def _specs_agree(src: Layout, dst: Layout, allow_cast: bool) -> bool:
    """Whether ``check_specs`` would pass, from the tensor specs alone (no fragment is read: the layouts' columns
    answer without building every rank's fragments). False when a destination tensor is missing from the
    source (the full check decides: it may have no elements) or its shape or dtype differs."""
    if src.same_tensors(dst):  # one set of specs (a preset pair): nothing to compare
        return True
    if not dst.quantized:  # from the columns, without building the specs
        have = src.shapes_and_dtypes()
        for n, (shape, dt) in dst.shapes_and_dtypes().items():
            s = have.get(n)
            if s is None or s[0] != shape or (s[1] != dt and not allow_cast):
                return False
        return True
    specs = src.specs
    for spec in dst.tensors:
        s = specs.get(spec.name)
        if s is None or s.shape != spec.shape or (s.dtype != spec.dtype and not allow_cast):
            return False
    return True
