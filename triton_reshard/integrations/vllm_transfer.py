"""A vLLM weight-transfer backend: ``weight_transfer_config={"backend": "triton_reshard"}``.

vLLM (>= 0.2x) selects the refit transport by name (``vllm/distributed/weight_transfer/``): a worker-side
:class:`WeightTransferEngine` per inference worker and a trainer-side ``TrainerWeightTransferEngine``,
registered with ``WeightTransferEngineFactory`` / ``WeightTransferTrainerFactory``. This module registers
both under ``"triton_reshard"`` (:func:`register`, also run by vLLM's plugin loader through our
``vllm.general_plugins`` entry point, so every vLLM process knows the name).

What the backend does differently from vLLM's own: the trainer keeps its sharded local tensors; every worker
receives exactly the boxes of its own parameters, straight into ``model.named_parameters()`` (in place, no
staging copy of the model), from the trainer rank that holds them.

* **Rendezvous** (``init_transfer_engine`` / ``trainer_init``): all trainer ranks (``0..T-1``) and all
  workers (``T..T+W-1``, worker ``dp_rank * tp + tp_rank``) join one :func:`~triton_reshard.init_refit_group`.
  Trainer rank 0 contributes its layout; each worker records its own loader (:mod:`.record`: the destination
  layout is what *this* vLLM's ``load_weights`` does, not our preset) and the records are exchanged, so
  every rank plans the same reshard.
* **Every update** (``update_weights`` on the workers, ``send_weights`` on the trainer ranks): one
  ``refit`` over the refit group. ``start_weight_update`` / ``finish_weight_update`` have nothing to do (the
  weights are written in place, in the checkpoint format the loader writes).
* **The secret** (``docs/security.md``): the trainer passes ``secret=`` (never printed: ``repr=False``) or
  names where it lives (``secret_env``, default ``TRITON_RESHARD_SECRET``; ``secret_file``); the workers get
  only those names in their init info (which travels over vLLM's control plane and may be logged) and read the
  secret from their own environment or file. Every member proves it before it takes a rank.
* Older vLLMs without the weight-transfer API: :class:`RefitWorkerExtension` (``worker_extension_cls=``) gives
  the workers ``init_refit_group`` / ``refit_from_trainer`` methods for ``collective_rpc``.

Not handled: vLLM pipeline parallelism (``pipeline_parallel_size > 1``), and kernel formats that rewrite the
weights after loading (quantized methods, FlashInfer MoE on SM100): the recorded layout describes the
checkpoint format ``load_weights`` writes, so run :func:`~triton_reshard.verify_refit` after the engine's
post-processing to see whether the parameters still hold it.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..auth import SECRET_ENV, secret_from
from ..group import RefitGroup, init_refit_group
from ..layout import Layout
from ..refit import refit
from .record import layout_from_records

BACKEND = "triton_reshard"
_REGISTERED = False


def register() -> None:
    """Register the backend with vLLM's weight-transfer factories (idempotent; vLLM's plugin hook)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    for factory, cls in ((WeightTransferEngineFactory, "TritonReshardWeightTransferEngine"),
                         (WeightTransferTrainerFactory, "TritonReshardTrainerEngine")):
        if BACKEND not in factory._registry:
            factory.register_engine(BACKEND, __name__, cls)
    _REGISTERED = True


def _rendezvous(group: RefitGroup, trainer_part: tuple | None, model, rank_in_group: int) -> tuple[Layout, Layout]:
    """Round 1: trainer rank 0 shares its layout; round 2: workers share their load records."""
    from .vllm import record_vllm

    first = group.all_gather_object(trainer_part)
    parts = [p for p in first if p is not None]
    if len(parts) != 1:
        raise RuntimeError(f"rank {group.rank}: expected one trainer layout in the refit group, got {len(parts)}")
    src_layout: Layout = parts[0][0]
    shapes = {t.name: t.shape for t in src_layout.tensors}
    rec = None if model is None else record_vllm(model, shapes, rank_in_group)
    if rec is not None:
        rec.raise_on_problems()
    records = [r for r in group.all_gather_object(rec) if r is not None]
    return plan_pair(group, src_layout, layout_from_records(records))


def _delta_kwargs(info) -> dict:
    """``refit``'s ``version`` / ``delta`` from an update info: a delta needs the int version; a dense update
    keeps the tag out of ``refit`` as before (it is vLLM's, for logs)."""
    delta = getattr(info, "delta", False)
    return {"version": info.version, "delta": delta} if delta else {}


def plan_pair(group: RefitGroup, src_layout: Layout, dst_layout: Layout) -> tuple[Layout, Layout]:
    """The (trainer, engine) layouts to plan: the trainer may hold tensors no engine rank loads (e.g. an MTP
    layer the engine skips): plan only what both have, and say which were left out."""
    keep = {t.name for t in dst_layout.tensors}
    unused = sorted({t.name for t in src_layout.tensors} - keep)
    if unused:
        warnings.warn(f"rank {group.rank}: {len(unused)} trainer tensors are loaded by no engine worker and are not "
                      f"sent: {unused[:6]}{' ...' if len(unused) > 6 else ''}", stacklevel=3)
        src_layout = src_layout.restrict(keep)
    return src_layout, dst_layout


# ---------------------------------------------------------------------------------------------------------
# worker side
# ---------------------------------------------------------------------------------------------------------

try:  # the classes subclass vLLM's bases when vLLM is installed; the module imports without it
    from vllm.distributed.weight_transfer.base import (
        TrainerInitInfo,
        TrainerWeightTransferEngine,
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
except ImportError:  # pragma: no cover - exercised in the main test env, which has no vLLM
    TrainerInitInfo = TrainerWeightTransferEngine = WeightTransferEngine = None  # type: ignore[assignment,misc]
    WeightTransferInitInfo = WeightTransferUpdateInfo = object  # type: ignore[assignment,misc]


@dataclass
class ReshardInitInfo(WeightTransferInitInfo):
    """Worker-side init info (what trainer rank 0 sends through ``init_weight_transfer_engine``)."""

    host: str
    port: int
    rank_offset: int  # the number of trainer ranks: worker w joins the refit group as rank_offset + w
    world_size: int  # trainer ranks + all workers
    timeout: float = 300.0
    bucket_bytes: int = 256 << 20
    group_backend: str | None = None  # gloo / nccl (default: nccl with CUDA)
    # where this worker reads the refit group's secret (the secret itself never travels in init info)
    secret_env: str | None = SECRET_ENV
    secret_file: str | None = None
    insecure: bool | None = None  # no secret on a routable host: accept any process (see init_refit_group)


@dataclass
class ReshardUpdateInfo(WeightTransferUpdateInfo):
    """Per-update info: the plan is fixed at init. ``version``: a tag (an int such as the step for delta
    refits); ``delta``: ``refit``'s ``delta`` (False, True or "strict"; docs/delta.md)."""

    version: int | str | None = None
    delta: bool | str = False


if WeightTransferEngine is not None:

    class TritonReshardWeightTransferEngine(WeightTransferEngine[ReshardInitInfo, ReshardUpdateInfo]):
        """The worker side: receives its parameters' boxes in place, every update."""

        init_info_cls = ReshardInitInfo
        update_info_cls = ReshardUpdateInfo

        group: RefitGroup | None = None

        def _worker_index(self) -> int:
            from vllm.distributed import get_tensor_model_parallel_rank

            pc = self.parallel_config
            if pc.pipeline_parallel_size > 1:
                raise NotImplementedError("triton_reshard backend: vLLM pipeline parallelism is not supported")
            return pc.data_parallel_rank * pc.tensor_parallel_size + get_tensor_model_parallel_rank()

        def init_transfer_engine(self, init_info: ReshardInitInfo) -> None:
            self.info = init_info
            rank = init_info.rank_offset + self._worker_index()
            secret = secret_from(init_info.secret_env, init_info.secret_file, where=f"triton_reshard worker {rank}")
            self.group = init_refit_group(init_info.host, init_info.port, rank, init_info.world_size,
                                          backend=init_info.group_backend, timeout=init_info.timeout,
                                          secret=secret, insecure=init_info.insecure)
            self.src_layout, self.dst_layout = _rendezvous(self.group, None, self.model, rank)
            self.last_report = None

        def start_weight_update(self) -> None:
            """Nothing to prepare: the weights are written in place, in the loader's format."""

        def receive_weights(self, update_info: ReshardUpdateInfo) -> None:
            if self.group is None:
                raise RuntimeError("triton_reshard backend: init_transfer_engine was not called")
            self.last_report = refit({}, dict(self.model.named_parameters()), self.src_layout, self.dst_layout,
                                     group=self.group, bucket_bytes=self.info.bucket_bytes,
                                     timeout=self.info.timeout, **_delta_kwargs(update_info))

        def update_weights(self, update_info: dict[str, Any]) -> None:
            self.receive_weights(self.parse_update_info(update_info))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

        def finish_weight_update(self) -> None:
            """Nothing to finish: every byte is in place when ``update_weights`` returns."""

        def shutdown(self) -> None:
            if self.group is not None:
                self.group.destroy()
                self.group = None

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
        bucket_bytes: int = 256 << 20
        group_backend: str | None = None
        extra: dict = field(default_factory=dict)
        # the refit group's secret: ``secret`` itself (kept out of repr), else read from ``secret_file`` or the
        # environment variable ``secret_env``; the workers are told only ``secret_env`` / ``secret_file``
        secret: bytes | str | None = field(default=None, repr=False)
        secret_env: str | None = SECRET_ENV
        secret_file: str | None = None
        insecure: bool | None = None

    class TritonReshardTrainerEngine(TrainerWeightTransferEngine):
        """The trainer side: every trainer rank sends the boxes it holds, straight from its local tensors.

        ``source``: a ``WeightSource`` whose ``iter_local()`` yields this rank's local tensors under the
        trainer layout's local names (:class:`TensorsSource` wraps a dict such as
        ``dict(megatron_model.named_parameters())``)."""

        init_info_cls = ReshardTrainerInitInfo

        @classmethod
        def trainer_init(cls, init_info: ReshardTrainerInitInfo, *, client, source=None):
            if init_info.layout is None:
                raise ValueError("ReshardTrainerInitInfo.layout: the trainer's Layout is required")
            eng = cls(client=client, source=source, is_sender=init_info.rank == 0, rank=init_info.rank)
            eng.info = init_info
            worker_info = dict(host=init_info.host, port=init_info.port, rank_offset=init_info.num_trainer_ranks,
                               world_size=init_info.world_size, timeout=init_info.timeout,
                               bucket_bytes=init_info.bucket_bytes, group_backend=init_info.group_backend,
                               secret_env=init_info.secret_env, secret_file=init_info.secret_file,
                               insecure=init_info.insecure)
            secret = init_info.secret if init_info.secret is not None else secret_from(
                init_info.secret_env, init_info.secret_file, where=f"triton_reshard trainer rank {init_info.rank}")
            rpc = _Call(client.init_weight_transfer_engine, worker_info) if eng.is_sender else None
            eng.group = init_refit_group(init_info.host, init_info.port, init_info.rank, init_info.world_size,
                                         backend=init_info.group_backend, timeout=init_info.timeout,
                                         secret=secret, insecure=init_info.insecure)
            part = (init_info.layout,) if eng.is_sender else None
            eng.src_layout, eng.dst_layout = _rendezvous(eng.group, part, None, init_info.rank)
            if rpc is not None:
                rpc.join(init_info.timeout)
            return eng

        def send_weights(self, version: int | str | None = None, delta: bool | str = False) -> None:
            """One update. ``delta=True`` (with an int ``version``, e.g. the step): only the changed elements
            travel after the first update (docs/delta.md); each trainer rank's cached Resharder keeps a
            snapshot of what it sends (``last_report.mode`` / ``fallback`` say whether the delta ran)."""
            tensors = dict(self.source.iter_local()) if self.source is not None else {}
            rpc = None
            info = {"version": version, "delta": delta}
            if self.is_sender:
                self.client.start_weight_update()
                rpc = _Call(self.client.update_weights, info)
            self.last_report = refit(tensors, {}, self.src_layout, self.dst_layout, group=self.group,
                                     bucket_bytes=self.info.bucket_bytes, timeout=self.info.timeout,
                                     **_delta_kwargs(ReshardUpdateInfo(**info)))
            if rpc is not None:
                rpc.join(self.info.timeout)
                self.client.finish_weight_update(version)

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


class _Call:
    """Run a control-plane RPC in a thread (it returns only once the workers have run their side, which
    needs the trainer's side running at the same time); ``join`` re-raises its error."""

    def __init__(self, fn, *args):
        self.error: BaseException | None = None

        def run():
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 (re-raised in join)
                self.error = e

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise TimeoutError(f"the engine's control-plane call did not return within {timeout:g}s")
        if self.error is not None:
            raise self.error


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
        secret = secret_from(secret_env, secret_file, where=f"triton_reshard worker {rank}")
        self._tr_group = init_refit_group(host, port, rank, world_size, backend=group_backend, timeout=timeout,
                                          secret=secret, insecure=insecure)
        self._tr_layouts = _rendezvous(self._tr_group, None, self._model(), rank)

    def refit_from_trainer(self, version: int | None = None, delta: bool | str = False) -> int:
        """One refit into this worker's parameters; ``version`` / ``delta`` as :func:`~triton_reshard.refit`
        (the trainer ranks pass the same)."""
        src, dst = self._tr_layouts
        rep = refit({}, dict(self._model().named_parameters()), src, dst, group=self._tr_group,
                    timeout=self._tr_timeout, version=version, delta=delta)
        return rep.recv_bytes


def trainer_refit_group(host: str, port: int, rank: int, world_size: int, layout: Layout, *,
                        timeout: float = 300.0, group_backend: str | None = None,
                        secret: bytes | str | None = None, insecure: bool | None = None):
    """The trainer ranks' half of :class:`RefitWorkerExtension`'s rendezvous: returns ``(group, src_layout,
    dst_layout)`` for ``refit(tensors, {}, src_layout, dst_layout, group=group)``. ``secret``: as
    :func:`~triton_reshard.init_refit_group` (default: ``TRITON_RESHARD_SECRET`` / ``_FILE``)."""
    group = init_refit_group(host, port, rank, world_size, backend=group_backend, timeout=timeout, secret=secret,
                             insecure=insecure)
    src, dst = _rendezvous(group, (layout,) if rank == 0 else None, None, rank)
    return group, src, dst
