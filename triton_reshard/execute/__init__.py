"""Execute: buffers, transport, kernels (see :mod:`.resharder`)."""

from .resharder import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_TIMEOUT,
    Difference,
    ReshardAbortedError,
    ReshardConnectionError,
    Resharder,
    ReshardError,
    ReshardTimeoutError,
    ReshardTransportError,
    RunReport,
    VerifyReport,
    _to_timedelta,
    refuse,
)

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_TIMEOUT",
    "Difference",
    "ReshardAbortedError",
    "ReshardConnectionError",
    "ReshardError",
    "ReshardTimeoutError",
    "ReshardTransportError",
    "Resharder",
    "RunReport",
    "VerifyReport",
    "_to_timedelta",
    "refuse",
]
