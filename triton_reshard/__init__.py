"""triton_reshard: a layout-aware reshard collective for RL weight refit.

Layout (what is where) -> Plan (who sends which box to whom, pure) -> Resharder (buffers, transport,
kernels). ``refit`` wraps the three for a training loop; ``verify_refit`` checks, writing nothing, that a
refit would leave the destination as it is.
"""

from .execute import Difference, Resharder, ReshardError, ReshardTimeoutError, RunReport, VerifyReport
from .layout import Fragment, Layout, LocalSpec, Replicate, Shard, TensorSpec
from .plan import Plan, PlanStats, Schedule, Transfer, plan_reshard
from .refit import clear_cache, refit, verify_refit

__all__ = [
    "Difference",
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
    "VerifyReport",
    "Transfer",
    "clear_cache",
    "plan_reshard",
    "refit",
    "verify_refit",
]

__version__ = "0.1.0"
