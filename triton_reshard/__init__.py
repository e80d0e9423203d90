"""triton_reshard: a layout-aware reshard collective for RL weight refit.

Layout (what is where) -> Plan (who sends which box to whom, pure) -> Resharder (buffers, transport,
kernels). ``refit`` wraps the three for a training loop.
"""

from .execute import Resharder, ReshardError, ReshardTimeoutError, RunReport
from .layout import Fragment, Layout, LocalSpec, Replicate, Shard, TensorSpec
from .plan import Plan, PlanStats, Schedule, Transfer, plan_reshard
from .refit import clear_cache, refit

__all__ = [
    "Fragment",
    "Layout",
    "LocalSpec",
    "Plan",
    "PlanStats",
    "Replicate",
    "ReshardError",
    "ReshardTimeoutError",
    "Resharder",
    "RunReport",
    "Schedule",
    "Shard",
    "TensorSpec",
    "Transfer",
    "clear_cache",
    "plan_reshard",
    "refit",
]

__version__ = "0.1.0"
