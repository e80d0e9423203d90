"""vLLM: a worker's destination layout read off its own loader, and vLLM's model classes on any device.

:func:`layout_from_vllm` runs the live model's ``load_weights`` once on id tensors shaped like the
checkpoint (see :mod:`.record`): whatever vLLM release and architecture the worker runs, the layout says
what *its* loader does, not what our presets believe it does. Nothing is written into the model.

:func:`load_vllm_model` builds vLLM's model class for a checkpoint directory and loads it with vLLM's own
``DefaultModelLoader`` in this process (one process per tensor-parallel rank, on an initialised
torch.distributed world): what the engine tier tests and ``triton-reshard verify`` use. vLLM's ``LLM``
engine does not run on CPU from the PyPI wheel; its model classes and loaders do, with
``VLLM_TARGET_DEVICE=cpu``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from ..layout import Layout
from .record import LoadRecord, checkpoint_shapes, layout_from_records, record_load


def record_vllm(model, checkpoint: str | Mapping[str, Sequence[int]], rank: int) -> LoadRecord:
    """This rank's :class:`LoadRecord` of ``model.load_weights`` (``checkpoint``: a safetensors directory or
    ``{name: shape}``)."""
    shapes = checkpoint_shapes(checkpoint) if isinstance(checkpoint, str) else checkpoint
    return record_load(dict(model.named_parameters()), model.load_weights, shapes, rank)


def layout_from_vllm(model, checkpoint: str | Mapping[str, Sequence[int]], *, group: dist.ProcessGroup | None = None,
                     rank: int | None = None) -> Layout:
    """The destination layout of a vLLM deployment, read off every worker's live ``model``.

    Call on every rank of ``group`` (the refit group: trainer ranks with no model pass ``model=None``). Each
    worker records its own loader; the records are all-gathered, so every rank returns the same Layout, whose
    ranks are the group's ranks. Raises, naming the parameter and rank, if a loader write is not a box copy
    of a checkpoint tensor (fail closed). Local tensors are the parameters ``load_weights`` writes; parameters
    it does not write (e.g. MLA's ``W_UV``/``W_UK_T``, made after loading) are not in the layout and are
    ignored by ``refit``.
    """
    if rank is None:
        rank = dist.get_rank(group) if dist.is_initialized() else 0
    rec = None if model is None else record_vllm(model, checkpoint, rank)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        recs: list[LoadRecord | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(recs, rec, group=group)
    else:
        recs = [rec]
    return layout_from_records(r for r in recs if r is not None)


def load_vllm_model(checkpoint_dir: str, *, tensor_parallel_size: int = 1, enable_expert_parallel: bool = False,
                    dtype: str | torch.dtype = "float32", init_groups: bool = True, **engine_args):
    """vLLM's model for ``checkpoint_dir``, built by vLLM's ``initialize_model`` and loaded by its
    ``DefaultModelLoader`` on this rank of an initialised torch.distributed world of ``tensor_parallel_size``
    ranks. ``init_groups``: initialise vLLM's parallel groups on that world (once per process; the first
    model decides whether vLLM creates its expert-parallel group, so build a MoE model first).
    Returns ``(model, vllm_config)``.
    """
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.utils import initialize_model

    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    args = dict(model=checkpoint_dir, tensor_parallel_size=tensor_parallel_size, dtype=dtype,
                skip_tokenizer_init=True, enforce_eager=True, enable_expert_parallel=enable_expert_parallel,
                max_model_len=128)
    args.update(engine_args)
    vc = EngineArgs(**args).create_engine_config()
    with set_current_vllm_config(vc):
        if init_groups:
            from vllm.distributed import init_distributed_environment, initialize_model_parallel

            rank, world = dist.get_rank(), dist.get_world_size()
            init_distributed_environment(world, rank, "env://", rank, backend=dist.get_backend())
            initialize_model_parallel(tensor_parallel_size)
        model = initialize_model(vllm_config=vc)
        DefaultModelLoader(vc.load_config).load_weights(model, vc.model_config)
    return model, vc
