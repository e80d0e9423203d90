"""The trainer side of the vLLM backend: :class:`TritonReshardTrainerEngine` (vLLM's weight-transfer API). See
:mod:`.vllm_transfer` for the whole backend (and :func:`~.vllm_transfer.trainer_refit_group` for vLLMs
without the API)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import ClassVar

from ..comm.secret import SECRET_ENV
from ..execute.options import DEFAULT_BUCKET_BYTES
from ..layout import Layout
from ..refit import refit
from .engine import ControlCall, broadcast_send, join_group, lost_text, plugin_secret
from .inflight import BackgroundSender
from .stage import beside
from .vllm_transfer import (
    BACKEND,
    MODES,
    ReshardUpdateInfo,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    delta_kwargs,
    group_layouts,
    rendezvous,
)

if TrainerWeightTransferEngine is not None:

    @dataclass
    class ReshardTrainerInitInfo(TrainerInitInfo):
        """Trainer-side init info (one per trainer rank; ``rank`` is this trainer rank, 0 the sender)."""

        backend: ClassVar[str] = BACKEND
        host: str = "127.0.0.1"
        port: int = 0
        world_size: int = 0  # trainer ranks + all workers
        num_trainer_ranks: int = 1
        layout: Layout | None = None  # the trainer's layout on refit ranks 0..num_trainer_ranks-1
        timeout: float = 300.0
        bucket_bytes: int = DEFAULT_BUCKET_BYTES
        group_backend: str | None = None
        extra: dict = field(default_factory=dict)
        # the refit group's secret: ``secret`` itself (kept out of repr), else read from ``secret_file`` or the
        # environment variable ``secret_env``; the workers are told only ``secret_env`` / ``secret_file``
        secret: bytes | str | None = field(default=None, repr=False)
        secret_env: str | None = SECRET_ENV
        secret_file: str | None = None
        insecure: bool | None = None
        mode: str = "auto"  # the workers' receive mode: "auto" | "inplace" | "reload" (see choose_mode)
        staging_bytes: int = 64 << 20  # reload mode: the checkpoint bytes of one refit (see group_layouts)
        prefetch: bool = False  # reload mode: workers receive group k+1 while loading group k (2 groups staged)
        # pause the engine's scheduler from before each update until it completed, through the client's
        # pause_generation(mode) / resume_generation: no engine step runs between the update's RPCs, and an
        # update that fails leaves the engine paused, not serving torn weights. False: the caller guarantees no
        # request runs during an update. ``pause_mode`` (vLLM's): "wait" (requests in flight finish on the old
        # weights first: every request sees one version), "keep" (held, continued on the new weights), "abort".
        pause: bool = True
        pause_mode: str = "wait"
        shadow: bool = True  # reload mode, stage then commit: new weights built while serving (ReshardInitInfo)

    # what the workers are told (ReshardInitInfo): the trainer's init info less what stays here
    _WORKER_FIELDS = ("host", "port", "world_size", "timeout", "bucket_bytes", "group_backend", "secret_env",
                      "secret_file", "insecure", "mode", "staging_bytes", "prefetch", "shadow")

    class TritonReshardTrainerEngine(TrainerWeightTransferEngine):
        """The trainer side: every trainer rank sends the boxes it holds, straight from its local tensors.

        ``source``: a ``WeightSource`` whose ``iter_local()`` yields this rank's local tensors under the
        trainer layout's local names (:class:`~.vllm_transfer.TensorsSource` wraps a dict). ``mode``: the
        workers' receive mode, agreed at init."""

        init_info_cls = ReshardTrainerInitInfo
        _staged: dict | None = None  # a completed send_weights(overlap=True) not yet committed
        _bg: BackgroundSender | None = None  # send_weights(background=True): the send in flight, its snapshot
        group = None

        @classmethod
        def trainer_init(cls, init_info: ReshardTrainerInitInfo, *, client, source=None):
            import inspect

            if init_info.layout is None:
                raise ValueError("ReshardTrainerInitInfo.layout: the trainer's Layout is required")
            if init_info.mode not in MODES:
                raise ValueError(f"ReshardTrainerInitInfo.mode must be one of {MODES}, got {init_info.mode!r}")
            kw = {"is_sender": init_info.rank == 0}  # vLLM 0.33's __init__ takes rank=; 0.32's does not
            if "rank" in inspect.signature(TrainerWeightTransferEngine.__init__).parameters:
                kw["rank"] = init_info.rank
            eng = cls(client=client, source=source, **kw)
            eng.rank, eng.info = init_info.rank, init_info
            worker_info = {k: getattr(init_info, k) for k in _WORKER_FIELDS}
            worker_info["rank_offset"] = init_info.num_trainer_ranks
            secret = plugin_secret(init_info.secret, init_info.secret_env, init_info.secret_file,
                                   where=f"triton_reshard trainer rank {init_info.rank}")
            rpc = ControlCall(client.init_weight_transfer_engine, worker_info) if eng.is_sender else None
            eng.group = join_group(init_info.host, init_info.port, init_info.rank, init_info.world_size,
                                   backend=init_info.group_backend, timeout=init_info.timeout,
                                   secret=secret, insecure=init_info.insecure)
            part = (init_info.layout,) if eng.is_sender else None
            try:
                eng.src_layout, eng.dst_layout, eng.mode = rendezvous(eng.group, part, None, init_info.rank)
            except BaseException:
                if rpc is not None:  # the workers fail the same init: let their answer arrive, then raise ours
                    with contextlib.suppress(BaseException):
                        rpc.join(min(init_info.timeout, 30.0))
                eng.shutdown()
                raise
            eng.groups = group_layouts(eng.src_layout, eng.dst_layout, eng.mode, init_info.staging_bytes)
            if rpc is not None:
                rpc.join(init_info.timeout)
            return eng

        def send_weights(self, version: int | str | None = None, delta: bool | str = False,
                         method: str = "reshard", prefetch: bool | None = None, overlap: bool = False,
                         shadow: bool | None = None, background: bool = False, tensors=None) -> None:
            """One update. ``delta=True`` (with an int ``version``, e.g. the step): only the changed elements
            travel after the first update (docs/delta.md). In reload mode an update is one refit per layer
            group (a delta patches the workers' staged checkpoint, vLLM re-packing a group while the next one moves).
            ``method="broadcast"``: the baseline (:class:`ReshardUpdateInfo`); needs every full tensor on one
            trainer rank. ``overlap=True``: stage, then commit: the workers receive into a private staging
            mirror in a background thread while the engine keeps serving; this returns once every worker has
            staged (the engine is not paused) and, in reload mode, built the new weights on a shadow of the model
            (``shadow``, default the init info's); :meth:`commit` later swaps them in under the pause.
            A failed staged update leaves the engine serving its weights untouched (raised here, not torn).

            ``background=True`` (with ``overlap=True``): this rank's local tensors are copied into a snapshot
            (1x its local weights, buffers reused across updates) and the whole staged update runs in a
            background thread; this returns after the copy, so the trainer may change its weights (its next
            training step) while the bytes move. :meth:`commit` joins it (raising its error: the engine then
            serves its old weights, untouched) and swaps as above. A send while one is in flight is refused
            (commit first); :meth:`shutdown` joins it within the group's timeout. ``tensors``: this rank's
            local tensors for this update instead of the source's; with ``background=True`` they are sent as
            given, without the snapshot copy (the caller's own copies: not to be changed until commit)."""
            if background and not overlap:
                raise ValueError(f"triton_reshard trainer rank {self.rank}: background=True needs overlap=True "
                                 "(a background send stages; commit() joins it and swaps)")
            self._sender().check_idle("send_weights")
            info = {"version": version, "delta": delta, "method": method, "prefetch": prefetch,
                    "phase": "stage" if overlap else "full", "shadow": shadow}
            # refused here, before any engine call: the engine keeps serving its old weights (issue 42)
            kw = dict(group=self.group, bucket_bytes=self.info.bucket_bytes, timeout=self.info.timeout,
                      **delta_kwargs(ReshardUpdateInfo(**info)))
            copied = tensors is not None
            if tensors is None:
                tensors = dict(self.source.iter_local()) if self.source is not None else {}
            if background:  # the copy the send reads while the trainer goes on
                tensors = self._sender().take(tensors, version, copied=copied)
            self._staged = None  # a new update supersedes a staged one not committed

            def send(phases: dict) -> int:
                if method == "broadcast":
                    return broadcast_send(self.group, self.src_layout, tensors, self.info.num_trainer_ranks,
                                          self.info.timeout)
                sent = 0
                for _names, src, dst in self.groups:  # one refit per layer group in reload mode, as workers receive
                    mine = {f.local or f.tensor for f in src.fragments if f.rank == self.group.rank}
                    part = {n: t for n, t in tensors.items() if n in mine}
                    self.last_report = rep = refit(part, {}, src, dst, **kw)
                    sent += rep.sent_bytes
                    phases["refits"] = phases.get("refits", 0) + 1
                    phases["pack_s"] = phases.get("pack_s", 0.0) + rep.pack_seconds
                    phases["wire_s"] = phases.get("wire_s", 0.0) + rep.wire_seconds
                return sent

            if background:
                self._sender().run(lambda: self._update(info, send))
                return
            self._update(info, send)

        def commit(self) -> None:
            """Swap the weights a completed ``send_weights(overlap=True)`` staged into the engine: pause (the
            configured ``pause_mode``), each worker's commit (in place: copy staging into the live parameters;
            reload mode: vLLM's layerwise reload fed from staging), resume. Every trainer rank calls it (the
            commit ends with the update's vote). Refused, before any engine call, without a complete staged
            update; a commit that fails part way leaves the weights torn and the engine paused, as a failed
            update does, and raises naming it. After ``send_weights(background=True)`` it first joins that send
            (bounded by 3x the group's timeout, each of its steps by the timeout itself) and raises its error
            (the engine untouched, serving its old weights); ``last_update["stage"]`` is then the send's."""
            stage = None
            if self._sender().in_flight:
                self._sender().join(3 * self.info.timeout)
                stage = {**self.last_update, **self._sender().last}
            if self._staged is None:
                raise RuntimeError(f"triton_reshard trainer rank {self.rank}: commit refused: no complete staged "
                                   "update (send_weights(overlap=True) first; a failed one cannot be committed)")
            version, self._staged = self._staged["version"], None
            self._update({"version": version, "phase": "commit"}, lambda phases: 0)
            if stage is not None:
                self.last_update["stage"] = stage

        def _sender(self) -> BackgroundSender:
            if self._bg is None:
                self._bg = BackgroundSender(f"triton_reshard trainer rank {self.rank}")
            return self._bg

        def _update(self, info: dict, send) -> None:
            """One engine update session around this rank's ``send``: pause (not for a staged receive), vLLM's
            ``start_weight_update`` / ``update_weights`` (rank 0, the workers' part, run beside ours), the sends,
            the update's vote, the workers' answer, ``finish_weight_update``, resume. Fills ``last_update``."""
            phase, version, method = info["phase"], info["version"], info.get("method", "reshard")
            t = [time.perf_counter()]
            phases: dict = {}

            def lap(key: str) -> None:
                t.append(time.perf_counter())
                phases[key] = t[-1] - t[-2]

            pause = phase != "stage" and self._pause()
            lap("pause_s")
            rpc = None
            if self.is_sender:
                self.client.start_weight_update()
                rpc = ControlCall(self.client.update_weights, info)
            lap("start_s")
            sent, err, bad = beside(self.group, lambda: send(phases), rpc, self.info.timeout,
                                    f"trainer rank {self.rank}", lap)
            sent = sent or 0
            if phase == "stage":
                return self._staged_done(version, err, bad, sent, t[0], phases)
            if err is not None:
                self._failed(version, method, f"{type(err).__name__}: {err}{self._lost(err)}", err)
            if bad:  # a worker failed on its own (e.g. in the engine's loader) while our sends completed
                self._failed(version, method, f"rank(s) {bad} of the refit group failed their part (see their log)",
                             None)
            if rpc is not None:
                self.client.finish_weight_update(None if version is None else str(version))
            lap("finish_s")
            if pause:
                self.client.resume_generation()
            lap("resume_s")
            self.last_update = {"mode": self.mode, "method": method, "sent_bytes": sent, "seconds": t[-1] - t[0],
                                **phases}
            if phase == "commit":
                self.last_update.update(phase="commit", version=version, commit_s=t[-2] - t[1],
                                        paused_s=t[-1] - t[0] if pause else 0.0)

        def _staged_done(self, version, err, bad, sent: int, t0: float, phases: dict) -> None:
            """A staged receive's end: vLLM's update session closes (the engine's weight version stays: nothing
            committed); a failure is raised saying the engine serves its weights as before."""
            # who left, asked before the engine's finish: an engine that lost a worker is stopped by vLLM then, and
            # its other workers leave too (asked after, the first gone may no longer be told apart)
            lost = self._lost(err) if err is not None or bad else ""
            engine_err = self._finish(None) if self.is_sender else None
            if err is None and not bad and engine_err is not None:
                raise engine_err
            if err is not None or bad:
                reason = f"{type(err).__name__}: {err}" if err is not None else f"rank(s) {bad} failed their part"
                self.last_update = {"mode": self.mode, "phase": "stage", "failed": reason[:400]}
                state = ("the engine was not paused and serves its weights as before (staging is private)"
                         if engine_err is None else "the engine was not paused, but its finish_weight_update failed "
                         f"({type(engine_err).__name__}: {str(engine_err)[:200]}): an engine that lost a worker is "
                         "stopped by vLLM: restart it")
                raise RuntimeError(
                    f"triton_reshard trainer rank {self.rank}: the staged update to version {version!r} failed "
                    f"({reason}){lost}; nothing was committed: {state}; re-init the trainer engine if "
                    "its refit group broke, then send_weights again") from err
            self._staged = {"version": version}
            s = time.perf_counter() - t0
            self.last_update = {"mode": self.mode, "method": "reshard", "phase": "stage", "sent_bytes": sent,
                                "transfer_s": s, "seconds": s, **phases}

        def _pause(self) -> bool:
            """Pause the engine's scheduler (rank 0, ``pause=True``, a client that can); whether it did."""
            pause = getattr(self.client, "pause_generation", None) if self.is_sender and self.info.pause else None
            if pause is not None:
                pause(self.info.pause_mode)
            return pause is not None

        def _finish(self, version) -> BaseException | None:
            """vLLM's ``finish_weight_update``, bounded by the group's timeout (an engine that lost a worker may
            answer late or never): its error, None once it returned."""
            try:
                ControlCall(self.client.finish_weight_update, version).join(self.info.timeout)
            except BaseException as e:  # noqa: BLE001 (the caller says what it means)
                return e
            return None

        def _lost(self, err: BaseException | None) -> str:
            return lost_text(self.group, err, self.info.num_trainer_ranks, self.info.timeout)

        def _failed(self, version, method: str, reason: str, cause: BaseException | None):
            """A failed update: close vLLM's update session on the workers (they keep their torn state: nothing
            is finalized, the forward stays refused) and raise, leaving the engine paused."""
            self.last_update = {"mode": self.mode, "method": method, "failed": reason[:400]}
            engine_err = self._finish(None) if self.is_sender else None
            if engine_err is not None:
                reason += (f"; the engine's finish_weight_update failed too ({type(engine_err).__name__}: "
                           f"{str(engine_err)[:200]}): an engine that lost a worker is stopped by vLLM: restart it")
            if cause is not None and not (self.is_sender and self.info.pause
                                          and getattr(self.client, "pause_generation", None)):
                raise cause
            raise RuntimeError(
                f"triton_reshard trainer rank {self.rank}: the weight update to version {version!r} failed "
                f"({reason}); the engine's workers hold torn weights and refuse a forward, and the engine stays "
                "paused (queued requests wait, none is served from torn weights) until a repair update completes: "
                "re-init the trainer engine if its refit group broke, then send_weights again") from cause

        def shutdown(self) -> None:
            if self._bg is not None:  # a background send in flight: joined within the group's timeout
                self._bg.close(self.info.timeout)
            if self.group is not None:
                group, self.group = self.group, None
                group.destroy()
