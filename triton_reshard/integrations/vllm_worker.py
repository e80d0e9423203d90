"""The worker side of the vLLM backend: :class:`TritonReshardWeightTransferEngine` (vLLM's weight-transfer API)
and :class:`RefitWorkerExtension` (vLLMs without it). See :mod:`.vllm_transfer` for the whole backend."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

from ..comm.group import RefitGroup
from ..comm.secret import SECRET_ENV
from ..refit import refit
from .engine import join_group, plugin_secret
from .vllm_reload import PhaseClock, group_layouts, no_mtp_check
from .vllm_update import (
    ReshardInitInfo,
    ReshardUpdateInfo,
    TornWeightsError,
    WeightTransferEngine,
    broadcast_root,
    commit_vote,
    delta_kwargs,
    group_broken,
    log_warning,
    rendezvous,
    wait_all,
)

if WeightTransferEngine is not None:

    class TritonReshardWeightTransferEngine(WeightTransferEngine[ReshardInitInfo, ReshardUpdateInfo]):
        """The worker side: receives exactly its boxes every update, in place into the live parameters or,
        when the engine rewrites its weights after loading (``mode``, see :func:`choose_mode`), into per-layer
        staging in the checkpoint's coordinates handed to vLLM's layerwise reload (``start_weight_update``:
        ``initialize_layerwise_reload``; ``model.load_weights`` per layer; ``finish_weight_update``:
        ``finalize_layerwise_reload``), which re-runs the post-processing (e.g. oneDNN packing) on the new
        weights. ``last_update``: what the last update did (mode, bytes, staging, seconds per phase).

        Failures: an update that fails part way (the trainer killed mid-refit, a timeout) leaves the weights
        torn; the worker says so (``torn``: version and reason, also in ``last_update``), refuses any forward
        with :class:`TornWeightsError` until a later update completes, and the next ``start_weight_update``
        repairs the reload state (every layer loads again from nothing). The trainer side keeps the engine's
        scheduler paused from before the update until it completed (:class:`TritonReshardTrainerEngine`), so
        no request is served from torn weights and none is lost: they wait for the repair."""

        init_info_cls = ReshardInitInfo
        update_info_cls = ReshardUpdateInfo

        group: RefitGroup | None = None
        mode: str = "inplace"
        _reloading: bool = False
        torn: dict | None = None
        _guard = None
        _stage_thread = None  # the background receive of a staged update (phase "stage")
        _staged: dict | None = None  # a staged update complete in the mirror, not yet committed: its info

        def _worker_index(self) -> int:
            from vllm.distributed import get_tensor_model_parallel_rank

            pc = self.parallel_config
            if pc.pipeline_parallel_size > 1:
                raise NotImplementedError("triton_reshard backend: vLLM pipeline parallelism is not supported")
            return pc.data_parallel_rank * pc.tensor_parallel_size + get_tensor_model_parallel_rank()

        def init_transfer_engine(self, init_info: ReshardInitInfo) -> None:
            self.info = init_info
            rank = init_info.rank_offset + self._worker_index()
            secret = plugin_secret(None, init_info.secret_env, init_info.secret_file,
                                   where=f"triton_reshard worker {rank}")
            self._join_stage(init_info.timeout)  # a staged receive of the old trainer ends (fails) first
            if self.group is not None:  # a new trainer (e.g. restarted after a failure): leave the old group
                with contextlib.suppress(Exception):
                    self.group.destroy()
                self.group = None
            self.group = join_group(init_info.host, init_info.port, rank, init_info.world_size,
                                    backend=init_info.group_backend, timeout=init_info.timeout, secret=secret,
                                    insecure=init_info.insecure)
            if not hasattr(self, "_records"):
                self._records: dict = {}
            try:
                self.src_layout, self.dst_layout, self.mode = rendezvous(self.group, None, self.model, rank,
                                                                         init_info.mode, self._records)
            except BaseException:
                self.group.destroy()
                self.group = None
                raise
            self.groups = group_layouts(self.src_layout, self.dst_layout, self.mode, init_info.staging_bytes)
            self.last_report = None
            self.last_update: dict = {"mode": self.mode, "torn": self.torn}
            self._drop_mirror()  # reload mode with delta: the staged checkpoint (see receive_weights)

        def _drop_mirror(self) -> None:
            """Forget the staged checkpoint a delta patches, and tell ``refit``'s fence: the next delta into a
            new mirror must run dense (a delta onto fresh, unwritten staging would load garbage)."""
            from ..refit import forget_refit_state

            self._mirror: dict[str, torch.Tensor] | None = None
            self._staged = None
            if getattr(self, "dst_layout", None) is not None:
                forget_refit_state(self.dst_layout)

        def start_weight_update(self) -> None:
            """After a failed update, the repair of its unfinished reload. The update itself begins vLLM's
            ``initialize_layerwise_reload`` in reload mode (the layers go back to their load format on the meta
            device; their loaders buffer until a layer is complete, then process it), where it needs one: a
            staged receive (phase "stage") leaves the model as it is, the engine serves on."""
            import time

            t0 = time.perf_counter()
            if self._reloading and self.torn is not None:
                self._reset_reload()
            self._phase = None  # set by this session's update (receive_weights begins a reload where it needs one)
            self._start_s = time.perf_counter() - t0

        def _begin_reload(self) -> None:
            if not self._reloading:
                from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

                initialize_layerwise_reload(self.model)
                self._reloading = True

        def _reset_reload(self) -> None:
            """Repair an unfinished layerwise reload (an update failed part way): every layer still loading
            drops what it buffered (otherwise those loads count toward its completion and a torn mix of
            versions would be processed, the rest of its new loads ignored as excessive), and every layer the
            failed update had completed goes back to loading, so the repair update loads the whole model."""
            from vllm.model_executor.model_loader.reload.layerwise import (
                LAYERWISE_INFO,
                initialize_layerwise_reload,
            )

            for m in self.model.modules():
                info = LAYERWISE_INFO.get(m)
                if info is not None and info.can_load():
                    info.loaded_weights = []
                    info.load_numel = 0
            flag = getattr(self.model, "_original_do_torchao_reload", None)
            initialize_layerwise_reload(self.model)  # the completed layers only: the others are still loading
            if flag is not None:
                self.model._original_do_torchao_reload = flag

        def _mark_torn(self, update_info: ReshardUpdateInfo, e: BaseException) -> None:
            self.torn = {"version": update_info.version, "mode": self.mode,
                         "reason": f"{type(e).__name__}: {e}"[:400]}
            self.last_update = {"mode": self.mode, "method": update_info.method, "torn": self.torn}
            if self._guard is None:
                rank = self.group.rank if self.group is not None else "?"

                def refuse(_module, _args, eng=self):
                    torn = eng.torn or {"version": "?", "reason": "?"}
                    raise TornWeightsError(
                        f"triton_reshard worker {rank}: the weight update to version {torn['version']!r} failed "
                        f"part way ({torn['reason']}); this worker's weights are torn, generation is refused "
                        "until a repair update completes")

                self._guard = self.model.register_forward_pre_hook(refuse)

        def _staging(self) -> bool:
            return self._stage_thread is not None and self._stage_thread.is_alive()

        def _join_stage(self, timeout: float) -> None:
            if self._stage_thread is not None:
                self._stage_thread.join(timeout)

        def _stage(self, info: ReshardUpdateInfo) -> None:
            """Phase "stage": receive this worker's boxes into its private staging mirror (1x its shard, kept
            between updates: a delta patches it) in a background thread, and return at once, so the engine keeps
            serving its current weights meanwhile. The thread ends with the commit vote (the trainer learns there
            whether every worker staged); a failure drops the mirror and touches nothing the engine serves."""
            import threading
            import time

            if self._staging():
                raise RuntimeError(f"triton_reshard worker {self.group.rank}: a staged receive is still running")
            self._staged = None
            kw = dict(group=self.group, bucket_bytes=self.info.bucket_bytes, timeout=self.info.timeout,
                      **delta_kwargs(info))

            def run():
                t0 = time.perf_counter()
                err: Exception | None = None
                try:
                    rep = self._receive_mirror(kw)
                    self._staged = {"version": info.version}  # before the vote: the trainer commits after it
                except Exception as e:  # noqa: BLE001 (voted, then recorded)
                    err = e
                if err is None or not group_broken(err):
                    try:
                        words = commit_vote(self.group, err is None, self.info.timeout, f"worker {self.group.rank}")
                        if err is None and not all(words):
                            err = RuntimeError(f"rank(s) {[r for r, w in enumerate(words) if not w]} of the refit "
                                               "group failed their part of this staged update")
                    except Exception as e:  # noqa: BLE001
                        err = err or e
                if err is not None:
                    self._drop_mirror()  # and the staged version with it
                    self.last_update = {"mode": self.mode, "phase": "stage", "version": info.version,
                                        "failed": f"{type(err).__name__}: {err}"[:400]}
                    log_warning(f"triton_reshard worker {self.group.rank}: the staged update to version "
                                f"{info.version!r} failed; the engine keeps its weights: {err}")
                    return
                self.last_report = rep
                self.last_update = {"mode": self.mode, "phase": "stage", "version": info.version,
                                    "recv_bytes": rep.recv_bytes, "staging_bytes": self._mirror_bytes(),
                                    "refit_s": rep.seconds, "stage_s": time.perf_counter() - t0,
                                    "delta_mode": rep.mode}

            self._stage_thread = threading.Thread(target=run, daemon=True, name="triton_reshard_stage")
            self._stage_thread.start()

        def _receive_mirror(self, kw: dict, stats: dict | None = None):
            """One refit into the staging mirror (the worker's shard in the destination layout's locals, kept
            between updates: a delta patches it); a fresh mirror tells the fence, so a delta into it runs dense."""
            import time

            if self._mirror is None:
                self._drop_mirror()
                t1 = time.perf_counter()
                self._mirror = {s.name: torch.empty(s.shape, dtype=s.dtype) for s in self.dst_layout.locals
                                if s.rank == self.group.rank}
                if stats is not None:
                    stats["alloc_s"] = time.perf_counter() - t1
            return refit({}, self._mirror, self.src_layout, self.dst_layout, **kw)

        def _mirror_bytes(self) -> int:
            return sum(math.prod(f.sizes) * self._mirror[f.local].element_size()
                       for f in self.dst_layout.fragments if f.rank == self.group.rank)

        def _commit(self, info: ReshardUpdateInfo) -> None:
            """Phase "commit" (the engine paused): swap the staged weights in. In place: copy each staged box
            into its live parameter; reload mode: vLLM's layerwise reload fed from the mirror (finalized by
            ``finish_weight_update``). Refused, touching nothing, without a complete staged update."""
            import time

            if self._staged is None:
                raise RuntimeError(f"triton_reshard worker {self.group.rank}: commit of version {info.version!r} "
                                    "refused: no complete staged update (the receive failed or never ran)")
            t0 = time.perf_counter()
            stats = {"mode": self.mode, "phase": "commit", "version": self._staged["version"], "recv_bytes": 0,
                     "staging_bytes": self._mirror_bytes()}
            if self.mode == "inplace":
                params = dict(self.model.named_parameters())
                with torch.no_grad():
                    for f in self.dst_layout.fragments:
                        if f.rank == self.group.rank:
                            box = tuple(slice(o, o + n) for o, n in zip(f.local_offsets, f.local_sizes, strict=True))
                            params[f.local][box].copy_(self._mirror[f.local][box])
                stats["load_s"] = time.perf_counter() - t0
            else:
                self._begin_reload()
                clock = PhaseClock()
                with no_mtp_check(), clock.timing():
                    self.model.load_weights(iter(list(self._mirror.items())))
                stats.update(load_s=time.perf_counter() - t0, process_s=clock.process_s)
            self._staged = None  # committed: the mirror stays (it holds the live version; a delta patches it)
            stats["seconds"] = time.perf_counter() - t0
            self.last_update = stats

        def receive_weights(self, update_info: ReshardUpdateInfo) -> None:
            if self.group is None:
                raise RuntimeError("triton_reshard backend: init_transfer_engine was not called")
            self._phase = update_info.phase
            if update_info.phase == "stage":
                return self._stage(update_info)
            err: Exception | None = None
            self._join_stage(self.info.timeout)  # the trainer sends this only after the staged receive's vote
            if self._staging():
                err = RuntimeError(f"triton_reshard worker {self.group.rank}: update to version "
                                   f"{update_info.version!r} refused: a staged receive is still running")
            elif update_info.phase == "full":
                # a full update supersedes a staged one; in place it writes the live parameters, not the mirror
                if self._mirror is not None and (self._staged is not None or self.mode == "inplace"):
                    self._drop_mirror()
                if self.mode == "reload" and update_info.method == "reshard":
                    self._begin_reload()
            try:
                if err is not None:
                    pass
                elif update_info.phase == "commit":
                    self._commit(update_info)
                elif update_info.method == "broadcast":
                    self._receive_broadcast(update_info)
                else:
                    self._receive_reshard(update_info)
            except Exception as e:  # noqa: BLE001 (recorded as the torn state, reported to the trainer)
                err = e
            if err is None or not group_broken(err):
                try:  # every rank's word: a peer may have failed where this worker completed
                    words = commit_vote(self.group, err is None, self.info.timeout, f"worker {self.group.rank}")
                    if err is None and not all(words):
                        bad = [r for r, w in enumerate(words) if not w]
                        err = RuntimeError(f"rank(s) {bad} of the refit group failed their part of this update")
                except Exception as e:  # noqa: BLE001
                    err = err or e
            if err is not None:
                # not raised: vLLM 0.32's MultiprocExecutor reads the workers' replies in order and stops at the
                # first failure, leaving the other workers' replies queued, so every later collective_rpc would
                # read the previous call's replies (seen here at TP2). The trainer learns of the failure from
                # its own refit (the group broke) or from the commit vote.
                e = err
                self._mark_torn(update_info, e)
                if update_info.delta or self._mirror is not None:
                    self._drop_mirror()
                log_warning(f"triton_reshard worker {self.group.rank if self.group else '?'}: the update to "
                             f"version {update_info.version!r} failed, weights torn, generation refused until a "
                             f"repair update completes: {self.torn['reason']}")

        def _receive_reshard(self, update_info: ReshardUpdateInfo) -> None:
            import time

            t0 = time.perf_counter()
            kw = dict(group=self.group, bucket_bytes=self.info.bucket_bytes, timeout=self.info.timeout,
                      **delta_kwargs(update_info))
            if self.mode == "inplace":
                self.last_report = refit({}, dict(self.model.named_parameters()), self.src_layout,
                                         self.dst_layout, **kw)
                rep = self.last_report
                self.last_update = {"mode": "inplace", "method": "reshard", "recv_bytes": rep.recv_bytes,
                                    "staging_bytes": 0, "refit_s": rep.seconds, "load_s": 0.0,
                                    "seconds": time.perf_counter() - t0, "delta_mode": rep.mode}
                return
            stats = {"mode": "reload", "method": "reshard", "recv_bytes": 0, "staging_bytes": 0, "refit_s": 0.0,
                     "groups": len(self.groups), "start_s": getattr(self, "_start_s", 0.0), "alloc_s": 0.0,
                     "unpack_s": 0.0}
            clock = PhaseClock()
            if update_info.delta:
                # a delta patches what the destination held: keep the staged checkpoint boxes between updates
                t1 = time.perf_counter()
                self.last_report = self._receive_mirror(kw, stats)
                stats.update(recv_bytes=self.last_report.recv_bytes, refit_s=time.perf_counter() - t1,
                             unpack_s=self.last_report.unpack_seconds, staging_bytes=self._mirror_bytes(),
                             delta_mode=self.last_report.mode)
                t2 = time.perf_counter()
                with no_mtp_check(), clock.timing():
                    self.model.load_weights(iter(list(self._mirror.items())))
                stats["load_s"] = time.perf_counter() - t2
            else:
                if self._mirror is not None:
                    self._drop_mirror()
                loader_s = [0.0]

                held = [0, 0]  # staging bytes held now, and the most held at once
                prefetch = self.info.prefetch if update_info.prefetch is None else update_info.prefetch

                def receive(src, dst) -> dict:
                    t1 = time.perf_counter()
                    mine = {s.name: torch.empty(s.shape, dtype=s.dtype) for s in dst.locals
                            if s.rank == self.group.rank}
                    t2 = time.perf_counter()
                    rep = refit({}, mine, src, dst, **kw)
                    t3 = time.perf_counter()
                    stats["alloc_s"] += t2 - t1
                    stats["refit_s"] += t3 - t2
                    stats["unpack_s"] += rep.unpack_seconds
                    stats["recv_bytes"] += rep.recv_bytes
                    box = sum(math.prod(f.sizes) * mine[f.local].element_size() for f in dst.fragments
                              if f.rank == self.group.rank)
                    held[0] += box
                    held[1] = max(held)
                    self.last_report = rep
                    return mine, box

                def load(mine):
                    for item in mine.items():
                        t4 = time.perf_counter()
                        yield item
                        loader_s[0] += time.perf_counter() - t4  # the loader's time runs between our yields

                def staged():
                    """Each layer group's boxes, received into fresh staging, yielded to the loader. With
                    ``prefetch``, group k+1 is received (one background thread; the refit group is used by it
                    alone until the update's end) while the loader processes group k: the wire overlaps vLLM's
                    loading and re-packing, and staging holds at most two groups."""
                    if not prefetch or len(self.groups) < 2:
                        for _names, src, dst in self.groups:
                            mine, box = receive(src, dst)
                            yield from load(mine)
                            held[0] -= box
                        return
                    from concurrent.futures import ThreadPoolExecutor

                    with ThreadPoolExecutor(1, thread_name_prefix="triton_reshard_prefetch") as pool:
                        fut = pool.submit(receive, *self.groups[0][1:])
                        for k in range(len(self.groups)):
                            mine, box = fut.result()
                            if k + 1 < len(self.groups):
                                fut = pool.submit(receive, *self.groups[k + 1][1:])
                            yield from load(mine)
                            del mine
                            held[0] -= box

                with no_mtp_check(), clock.timing():
                    self.model.load_weights(staged())
                stats["load_s"] = loader_s[0]
                stats["staging_bytes"] = held[1]
                stats["prefetch"] = bool(prefetch)
            stats["process_s"] = clock.process_s  # part of load_s: vLLM's per-layer post-processing
            stats["seconds"] = time.perf_counter() - t0
            self.last_update = stats

        def _receive_broadcast(self, update_info: ReshardUpdateInfo) -> None:
            """The baseline: every full tensor from trainer rank 0, one at a time, into vLLM's loader."""
            import time

            t0 = time.perf_counter()
            if self._mirror is not None:
                self._drop_mirror()
            self._begin_reload()  # in-place mode too: the baseline always goes through vLLM's loader
            stats = {"mode": "reload", "method": "broadcast", "recv_bytes": 0, "staging_bytes": 0, "refit_s": 0.0,
                     "start_s": getattr(self, "_start_s", 0.0) + time.perf_counter() - t0, "alloc_s": 0.0}
            loader_s = [0.0]
            clock = PhaseClock()

            root = broadcast_root(self.src_layout, self.info.rank_offset)

            def received():
                for spec in self.src_layout.tensors:
                    t1 = time.perf_counter()
                    buf = torch.empty(spec.shape, dtype=spec.dtype)
                    t2 = time.perf_counter()
                    wait_all(self.group.post([], [(root, buf)]), self.info.timeout,
                              f"worker {self.group.rank}: broadcast of {spec.name}")
                    stats["alloc_s"] += t2 - t1
                    stats["refit_s"] += time.perf_counter() - t2
                    stats["recv_bytes"] += buf.nbytes
                    stats["staging_bytes"] = max(stats["staging_bytes"], buf.nbytes)
                    t4 = time.perf_counter()
                    yield spec.name, buf
                    loader_s[0] += time.perf_counter() - t4

            with no_mtp_check(), clock.timing():
                self.model.load_weights(received())
            stats["seconds"] = time.perf_counter() - t0
            stats["load_s"] = loader_s[0]
            stats["process_s"] = clock.process_s
            self.last_update = stats

        def update_weights(self, update_info: dict[str, Any]) -> None:
            self.receive_weights(self.parse_update_info(update_info))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

        def finish_weight_update(self) -> None:
            """Reload mode: vLLM's ``finalize_layerwise_reload`` (processes the layers not yet processed, e.g.
            attention and padded ones, and puts the kernel tensors back). In place: nothing to finish. Either
            way the update completed: a torn state from an earlier failure is repaired, generation allowed."""
            import time

            if getattr(self, "_phase", None) == "stage":
                return  # a staged receive touched nothing the engine serves: nothing to finalize or repair
            if self.torn is not None and self.last_update.get("torn"):
                # this update failed: nothing to finalize (the reload stays unfinished, the weights torn, the
                # forward refused); vLLM's session closes, the next start_weight_update repairs
                return
            t0 = time.perf_counter()
            with PhaseClock().timing() as clock:
                if self._reloading:
                    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

                    finalize_layerwise_reload(self.model, self.model_config)
                    self._reloading = False
            self.last_update["finalize_s"] = time.perf_counter() - t0
            self.last_update["finalize_process_s"] = clock.process_s
            if self.torn is not None:
                self.last_update["repaired"] = self.torn
                self.torn = None
            if self._guard is not None:
                self._guard.remove()
                self._guard = None

        def shutdown(self) -> None:
            if self.group is not None:
                self.group.destroy()
                self.group = None


class RefitWorkerExtension:
    """For vLLMs without the weight-transfer API: ``LLM(..., worker_extension_cls=
    "triton_reshard.integrations.vllm_transfer.RefitWorkerExtension")``, then from the trainer side
    ``llm.collective_rpc("init_refit_group", args=(host, port, num_trainer_ranks, world_size))`` once and
    ``llm.collective_rpc("refit_from_trainer")`` every step (while the trainer ranks run ``refit`` with an
    empty destination over the same group: :func:`trainer_refit_group` + :func:`~triton_reshard.refit`).
    The methods run inside each vLLM worker, which has ``self.model_runner.model``."""

    def _model(self):
        return self.model_runner.model

    def init_refit_group(self, host: str, port: int, num_trainer_ranks: int, world_size: int,
                         timeout: float = 300.0, group_backend: str | None = None,
                         secret_env: str | None = SECRET_ENV, secret_file: str | None = None,
                         insecure: bool | None = None) -> None:
        """``secret_env`` / ``secret_file``: where this worker reads the group's secret (never the secret
        itself: collective_rpc arguments may be logged)."""
        from vllm.distributed import get_tensor_model_parallel_rank

        pc = self.vllm_config.parallel_config if hasattr(self, "vllm_config") else None
        dp, tp = (pc.data_parallel_rank, pc.tensor_parallel_size) if pc is not None else (0, 1)
        rank = num_trainer_ranks + dp * tp + get_tensor_model_parallel_rank()
        self._tr_timeout = timeout
        self._tr_group = join_group(host, port, rank, world_size, backend=group_backend, timeout=timeout,
                                    secret_env=secret_env, secret_file=secret_file, insecure=insecure,
                                    where=f"triton_reshard worker {rank}")
        self._tr_layouts = rendezvous(self._tr_group, None, self._model(), rank)[:2]

    def weight_transfer_stats(self) -> dict:
        """What the weight-transfer backend's last update did on this worker (``last_update``: mode, method,
        bytes received, staging bytes, seconds), for ``collective_rpc("weight_transfer_stats")``."""
        eng = getattr(self, "weight_transfer_engine", None)
        return dict(getattr(eng, "last_update", None) or {})

    def forward_refused(self) -> str | None:
        """Whether this worker's model refuses a forward now (a failed update left its weights torn): the
        refusal's message, else None. Runs only the model's forward pre-hooks (no forward)."""
        model = self._model()
        try:
            for hook in list(model._forward_pre_hooks.values()):
                hook(model, ())
        except TornWeightsError as e:
            return str(e)
        return None

    def param_digests(self) -> dict:
        """``{parameter name: [numel, sha256 of its bytes]}`` of this worker's live parameters (what the kernels
        read where the engine did not rewrite them), for ``collective_rpc("param_digests")``."""
        import hashlib

        out = {}
        for n, p in self._model().named_parameters():
            t = p.detach().contiguous().cpu()
            out[n] = [t.numel(), hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()]
        return out

    def refit_from_trainer(self, version: int | None = None, delta: bool | str = False) -> int:
        """One refit into this worker's parameters; ``version`` / ``delta`` as :func:`~triton_reshard.refit`
        (the trainer ranks pass the same)."""
        src, dst = self._tr_layouts
        rep = refit({}, dict(self._model().named_parameters()), src, dst, group=self._tr_group,
                    timeout=self._tr_timeout, version=version, delta=delta)
        return rep.recv_bytes
