"""Plan: two layouts in, transfers out (pure, deterministic, immutable).

Modules, each importing only the ones before it: ``types`` (values, constants) <- ``quant`` (block-quantized
destinations) <- ``schedule`` (first-fit steps), ``relay`` (fan-out) <- ``routing`` (holders, pieces, checks,
the lower bound) <- ``validate`` (exact cover) <- ``core`` (``Plan``) <- ``local`` (the local rules: the
default planner, rank plans, the pair schedule), ``greedy`` (the greedy router, kept for comparison) <-
``planner`` (``plan_reshard``); ``work``: what one rank's executor needs of a plan. Box geometry:
``triton_reshard.box``.
"""

from .core import Plan
from .planner import plan_reshard
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
