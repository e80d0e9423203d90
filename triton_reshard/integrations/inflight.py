"""A background send (integration kit): one update's transfer running in a thread while the trainer goes on
(its next training step), from a snapshot of the tensors it sends, joined before the engine swaps the new
weights in. Engine-independent; a plug-in's trainer engine holds one :class:`BackgroundSender`:

* :meth:`BackgroundSender.start`: refuses a second send while one is in flight (one thread uses the refit group
  at a time), copies this rank's local tensors into snapshot buffers (1x the tensors' bytes, allocated at the
  first send and reused: the trainer may change its own tensors as soon as ``start`` returns), then runs the
  plug-in's send of that snapshot in a daemon thread;
* :meth:`BackgroundSender.join`: waits for it and returns its result, or raises its error (the plug-in's staged
  update failed: nothing was committed); the slot is free either way;
* :meth:`BackgroundSender.close`: a shutdown's join, bounded by the group's timeout, never raising.

A caller that already holds copies (e.g. the bf16 weights it casts from fp32 masters into tensors of its own)
passes them with ``copied=True``: no second copy; it must not change them until the join returned.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping

import torch

__all__ = ["BackgroundSend", "BackgroundSender", "Snapshot"]


class Snapshot:
    """Copies of a rank's local tensors for one send in flight: one buffer per tensor (same shape, dtype, device
    and strides), allocated at the first :meth:`take` and reused by the next ones (a cached plan's bindings stay
    valid), so the snapshot costs one copy per send and 1x the tensors' bytes, held between sends."""

    def __init__(self):
        self._bufs: dict[str, torch.Tensor] = {}

    def take(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``{name: a copy of tensors[name]}`` in this snapshot's buffers (buffers of names no longer given
        are dropped)."""
        out = {}
        with torch.no_grad():
            for n, t in tensors.items():
                b = self._bufs.get(n)
                if b is None or b.shape != t.shape or b.dtype != t.dtype or b.device != t.device \
                        or b.stride() != t.stride():
                    b = torch.empty_like(t)
                b.copy_(t)
                out[n] = b
        self._bufs = dict(out)
        return out

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._bufs.values())

    def release(self) -> None:
        self._bufs = {}


class BackgroundSend:
    """``fn()`` in a daemon thread (named ``name``); :meth:`join` returns its result or raises its error."""

    def __init__(self, fn: Callable[[], object], *, version=None, name: str = "triton_reshard_send"):
        self.version = version
        self.result: object = None
        self.error: BaseException | None = None
        self.t0, self.t1 = time.perf_counter(), None
        self._done = threading.Event()

        def run():
            try:
                self.result = fn()
            except BaseException as e:  # noqa: BLE001 (re-raised in join)
                self.error = e
            finally:
                self.t1 = time.perf_counter()
                self._done.set()

        self.thread = threading.Thread(target=run, daemon=True, name=name)
        self.thread.start()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def join(self, timeout: float | None, what: str = "the background send"):
        if not self._done.wait(timeout):
            raise TimeoutError(f"{what} of version {self.version!r} did not complete within {timeout:g}s")
        if self.error is not None:
            raise self.error
        return self.result


class BackgroundSender:
    """At most one :class:`BackgroundSend` in flight, from a reused :class:`Snapshot` (module docstring).
    ``where`` heads the refusals (e.g. ``"triton_reshard trainer rank 0"``)."""

    def __init__(self, where: str):
        self.where = where
        self.snapshot = Snapshot()
        self.current: BackgroundSend | None = None
        self.last: dict = {}  # the last joined send: version, snapshot_s, send_s, join_wait_s

    @property
    def in_flight(self) -> bool:
        return self.current is not None

    def check_idle(self, doing: str) -> None:
        """Refuse ``doing`` while a send is in flight (it uses the refit group until it is joined)."""
        if self.current is not None:
            state = "completed, not joined" if self.current.done else "running"
            raise RuntimeError(f"{self.where}: {doing} refused: the background send of version "
                               f"{self.current.version!r} is in flight ({state}); commit() joins it first")

    def take(self, tensors: Mapping[str, torch.Tensor], version=None, *, copied: bool = False) -> dict:
        """The tensors the next :meth:`run` sends: a snapshot of ``tensors`` (``copied``: ``tensors`` as given,
        the caller's own copies). Refused while a send is in flight."""
        self.check_idle("send_weights")
        t0 = time.perf_counter()
        snap = dict(tensors) if copied else self.snapshot.take(tensors)
        self.last = {"version": version, "snapshot_s": time.perf_counter() - t0,
                     "snapshot_bytes": 0 if copied else self.snapshot.nbytes}
        return snap

    def run(self, send: Callable[[], object]) -> BackgroundSend:
        """``send()`` (of what :meth:`take` returned) in a background thread; refused while one is in flight."""
        self.check_idle("send_weights")
        self.current = BackgroundSend(send, version=self.last.get("version"))
        return self.current

    def start(self, send: Callable[[dict], object], tensors: Mapping[str, torch.Tensor], version=None, *,
              copied: bool = False) -> BackgroundSend:
        """:meth:`take` then :meth:`run`: ``send(snapshot)`` in a background thread."""
        snap = self.take(tensors, version, copied=copied)
        return self.run(lambda: send(snap))

    def join(self, timeout: float | None):
        """Wait for the send in flight (None: nothing to join); its result, or its error raised. The slot is
        free afterwards either way; a send still running after ``timeout`` keeps it (TimeoutError)."""
        job = self.current
        if job is None:
            return None
        t0 = time.perf_counter()
        if not job._done.wait(timeout):
            raise TimeoutError(f"{self.where}: the background send of version {job.version!r} did not complete "
                               f"within {timeout:g}s (it is still in flight)")
        self.current = None
        self.last.update(send_s=job.t1 - job.t0, join_wait_s=time.perf_counter() - t0, failed=job.error is not None)
        return job.join(0)

    def close(self, timeout: float) -> BaseException | None:
        """A shutdown's join: waits up to ``timeout`` for a send in flight; its error (or the timeout) returned,
        not raised; the snapshot buffers are freed."""
        err = None
        try:
            self.join(timeout)
        except BaseException as e:  # noqa: BLE001 (returned: the caller's shutdown goes on)
            err = e
        self.current = None
        self.snapshot.release()
        return err
