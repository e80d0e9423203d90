"""The worker side of the vLLM backend: :class:`TritonReshardWeightTransferEngine` (vLLM's weight-transfer API)
and :class:`RefitWorkerExtension` (vLLMs without it). See :mod:`.vllm_transfer` for the whole backend."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from ..comm.secret import SECRET_ENV
from ..refit import refit
from . import engine as kit
from .stage import Receiver, Staging, forward_refused, log_warning, refuse_forward, voted
from .vllm_transfer import (
    ReshardInitInfo,
    ReshardUpdateInfo,
    WeightTransferEngine,
    delta_kwargs,
    group_layouts,
    no_mtp_check,
    process_clock,
    rendezvous,
    shadow_reload,
)

if WeightTransferEngine is not None:

    class TritonReshardWeightTransferEngine(WeightTransferEngine[ReshardInitInfo, ReshardUpdateInfo]):
        """The worker side: receives exactly its boxes every update, in place into the live parameters or, when
        the engine rewrites its weights after loading (``mode``, see :func:`choose_mode`), into per-layer staging
        in the checkpoint's coordinates fed to vLLM's layerwise reload (``initialize_layerwise_reload``, then
        ``model.load_weights``, ``finish_weight_update``: ``finalize_layerwise_reload``), which re-runs the
        post-processing. Phase "stage" receives into a private mirror (:class:`~.stage.Staging`) in a background
        thread while the engine serves and, in reload mode, builds the new weights on a shadow of the model
        (:func:`.vllm_transfer.shadow_reload`; else, or if that fails, the commit reloads); phase "commit" swaps
        them in. ``last_update``: what the last update did. An update that fails part way leaves the weights torn:
        the worker says so (``torn``) and refuses any forward (:class:`TornWeightsError`) until a later update
        completes; the next ``start_weight_update`` repairs the reload state. A failed staged receive touches
        nothing the engine serves."""

        init_info_cls = ReshardInitInfo
        update_info_cls = ReshardUpdateInfo
        group = staging = rx = None
        mode: str = "inplace"
        torn: dict | None = None
        _reloading = False
        _guard = None
        _shadow = None  # reload mode: the staged version built on a shadow of the model, swapped in at the commit
        _phase: str | None = None
        last_report = property(lambda self: None if self.rx is None else self.rx.last_report)

        def init_transfer_engine(self, init_info: ReshardInitInfo) -> None:
            from vllm.distributed import get_tensor_model_parallel_rank

            pc = self.parallel_config
            if pc.pipeline_parallel_size > 1:
                raise NotImplementedError("triton_reshard backend: vLLM pipeline parallelism is not supported")
            self.info = info = init_info
            rank = info.rank_offset + pc.data_parallel_rank * pc.tensor_parallel_size + get_tensor_model_parallel_rank()
            secret = kit.plugin_secret(None, info.secret_env, info.secret_file, where=f"triton_reshard worker {rank}")
            if self.staging is not None:
                self.staging.join(info.timeout)  # a staged receive of the old trainer ends (fails) first
            with contextlib.suppress(Exception):  # a new trainer (e.g. after a failure): leave the old group
                self.shutdown()
            self.group = kit.join_group(info.host, info.port, rank, info.world_size, backend=info.group_backend,
                                        timeout=info.timeout, secret=secret, insecure=info.insecure)
            self._records = self.__dict__.get("_records", {})
            try:
                self.src_layout, self.dst_layout, self.mode = rendezvous(self.group, None, self.model, rank,
                                                                         info.mode, self._records)
            except BaseException:
                self.shutdown()
                raise
            self.groups = group_layouts(self.src_layout, self.dst_layout, self.mode, info.staging_bytes)
            self.rx = Receiver(self.group, bucket_bytes=info.bucket_bytes, timeout=info.timeout)
            self.last_update: dict = {"mode": self.mode, "torn": self.torn}
            self.staging = Staging(self.dst_layout, rank, parts=[dst for _names, _src, dst in self.groups])
            self._drop()

        def _drop(self) -> None:
            self._shadow = None
            self.staging.drop()

        def start_weight_update(self) -> None:
            """After a failed update, the repair of its unfinished reload (the update itself begins vLLM's
            layerwise reload where it needs one: a staged receive leaves the model as it is)."""
            t0 = time.perf_counter()
            if self._reloading and self.torn is not None:
                self._reset_reload()
            self._phase = None
            self._start_s = time.perf_counter() - t0

        def _begin_reload(self) -> None:
            if not self._reloading:
                from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

                initialize_layerwise_reload(self.model)
                self._reloading = True

        def _reset_reload(self) -> None:
            """Repair an unfinished layerwise reload: every layer still loading drops what it buffered (a torn mix
            would be processed otherwise), and every layer the failed update completed goes back to loading."""
            from vllm.model_executor.model_loader.reload.layerwise import (
                LAYERWISE_INFO,
                initialize_layerwise_reload,
            )

            for m in self.model.modules():
                info = LAYERWISE_INFO.get(m)
                if info is not None and info.can_load():
                    info.loaded_weights, info.load_numel = [], 0
            flag = getattr(self.model, "_original_do_torchao_reload", None)
            initialize_layerwise_reload(self.model)  # the completed layers only: the others are still loading
            if flag is not None:
                self.model._original_do_torchao_reload = flag

        def update_weights(self, update_info: dict[str, Any]) -> None:
            self.receive_weights(self.parse_update_info(update_info))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

        def receive_weights(self, update_info: ReshardUpdateInfo) -> None:
            """One update's part on this worker, then the update's vote. Phase "stage" runs in a background
            thread and returns at once (its vote tells the trainer it is complete). Errors are not raised: vLLM
            0.32's MultiprocExecutor stops at the first failed reply and leaves the others queued, so every later
            ``collective_rpc`` would read stale replies; the trainer learns of it from its refit or the vote."""
            if self.group is None:
                raise RuntimeError("triton_reshard backend: init_transfer_engine was not called")
            self._phase = update_info.phase
            if update_info.phase == "stage":
                return self.staging.start(self._voted, update_info, who=f"triton_reshard worker {self.group.rank}",
                                          name="triton_reshard_stage")
            self.staging.join(self.info.timeout)  # the trainer sends this only after the staged receive's vote
            self._voted(update_info, self.staging.busy())

        def _voted(self, info: ReshardUpdateInfo, busy: bool = False) -> None:
            t0, stage, rank = time.perf_counter(), info.phase == "stage", self.group.rank

            def part() -> None:
                if busy:
                    raise RuntimeError(f"triton_reshard worker {rank}: update to version {info.version!r} refused: "
                                       "a staged receive is still running")
                stats = self._apply(info)  # recorded before the vote: a staged update's trainer may ask right after
                self.last_update = {**stats, "seconds": time.perf_counter() - t0}

            err = voted(self.group, part, self.info.timeout, f"worker {rank}", staged=stage)
            if err is not None and stage:
                self._drop()  # and the staged version with it; the engine keeps its weights
                self.last_update = {"mode": self.mode, "phase": "stage", "version": info.version,
                                    "failed": f"{type(err).__name__}: {err}"[:400]}
                log_warning(f"triton_reshard worker {rank}: the staged update to version {info.version!r} failed; "
                            f"the engine keeps its weights: {err}")
            elif err is not None:
                self._mark_torn(info, err)
                if info.delta or self.staging.tensors is not None:
                    self._drop()
                log_warning(f"triton_reshard worker {rank}: the update to version {info.version!r} failed, weights "
                            f"torn, generation refused until a repair update completes: {self.torn['reason']}")

        def _apply(self, info: ReshardUpdateInfo) -> dict:
            """This worker's part of one update (class docstring); returns its ``last_update``."""
            kw, reload, st, rx = delta_kwargs(info), self.mode == "reload", self.staging, self.rx
            stats = rx.stats = {"mode": self.mode, "method": info.method, "phase": info.phase, "recv_bytes": 0,
                                "staging_bytes": 0, "refit_s": 0.0, "alloc_s": 0.0, "unpack_s": 0.0, "load_s": 0.0,
                                "start_s": getattr(self, "_start_s", 0.0)}
            if info.phase == "stage":  # the mirror is written one layer group per refit, as a full delta writes it
                for _item in rx.into(st.mirror(stats), self.groups, prefetch=False, **kw):
                    pass
                shadow = self.info.shadow if info.shadow is None else info.shadow
                self._shadow = self._build_shadow(stats) if reload and shadow else None
                st.staged = {"version": info.version}  # before the vote: the trainer commits after it
                return {**stats, "version": info.version, "staging_bytes": st.nbytes()}
            if info.phase == "commit":
                if st.staged is None:
                    raise RuntimeError(f"triton_reshard worker {self.group.rank}: commit of version {info.version!r} "
                                       "refused: no complete staged update (the receive failed or never ran)")
                stats.update(version=st.staged["version"], staging_bytes=st.nbytes(),
                             commit_path="reload" if reload else "copy")
                t0, sh, self._shadow = time.perf_counter(), self._shadow, None
                if sh is not None:
                    sh.swap()
                    stats.update(load_s=time.perf_counter() - t0, commit_path="shadow", **sh.stats)
                elif reload:
                    self._load(list(st.tensors.items()), stats)
                else:
                    st.commit(dict(self.model.named_parameters()))
                    stats["load_s"] = time.perf_counter() - t0
                st.staged = None  # committed: the mirror stays (it holds the live version; a delta patches it)
                return stats
            # a full update supersedes a staged one; in place it writes the live parameters, not the mirror
            if st.tensors is not None and (st.staged is not None or not reload or info.method == "broadcast"
                                           or not info.delta):
                self._drop()
            if info.method == "broadcast":
                stats["mode"] = "reload"  # the baseline always goes through vLLM's loader
                self._load(kit.broadcast_receive(self.group, self.src_layout, self.info.rank_offset,
                                                 self.info.timeout, stats), stats)
            elif not reload:
                rx.refit(dict(self.model.named_parameters()), self.src_layout, self.dst_layout, **kw)
            elif info.delta:  # a delta patches what the destination held: the staged checkpoint boxes, one layer
                # group per refit, vLLM re-packing group k while group k+1 is on the wire
                self._load(rx.into(st.mirror(stats), self.groups, prefetch=True, **kw), stats)
                stats["staging_bytes"] = st.nbytes()
            else:
                self._load(rx.groups(self.groups, self.info.prefetch if info.prefetch is None else info.prefetch,
                                     **kw), stats)
            return stats

        def _build_shadow(self, stats: dict):
            """The staged version's weights built on a shadow of the model (in the staging thread, the engine
            serving); a failure is named in ``stats["shadow_failed"]`` and the commit reloads instead."""
            try:  # the shadow costs about 1x this worker's shard (the packed weights): skipped without the room
                kit.check_room(self.staging.nbytes(), self.device, "the shadow build")
                sh = shadow_reload(self.model, list(self.staging.tensors.items()), stats)
            except Exception as e:  # noqa: BLE001 (named; the engine keeps its weights, the commit falls back)
                stats["shadow_failed"] = f"{type(e).__name__}: {e}"[:400]
                log_warning(f"triton_reshard worker {self.group.rank}: {stats['shadow_failed']}; the engine keeps "
                            "its weights, the commit runs vLLM's reload from staging instead")
                return None
            sh.stats = {k: stats[k] for k in ("shadow_s", "shadow_process_s", "shadow_bytes") if k in stats}
            return sh

        def _load(self, items, stats: dict) -> None:
            """Feed ``(name, tensor)`` items to vLLM's loader inside its layerwise reload: ``load_s`` is the
            loader's time (between our yields), ``process_s`` the part that is vLLM's per-layer re-packing."""
            self._begin_reload()
            process_s = [0.0]

            def timed():
                for item in items:
                    t0 = time.perf_counter()
                    yield item
                    stats["load_s"] += time.perf_counter() - t0

            with no_mtp_check(), process_clock(process_s):
                self.model.load_weights(timed())
            stats["process_s"] = process_s[0]

        def _mark_torn(self, info: ReshardUpdateInfo, e: BaseException) -> None:
            self.torn = {"version": info.version, "mode": self.mode, "reason": f"{type(e).__name__}: {e}"[:400]}
            self.last_update = {"mode": self.mode, "method": info.method, "torn": self.torn}
            if self._guard is None:
                who = f"triton_reshard worker {self.group.rank if self.group is not None else '?'}"
                self._guard = refuse_forward(self.model, lambda: self.torn, who)

        def finish_weight_update(self) -> None:
            """Reload mode: vLLM's ``finalize_layerwise_reload`` (processes the layers not yet processed and puts
            the kernel tensors back). Either way the update completed: a torn state is repaired, generation
            allowed. Nothing to do after a staged receive, or after a failed update (it stays torn)."""
            if self._phase == "stage" or (self.torn is not None and self.last_update.get("torn")):
                return
            t0, process_s = time.perf_counter(), [0.0]
            with process_clock(process_s):
                if self._reloading:
                    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

                    finalize_layerwise_reload(self.model, self.model_config)
                    self._reloading = False
            self.last_update.update(finalize_s=time.perf_counter() - t0, finalize_process_s=process_s[0])
            if self.torn is not None:
                self.last_update["repaired"], self.torn = self.torn, None
            if self._guard is not None:
                self._guard.remove()
                self._guard = None

        def shutdown(self) -> None:
            if self.group is not None:
                group, self.group = self.group, None
                group.destroy()


class RefitWorkerExtension:
    """For vLLMs without the weight-transfer API: ``LLM(..., worker_extension_cls=
    "triton_reshard.integrations.vllm_transfer.RefitWorkerExtension")``, then from the trainer side
    ``llm.collective_rpc("init_refit_group", args=(host, port, num_trainer_ranks, world_size))`` once and
    ``llm.collective_rpc("refit_from_trainer")`` every step (while the trainer ranks run ``refit`` with an
    empty destination over the same group: :func:`trainer_refit_group` + :func:`~triton_reshard.refit`).
    Also the tier's probes of a running engine (``weight_transfer_stats``, ``forward_refused``,
    ``param_digests``). The methods run inside each vLLM worker, which has ``self.model_runner.model``."""

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
        self._tr_group = kit.join_group(host, port, rank, world_size, backend=group_backend, timeout=timeout,
                                        secret_env=secret_env, secret_file=secret_file, insecure=insecure,
                                        where=f"triton_reshard worker {rank}")
        self._tr_layouts = rendezvous(self._tr_group, None, self._model(), rank)[:2]

    def refit_from_trainer(self, version: int | None = None, delta: bool | str = False) -> int:
        """One refit into this worker's parameters; ``version`` / ``delta`` as :func:`~triton_reshard.refit`."""
        src, dst = self._tr_layouts
        return refit({}, dict(self._model().named_parameters()), src, dst, group=self._tr_group,
                     timeout=self._tr_timeout, version=version, delta=delta).recv_bytes

    def weight_transfer_stats(self) -> dict:
        """What the weight-transfer backend's last update did on this worker (``last_update``)."""
        return dict(getattr(getattr(self, "weight_transfer_engine", None), "last_update", None) or {})

    def forward_refused(self) -> str | None:
        """The refusal of a forward by this worker's model now (torn weights), else None."""
        return forward_refused(self._model())

    def param_digests(self) -> dict:
        """``{parameter name: [numel, sha256 of its bytes]}`` of this worker's live parameters."""
        return kit.param_digests(self._model())
