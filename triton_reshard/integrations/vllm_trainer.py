"""The trainer side of the vLLM backend: :class:`TritonReshardTrainerEngine` (vLLM's weight-transfer API), the
sources and clients it takes, and :func:`trainer_refit_group` (for vLLMs without the API). See
:mod:`.vllm_transfer` for the whole backend."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..comm.secret import SECRET_ENV
from ..execute.options import DEFAULT_BUCKET_BYTES
from ..layout import Layout
from ..refit import refit
from .engine import join_group, plugin_secret
from .vllm_reload import MODES, group_layouts
from .vllm_update import (
    BACKEND,
    ControlCall,
    ReshardUpdateInfo,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    add_report,
    broadcast_root,
    commit_vote,
    delta_kwargs,
    group_broken,
    register,
    rendezvous,
    wait_all,
)

# a trainer process has no vLLM plugin loader: importing the trainer side (vllm_transfer imports it) registers
# the backend, so WeightTransferTrainerFactory.trainer_init finds it as the docs show (issue 42)
register()

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
        # pause_generation(mode) / resume_generation (LLMClient: vLLM's level-0 sleep / wake_up): no engine step
        # runs between the update's RPCs (a reload has layers on the meta device then), and an update that fails
        # leaves the engine paused, not serving torn weights. False: the caller guarantees no request runs
        # during an update. ``pause_mode`` (vLLM's): "wait" (requests in flight finish on the old weights first,
        # new ones queue: every request sees one version), "keep" (requests in flight are held and continue on
        # the new weights, attending to KV cache the old weights computed), "abort" (they are aborted).
        pause: bool = True
        pause_mode: str = "wait"

    def _trainer_engine_kwargs(is_sender: bool, rank: int) -> dict:
        """vLLM 0.33's ``TrainerWeightTransferEngine.__init__`` takes ``rank=``; 0.32's does not."""
        import inspect

        params = inspect.signature(TrainerWeightTransferEngine.__init__).parameters
        return {"is_sender": is_sender, **({"rank": rank} if "rank" in params else {})}

    class TritonReshardTrainerEngine(TrainerWeightTransferEngine):
        """The trainer side: every trainer rank sends the boxes it holds, straight from its local tensors.

        ``source``: a ``WeightSource`` whose ``iter_local()`` yields this rank's local tensors under the
        trainer layout's local names (:class:`TensorsSource` wraps a dict such as
        ``dict(megatron_model.named_parameters())``). ``mode``: the workers' receive mode, agreed at init."""

        init_info_cls = ReshardTrainerInitInfo
        _staged: dict | None = None  # a completed send_weights(overlap=True) not yet committed

        @classmethod
        def trainer_init(cls, init_info: ReshardTrainerInitInfo, *, client, source=None):
            if init_info.layout is None:
                raise ValueError("ReshardTrainerInitInfo.layout: the trainer's Layout is required")
            if init_info.mode not in MODES:
                raise ValueError(f"ReshardTrainerInitInfo.mode must be one of {MODES}, got {init_info.mode!r}")
            eng = cls(client=client, source=source, **_trainer_engine_kwargs(init_info.rank == 0, init_info.rank))
            eng.rank = init_info.rank
            eng.info = init_info
            worker_info = dict(host=init_info.host, port=init_info.port, rank_offset=init_info.num_trainer_ranks,
                               world_size=init_info.world_size, timeout=init_info.timeout,
                               bucket_bytes=init_info.bucket_bytes, group_backend=init_info.group_backend,
                               secret_env=init_info.secret_env, secret_file=init_info.secret_file,
                               insecure=init_info.insecure, mode=init_info.mode,
                               staging_bytes=init_info.staging_bytes, prefetch=init_info.prefetch)
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
                eng.group.destroy()
                eng.group = None
                raise
            eng.groups = group_layouts(eng.src_layout, eng.dst_layout, eng.mode, init_info.staging_bytes)
            if rpc is not None:
                rpc.join(init_info.timeout)
            return eng

        def send_weights(self, version: int | str | None = None, delta: bool | str = False,
                         method: str = "reshard", prefetch: bool | None = None, overlap: bool = False) -> None:
            """One update. ``delta=True`` (with an int ``version``, e.g. the step): only the changed elements
            travel after the first update (docs/delta.md); each trainer rank's cached Resharder keeps a
            snapshot of what it sends (``last_report.mode`` / ``fallback`` say whether the delta ran).
            In reload mode a dense update is one refit per layer group (the workers stage one layer at a
            time), a delta update one refit (the workers keep the staged checkpoint to patch).
            ``method="broadcast"``: the baseline (:class:`ReshardUpdateInfo`); needs every full tensor on
            trainer rank 0 (a one-rank trainer).

            ``overlap=True``: stage, then commit. The workers receive into a private staging mirror (1x their
            shard) in a background thread while the engine keeps serving; this returns once every worker has
            staged (the engine is not paused); :meth:`commit` later swaps the staged weights in under the pause.
            A failed staged update leaves the engine serving its weights untouched (raised here, not torn)."""
            import time

            info = {"version": version, "delta": delta, "method": method, "prefetch": prefetch,
                    "phase": "stage" if overlap else "full"}
            # options the trainer can check are refused here, before any engine call: the engine keeps serving
            # its old weights (issue 42: a bad delta/version reached the workers after the pause and the reload)
            kw = dict(group=self.group, bucket_bytes=self.info.bucket_bytes, timeout=self.info.timeout,
                      **delta_kwargs(ReshardUpdateInfo(**info)))
            tensors = dict(self.source.iter_local()) if self.source is not None else {}
            self._staged = None  # a new update supersedes a staged one not committed
            if overlap:
                return self._stage(info, tensors, kw)
            phases = {"pause_s": 0.0, "start_s": 0.0, "send_s": 0.0, "wait_workers_s": 0.0, "finish_s": 0.0,
                      "resume_s": 0.0}
            t0 = time.perf_counter()
            pause = self._pause()
            t1 = time.perf_counter()
            phases["pause_s"] = t1 - t0
            rpc = None
            if self.is_sender:
                self.client.start_weight_update()
                rpc = ControlCall(self.client.update_weights, info)
            t2 = time.perf_counter()
            phases["start_s"] = t2 - t1
            sent, err, bad = self._transfer(tensors, method, delta, kw, phases, per_group=True)
            t3 = time.perf_counter()
            phases["send_s"] = t3 - t2
            err = self._join(rpc, err)
            phases["wait_workers_s"] = time.perf_counter() - t3
            t4 = time.perf_counter()
            self._raise_failed(version, method, err, bad)
            if rpc is not None:
                self.client.finish_weight_update(None if version is None else str(version))
            t5 = time.perf_counter()
            phases["finish_s"] = t5 - t4
            if pause:
                self.client.resume_generation()
            phases["resume_s"] = time.perf_counter() - t5
            self.last_update = {"mode": self.mode, "method": method, "sent_bytes": sent,
                                "seconds": time.perf_counter() - t0, **phases}

        def _pause(self) -> bool:
            """Pause the engine's scheduler (rank 0, ``pause=True``, a client that can); whether it did."""
            pause = getattr(self.client, "pause_generation", None) if self.is_sender and self.info.pause else None
            if pause is not None:
                pause(self.info.pause_mode)
            return pause is not None

        def _join(self, rpc, err):
            """Wait for the workers' update RPC; the first error wins."""
            if rpc is not None:
                try:
                    rpc.join(self.info.timeout)
                except BaseException as e:  # noqa: BLE001
                    err = err or e
            return err

        def _finish(self, version) -> BaseException | None:
            """vLLM's ``finish_weight_update``, bounded by the group's timeout (an engine that lost a worker may
            answer late or never): its error, None once it returned."""
            call = ControlCall(self.client.finish_weight_update, version)
            try:
                call.join(self.info.timeout)
            except BaseException as e:  # noqa: BLE001 (the caller says what it means)
                return e
            return None

        def _lost(self, err: BaseException | None) -> str:
            """Who left the refit group, for an error (rank 0 serves the group's rendezvous: a member whose
            process died has no connection to it; on a lost peer its socket closes within moments, so this waits
            up to 2 s for it): ``"; lost: engine worker 1 (refit-group rank 2) ..."``, or ``""``."""
            import time

            if self.group is None or (err is not None and not group_broken(err)):
                return ""
            deadline = time.monotonic() + min(2.0, self.info.timeout)
            lost = self.group.lost_members()
            while lost == [] and err is not None and time.monotonic() < deadline:
                time.sleep(0.05)
                lost = self.group.lost_members()
            if not lost:
                return ""
            n = self.info.num_trainer_ranks
            who = [f"engine worker {r - n} (refit-group rank {r})" if r >= n else f"trainer rank {r}" for r in lost]
            then = f" (then {', '.join(who[1:])}, in the order they left)" if len(who) > 1 else ""
            return f"; lost: {who[0]}: its process died or left the refit group{then}"

        def _raise_failed(self, version, method: str, err, bad: list[int]) -> None:
            if err is not None:
                self._failed(version, method, f"{type(err).__name__}: {err}{self._lost(err)}", err)
            if bad:  # a worker failed on its own (e.g. in the engine's loader) while our sends completed
                self._failed(version, method, f"rank(s) {bad} of the refit group failed their part (see their log)",
                             None)

        def _transfer(self, tensors: dict, method: str, delta, kw: dict, phases: dict, per_group: bool):
            """This rank's sends of one update, then the commit vote: ``(bytes sent, error, failed ranks)``.
            ``per_group``: in reload mode a dense update is one refit per layer group."""
            sent, err, bad = 0, None, []
            try:
                if method == "commit":
                    pass  # a commit moves no bytes here: the vote alone
                elif method == "broadcast":
                    sent = self._send_broadcast(tensors)
                elif per_group and self.mode == "reload" and not delta:
                    for _names, src, dst in self.groups:
                        mine = {f.local or f.tensor for f in src.fragments if f.rank == self.group.rank}
                        self.last_report = refit({n: t for n, t in tensors.items() if n in mine}, {}, src, dst,
                                                 **kw)
                        sent += self.last_report.sent_bytes
                        add_report(phases, self.last_report)
                else:
                    self.last_report = refit(tensors, {}, self.src_layout, self.dst_layout, **kw)
                    sent = self.last_report.sent_bytes
                    add_report(phases, self.last_report)
            except BaseException as e:  # noqa: BLE001 (raised by the caller, after the vote and the workers' answer)
                err = e
            if err is None or not group_broken(err):
                try:  # every rank's word, the workers' too: one may have failed where we completed
                    words = commit_vote(self.group, err is None, self.info.timeout, f"trainer rank {self.rank}")
                    bad = [r for r, w in enumerate(words) if not w]
                except Exception as e:  # noqa: BLE001
                    err = err or e
            return sent, err, bad

        def _stage(self, info: dict, tensors: dict, kw: dict) -> None:
            """``send_weights(overlap=True)``: the workers start their background receive (one RPC, between two
            engine steps), every trainer rank sends, all vote; nothing pauses the engine."""
            import time

            t0 = time.perf_counter()
            rpc = None
            if self.is_sender:  # vLLM's update session: the workers start their receive thread and return
                self.client.start_weight_update()
                rpc = ControlCall(self.client.update_weights, info)
            phases: dict = {}
            sent, err, bad = self._transfer(tensors, "reshard", info["delta"], kw, phases, per_group=False)
            err = self._join(rpc, err)
            # the session closes; the engine's weight version stays (nothing committed)
            engine_err = self._finish(None) if rpc is not None else None
            version = info["version"]
            if err is None and not bad and engine_err is not None:
                raise engine_err
            if err is not None or bad:
                reason = f"{type(err).__name__}: {err}" if err is not None else f"rank(s) {bad} failed their part"
                self.last_update = {"mode": self.mode, "phase": "stage", "failed": reason[:400]}
                lost = self._lost(err)
                state = ("the engine was not paused and serves its weights as before (staging is private)"
                         if engine_err is None else "the engine was not paused, but its finish_weight_update failed "
                         f"({type(engine_err).__name__}: {str(engine_err)[:200]}): an engine that lost a worker is "
                         "stopped by vLLM: restart it")
                raise RuntimeError(
                    f"triton_reshard trainer rank {self.rank}: the staged update to version {version!r} failed "
                    f"({reason}){lost}; nothing was committed: {state}; re-init the trainer engine if its refit "
                    "group broke, then send_weights again") from err
            self._staged = {"version": version}
            self.last_update = {"mode": self.mode, "method": "reshard", "phase": "stage", "sent_bytes": sent,
                                "transfer_s": time.perf_counter() - t0, "seconds": time.perf_counter() - t0,
                                **phases}

        def commit(self) -> None:
            """Swap the weights a completed ``send_weights(overlap=True)`` staged into the engine: pause (the
            configured ``pause_mode``), each worker's commit (in place: copy staging into the live parameters;
            reload mode: vLLM's layerwise reload fed from staging), resume. Every trainer rank calls it (the
            commit ends with the update's vote). Refused, before any engine call, without a complete staged
            update; a commit that fails part way leaves the weights torn and the engine paused, as a failed
            update does, and raises naming it."""
            import time

            if self._staged is None:
                raise RuntimeError(f"triton_reshard trainer rank {self.rank}: commit refused: no complete staged "
                                   "update (send_weights(overlap=True) first; a failed one cannot be committed)")
            version = self._staged["version"]
            self._staged = None
            t0 = time.perf_counter()
            pause = self._pause()
            t1 = time.perf_counter()
            rpc = None
            if self.is_sender:
                self.client.start_weight_update()
                rpc = ControlCall(self.client.update_weights, {"version": version, "phase": "commit"})
            _, err, bad = self._transfer({}, "commit", False, {}, {}, per_group=False)
            err = self._join(rpc, err)
            self._raise_failed(version, "reshard", err, bad)
            if rpc is not None:
                self.client.finish_weight_update(None if version is None else str(version))
            t2 = time.perf_counter()
            if pause:
                self.client.resume_generation()
            t3 = time.perf_counter()
            self.last_update = {"mode": self.mode, "method": "reshard", "phase": "commit", "version": version,
                                "pause_s": t1 - t0, "commit_s": t2 - t1, "resume_s": t3 - t2,
                                "paused_s": t3 - t0 if pause else 0.0, "seconds": t3 - t0}

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

        def _send_broadcast(self, tensors: dict) -> int:
            root = broadcast_root(self.src_layout, self.info.num_trainer_ranks)
            if self.group.rank != root:
                return 0
            missing = [t.name for t in self.src_layout.tensors if t.name not in tensors]
            if missing:
                raise ValueError(f"trainer rank {root}: method 'broadcast' needs every full tensor here; missing "
                                 f"{missing[:4]}")
            workers = range(self.info.num_trainer_ranks, self.info.world_size)
            sent = 0
            for spec in self.src_layout.tensors:
                t = tensors[spec.name].detach().to(spec.dtype).contiguous()
                if tuple(t.shape) != tuple(spec.shape):
                    raise ValueError(f"trainer rank 0: {spec.name}: shape {tuple(t.shape)}, the layout says "
                                     f"{tuple(spec.shape)}")
                wait_all(self.group.post([(w, t) for w in workers], []), self.info.timeout,
                          f"trainer rank 0: broadcast of {spec.name}")
                sent += t.nbytes * len(workers)
            return sent

        def shutdown(self) -> None:
            if getattr(self, "group", None) is not None:
                self.group.destroy()
                self.group = None


class TensorsSource:
    """A minimal ``WeightSource`` over a dict of this rank's local tensors (``iter_local`` only)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self._tensors = tensors

    def iter_local(self):
        return iter(self._tensors.items())


class LLMClient:
    """The trainer's ``VLLMWeightSyncClient`` for a ``vllm.LLM`` it holds (vLLM's offline engine: its EngineCore
    and TP workers run in their own processes, so the trainer and the engine stay separate jobs): the four
    weight-sync calls of vLLM's RL API (``LLM.init_weight_transfer_engine`` ... ``finish_weight_update``),
    which reach every worker through vLLM's ``collective_rpc``."""

    def __init__(self, llm):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)

    def pause_generation(self, mode: str = "wait") -> None:
        """vLLM's level-0 sleep: the scheduler stops between two engine steps, new requests queue; ``mode``
        (vLLM's pause modes): "wait" returns once the requests in flight have finished, "keep" holds them
        (they continue after ``resume_generation``), "abort" aborts them."""
        self.llm.sleep(level=0, mode=mode)

    def resume_generation(self) -> None:
        self.llm.wake_up(tags=["scheduling"])


def trainer_refit_group(host: str, port: int, rank: int, world_size: int, layout: Layout, *,
                        timeout: float = 300.0, group_backend: str | None = None,
                        secret: bytes | str | None = None, insecure: bool | None = None):
    """The trainer ranks' half of :class:`RefitWorkerExtension`'s rendezvous: returns ``(group, src_layout,
    dst_layout)`` for ``refit(tensors, {}, src_layout, dst_layout, group=group)``. ``secret``: as
    :func:`~triton_reshard.init_refit_group` (default: ``TRITON_RESHARD_SECRET`` / ``_FILE``)."""
    group = join_group(host, port, rank, world_size, backend=group_backend, timeout=timeout, secret=secret,
                       secret_env=None, insecure=insecure)
    src, dst, _ = rendezvous(group, (layout,) if rank == 0 else None, None, rank)
    return group, src, dst
