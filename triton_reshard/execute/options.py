"""The options of a refit, validated once: one frozen value that ``refit``, ``verify_refit``,
``get_resharder`` and :class:`~triton_reshard.execute.Resharder` share instead of four keyword lists."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
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


@dataclass(frozen=True, slots=True)
class RefitOptions:
    """How a refit runs (build it with :meth:`of`, which validates every option once).

    Executor options: ``bucket_bytes`` (staging bound), ``timeout`` (every wait), ``backend`` (copy backend,
    None: by device / ``TRITON_RESHARD_BACKEND``), ``overlap`` (two staging slots), ``direct_min_bytes``
    (in-place threshold). Planner options (checked by ``plan_reshard``): ``allow_cast``, ``gpus_per_node``,
    ``relay``, ``instances``. Hashable: it is the cache key of ``get_resharder`` with the layouts and group."""

    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout: timedelta = DEFAULT_TIMEOUT
    backend: str | None = None
    overlap: bool = False
    direct_min_bytes: int = DIRECT_MIN_BYTES
    allow_cast: bool = False
    gpus_per_node: int | None = None
    relay: bool | None = None
    instances: int = 1

    @classmethod
    def of(cls, bucket_bytes=DEFAULT_BUCKET_BYTES, timeout=DEFAULT_TIMEOUT, backend: str | None = None,
           overlap: bool = False, direct_min_bytes=DIRECT_MIN_BYTES, allow_cast: bool = False,
           gpus_per_node: int | None = None, relay: bool | None = None, instances: int = 1) -> RefitOptions:
        """Validated options (``TypeError`` / ``ValueError`` naming the option)."""
        bucket_bytes = as_int(bucket_bytes, "Resharder: bucket_bytes", 1)
        timeout = to_timedelta(timeout)
        if backend is not None and backend not in ops.BACKENDS:
            raise ValueError(f"Resharder: unknown copy backend {backend!r}; expected None or one of {ops.BACKENDS}")
        direct_min_bytes = as_int(direct_min_bytes, "Resharder: direct_min_bytes", 0)
        opts = cls(bucket_bytes, timeout, backend, bool(overlap), direct_min_bytes, bool(allow_cast), gpus_per_node,
                   relay, instances)
        if opts.slot_bytes < MIN_STEP_BYTES:  # the one minimum: the schedule's per-step cap (plan.MIN_STEP_BYTES)
            need = MIN_STEP_BYTES * opts.slots
            raise ValueError(f"Resharder: bucket_bytes={bucket_bytes} is too small: at least {need} B"
                             + (f" with overlap=True (two staging slots of {MIN_STEP_BYTES} B)" if overlap else ""))
        return opts

    @property
    def slots(self) -> int:
        """Staging slots: 2 with ``overlap`` (step k+1 packed while step k is on the wire), else 1."""
        return 2 if self.overlap else 1

    @property
    def slot_bytes(self) -> int:
        """The bucket of one staging slot: the schedule's per-step cap."""
        return self.bucket_bytes // self.slots
