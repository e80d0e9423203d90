"""Plan: two layouts in, transfers out (pure, deterministic, immutable).

One plan type, :class:`Plan`: the whole plan (``rank=None``) or one rank's share (``plan_reshard(..., rank=r)``).
Modules, each importing only the ones before it: ``types`` (values, constants) <- ``quant`` (block-quantized
destinations) <- ``pair_schedule`` (the pair rule: every plan's steps), ``relay`` (fan-out) <- ``routing``
(pieces, checks) <- ``options`` (``PlanOptions``, ``StepBudget``: the options resolved once) <- ``index``
(per-tensor queries on a layout) <- ``validate`` (exact cover, a share's check) <- ``core`` (``Plan``) <-
``holders`` (the holder rule, one piece on ranks) <- ``rows`` (the whole plan as numpy rows, the lower bound)
<- ``local`` (a rank's share) <- ``planner`` (``plan_reshard``);
``work``: what one rank's executor needs of a plan. Box geometry: ``triton_reshard.box``.
"""

from .core import Plan
from .options import PlanOptions, StepBudget
from .planner import plan_reshard
from .rows import lower_bound_bytes
from .table import TransferTable
from .types import ALIGN, DIRECT_MIN_BYTES, MIN_STEP_BYTES, PlanStats, Schedule, Transfer

__all__ = [
    "ALIGN",
    "MIN_STEP_BYTES",
    "DIRECT_MIN_BYTES",
    "Plan",
    "PlanOptions",
    "PlanStats",
    "Schedule",
    "StepBudget",
    "Transfer",
    "TransferTable",
    "lower_bound_bytes",
    "plan_reshard",
]
