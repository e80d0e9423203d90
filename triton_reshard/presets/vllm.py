"""vLLM inference layout: the parameters of vLLM's model runner on each worker (tensor x data parallel).

Local tensor names are what ``model.named_parameters()`` gives in a vLLM worker (V1 engine), formats from
vLLM ``main`` as of v0.10/0.11 (files read: ``model_executor/models/llama.py``, ``qwen2.py``, ``qwen3.py``,
``qwen3_moe.py``, ``layers/linear.py`` (QKVParallelLinear, MergedColumnParallelLinear,
RowParallelLinear), ``layers/vocab_parallel_embedding.py``, ``layers/fused_moe/layer.py`` and
``fused_moe/config.py`` (FusedMoEParallelConfig), ``models/deepseek_v2.py``):

* ``model.layers.{i}.self_attn.qkv_proj.weight`` ``[(nh/tp + 2*kv_loc)*hd, H]`` = ``[q_tp; k_tp; v_tp]``.
  With ``tp > num_kv_heads`` each rank holds ``kv_loc = 1`` head, number ``tp_rank * num_kv_heads // tp``
  (the KV heads are replicated ``tp / num_kv_heads`` times). ``.bias`` (Qwen2) likewise.
* ``self_attn.o_proj.weight`` ``[H, nh*hd/tp]`` (row parallel); ``self_attn.q_norm``/``k_norm`` (Qwen3)
  and all RMSNorms replicated.
* ``mlp.gate_up_proj.weight`` ``[2*I/tp, H]`` = ``[gate_tp; up_tp]``; ``mlp.down_proj.weight`` ``[H, I/tp]``.
* MoE (FusedMoE): ``mlp.gate.weight`` ``[E, H]`` replicated; ``mlp.experts.routed_experts.w13_weight``
  ``[E_loc, 2*I_loc, H]`` = per expert ``[gate; up]`` and ``...w2_weight`` ``[E_loc, H, I_loc]`` (``mlp.experts.w13_weight`` / ``w2_weight`` up to vLLM 0.23).
  The experts are split over all ``tp*dp`` workers (``flatten_tp_across_dp``, worker ``dp_rank*tp +
  tp_rank``): over the intermediate dim without expert parallelism, by whole experts with
  ``enable_expert_parallel`` (``E_loc = E // n`` plus one for the first ``E % n`` workers, "linear"
  placement).
* ``model.embed_tokens.weight`` and ``lm_head.weight`` ``[V_pad/tp, H]`` with ``V_pad`` = vocab rounded up
  to a multiple of 64 (``pad_vocab_size``), split evenly over TP; padding rows are never transferred. With
  tied embeddings vLLM has no separate ``lm_head.weight``.

DeepSeek-V3 (``models/deepseek_v2.py``: DeepseekV2MLAAttention, DeepSeekV2FusedQkvAProjLinear,
DeepseekV2MoE, DeepseekV2MLP, ``load_weights`` with ``mla_params_mapping``; ``config/parallel.py``
``use_sequence_parallel_moe``):

* ``self_attn.fused_qkv_a_proj.weight`` ``[q_lora_rank + kv_lora_rank + rope, H]`` = ``[q_a_proj;
  kv_a_proj_with_mqa]``, whole on every rank (``disable_tp``); ``q_lora_rank=None``: ColumnParallel
  ``q_proj`` ``[nh/tp * (nope+rope), H]`` and a ReplicatedLinear ``kv_a_proj_with_mqa`` instead.
* ``self_attn.q_a_layernorm`` / ``kv_a_layernorm`` replicated; ``q_b_proj`` ``[nh/tp * (nope+rope), q_lora_rank]``
  and ``kv_b_proj`` ``[nh/tp * (nope+v), kv_lora_rank]`` ColumnParallel; ``o_proj`` ``[H, nh*v / tp]``.
  (vLLM's MLA backends derive ``W_UK_T``/``W_UV`` from ``kv_b_proj`` in ``process_weights_after_loading``;
  re-run it after a refit unless your version keeps them as views of the weight.)
* dense layers: ``mlp.gate_up_proj`` / ``mlp.down_proj`` as above. MoE layers: ``mlp.gate.weight`` replicated,
  ``mlp.gate.e_score_correction_bias`` ``[E]`` (an fp32 Parameter, ``topk_method="noaux_tc"``), FusedMoE
  experts as above, ``mlp.shared_experts.gate_up_proj`` / ``down_proj`` TP-split like a dense MLP, or whole on
  every rank when sequence-parallel MoE is on (``DeepseekV2MLP(disable_tp=is_sequence_parallel)``: expert
  parallel with ``tp > 1`` and ``dp > 1``). Not placed: the MTP/spec-decode layer, ROCm AITER's fused
  shared experts.

Block FP8 (a config with ``quantization_config`` ``{"quant_method": "fp8", "activation_scheme": "dynamic",
"weight_block_size": [n, k]}``, as DeepSeek-V3 / Qwen3-FP8 checkpoints; vLLM 0.33 ``layers/quantization/
fp8.py`` ``Fp8Config``, ``Fp8LinearMethod``, ``Fp8MoEMethod``, ``utils/fp8_utils.py``, ``layers/linear.py``
``adjust_block_scale_shard``; checked against the real classes and loader in ``tests/engines/test_vllm_fp8.py``):

* FP8 (``float8_e4m3fn``, logical tensors with a ``BlockQuant``, see :func:`fp8_tensors`): the weights of
  ``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj`` (dense and DeepSeek shared experts), MLA's
  ``fused_qkv_a_proj`` (or ``q_proj`` + ``kv_a_proj_with_mqa``), ``q_b_proj``, ``kv_b_proj``, the FusedMoE
  ``w13_weight`` / ``w2_weight``, and Qwen3-MoE's router ``mlp.gate.weight`` (built with the quant config);
  BF16 (``dtype``): embeddings, ``lm_head``, norms, biases, DeepSeek's router ``mlp.gate.weight`` and its fp32
  ``e_score_correction_bias``; modules in ``modules_to_not_convert`` (vLLM's exact-name rule: a fused layer
  when all of its shards are listed, a layer's experts when a listed name contains ``mlp.experts``).
* Scales: float32 logical tensors ``<weight>_scale_inv`` ``[ceil(rows/n), ceil(cols/k)]`` (the checkpoint's),
  in vLLM's ``<param>_scale_inv`` (``qkv_proj.weight_scale_inv``, ``mlp.experts.routed_experts.
  w13_weight_scale_inv`` ``[E_loc, 2*ceil(I_loc/n), ceil(H/k)]``, ``w2_weight_scale_inv`` ``[E_loc,
  ceil(H/n), ceil(I_loc/k)]``), TP-split by blocks like their weights: each part of a fused tensor at its
  block offset (k's scale rows of ``qkv_proj`` at ``q_loc / n``, up's of ``w13`` at ``I_loc / n``).
* A TP (or expert) partition that is not whole blocks raises, naming the tensor (vLLM refuses it for linear
  layers; for FusedMoE it may refine the scale blocks, which no preset describes). Not covered: per-tensor /
  per-channel FP8, the kv-cache scales vLLM adds to each attention layer (``attn.k_scale`` ...; not checkpoint
  tensors, never written by a refit), formats after ``process_weights_after_loading`` (CUDA kernels may
  repack FP8 weights / scales).

Ranks: position ``p`` of ``ranks`` is ``dp_rank = p // tp``, ``tp_rank = p % tp`` (DP-major blocks of TP);
each DP replica holds a full copy of the non-expert weights. ``instances=N``: N engines, engine ``i`` on the
ranks shifted by ``i * tp * dp`` (consecutive ranks; in general by their span).
"""

from __future__ import annotations

import importlib.metadata
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatch

import numpy as np
import torch

from ..layout import Layout, block_quant_layout
from .hf import (
    LayoutBuilder,
    ModelSpec,
    check_ranks,
    expert_names,
    gc_paused,
    layer_prefix,
    model_spec,
)

VOCAB_PADDING = 64  # vllm.model_executor.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE
NEWEST_KNOWN = "0.33.0"  # the newest vLLM whose format the engine tier (tests/engines) checked
ROUTED_EXPERTS_SINCE = (0, 24)  # FusedMoE weights under mlp.experts.routed_experts.* from this release on


def version_tuple(v: str, what: str = "vllm_version") -> tuple[int, ...]:
    out = []
    for part in str(v).split("+")[0].split("."):
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        out.append(int(digits))
    if len(out) < 2:
        raise ValueError(f"{what}={v!r} is not a version like '0.33.0'")
    return tuple(out)


def installed_version(package: str) -> str | None:
    """The version of ``package`` installed in this environment (read from its metadata; the package is not
    imported), or None."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def installed_vllm_version() -> str | None:
    """The version of the vLLM installed here, or None (:func:`installed_version`)."""
    return installed_version("vllm")


def resolve_vllm_version(vllm_version: str | None = None) -> str:
    """``vllm_version`` if given, else the installed vLLM's, else :data:`NEWEST_KNOWN`."""
    v = vllm_version or installed_vllm_version() or NEWEST_KNOWN
    version_tuple(v)
    return v


def fused_moe_prefix(vllm_version: str | None = None) -> str:
    """Where a FusedMoE layer's ``w13_weight`` / ``w2_weight`` live under ``model.layers.{i}.mlp``:
    ``experts.routed_experts`` since vLLM 0.24, ``experts`` up to 0.23."""
    v = version_tuple(resolve_vllm_version(vllm_version))
    return "experts.routed_experts" if v >= ROUTED_EXPERTS_SINCE else "experts"


def pad_vocab_size(vocab: int, pad_to: int = VOCAB_PADDING) -> int:
    return -(-vocab // pad_to) * pad_to


def expert_range(num_experts: int, ep_size: int, ep_rank: int) -> tuple[int, int]:
    """``(first, count)`` of the experts of ``ep_rank`` (vLLM ``determine_expert_map``, linear placement)."""
    base, rem = divmod(num_experts, ep_size)
    return ep_rank * base + min(ep_rank, rem), base + (1 if ep_rank < rem else 0)


@dataclass(frozen=True)
class BlockFp8:
    """A HF ``quantization_config`` of block FP8 as vLLM reads it (``Fp8Config.from_config``)."""

    block: tuple[int, int]  # weight_block_size: [rows (block_n), cols (block_k)]
    ignored: tuple[str, ...] = ()  # ignored_layers, else modules_to_not_convert: module names vLLM keeps unquantized
    ue8m0: bool = False  # scale_fmt "ue8m0" (DeepSeek-V3.1+): scales are powers of two


def block_fp8_config(config) -> BlockFp8 | None:
    """The block-FP8 ``quantization_config`` of ``config`` (None for an unquantized model).

    Accepted as vLLM 0.33's ``Fp8Config`` takes it: ``quant_method`` ``"fp8"``, ``activation_scheme``
    ``"dynamic"`` (the only one vLLM allows with blocks), ``weight_block_size`` ``[n, k]``; the unquantized
    modules from ``ignored_layers``, else ``modules_to_not_convert``. Anything else (other methods,
    per-tensor / per-channel FP8 without ``weight_block_size``, a serialized-bf16 "online" FP8, ``fmt`` other
    than e4m3, ``store_dtype``) raises ``NotImplementedError``: no preset describes those weights."""
    c = model_spec(config).raw or {}
    qc = c.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    method = qc.get("quant_method")
    if method != "fp8":
        raise NotImplementedError(f"vllm_layout: quantization_config quant_method={method!r} is not supported "
                                  f"(block FP8 only: quant_method 'fp8' with weight_block_size)")
    wbs = qc.get("weight_block_size")
    if wbs is None:
        raise NotImplementedError("vllm_layout: per-tensor FP8 (quantization_config without weight_block_size) is "
                                  "not supported; block FP8 only")
    if (not isinstance(wbs, (list, tuple)) or len(wbs) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in wbs)):
        raise ValueError(f"vllm_layout: quantization_config weight_block_size={wbs!r} must be two ints > 0 "
                         f"(vLLM: [block_n, block_k])")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"vllm_layout: quantization_config activation_scheme={scheme!r}: vLLM's block FP8 takes "
                         f"'dynamic' only")
    fmt = qc.get("fmt", "e4m3")
    if fmt not in ("e4m3", "float8_e4m3fn"):
        raise NotImplementedError(f"vllm_layout: quantization_config fmt={fmt!r} is not supported (e4m3 only)")
    if qc.get("store_dtype"):
        raise NotImplementedError(f"vllm_layout: quantization_config store_dtype={qc['store_dtype']!r} is not "
                                  f"supported")
    ignored = qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ()
    if isinstance(ignored, str) or not all(isinstance(x, str) for x in ignored):
        raise ValueError(f"vllm_layout: quantization_config modules_to_not_convert={ignored!r} must be a list of "
                         f"module names")
    scale_fmt = qc.get("scale_fmt")
    if scale_fmt not in (None, "ue8m0"):
        raise NotImplementedError(f"vllm_layout: quantization_config scale_fmt={scale_fmt!r} is not supported")
    return BlockFp8((int(wbs[0]), int(wbs[1])), tuple(ignored), scale_fmt == "ue8m0")


@dataclass(frozen=True)
class ModelOptQuant:
    """A ModelOpt ``quantization_config`` of MXFP8 or NVFP4 as vLLM 0.33 reads it (``ModelOptMxFp8Config`` /
    ``ModelOptNvFp4Config``): the format and ``exclude_modules`` (wildcards)."""

    format: str  # "mxfp8" or "nvfp4"
    excluded: tuple[str, ...] = ()


def modelopt_config(config) -> ModelOptQuant | None:
    """The ModelOpt MXFP8 / NVFP4 ``quantization_config`` of ``config`` (None: not one). Accepted as vLLM 0.33
    takes them: ``{"quant_method": "modelopt", "quantization": {"quant_algo": "MXFP8" | "NVFP4", "group_size":
    16, "exclude_modules": [...]}}``, the flat form (``quant_algo`` beside ``quant_method``), and MiniMax-style
    ``{"quant_method": "mxfp8", "ignored_layers": [...]}``. NVFP4 takes ``group_size`` 16 only."""
    c = model_spec(config).raw or {}
    qc = c.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    method = str(qc.get("quant_method", "")).lower()
    if method == "mxfp8" and "quant_algo" not in qc and "quantization" not in qc:
        return ModelOptQuant("mxfp8", tuple(qc.get("ignored_layers") or ()))
    if method != "modelopt":
        return None
    inner = qc.get("quantization") if isinstance(qc.get("quantization"), Mapping) else qc
    algo = str(inner.get("quant_algo", "")).upper()
    if algo not in ("MXFP8", "NVFP4"):
        raise NotImplementedError(f"vllm_layout: ModelOpt quant_algo={algo!r} is not supported (MXFP8, NVFP4)")
    if algo == "NVFP4" and int(inner.get("group_size", 16)) != 16:
        raise NotImplementedError(f"vllm_layout: NVFP4 group_size={inner.get('group_size')!r}: 16 only")
    excluded = inner.get("exclude_modules") or ()
    if isinstance(excluded, str) or not all(isinstance(x, str) for x in excluded):
        raise ValueError(f"vllm_layout: exclude_modules={excluded!r} must be a list of module names / wildcards")
    return ModelOptQuant(algo.lower(), tuple(excluded))


def _modelopt_skipped(module: str, shards: Sequence[str], excluded: Sequence[str]) -> bool:
    """vLLM 0.33 ``ModelOptQuantConfigBase.is_layer_excluded``: the exact rule (fused shards), then a listed name
    contained in the module's name, then a wildcard (``fnmatch``)."""
    if not excluded:
        return False
    if _fp8_skipped(module, shards, excluded):
        return True
    return any((x != module and x in module) or fnmatch(module, x) for x in excluded)


def _fp8_skipped(module: str, shards: Sequence[str], ignored: Sequence[str]) -> bool:
    """vLLM 0.33 ``is_layer_skipped`` (``match_mode="exact"``) for module ``module`` (HF naming);
    ``shards``: the checkpoint modules of a fused one (``packed_modules_mapping``)."""
    if shards:
        if module in ignored:
            return True
        skipped = {sh in ignored for sh in shards}
        if len(skipped) > 1:
            raise ValueError(f"vllm_layout: modules_to_not_convert lists some but not all of {list(shards)}, which "
                             f"vLLM fuses into {module!r}: the shards of a fused layer need one precision (vLLM "
                             f"refuses it too)")
        return skipped.pop()
    if "experts" in module:  # any listed name containing the module's prefix (e.g. one expert) skips it
        return any(module in x for x in ignored if "experts" in x)
    return module in ignored


def fp8_tensors(config, fp8: BlockFp8 | None = None) -> list[str]:
    """The logical (checkpoint) tensors vLLM 0.33 holds in block FP8 for a model with ``quantization_config``
    ``fp8`` (see :func:`block_fp8_config`): the weights of every linear layer built with the quantization
    config (``Fp8LinearMethod``: QKV / gate-up / down / o projections, MLA's ``fused_qkv_a_proj``
    (``q_a_proj`` + ``kv_a_proj_with_mqa``) / ``q_b_proj`` / ``kv_b_proj``, DeepSeek's shared experts,
    Qwen3-MoE's router ``mlp.gate``) and the FusedMoE experts (``Fp8MoEMethod``), minus the modules
    ``modules_to_not_convert`` skips. Never quantized: embeddings, ``lm_head``, norms, biases, DeepSeek's
    router ``mlp.gate`` (a ``GateLinear`` built without the quantization config) and its
    ``e_score_correction_bias``."""
    s = model_spec(config)
    fp8 = fp8 or block_fp8_config(s)
    if fp8 is None:
        return []
    return quantized_linear_tensors(s, lambda module, shards: _fp8_skipped(module, shards, fp8.ignored))


def quantized_linear_tensors(s: ModelSpec, skipped) -> list[str]:
    """The weights of the linear layers vLLM 0.33 builds with a quantization config (see :func:`fp8_tensors`),
    minus those ``skipped(module, shard modules)`` says the config leaves unquantized."""
    out: list[str] = []

    def linear(module: str, shards: Sequence[str] = ()) -> None:
        parent = module.rsplit(".", 1)[0]
        full = [f"{parent}.{sh}" for sh in shards]
        if not skipped(module, full):
            out.extend(f"{m}.weight" for m in (full or [module]))

    for i in range(s.layers):
        p = layer_prefix(i)
        att = f"{p}.self_attn"
        if s.mla:
            if s.q_lora_rank is None:
                linear(f"{att}.q_proj")
                linear(f"{att}.kv_a_proj_with_mqa")
            else:
                linear(f"{att}.fused_qkv_a_proj", ("q_a_proj", "kv_a_proj_with_mqa"))
                linear(f"{att}.q_b_proj")
            linear(f"{att}.kv_b_proj")
        else:
            linear(f"{att}.qkv_proj", ("q_proj", "k_proj", "v_proj"))
        linear(f"{att}.o_proj")
        mlps = [f"{p}.mlp"]
        if s.is_moe_layer(i):
            mlps = [f"{p}.mlp.shared_experts"] if s.shared_intermediate else []
            if s.family == "qwen3_moe":  # Qwen3MoeSparseMoeBlock: GateLinear(..., quant_config=quant_config)
                linear(f"{p}.mlp.gate")
            if not skipped(f"{p}.mlp.experts", ()):
                out.extend(n for e in range(s.experts) for n in expert_names(i, e))
        for mlp in mlps:
            linear(f"{mlp}.gate_up_proj", ("gate_proj", "up_proj"))
            linear(f"{mlp}.down_proj")
    return out


@gc_paused()  # ~10^5 small objects per 128-rank layout, no cycles
def vllm_layout(
    config,
    tp: int = 1,
    dp: int = 1,
    enable_expert_parallel: bool = False,
    ranks: Sequence[int] | int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    vocab_padding: int = VOCAB_PADDING,
    sequence_parallel_moe: bool | None = None,
    vllm_version: str | None = None,
    instances: int = 1,
) -> Layout:
    """The layout of vLLM workers serving the model with ``tensor_parallel_size=tp`` and
    ``data_parallel_size=dp`` (``enable_expert_parallel``: experts split whole over the ``tp*dp`` workers).

    ``ranks``: the ``tp*dp`` global ranks, DP-major (default ``0..``; an int is an offset, e.g. ``4`` for
    inference on ranks 4.. next to training on 0..3). ``sequence_parallel_moe`` (DeepSeek shared experts):
    vLLM's ``ParallelConfig.use_sequence_parallel_moe``; ``None`` follows vLLM's default rule (expert
    parallel, ``tp > 1`` and ``dp > 1``, with the default all2all backends), under which the shared experts
    are replicated on every TP rank instead of TP-split. ``vllm_version``: the vLLM release whose parameter
    names to use (FusedMoE: ``mlp.experts.routed_experts.w13_weight`` since 0.24, ``mlp.experts.routed_experts.w13_weight``
    before); default: the installed vLLM's version, else the newest known (:data:`NEWEST_KNOWN`). A trainer
    process without vLLM installed should pass the engine's version; a mismatch fails closed (the engine
    side's names differ, so the plan digests differ and refit raises before any byte moves).

    A ``quantization_config`` of block FP8 in ``config`` is honoured as vLLM does (module docstring: which
    layers are FP8, the ``..._scale_inv`` scale tensors); ``dtype`` is then the dtype of the unquantized rest.
    So is a ModelOpt MXFP8 / NVFP4 one (:func:`modelopt_config`): the same linear layers (minus
    ``exclude_modules``) become ``block_quant_layout(..., format="mxfp8" | "nvfp4")`` (``weight`` /
    ``weight_scale`` [/ ``weight_scale_2``], as vLLM's ModelOpt linear and MoE methods create them; NVFP4's
    calibrated ``input_scale`` is not a weight and is left to the engine: no refit touches it). Other
    quantization methods raise ``NotImplementedError``.

    ``instances``: that many independent engines, each a full copy of this layout (``Layout.instances``):
    engine ``i`` on ``ranks`` shifted by ``i * span`` (``span = max(ranks) - min(ranks) + 1``: ``tp * dp`` for
    consecutive ``ranks``). Unlike ``dp``, the
    experts of an engine are split over its own ``tp*dp`` workers only. To spread the trainer's sends over the
    engines, pass the one-engine layout to ``refit(..., instances=N)`` (or give ``plan_reshard`` the layout's
    ``instance_groups(N)`` as ``relay_groups``).
    """
    s = model_spec(config)
    if s.family not in ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3"):
        raise NotImplementedError(f"vllm_layout: model_type {s.family!r} is not supported")
    mo = modelopt_config(s)
    fp8 = None if mo is not None else block_fp8_config(s)
    layout = fused_layout(s, tp=tp, dp=dp, enable_expert_parallel=enable_expert_parallel, ranks=ranks, dtype=dtype,
                          vocab_padding=vocab_padding, sequence_parallel_moe=sequence_parallel_moe,
                          moe_prefix=fused_moe_prefix(vllm_version) if any(s.moe_layers) else "", who="vllm_layout")
    if fp8 is not None:
        try:
            layout = block_quant_layout(layout, fp8_tensors(s, fp8), fp8.block, ue8m0=fp8.ue8m0)
        except ValueError as e:  # a TP shard that splits a block: vLLM's validate_fp8_block_shape refuses it too
            hint = (" (vLLM 0.33 refuses such a TP partition of a linear layer; for FusedMoE experts it may instead "
                    "refine the scales to a finer block at load time, a format no preset describes: use expert "
                    "parallelism or a TP size whose partitions are whole blocks)")
            raise ValueError(f"vllm_layout(tp={tp}, dp={dp}, enable_expert_parallel={enable_expert_parallel}): "
                             f"block FP8 {list(fp8.block)}: {e}{hint}") from None
    if mo is not None:
        names = quantized_linear_tensors(s, lambda module, shards: _modelopt_skipped(module, shards, mo.excluded))
        try:
            layout = block_quant_layout(layout, names, None, format=mo.format)
        except ValueError as e:  # a TP shard that splits a 1x32 / 1x16 block: vLLM refuses it too
            raise ValueError(f"vllm_layout(tp={tp}, dp={dp}, enable_expert_parallel={enable_expert_parallel}): "
                             f"{mo.format}: {e}") from None
    return layout.instances(instances)


def fused_layout(s: ModelSpec, *, tp: int, dp: int, enable_expert_parallel: bool, ranks, dtype: torch.dtype,
                 vocab_padding: int, sequence_parallel_moe: bool | None, moe_prefix: str, who: str) -> Layout:
    """The unquantized layout of an engine with vLLM's fused formats (``qkv_proj``, ``gate_up_proj``, padded
    vocab, FusedMoE ``w13_weight`` / ``w2_weight`` under ``mlp.{moe_prefix}``): :func:`vllm_layout`'s, and
    SGLang's (``presets.sglang``), which differ in the FusedMoE prefix. ``who`` names the caller in errors."""
    vpad, use_ep, shared_tp = _check_fused(s, tp, dp, enable_expert_parallel, vocab_padding, sequence_parallel_moe, who)
    workers = tp * dp
    ranks = check_ranks(ranks, workers, f"{who}(tp={tp}, dp={dp})")
    b = LayoutBuilder.for_model(s, dtype)
    rank_of = np.asarray(ranks, dtype=np.int64)
    pos = np.arange(workers)
    _dense_weights(b, s, rank_of, pos % tp, tp, vpad // tp, shared_tp)
    if any(s.moe_layers):
        _routed_experts(b, s, rank_of, use_ep, moe_prefix)
    return b.build()


def _check_fused(s: ModelSpec, tp: int, dp: int, enable_expert_parallel: bool, vocab_padding: int,
                 sequence_parallel_moe: bool | None, who: str) -> tuple[int, bool, int]:
    """The engine's sizes split the model as vLLM splits it; returns ``(padded vocab, experts split whole
    over the workers?, the shared experts' TP size)``."""
    if s.o_bias:
        raise NotImplementedError(f"{who}: attention_bias on o_proj is not supported")
    for name, v in (("tp", tp), ("dp", dp)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{who}: {name}={v!r} must be an int >= 1")
    if s.heads % tp:
        raise ValueError(f"{who}: tp={tp} does not divide num_attention_heads={s.heads}")
    if not s.mla and tp >= s.kv_heads and tp % s.kv_heads:
        raise ValueError(f"{who}: tp={tp} is not a multiple of num_key_value_heads={s.kv_heads}")
    if not s.mla and tp < s.kv_heads and s.kv_heads % tp:
        raise ValueError(f"{who}: tp={tp} does not divide num_key_value_heads={s.kv_heads}")
    if any(not s.is_moe_layer(i) for i in range(s.layers)) and s.intermediate % tp:
        raise ValueError(f"{who}: tp={tp} does not divide intermediate_size={s.intermediate}")
    vpad = pad_vocab_size(s.vocab, vocab_padding)
    if vpad % tp:
        raise ValueError(f"{who}: tp={tp} does not divide the padded vocab {vpad}")
    has_moe = any(s.moe_layers)
    workers = tp * dp
    use_ep = has_moe and enable_expert_parallel and workers > 1
    if has_moe:
        if use_ep and s.experts < workers:
            raise ValueError(f"{who}: {s.experts} experts cannot be split over {workers} EP ranks")
        if not use_ep and s.moe_intermediate % workers:
            raise ValueError(
                f"{who}: tp*dp={workers} does not divide moe_intermediate_size={s.moe_intermediate}"
            )
    if sequence_parallel_moe is None:  # vllm/config/parallel.py ParallelConfig.use_sequence_parallel_moe
        sequence_parallel_moe = enable_expert_parallel and tp > 1 and dp > 1
    shared_tp = 1 if sequence_parallel_moe else tp  # DeepseekV2MLP(disable_tp=is_sequence_parallel)
    if s.shared_intermediate % shared_tp:
        raise ValueError(f"{who}: tp={tp} does not divide the shared experts' size {s.shared_intermediate}")
    return vpad, use_ep, shared_tp


def _dense_weights(b: LayoutBuilder, s: ModelSpec, rank: np.ndarray, t: np.ndarray, tp: int, vloc: int,
                   shared_tp: int) -> None:
    """The non-expert weights: one call per tensor for all workers at once, ``t`` the TP position of each
    (every DP replica holds the same; see LayoutBuilder)."""
    H, hd = s.hidden, s.head_dim
    q_loc = s.heads // tp * hd
    kv_heads_loc = max(1, s.kv_heads // tp)
    kv_loc = kv_heads_loc * hd
    kv_first = (t * s.kv_heads // tp) if tp >= s.kv_heads else t * kv_heads_loc
    loc = b.local(rank, "model.embed_tokens.weight", (vloc, H))
    b.rows("model.embed_tokens.weight", rank, loc, t * vloc, vloc)
    if not s.tied:
        loc = b.local(rank, "lm_head.weight", (vloc, H))
        b.rows("lm_head.weight", rank, loc, t * vloc, vloc)
    b.full("model.norm.weight", rank, "model.norm.weight")
    for i in range(s.layers):
        hf = layer_prefix(i)
        att = f"{hf}.self_attn"
        if s.mla:
            _mla_attention(b, s, rank, t, tp, att)
        else:
            _gqa_attention(b, s, rank, t, att, q_loc, kv_loc, kv_first)
        b.full(f"{hf}.input_layernorm.weight", rank, f"{hf}.input_layernorm.weight")
        b.full(f"{hf}.post_attention_layernorm.weight", rank, f"{hf}.post_attention_layernorm.weight")
        if not s.is_moe_layer(i):
            _tp_mlp(b, rank, t, s.intermediate // tp, H, f"{hf}.mlp")
            continue
        b.full(f"{hf}.mlp.gate.weight", rank, f"{hf}.mlp.gate.weight")
        if s.expert_bias:
            b.full(f"{hf}.mlp.gate.e_score_correction_bias", rank, f"{hf}.mlp.gate.e_score_correction_bias")
        if s.shared_intermediate:
            Is_loc = s.shared_intermediate // shared_tp
            _tp_mlp(b, rank, t % shared_tp, Is_loc, H, f"{hf}.mlp.shared_experts")


def _routed_experts(b: LayoutBuilder, s: ModelSpec, rank_of: np.ndarray, use_ep: bool, moe_prefix: str) -> None:
    """The routed experts of worker ``p`` (position ``p`` of ``rank_of``): ``E_loc[p]`` experts from ``e0[p]``,
    rows ``im0[p]`` on of each (whole experts under expert parallelism, else a TP slice of every expert); one
    call per layer and local expert index ``k``, over the workers that have a ``k``-th expert."""
    H, workers = s.hidden, len(rank_of)
    if use_ep:
        e0, E_loc = (np.array(v, dtype=np.int64) for v in zip(
            *(expert_range(s.experts, workers, p) for p in range(workers)), strict=True))
        Im_loc, im0 = s.moe_intermediate, 0
    else:
        e0, E_loc = np.zeros(workers, np.int64), np.full(workers, s.experts, np.int64)
        Im_loc = s.moe_intermediate // workers
        im0 = np.arange(workers) * Im_loc
    for i in range(s.layers):
        if not s.is_moe_layer(i):
            continue
        hf = layer_prefix(i)
        w13 = b.local(rank_of, f"{hf}.mlp.{moe_prefix}.w13_weight", (E_loc, 2 * Im_loc, H))
        w2 = b.local(rank_of, f"{hf}.mlp.{moe_prefix}.w2_weight", (E_loc, H, Im_loc))
        ids = b.expert_ids(s)[i]  # [expert, (gate, up, down)] tensor ids
        for k in range(int(E_loc.max())):
            has = E_loc > k
            rank, e = rank_of[has], (e0 + k)[has]
            gate, up, down = ids[e, 0], ids[e, 1], ids[e, 2]
            start = im0 if isinstance(im0, int) else im0[has]
            b.rows(gate, rank, w13, start, Im_loc, at=0, lead=(k,))
            b.rows(up, rank, w13, start, Im_loc, at=Im_loc, lead=(k,))
            b.cols(down, rank, w2, start, Im_loc, lead=(k,))


def _tp_mlp(b: LayoutBuilder, rank: int, t: int, I_loc: int, H: int, mlp: str) -> None:
    """MergedColumnParallelLinear ``gate_up_proj = [gate_tp; up_tp]`` and RowParallelLinear ``down_proj``."""
    loc = b.local(rank, f"{mlp}.gate_up_proj.weight", (2 * I_loc, H))
    b.rows(f"{mlp}.gate_proj.weight", rank, loc, t * I_loc, I_loc, at=0)
    b.rows(f"{mlp}.up_proj.weight", rank, loc, t * I_loc, I_loc, at=I_loc)
    loc = b.local(rank, f"{mlp}.down_proj.weight", (H, I_loc))
    b.cols(f"{mlp}.down_proj.weight", rank, loc, t * I_loc, I_loc)


def _mla_attention(b: LayoutBuilder, s: ModelSpec, rank: int, t: int, tp: int, att: str) -> None:
    """DeepseekV2MLAAttention: ``fused_qkv_a_proj = [q_a_proj; kv_a_proj_with_mqa]`` replicated
    (``disable_tp``; with ``q_lora_rank=None`` a ColumnParallel ``q_proj`` and a replicated
    ``kv_a_proj_with_mqa``), ColumnParallel ``q_b_proj``/``kv_b_proj`` (whole heads), RowParallel ``o_proj``,
    replicated ``q_a_layernorm``/``kv_a_layernorm``."""
    H, nh_loc = s.hidden, s.heads // tp
    q_rows = nh_loc * s.qk_head_dim
    kva = s.kv_lora_rank + s.qk_rope_head_dim
    if s.q_lora_rank is None:
        loc = b.local(rank, f"{att}.q_proj.weight", (q_rows, H))
        b.rows(f"{att}.q_proj.weight", rank, loc, t * q_rows, q_rows)
        b.full(f"{att}.kv_a_proj_with_mqa.weight", rank, f"{att}.kv_a_proj_with_mqa.weight")
    else:
        qr = s.q_lora_rank
        loc = b.local(rank, f"{att}.fused_qkv_a_proj.weight", (qr + kva, H))
        b.rows(f"{att}.q_a_proj.weight", rank, loc, 0, qr, at=0)
        b.rows(f"{att}.kv_a_proj_with_mqa.weight", rank, loc, 0, kva, at=qr)
        b.full(f"{att}.q_a_layernorm.weight", rank, f"{att}.q_a_layernorm.weight")
        loc = b.local(rank, f"{att}.q_b_proj.weight", (q_rows, qr))
        b.rows(f"{att}.q_b_proj.weight", rank, loc, t * q_rows, q_rows)
    b.full(f"{att}.kv_a_layernorm.weight", rank, f"{att}.kv_a_layernorm.weight")
    kv_rows = nh_loc * (s.qk_nope_head_dim + s.v_head_dim)
    loc = b.local(rank, f"{att}.kv_b_proj.weight", (kv_rows, s.kv_lora_rank))
    b.rows(f"{att}.kv_b_proj.weight", rank, loc, t * kv_rows, kv_rows)
    o_cols = nh_loc * s.v_head_dim
    loc = b.local(rank, f"{att}.o_proj.weight", (H, o_cols))
    b.cols(f"{att}.o_proj.weight", rank, loc, t * o_cols, o_cols)


def _gqa_attention(b: LayoutBuilder, s: ModelSpec, rank: int, t: int, att: str, q_loc: int, kv_loc: int,
                   kv_first: int) -> None:
    """QKVParallelLinear ``qkv_proj = [q_tp; k_tp; v_tp]`` (+ bias), q/k norms, RowParallel ``o_proj``."""
    H, hd = s.hidden, s.head_dim
    for kind in ("weight", "bias") if s.qkv_bias else ("weight",):
        rows = q_loc + 2 * kv_loc
        loc = b.local(rank, f"{att}.qkv_proj.{kind}", (rows, H) if kind == "weight" else (rows,))
        b.rows(f"{att}.q_proj.{kind}", rank, loc, t * q_loc, q_loc, at=0)
        b.rows(f"{att}.k_proj.{kind}", rank, loc, kv_first * hd, kv_loc, at=q_loc)
        b.rows(f"{att}.v_proj.{kind}", rank, loc, kv_first * hd, kv_loc, at=q_loc + kv_loc)
    if s.qk_norm:
        b.full(f"{att}.q_norm.weight", rank, f"{att}.q_norm.weight")
        b.full(f"{att}.k_norm.weight", rank, f"{att}.k_norm.weight")
    loc = b.local(rank, f"{att}.o_proj.weight", (H, q_loc))
    b.cols(f"{att}.o_proj.weight", rank, loc, t * q_loc, q_loc)
