"""SGLang inference layout: the parameters of SGLang's model runner on each TP rank.

SGLang (0.5.23, checked against its real model classes and loader in ``tests/sglang``) keeps vLLM's fused
formats (``qkv_proj = [q_tp; k_tp; v_tp]`` with KV heads replicated when ``tp > num_key_value_heads``,
``gate_up_proj = [gate_tp; up_tp]``, vocab padded to a multiple of 64 and split evenly, tied embeddings without
``lm_head``), so the layout is built by the same code as :func:`~triton_reshard.presets.vllm_layout`
(:func:`~triton_reshard.presets.vllm.fused_layout`), except:

* FusedMoE weights are ``model.layers.{i}.mlp.experts.w13_weight`` ``[E_loc, 2*I_loc, H]`` (per expert ``[gate;
  up]``) and ``mlp.experts.w2_weight`` ``[E_loc, H, I_loc]`` (vLLM's names up to 0.23; vLLM 0.24+ says
  ``mlp.experts.routed_experts.*``);
* expert parallelism is ``ep`` (``--ep-size``): ``ep == tp`` splits whole experts over the TP ranks (``E / ep``
  each, in order), ``ep == 1`` splits every expert's intermediate dim over TP. ``1 < ep < tp`` (experts split
  over ``ep`` and each over ``tp / ep``) is not described here: use :func:`~triton_reshard.integrations.sglang.
  layout_from_sglang`;
* ``dp`` without attention data parallelism is ``dp`` independent replicas (SGLang's data-parallel controller
  runs one TP group per replica): ``dp`` copies of the TP layout on consecutive ranks (``Layout.instances``).
  Attention DP (``enable_dp_attention``) is refused.

Not covered by the preset (refused with one line): DeepSeek-V3 / MLA (SGLang fuses ``q_a_proj`` and
``kv_a_proj_with_mqa`` as ``fused_qkv_a_proj_with_mqa`` and derives ``w_kc``/``w_vc`` after loading; record
the engine's loader instead), quantized checkpoints (``quantization_config``; for ModelOpt NVFP4 / MXFP8 the
refusal says what SGLang 0.5.23's own classes did with them on CPU, docs/quant_formats.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..layout import Layout, gc_paused
from .hf import model_spec
from .vllm import VOCAB_PADDING, fused_layout, installed_version, modelopt_config, version_tuple

NEWEST_KNOWN = "0.5.23"  # the newest SGLang whose format the SGLang tier (tests/sglang) checked
CHECKED_SINCE = (0, 5)  # the releases whose FusedMoE names are mlp.experts.w13_weight / w2_weight (read, checked: 0.5.23)


def installed_sglang_version() -> str | None:
    """The version of the SGLang installed here (from its metadata; SGLang is not imported), or None."""
    return installed_version("sglang")


def resolve_sglang_version(sglang_version: str | None = None) -> str:
    """``sglang_version`` if given, else the installed SGLang's, else :data:`NEWEST_KNOWN`."""
    v = sglang_version or installed_sglang_version() or NEWEST_KNOWN
    version_tuple(v, "sglang_version")
    return v


def fused_moe_prefix(sglang_version: str | None = None) -> str:
    """Where SGLang's FusedMoE ``w13_weight`` / ``w2_weight`` live under ``model.layers.{i}.mlp``. Releases
    before 0.5 were not checked: they raise rather than guess."""
    v = resolve_sglang_version(sglang_version)
    if version_tuple(v) < CHECKED_SINCE:
        raise NotImplementedError(f"sglang_layout: SGLang {v}'s parameter names were not checked (0.5 and later "
                                  f"are); record the engine's loader instead (layout_from_sglang)")
    return "experts"


def _quant_refusal(s) -> str:
    """Why a quantized checkpoint has no SGLang preset (measured with SGLang 0.5.23's model classes on CPU)."""
    qc = s.raw["quantization_config"]
    mo = modelopt_config(s)
    if mo is not None and mo.format == "nvfp4":
        return ("ModelOpt NVFP4 checkpoints are not described: SGLang 0.5.23's ModelOptFp4Config does not load "
                "them as vLLM does (a tiny Llama whose embed_tokens / lm_head are BF16 fails in "
                "VocabParallelEmbedding.weight_loader, the embedding built packed), and its NVFP4 FusedMoE refuses "
                "to build without a Blackwell GPU (or marlin on SM80+), so the layout could not be checked; record "
                "the engine's loader instead (integrations.sglang.layout_from_sglang)")
    if mo is not None and mo.format == "mxfp8":
        return ("ModelOpt MXFP8 checkpoints are not described: SGLang 0.5.23 reads them through its own 'mxfp8' "
                "Fp8Config (scales named weight_scale_inv, not vLLM's weight_scale; exclude_modules wildcards not "
                "applied as vLLM applies them), a format this preset does not produce; record the engine's loader "
                "instead (integrations.sglang.layout_from_sglang)")
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    return f"quantized checkpoints (quantization_config quant_method={method!r}) are not supported"


@gc_paused()
def sglang_layout(
    config,
    tp: int = 1,
    dp: int = 1,
    ep: int = 1,
    ranks: Sequence[int] | int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    vocab_padding: int = VOCAB_PADDING,
    enable_dp_attention: bool = False,
    sglang_version: str | None = None,
) -> Layout:
    """The layout of an SGLang deployment serving the model with ``--tp-size tp``, ``--dp-size dp`` (replicas,
    see the module docstring) and ``--ep-size ep`` (1 or ``tp``).

    ``ranks``: the ``tp*dp`` global ranks, replica-major (default ``0..``; an int is an offset; consecutive
    when ``dp > 1``).
    ``sglang_version``: the SGLang release whose names to use (default: the installed SGLang's, else
    :data:`NEWEST_KNOWN`); a trainer without SGLang installed should pass the engine's. A layout that differs
    from the engine's loader fails closed: the plug-in compares it with the recorded one and names the tensor.
    """
    s = model_spec(config)
    if s.family not in ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe"):
        raise NotImplementedError(f"sglang_layout: model_type {s.family!r} is not supported (record the engine's "
                                  f"loader instead: integrations.sglang.layout_from_sglang)")
    if (s.raw or {}).get("quantization_config") is not None:
        raise NotImplementedError(f"sglang_layout: {_quant_refusal(s)}")
    if enable_dp_attention:
        raise NotImplementedError("sglang_layout: attention data parallelism (enable_dp_attention) is not supported")
    for name, v in (("tp", tp), ("dp", dp), ("ep", ep)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"sglang_layout: {name}={v!r} must be an int >= 1")
    if tp % ep:
        raise ValueError(f"sglang_layout: ep={ep} must divide tp={tp} (SGLang: moe_tp_size = tp / ep)")
    has_moe = any(s.moe_layers)
    if has_moe and ep not in (1, tp):
        raise NotImplementedError(f"sglang_layout: ep={ep} with tp={tp} (experts split over ep and each over tp/ep) "
                                  f"is not described by the preset; record the engine's loader (layout_from_sglang)")
    if has_moe and ep > 1 and s.experts % ep:
        raise ValueError(f"sglang_layout: ep={ep} does not divide num_experts={s.experts} (SGLang requires it)")
    prefix = fused_moe_prefix(sglang_version) if has_moe else ""
    if isinstance(ranks, int) or ranks is None:
        first = ranks or 0
        one = range(first, first + tp)
    else:
        ranks = tuple(ranks)
        if len(ranks) != tp * dp:
            raise ValueError(f"sglang_layout(tp={tp}, dp={dp}) needs {tp * dp} ranks, got {len(ranks)}")
        if dp > 1 and list(ranks) != list(range(ranks[0], ranks[0] + tp * dp)):
            raise ValueError(f"sglang_layout: with dp={dp}, ranks must be consecutive (replica i on ranks "
                             f"{ranks[0]} + i*tp ..), got {list(ranks)}")
        one = ranks[:tp]
    layout = fused_layout(s, tp=tp, dp=1, enable_expert_parallel=has_moe and ep > 1, ranks=one, dtype=dtype,
                          vocab_padding=vocab_padding, sequence_parallel_moe=False, moe_prefix=prefix,
                          who="sglang_layout")
    return layout.instances(dp)
