"""The options of a refit, validated once: one frozen value that ``refit``, ``verify_refit``,
``get_resharder`` and :class:`~triton_reshard.execute.Resharder` share.

:class:`RefitOptions` is the one table of every option (name, default, check, who takes it): its fields build
:meth:`RefitOptions.of`, which checks each option once; the public entry points write their option parameters
out with these defaults (``tests/test_bad_input.py`` holds them to this table). It resolves into the two values
the plan side takes, which are never checked again: the planner's
:class:`~triton_reshard.plan.options.PlanOptions` (:meth:`RefitOptions.plan_options`) and the schedule's
:class:`~triton_reshard.plan.options.StepBudget` (:attr:`RefitOptions.budget`). The relay and
``gpus_per_node`` rules are ``plan.options``' (one place for ``refit`` and ``plan_reshard``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from datetime import timedelta

from .. import ops
from ..layout import Layout
from ..plan import DIRECT_MIN_BYTES
from ..plan.options import (
    PlanOptions,
    StepBudget,
    check_gpus_per_node,
    check_relay,
    default_relay,
    relay_value,
)

DEFAULT_BUCKET_BYTES = 256 << 20  # the one default of bucket_bytes (integrations import it)
DEFAULT_TIMEOUT = timedelta(seconds=300)


def to_timedelta(timeout) -> timedelta:
    """``timeout`` (a positive timedelta or a finite positive number of seconds) as a timedelta."""
    if isinstance(timeout, timedelta):
        if timeout.total_seconds() > 0:
            return timeout
    elif (isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and math.isfinite(timeout)
          and timeout > 0):
        return timedelta(seconds=float(timeout))
    raise TypeError(f"timeout must be a timedelta or a finite positive number of seconds, got {timeout!r}")


def _backend(v):
    if v is not None and v not in ops.BACKENDS:
        raise ValueError(f"Resharder: unknown copy backend {v!r}; expected None or one of {ops.BACKENDS}")
    return v


def _gpus_per_node(v):
    check_gpus_per_node(v, "refit")
    return v


def _relay(v):
    return relay_value(v, "refit")


def _instances(v):
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"refit: instances={v!r} must be an int >= 1 (engines, each a copy of dst_layout)")
    return v


def _option(default, check, *, refit: bool = True, executor: bool = False):
    """A field of :class:`RefitOptions`: its default, its check (the user's value -> the stored one, or a
    ``TypeError`` / ``ValueError`` naming the option and the value; None: checked together as the step
    budget, :class:`~triton_reshard.plan.options.StepBudget`), whether ``refit`` / ``verify_refit`` /
    ``get_resharder`` take it (``refit``) and whether it is the executor's (``executor``: a parameter of
    :class:`~triton_reshard.execute.Resharder`, in field order; the others are the planner's,
    :class:`~triton_reshard.plan.options.PlanOptions`)."""
    return field(default=default, metadata={"check": check, "refit": refit, "executor": executor})


_ACCEPTED: dict[tuple, RefitOptions] = {}  # RefitOptions.of's memo: accepted options by (name, type, value)


@dataclass(frozen=True, slots=True)
class RefitOptions:
    """How a refit runs (build it with :meth:`of`, which validates every option once).

    Executor options: ``bucket_bytes`` (staging bound), ``timeout`` (every wait), ``backend`` (copy backend,
    None: by device / ``TRITON_RESHARD_BACKEND``), ``overlap`` (two staging slots), ``direct_min_bytes``
    (in-place threshold), ``digest`` (every message digested on both ends and compared at the end of the run,
    ``execute/integrity.py``); the step budget (:attr:`budget`) is made of three of them. Planner options
    (:meth:`plan_options`): ``allow_cast``, ``gpus_per_node``, ``relay``, ``instances``.
    Hashable: it is the cache key of ``get_resharder`` with the layouts and group."""

    bucket_bytes: int = _option(DEFAULT_BUCKET_BYTES, None, executor=True)
    timeout: timedelta = _option(DEFAULT_TIMEOUT, to_timedelta, executor=True)
    backend: str | None = _option(None, _backend, executor=True)
    overlap: bool = _option(False, bool, refit=False, executor=True)
    direct_min_bytes: int = _option(DIRECT_MIN_BYTES, None, refit=False, executor=True)
    digest: bool = _option(True, bool, executor=True)
    allow_cast: bool = _option(False, bool)
    gpus_per_node: int | None = _option(None, _gpus_per_node)
    relay: bool | None = _option(None, _relay)
    instances: int = _option(1, _instances)

    @classmethod
    def of(cls, **options) -> RefitOptions:
        """Validated options, by name (the fields; the rest take their defaults): a ``TypeError`` /
        ``ValueError`` naming the option and the value the user passed, before anything is planned. The step
        budget (``bucket_bytes``, ``overlap``, ``direct_min_bytes``) is checked by ``StepBudget.of``: one
        minimum for ``bucket_bytes``, a staging slot of ``plan.MIN_STEP_BYTES`` per slot.

        Options already accepted are remembered (every ``refit`` of an RL loop passes the same ones): by name,
        value *and type* (``overlap=1`` is not ``overlap=True``), hashable values only; a refused set is never
        remembered, so it raises each time."""
        try:
            key = tuple(sorted((k, type(v), v) for k, v in options.items()))
            hit = _ACCEPTED.get(key)
        except TypeError:  # an unhashable value: checked (and refused or accepted) without the memo
            key = hit = None
        if hit is not None:
            return hit
        opts = cls._validated(options)
        if key is not None:
            if len(_ACCEPTED) >= 64:
                _ACCEPTED.clear()
            _ACCEPTED[key] = opts
        return opts

    @classmethod
    def _validated(cls, options: dict) -> RefitOptions:
        known = {f.name: f for f in fields(cls)}
        for name in options:
            if name not in known:
                raise TypeError(f"RefitOptions.of() got an unexpected keyword argument {name!r}")
        checked = {n: f.metadata["check"](options[n]) for n, f in known.items()
                   if n in options and f.metadata["check"] is not None}
        budget = StepBudget.of(options.get("bucket_bytes", DEFAULT_BUCKET_BYTES), overlap=checked.get("overlap", False),
                               direct_min_bytes=options.get("direct_min_bytes", DIRECT_MIN_BYTES))
        opts = cls(bucket_bytes=budget.bucket_bytes, direct_min_bytes=budget.direct_min_bytes, **checked)
        check_relay(opts.relay, opts.gpus_per_node, opts.instances != 1, "refit")
        return opts

    @property
    def budget(self) -> StepBudget:
        """The step budget the schedule is cut by (``Plan.schedule``): ``bucket_bytes`` in :attr:`slots`
        staging slots, ``direct_min_bytes`` (checked by :meth:`of`)."""
        return StepBudget(self.bucket_bytes, self.slots, self.direct_min_bytes)

    @property
    def slots(self) -> int:
        """Staging slots: 2 with ``overlap`` (step k+1 packed while step k is on the wire), else 1."""
        return 2 if self.overlap else 1

    @property
    def slot_bytes(self) -> int:
        """The bucket of one staging slot: the schedule's per-step cap."""
        return self.bucket_bytes // self.slots

    def relay_decided(self, dst_layout: Layout, *, verify: bool = False) -> RefitOptions:
        """These options with ``relay`` decided for ``dst_layout`` (``plan.options.default_relay``, as
        :meth:`plan_options` decides it, without building the planned layout): a refit session's cache key."""
        relay = default_relay(self.relay, self.gpus_per_node, self.instances != 1, quantized=dst_layout.quantized,
                              verify=verify)
        return self if relay is self.relay else replace(self, relay=relay)

    def plan_options(self, dst_layout: Layout, *, verify: bool = False) -> tuple[Layout, PlanOptions]:
        """The layout to plan (``dst_layout``, or its ``instances`` copies) and the planner's options, resolved
        (``PlanOptions.for_instances``: relay groups from ``instances``, the relay default decided; ``verify``:
        no relays). The one place ``refit``, ``verify_refit`` and ``get_resharder`` build them: resolved, not
        checked again (:meth:`of` checked them)."""
        return PlanOptions.for_instances(dst_layout, self.instances, self.allow_cast, self.gpus_per_node, self.relay,
                                         verify=verify, checked=True)


REFIT_OPTIONS = tuple(f.name for f in fields(RefitOptions) if f.metadata["refit"])
EXECUTOR_OPTIONS = tuple(f.name for f in fields(RefitOptions) if f.metadata["executor"])  # Resharder's own
DEFAULTS = {f.name: f.default for f in fields(RefitOptions)}  # each option's one default
