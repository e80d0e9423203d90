"""The planner's options and the schedule's step budget, each resolved once into a frozen value.

:class:`PlanOptions`: what ``plan_reshard`` plans with besides the two layouts (``allow_cast``, the topology
``gpus_per_node``, ``relay`` decided, the ``relay_groups``), checked and resolved in :meth:`PlanOptions.of`;
``refit`` builds it from its own options in one place (:meth:`PlanOptions.for_instances`: ``instances``
copies of one engine's layout become the planned layout and its relay groups; a
:class:`~triton_reshard.tools.topology.Topology` gives ``gpus_per_node``).

:class:`StepBudget`: the bytes a schedule's steps may stage (the user's ``bucket_bytes``, split into
``slots`` staging slots with ``overlap``) and the in-place threshold ``direct_min_bytes``, checked in
:meth:`StepBudget.of` against the one minimum (a staging slot of :data:`MIN_STEP_BYTES`), naming the value
the user passed; ``Plan.schedule(budget)`` schedules by it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from ..layout import Layout
from .routing import check_gpus_per_node, check_relay_groups
from .types import DIRECT_MIN_BYTES, MIN_STEP_BYTES

RelayGroups = tuple[tuple[int, ...], ...]


def default_relay(relay: bool | None, gpus_per_node: int | None, grouped: bool, *, quantized: bool = False,
                  verify: bool = False) -> bool:
    """Whether to relay: the one place the defaults are decided (``plan_reshard``, ``refit``,
    ``verify_refit``). ``relay`` as given (None: the default), ``grouped``: relay groups are given (e.g.
    ``instances > 1``). Relays need somewhere to fan out (a node or a group); the default is on exactly then,
    except for a block-quantized destination (``quantized``: ``refit``'s default is off there, plan/quant.py
    refuses relays of quantized tensors). ``verify``: never (a relay forwards the relaying rank's destination
    tensor, the very thing ``verify_refit`` checks), whatever ``relay`` says, whenever there is somewhere to
    fan out."""
    fans_out = gpus_per_node is not None or grouped
    if verify and fans_out:
        return False
    if relay is None:
        return fans_out and not quantized
    return relay


_FAN_OUT = {"refit": ("instances > 1", "over the engines"), "plan_reshard": ("relay_groups", "a group")}


def relay_value(relay, who: str):
    """``relay`` as given: a bool, or None for the default (:func:`default_relay`); else a ``TypeError``."""
    if relay is not None and not isinstance(relay, bool):
        raise TypeError(f"{who}: relay={relay!r} must be a bool or None")
    return relay


def check_relay(relay, gpus_per_node: int | None, grouped: bool, who: str) -> None:
    """The relay rules, the one place (``refit``'s options and ``plan_reshard``'s): ``relay`` a bool or None,
    and ``relay=True`` needs somewhere to fan out: ``gpus_per_node`` (a node) or groups (``grouped``: relay
    groups, ``refit``'s ``instances > 1``). ``who``: the entry point, for the message."""
    relay_value(relay, who)
    if relay and gpus_per_node is None and not grouped:
        other, where = _FAN_OUT[who]
        raise ValueError(f"{who}: relay=True needs gpus_per_node or {other} (relays fan out inside a node or {where})")


@dataclass(frozen=True, slots=True)
class PlanOptions:
    """``plan_reshard``'s options, resolved (build it with :meth:`of`): ``relay`` is decided (a bool), and
    ``relay_groups`` is kept only when relays are on (``None`` otherwise: the groups change nothing then).
    :attr:`key` is what the plan's digest hashes. What they do (the rules: ``plan/holders.py``):

    ``allow_cast``: source and destination dtypes may differ (the copy casts; on the sender where that shrinks
    the wire bytes).

    ``gpus_per_node``: ranks ``[k*n, (k+1)*n)`` share a node (a fast NVLink domain). A piece several source
    ranks hold is spread over them by quotas (each holder sends it ``n // h`` or ``n // h + 1`` times, for
    ``n`` receivers and ``h`` holders); with ``gpus_per_node`` a receiver first takes a holder in its own node
    that has quota left, the others the holders left: fewer bytes cross the network while no holder sends a
    piece more often than its quota. ``None``: no topology (the default).

    ``relay`` (needs ``gpus_per_node`` or ``relay_groups``; ``None``: on exactly when one is given): fan-out,
    the idea of NCCL's M2N ring. The ranks of one node that need a piece over the wire while no source rank of
    that node holds it (at least two of them) form a fan group: the piece is split into near-equal contiguous
    parts, at most one per rank of the group and each at least ``RELAY_SPLIT_MIN_BYTES`` (a small piece gets
    fewer parts, or stays whole); each part crosses the network once, from a holder as above, to one rank of
    the group (the heads rotate from piece to piece), and that rank forwards it to the others by relay
    transfers (``Transfer.relay``), which read its destination tensor and run in a second phase, over NVLink:
    a scatter over the network, then an all-gather over NVLink. Every destination element still arrives once,
    so the wire bytes stay the lower bound; fewer bytes cross the network and leave the sources. A plan in
    which nothing fans out, and every plan with ``relay=False``, is exactly the plan of the node-aware routing
    alone. Block-quantized destinations are never relayed (``relay=True`` raises there).

    ``relay_groups``: groups of destination ranks that need the same pieces, e.g. the same position in several
    copies of one layout (``Layout.instance_groups``: independent inference engines), as a tuple of disjoint
    tuples of ranks (a rank in no group is a group of its own). The same fan-out, inside a group instead of a
    node, even when a source rank inside the group holds the piece (the point is to unload the sources): with
    n copies of an engine the sources send each such byte once per group instead of n times. With
    ``gpus_per_node`` nodes come first (relaying inside a node is cheaper); the ranks left fan out inside
    their group. A rank receives each element once, by one relay at most (no chains).
    """

    allow_cast: bool = False
    gpus_per_node: int | None = None
    relay: bool = False
    relay_groups: RelayGroups | None = None

    @classmethod
    def of(cls, allow_cast: bool = False, gpus_per_node: int | None = None, relay: bool | None = None,
           relay_groups: RelayGroups | None = None, *, quantized: bool = False, verify: bool = False) -> PlanOptions:
        """Checked and resolved: a ``TypeError`` / ``ValueError`` naming the option and the value given (a
        ``gpus_per_node`` < 1, relay groups that are not disjoint tuples of ranks, a non-bool ``relay``,
        ``relay=True`` with nowhere to fan out); ``relay`` (None: the default) decided by
        :func:`default_relay` (``quantized``, ``verify``: see there)."""
        check_gpus_per_node(gpus_per_node, "plan_reshard")
        grouped = bool(check_relay_groups(relay_groups))
        check_relay(relay, gpus_per_node, relay_groups is not None, "plan_reshard")
        return cls.resolved(allow_cast, gpus_per_node, relay, relay_groups, grouped, quantized=quantized,
                            verify=verify)

    @classmethod
    def resolved(cls, allow_cast: bool, gpus_per_node: int | None, relay: bool | None,
                 relay_groups: RelayGroups | None, grouped: bool, *, quantized: bool = False,
                 verify: bool = False) -> PlanOptions:
        """From options checked already (:meth:`of`, or ``refit``'s ``RefitOptions.of``): ``relay`` decided
        (:func:`default_relay`; ``grouped``: the relay groups fan out), nothing checked again."""
        relay = default_relay(relay, gpus_per_node, grouped, quantized=quantized, verify=verify)
        return cls(allow_cast, gpus_per_node, relay, relay_groups if relay else None)

    @classmethod
    def for_instances(cls, dst: Layout, instances: int, allow_cast: bool = False, gpus_per_node: int | None = None,
                      relay: bool | None = None, *, verify: bool = False, checked: bool = False
                      ) -> tuple[Layout, PlanOptions]:
        """``instances`` copies of the engine layout ``dst`` (``Layout.instances``): the layout to plan
        and its options, the copies' same positions as relay groups (``Layout.instance_groups``); relays
        default to off for a block-quantized ``dst``, and are never on with ``verify`` (:func:`default_relay`).
        ``refit``, ``verify_refit`` and ``get_resharder`` plan with this, with ``checked`` (their options were
        checked once, by ``RefitOptions.of``: they are only resolved here)."""
        groups, planned = None, dst
        if instances != 1:
            groups, planned = dst.instance_groups(instances), dst.instances(instances)
        if checked:
            return planned, cls.resolved(allow_cast, gpus_per_node, relay, groups, instances != 1,
                                         quantized=dst.quantized, verify=verify)
        return planned, cls.of(allow_cast, gpus_per_node, relay, groups, quantized=dst.quantized, verify=verify)

    @property
    def groups(self) -> dict[int, int]:
        """The relay groups by rank (rank -> index of its group; groups of one rank left out): empty when
        relays are off."""
        return check_relay_groups(self.relay_groups)

    @property
    def key(self) -> tuple:
        """``(allow_cast, gpus_per_node, relay, relay_groups)``: the plan's ``options`` (its digest hashes
        them)."""
        return (self.allow_cast, self.gpus_per_node, self.relay, self.relay_groups)


def _int(v, what: str) -> int:
    """``v`` as an int (ints and integer-like objects only: no floats, strings or bools)."""
    if isinstance(v, bool):
        raise TypeError(f"{what} must be an int, got {v!r}")
    try:
        return operator.index(v)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {v!r}") from None


@dataclass(frozen=True, slots=True)
class StepBudget:
    """What a schedule's steps may stage (build it with :meth:`of`, which checks it): ``bucket_bytes``, the
    user's bound on a rank's staging memory, split into ``slots`` staging slots (2 with ``overlap``: step
    k+1 is packed while step k is on the wire) of :attr:`slot_bytes` each, the per-step cap the schedule
    cuts by; chunks of at least ``direct_min_bytes`` contiguous on one side move in place there."""

    bucket_bytes: int
    slots: int = 1
    direct_min_bytes: int = DIRECT_MIN_BYTES

    @classmethod
    def of(cls, bucket_bytes, *, overlap: bool = False, direct_min_bytes=DIRECT_MIN_BYTES,
           who: str = "Resharder") -> StepBudget:
        """Checked: ``bucket_bytes`` an int of at least one staging slot of :data:`MIN_STEP_BYTES` per slot
        (the one minimum), ``direct_min_bytes`` an int >= 0; a ``TypeError`` / ``ValueError`` naming the value
        the user passed (``who``: the entry point, for the message)."""
        slots = 2 if overlap else 1
        n = _int(bucket_bytes, f"{who}: bucket_bytes")
        if n // slots < MIN_STEP_BYTES:
            raise ValueError(f"{who}: bucket_bytes={n} is too small: at least {MIN_STEP_BYTES * slots} B"
                             + (f" with overlap=True (two staging slots of {MIN_STEP_BYTES} B)" if overlap else ""))
        d = _int(direct_min_bytes, f"{who}: direct_min_bytes")
        if d < 0:
            raise ValueError(f"{who}: direct_min_bytes must be >= 0, got {d}")
        return cls(n, slots, d)

    @property
    def slot_bytes(self) -> int:
        """The bucket of one staging slot: the schedule's per-step cap."""
        return self.bucket_bytes // self.slots

    @property
    def key(self) -> tuple[int, int]:
        """``(slot_bytes, direct_min_bytes)``: what the schedule depends on (its cache key in ``Plan``)."""
        return (self.slot_bytes, self.direct_min_bytes)
