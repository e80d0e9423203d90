"""The options of a refit, validated once: one frozen value that ``refit``, ``verify_refit``,
``get_resharder`` and :class:`~triton_reshard.execute.Resharder` share.

:class:`RefitOptions` is the one definition of every option (name, default, check, who takes it): its fields
build :meth:`RefitOptions.of` and, through :func:`takes_options`, the keyword parameters of the public entry
points, so adding an option is one field here."""

from __future__ import annotations

import functools
import inspect
import math
import operator
from dataclasses import dataclass, field, fields
from datetime import timedelta

from .. import ops
from ..plan import DIRECT_MIN_BYTES, MIN_STEP_BYTES

DEFAULT_BUCKET_BYTES = 256 << 20
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


def as_int(v, what: str, low: int) -> int:
    """``v`` as an int >= ``low`` (ints and integer-like objects only: no floats, strings or bools)."""
    if isinstance(v, bool):
        raise TypeError(f"{what} must be an int, got {v!r}")
    try:
        n = operator.index(v)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {v!r}") from None
    if n < low:
        raise ValueError(f"{what} must be >= {low}, got {n}")
    return n


def _backend(v):
    if v is not None and v not in ops.BACKENDS:
        raise ValueError(f"Resharder: unknown copy backend {v!r}; expected None or one of {ops.BACKENDS}")
    return v


def _gpus_per_node(v):
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
        raise ValueError(f"refit: gpus_per_node={v!r} must be an int >= 1 or None")
    return v


def _relay(v):
    if v is not None and not isinstance(v, bool):
        raise TypeError(f"refit: relay={v!r} must be a bool or None")
    return v


def _instances(v):
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"refit: instances={v!r} must be an int >= 1 (engines, each a copy of dst_layout)")
    return v


def _option(default, check, accepts: str, *, refit: bool = True):
    """A field of :class:`RefitOptions`: its default, its check (the user's value -> the stored one, or a
    ``TypeError`` / ``ValueError`` naming the option and the value), the type users may pass (``accepts``, the
    public annotation), and whether ``refit`` / ``verify_refit`` / ``get_resharder`` take it (``refit``;
    every option is the Resharder's or the planner's)."""
    return field(default=default, metadata={"check": check, "accepts": accepts, "refit": refit})


@dataclass(frozen=True, slots=True)
class RefitOptions:
    """How a refit runs (build it with :meth:`of`, which validates every option once).

    Executor options: ``bucket_bytes`` (staging bound), ``timeout`` (every wait), ``backend`` (copy backend,
    None: by device / ``TRITON_RESHARD_BACKEND``), ``overlap`` (two staging slots), ``direct_min_bytes``
    (in-place threshold). Planner options: ``allow_cast``, ``gpus_per_node``, ``relay``, ``instances``.
    Hashable: it is the cache key of ``get_resharder`` with the layouts and group."""

    bucket_bytes: int = _option(DEFAULT_BUCKET_BYTES, lambda v: as_int(v, "Resharder: bucket_bytes", 1), "int")
    timeout: timedelta = _option(DEFAULT_TIMEOUT, to_timedelta, "float | timedelta")
    backend: str | None = _option(None, _backend, "str | None")
    overlap: bool = _option(False, bool, "bool", refit=False)
    direct_min_bytes: int = _option(DIRECT_MIN_BYTES, lambda v: as_int(v, "Resharder: direct_min_bytes", 0), "int",
                                    refit=False)
    allow_cast: bool = _option(False, bool, "bool")
    gpus_per_node: int | None = _option(None, _gpus_per_node, "int | None")
    relay: bool | None = _option(None, _relay, "bool | None")
    instances: int = _option(1, _instances, "int")

    @classmethod
    def of(cls, **options) -> RefitOptions:
        """Validated options, by name (the fields; the rest take their defaults): a ``TypeError`` /
        ``ValueError`` naming the option and the value the user passed, before anything is planned."""
        known = {f.name: f for f in fields(cls)}
        for name in options:
            if name not in known:
                raise TypeError(f"RefitOptions.of() got an unexpected keyword argument {name!r}")
        opts = cls(**{n: f.metadata["check"](options[n]) for n, f in known.items() if n in options})
        if opts.slot_bytes < MIN_STEP_BYTES:  # the one minimum: the schedule's per-step cap (plan.MIN_STEP_BYTES)
            need = MIN_STEP_BYTES * opts.slots
            raise ValueError(f"Resharder: bucket_bytes={options.get('bucket_bytes', opts.bucket_bytes)} is too small: at least {need} B"
                             + (f" with overlap=True (two staging slots of {MIN_STEP_BYTES} B)" if opts.overlap else ""))
        if opts.relay and opts.gpus_per_node is None and opts.instances == 1:
            raise ValueError("refit: relay=True needs gpus_per_node or instances > 1 (relays fan out inside a node "
                             "or over the engines)")
        return opts

    @property
    def slots(self) -> int:
        """Staging slots: 2 with ``overlap`` (step k+1 packed while step k is on the wire), else 1."""
        return 2 if self.overlap else 1

    @property
    def slot_bytes(self) -> int:
        """The bucket of one staging slot: the schedule's per-step cap."""
        return self.bucket_bytes // self.slots


REFIT_OPTIONS = tuple(f.name for f in fields(RefitOptions) if f.metadata["refit"])
EXECUTOR_OPTIONS = ("bucket_bytes", "timeout", "backend", "overlap", "direct_min_bytes")  # Resharder's own


def takes_options(fn):
    """Give ``fn`` (``def f(..., *, group=None, ..., **options)``) the option keywords ``refit`` takes
    (:data:`REFIT_OPTIONS`) as explicit keyword-only parameters: ``inspect.signature`` and ``help`` show
    them, with :class:`RefitOptions`' defaults, right after ``group``; an unknown keyword is the ``TypeError``
    Python raises; ``fn`` receives the ones the caller passed in ``**options`` (:meth:`RefitOptions.of`
    fills in the rest)."""
    sig = inspect.signature(fn)
    known = {f.name: f for f in fields(RefitOptions)}
    opts = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=known[n].default,
                              annotation=known[n].metadata["accepts"]) for n in REFIT_OPTIONS]
    params = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    at = next((i + 1 for i, p in enumerate(params) if p.name == "group"), len(params))
    public = sig.replace(parameters=params[:at] + opts + params[at:])
    names = frozenset(REFIT_OPTIONS) | {p.name for p in params}

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        for k in kwargs:
            if k not in names:
                raise TypeError(f"{fn.__name__}() got an unexpected keyword argument {k!r}")
        return fn(*args, **kwargs)

    wrapper.__signature__ = public
    return wrapper
