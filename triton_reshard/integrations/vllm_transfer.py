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
* **Stage, then commit** (``send_weights(overlap=True)``, then ``commit()``; docs/integrations.md): the workers
  receive into a private staging mirror (1x their shard) in a background thread while the engine serves; the
  commit swaps it in under the pause (in place: a copy; reload mode: vLLM's layerwise reload fed from it).
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

The backend's modules (this one is its public face: every name users import from here still is): the worker
side :mod:`.vllm_worker`, the trainer side :mod:`.vllm_trainer`, what both share :mod:`.vllm_update` (infos,
rendezvous, commit vote), the receive modes :mod:`.vllm_reload`; the pieces every plug-in shares (join the
group, exchange layouts, plan the pair, delta options) are the integration kit, :mod:`.engine`.
"""

from __future__ import annotations

from .engine import plan_pair
from .vllm_reload import (
    MODES,
    choose_mode,
    group_layouts,
    model_format_params,
    rewritten_params,
    stage_groups,
    staging_record,
)
from .vllm_trainer import BACKEND, LLMClient, TensorsSource, trainer_refit_group
from .vllm_update import (
    ReshardInitInfo,
    ReshardUpdateInfo,
    TornWeightsError,
    WeightTransferEngine,
    broadcast_root,
    commit_vote,
    delta_kwargs,
    register,
)
from .vllm_worker import RefitWorkerExtension

__all__ = [
    "BACKEND",
    "MODES",
    "LLMClient",
    "RefitWorkerExtension",
    "ReshardInitInfo",
    "ReshardUpdateInfo",
    "TensorsSource",
    "TornWeightsError",
    "broadcast_root",
    "choose_mode",
    "commit_vote",
    "delta_kwargs",
    "group_layouts",
    "model_format_params",
    "plan_pair",
    "register",
    "rewritten_params",
    "stage_groups",
    "staging_record",
    "trainer_refit_group",
]

if WeightTransferEngine is not None:  # the engine classes subclass vLLM's: only where vLLM is installed
    from .vllm_trainer import ReshardTrainerInitInfo, TritonReshardTrainerEngine
    from .vllm_worker import TritonReshardWeightTransferEngine

    __all__ += ["ReshardTrainerInitInfo", "TritonReshardTrainerEngine", "TritonReshardWeightTransferEngine"]

_delta_kwargs = delta_kwargs  # its name before the split (tests/test_delta_plugins.py reads it here)
