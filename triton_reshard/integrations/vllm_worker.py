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
from .session import WorkerSession
from .stage import TornState, forward_refused
from .vllm_transfer import (
    ReshardInitInfo,
    ReshardUpdateInfo,
    WeightTransferEngine,
    group_layouts,
    no_mtp_check,
    process_clock,
    rendezvous,
    shadow_reload,
)

if WeightTransferEngine is not None:

    class TritonReshardWeightTransferEngine(WeightTransferEngine[ReshardInitInfo, ReshardUpdateInfo]):
        """The worker side, on the kit's :class:`~.session.WorkerSession`: receives exactly its boxes every update,
        in place into the live parameters or, when the engine rewrites its weights after loading (``mode``, see
        :func:`choose_mode`), into per-layer staging in the checkpoint's coordinates fed to vLLM's layerwise reload
        (``initialize_layerwise_reload``, then ``model.load_weights``, ``finish_weight_update``:
        ``finalize_layerwise_reload``), which re-runs the post-processing. Phase "stage" receives into a private
        mirror in a background thread while the engine serves and, in reload mode, builds the new weights on a
        shadow of the model (:func:`.vllm_transfer.shadow_reload`; else, or if that fails, the commit reloads);
        phase "commit" swaps them in. ``last_update``: what the last update did. An update that fails part way
        leaves the weights torn: the worker says so (``torn``) and refuses any forward (:class:`TornWeightsError`)
        until a later update completes; the next ``start_weight_update`` repairs the reload state. A failed staged
        receive touches nothing the engine serves."""

        init_info_cls = ReshardInitInfo
        update_info_cls = ReshardUpdateInfo
        group = session = None
        _reloading = False
        last_report = property(lambda self: None if self.session is None else self.session.rx.last_report)
        last_update = property(lambda self: self.session.last_update)
        _torn: TornState | None = None  # kept across refit groups (a new trainer after a failure)
        torn = property(lambda self: self._torn and self._torn.state)

        def init_transfer_engine(self, init_info: ReshardInitInfo) -> None:
            from vllm.distributed import get_tensor_model_parallel_rank

            pc = self.parallel_config
            if pc.pipeline_parallel_size > 1:
                raise NotImplementedError("triton_reshard backend: vLLM pipeline parallelism is not supported")
            self.info = info = init_info
            rank = info.rank_offset + pc.data_parallel_rank * pc.tensor_parallel_size + get_tensor_model_parallel_rank()
            secret = kit.plugin_secret(None, info.secret_env, info.secret_file, where=f"triton_reshard worker {rank}")
            if self.session is not None:
                self.session.staging.join(info.timeout)  # a staged receive of the old trainer ends (fails) first
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
            self._torn = self._torn or TornState()
            self.session = WorkerSession(
                self.group, self.src_layout, self.dst_layout, self.mode,
                group_layouts(self.src_layout, self.dst_layout, self.mode, info.staging_bytes), self._torn,
                model=lambda: self.model, load=self._load, build=lambda items, stats: shadow_reload(self.model, items, stats),
                timeout=info.timeout, bucket_bytes=info.bucket_bytes, rank_offset=info.rank_offset,
                prefetch=info.prefetch, shadow=info.shadow, device=self.device, who=f"triton_reshard worker {rank}",
                engine="vLLM")

        def start_weight_update(self) -> None:
            """After a failed update, the repair of its unfinished reload (the update itself begins vLLM's
            layerwise reload where it needs one: a staged receive leaves the model as it is)."""
            t0 = time.perf_counter()
            if self._reloading and self.torn is not None:
                self._reset_reload()
            if self.session is not None:
                self.session.started(time.perf_counter() - t0)

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
            """One update's part on this worker, then the update's vote (:meth:`~.session.WorkerSession.receive`).
            Errors are not raised: vLLM 0.32's MultiprocExecutor stops at the first failed reply and leaves the
            others queued, so every later ``collective_rpc`` would read stale replies; the trainer learns of it from
            its refit or the vote."""
            if self.group is None:
                raise RuntimeError("triton_reshard backend: init_transfer_engine was not called")
            self.session.receive(update_info)

        def _load(self, items, stats: dict) -> None:
            """Feed ``(name, tensor)`` items to vLLM's loader inside its layerwise reload (``process_s``: the part
            that is vLLM's per-layer re-packing)."""
            self._begin_reload()
            process_s = [0.0]
            with no_mtp_check(), process_clock(process_s):
                self.model.load_weights(items)
            stats["process_s"] = process_s[0]

        def finish_weight_update(self) -> None:
            """Reload mode: vLLM's ``finalize_layerwise_reload`` (processes the layers not yet processed and puts
            the kernel tensors back). Either way the update completed: a torn state is repaired, generation
            allowed. Nothing to do after a staged receive, or after a failed update (it stays torn)."""
            if not self.session.finishing():
                return
            t0, process_s = time.perf_counter(), [0.0]
            with process_clock(process_s):
                if self._reloading:
                    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

                    finalize_layerwise_reload(self.model, self.model_config)
                    self._reloading = False
            self.session.finished(finalize_s=time.perf_counter() - t0, finalize_process_s=process_s[0])

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
