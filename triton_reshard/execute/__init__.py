"""Execute: buffers, transport, kernels. :class:`Resharder` (``resharder``) runs a plan on one rank; beside it
its jobs: ``options``, ``checks``, ``transport``, ``handshake``, ``bind``, ``steps``, ``delta`` (delta refits),
``integrity`` (per-message digests), ``reports``, ``errors``."""

from .delta import DeltaRefusedError, DeltaRequest
from .errors import (
    ReshardAbortedError,
    ReshardConnectionError,
    ReshardError,
    ReshardTimeoutError,
    ReshardTransportError,
)
from .handshake import refuse
from .integrity import ReshardIntegrityError
from .options import DEFAULT_BUCKET_BYTES, DEFAULT_TIMEOUT, RefitOptions, to_timedelta
from .reports import Difference, RunReport, VerifyReport
from .resharder import Resharder

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_TIMEOUT",
    "DeltaRefusedError",
    "DeltaRequest",
    "Difference",
    "RefitOptions",
    "ReshardAbortedError",
    "ReshardConnectionError",
    "ReshardError",
    "ReshardIntegrityError",
    "ReshardTimeoutError",
    "ReshardTransportError",
    "Resharder",
    "RunReport",
    "VerifyReport",
    "refuse",
    "to_timedelta",
]
