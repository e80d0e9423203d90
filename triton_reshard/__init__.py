"""triton_reshard: a layout-aware reshard collective for RL weight refit.

Layout (what is where) -> Plan (who sends which box to whom, pure) -> Resharder (buffers, transport,
kernels). ``refit`` wraps the three for a training loop; ``verify_refit`` checks, writing nothing, that a
refit would leave the destination as it is.
"""

from .comm.group import RefitGroup, RefitGroupError, init_refit_group
from .execute import (
    DEFAULT_BUCKET_BYTES,
    DeltaRefusedError,
    DeltaRequest,
    Difference,
    ReshardAbortedError,
    ReshardConnectionError,
    Resharder,
    ReshardError,
    ReshardIntegrityError,
    ReshardTimeoutError,
    ReshardTransportError,
    RunReport,
    VerifyReport,
)
from .layout import (
    FP8_BLOCK,
    MXFP8,
    NVFP4,
    BlockQuant,
    Fragment,
    Layout,
    LocalSpec,
    QuantFormat,
    Replicate,
    Shard,
    TensorSpec,
    block_quant_layout,
)
from .plan import Plan, PlanStats, Schedule, Transfer, plan_reshard
from .refit import RefitState, clear_cache, refit, refit_state, verify_refit

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "FP8_BLOCK",
    "MXFP8",
    "NVFP4",
    "QuantFormat",
    "BlockQuant",
    "DeltaRefusedError",
    "DeltaRequest",
    "Difference",
    "Fragment",
    "Layout",
    "LocalSpec",
    "Plan",
    "RefitGroup",
    "RefitGroupError",
    "PlanStats",
    "Replicate",
    "RefitState",
    "ReshardAbortedError",
    "ReshardConnectionError",
    "ReshardError",
    "ReshardIntegrityError",
    "ReshardTimeoutError",
    "ReshardTransportError",
    "Resharder",
    "RunReport",
    "Schedule",
    "Shard",
    "TensorSpec",
    "block_quant_layout",
    "VerifyReport",
    "Transfer",
    "clear_cache",
    "init_refit_group",
    "plan_reshard",
    "refit",
    "refit_state",
    "verify_refit",
]

__version__ = "0.1.0"
