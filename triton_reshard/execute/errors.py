"""The errors a reshard raises, and how a transport's message is read into one of them."""

from __future__ import annotations


class ReshardError(RuntimeError):
    """A reshard could not run (ranks disagree, a peer rejected its input) or failed part way.

    ``torn``: the destination local tensors on this rank that may be partly written (sorted; empty when the
    run failed before writing any destination byte, e.g. every rejected input)."""

    torn: tuple[str, ...] = ()


class ReshardTransportError(ReshardError):
    """The transport failed during a run: a timeout, a lost connection, or another backend error. The process
    group is unusable afterwards: destroy it and build a new one (and new Resharders) before retrying.

    Attributes (None when unknown): ``rank``, ``what`` (e.g. ``"step 2/5"``, ``"the plan handshake"``),
    ``peers`` (the ranks of that step), ``peer`` (the rank of the failing operation, where the backend
    tells), ``kind`` (``"timeout"``, ``"connection"`` or ``"error"``), ``elapsed`` (seconds from posting to
    the failure), ``timeout`` (seconds), ``torn`` (see :class:`ReshardError`)."""

    kind = "error"

    def __init__(self, message: str, *, rank: int | None = None, what: str | None = None,
                 peers: tuple[int, ...] | None = None, peer: int | None = None, elapsed: float | None = None,
                 timeout: float | None = None) -> None:
        super().__init__(message)
        self.rank, self.what, self.peers, self.peer = rank, what, peers, peer
        self.elapsed, self.timeout = elapsed, timeout


class ReshardTimeoutError(ReshardTransportError, TimeoutError):
    """A peer did not arrive within the timeout. The process group is unusable afterwards: destroy it."""

    kind = "timeout"


class ReshardConnectionError(ReshardTransportError, ConnectionError):
    """The connection to a peer was lost (it died, or the group broke earlier). Destroy the group."""

    kind = "connection"


class ReshardAbortedError(ReshardError):
    """This rank failed part way through a run (a copy raised after the handshake); its peers are left
    waiting and will fail too. The process group is unusable afterwards: destroy it. ``__cause__``: the
    original exception. ``group_ok``: the failure came after the run's digest round had proven every message
    (a delta's last apply raising on a message that verified): the peers returned, nothing is in flight, and
    the group and this rank's Resharder stay usable (its next refit goes dense)."""

    def __init__(self, message: str, *, group_ok: bool = False) -> None:
        super().__init__(message)
        self.group_ok = group_ok


# how a backend's message says what went wrong (gloo, NCCL, our RefitGroup)
TIMEOUT_WORDS = ("timed out", "timeout")
CONNECTION_WORDS = ("connection", "reset by peer", "broken pipe", "read error", "write error", "eof",
                     "closed", "socket", "unreachable", "destroyed", "aborted")


def classify(msg: str) -> type[ReshardTransportError]:
    low = msg.lower()
    if any(w in low for w in TIMEOUT_WORDS):
        return ReshardTimeoutError
    if any(w in low for w in CONNECTION_WORDS):
        return ReshardConnectionError
    return ReshardTransportError


GROUP_DEAD = ("the process group is unusable now: destroy it and build a new one (and new Resharders; "
              "refit does that for a new group) before retrying")


class ReshardIntegrityError(ReshardError):
    """A message's digest on its receiver (over what the receiver wrote) differs from its sender's (over
    what it sent): raised on every rank alike after the refit's end-of-run exchange. The group stays usable;
    the destination is torn (``torn`` on each rank: what it wrote) until a refit succeeds, and the next
    delta refit goes dense. ``tensor``, ``step`` (1-based), ``sender``, ``receiver``: the first differing
    message; ``pairs``: every (sender, receiver) pair whose digests differ."""

    def __init__(
        self,
        message: str,
        *,
        tensor: str | None,
        step: int | None,
        sender: int,
        receiver: int,
        pairs: tuple[tuple[int, int], ...],
    ) -> None:
        super().__init__(message)
        self.tensor, self.step, self.sender, self.receiver, self.pairs = tensor, step, sender, receiver, pairs


def integrity_error(me: int, bad: list, found: list, max_msgs: int) -> ReshardIntegrityError:
    """The integrity check's verdict on rank ``me`` (``execute/integrity.py``): ``bad``, the (sender, receiver)
    pairs whose digests differ; ``found``, per localized pair, (sender, receiver, messages sent, landed, the
    first differing message (index, step, tensor) or None) among the first ``max_msgs``."""
    s, q, n_s, n_q, first = found[0]
    if first is not None:
        k, step, tensor = first
        what = (
            f"message {k + 1} from rank {s} to rank {q} (step {step + 1} on rank {q}, tensor {tensor!r}) differs: its "
            f"digest on rank {q} over what it wrote is not rank {s}'s over what it sent"
        )
    elif n_s != n_q:
        what = f"rank {s} sent {n_s} messages to rank {q}, which landed {n_q}"
        step = tensor = None
    else:
        what = (
            f"a message from rank {s} to rank {q} after the first {max_msgs} of their {n_s} differs: its "
            f"digest on rank {q} over what it wrote is not rank {s}'s over what it sent"
        )
        step = tensor = None
    more = f"; {len(bad)} (sender, receiver) pairs differ: {bad}" if len(bad) > 1 else ""
    return ReshardIntegrityError(
        f"rank {me}: integrity check failed: {what}{more}; the destination holds bytes its sender did not send "
        f"(it is torn until a refit succeeds; the next delta refit goes dense)",
        tensor=tensor,
        step=None if step is None else step + 1,
        sender=s,
        receiver=q,
        pairs=tuple(bad),
    )
