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
from .record import LoadRecord, checkpoint_shapes, layout_from_model, record_block_quant

SCALE_SUFFIX = "_scale_inv"  # block FP8: checkpoint "X.weight_scale_inv" -> vLLM param "...weight_scale_inv"
# the parameters vLLM's block-FP8 methods hold quantized (Fp8LinearMethod / Fp8MoEMethod, vLLM 0.33), each
# with its float32 scales in the parameter of the same name + SCALE_SUFFIX
FP8_WEIGHTS = ("weight", "w13_weight", "w2_weight")


def block_quantized_params(model) -> dict[str, tuple[int, ...]]:
    """``{parameter name: weight_block_size}`` of the parameters a vLLM model holds in block FP8: those of the
    modules whose quantization method set ``weight_block_size`` at ``create_weights`` (linear layers and
    FusedMoE experts of a ``quantization_config`` with ``quant_method: fp8`` and ``weight_block_size``)."""
    params = dict(model.named_parameters())
    out: dict[str, tuple[int, ...]] = {}
    for mname, m in model.named_modules():
        wbs = getattr(m, "weight_block_size", None)
        if wbs is None:
            continue
        for pn in FP8_WEIGHTS:
            n = f"{mname}.{pn}" if mname else pn
            if n in params and n + SCALE_SUFFIX in params:
                out[n] = tuple(int(b) for b in wbs)
    return out


def _scale_fmt_ue8m0(model) -> bool:
    qc = getattr(getattr(model, "config", None), "quantization_config", None)
    if qc is not None and not isinstance(qc, Mapping):
        qc = getattr(qc, "to_dict", lambda: vars(qc))()
    return bool(qc) and qc.get("scale_fmt") == "ue8m0"


def record_vllm(model, checkpoint: str | Mapping[str, Sequence[int]], rank: int,
                ue8m0: bool | None = None) -> LoadRecord:
    """This rank's :class:`LoadRecord` of ``model.load_weights`` (``checkpoint``: a safetensors directory or
    ``{name: shape}``). The parameters vLLM holds in block FP8 (:func:`block_quantized_params`) are recorded with
    their scales ``X + "_scale_inv"`` (:func:`~.record.record_block_quant`: a BF16 trainer's checkpoint gets the
    scale tensors the FP8 loader expects). ``ue8m0``: power-of-two scales (default: the config's
    ``quantization_config.scale_fmt == "ue8m0"``)."""
    shapes = checkpoint_shapes(checkpoint) if isinstance(checkpoint, str) else checkpoint
    blocks = block_quantized_params(model)
    if blocks and ue8m0 is None:
        ue8m0 = _scale_fmt_ue8m0(model)
    return record_block_quant(dict(model.named_parameters()), model.load_weights, shapes, rank, blocks, SCALE_SUFFIX,
                              ue8m0)


def layout_from_vllm(model, checkpoint: str | Mapping[str, Sequence[int]], *, group: dist.ProcessGroup | None = None,
                     rank: int | None = None) -> Layout:
    """The destination layout of a vLLM deployment, read off every worker's live ``model``
    (:func:`~.record.layout_from_model` of :func:`record_vllm`). Call on every rank of ``group`` (the refit group:
    trainer ranks with no model pass ``model=None``); every rank returns the same Layout, whose ranks are the
    group's ranks. Local tensors are the parameters ``load_weights`` writes; parameters it does not write (e.g.
    MLA's ``W_UV``/``W_UK_T``, made after loading) are not in the layout and are ignored by ``refit``."""
    return layout_from_model(record_vllm, model, checkpoint, group, rank)


def amx_packing_unbuilt() -> bool:
    """An AMX-capable CPU without ``torch.ops._C.convert_weight_packed``, the weight packing vLLM picks on such a
    CPU (its AMX MLA backend, its sgl-kernel GEMM for small bf16 weights) and only vLLM's CPU build ships (the
    PyPI wheel does not)."""
    if not torch.cpu._is_amx_tile_supported():
        return False
    try:
        getattr(torch.ops._C, "convert_weight_packed")  # noqa: B009 (torch.ops raises AttributeError when absent)
    except (AttributeError, RuntimeError):
        return True
    return False


def load_vllm_model(checkpoint_dir: str, *, tensor_parallel_size: int = 1, enable_expert_parallel: bool = False,
                    dtype: str | torch.dtype = "float32", init_groups: bool = True, **engine_args):
    """vLLM's model for ``checkpoint_dir``, built by vLLM's ``initialize_model`` and loaded by its
    ``DefaultModelLoader`` on this rank of an initialised torch.distributed world of ``tensor_parallel_size``
    ranks, under the model dtype as torch's default (as vLLM's own ``load_model``: parameters vLLM does not
    give a dtype of their own are ``dtype``). ``init_groups``: initialise vLLM's parallel groups on that world (once per process; the first
    model decides whether vLLM creates its expert-parallel group, so build a MoE model first).
    Returns ``(model, vllm_config)``.
    """
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.platforms import current_platform
    from vllm.utils.torch_utils import set_default_torch_dtype

    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    args = dict(model=checkpoint_dir, tensor_parallel_size=tensor_parallel_size, dtype=dtype,
                skip_tokenizer_init=True, enforce_eager=True, enable_expert_parallel=enable_expert_parallel,
                max_model_len=128)
    # on an AMX-capable CPU vLLM prefers its AMX MLA backend, whose post-load packing only vLLM's CPU build ships
    # (amx_packing_unbuilt): then the reference CPU_MLA backend runs (it keeps the weights in the checkpoint format)
    if not {"attention_backend", "attention_config"} & set(engine_args) and current_platform.is_cpu() \
            and amx_packing_unbuilt():
        args["attention_backend"] = "CPU_MLA"
    args.update(engine_args)
    vc = EngineArgs(**args).create_engine_config()
    with set_current_vllm_config(vc), set_default_torch_dtype(vc.model_config.dtype):
        if init_groups:
            from vllm.distributed import init_distributed_environment, initialize_model_parallel

            rank, world = dist.get_rank(), dist.get_world_size()
            init_distributed_environment(world, rank, "env://", rank, backend=dist.get_backend())
            initialize_model_parallel(tensor_parallel_size)
        model = initialize_model(vllm_config=vc)
        DefaultModelLoader(vc.load_config).load_weights(model, vc.model_config)
    return model, vc
