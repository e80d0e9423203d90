"""Plan: two layouts in, transfers out (pure, deterministic, immutable).

``types`` (values and constants) <- ``routing`` (holders, topology, pieces), ``relay`` (fan-out), ``schedule``
(steps and messages), ``validate`` (exact cover) <- ``core`` (``Plan``, ``plan_reshard``).
"""

from .core import Plan, plan_reshard
from .routing import lower_bound_bytes
from .schedule import build_schedule
from .types import ALIGN, DIRECT_MIN_BYTES, PlanStats, Schedule, Transfer

__all__ = [
    "ALIGN",
    "DIRECT_MIN_BYTES",
    "Plan",
    "PlanStats",
    "Schedule",
    "Transfer",
    "build_schedule",
    "lower_bound_bytes",
    "plan_reshard",
]
