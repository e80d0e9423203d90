"""Megatron-Core training layout: ``GPTModel`` built with the Transformer-Engine (default) or local layer spec.

Local tensor names are exactly what ``model.named_parameters()`` gives on each rank (no ``module.`` prefix of
a DDP/Float16Module wrapper: strip it, or pass ``model.module``). Formats, from Megatron-Core
(``core_r0.13``-era ``main``; files read: ``megatron/core/models/gpt/gpt_layer_specs.py``,
``gpt_model.py``, ``transformer/attention.py``, ``transformer/mlp.py``, ``transformer/moe/experts.py``,
``tensor_parallel/layers.py``, ``parallel_state.py``, ``training/tokenizer/tokenizer.py``):

* ``decoder.layers.{j}.self_attention.linear_qkv.weight`` ``[(nh + 2*ng)*hd / tp, H]``: rank ``t`` holds rows
  ``[t*R, (t+1)*R)`` of the interleaved tensor whose rows are, per KV group ``g``, ``[q_g (nh/ng heads); k_g;
  v_g]`` (``get_query_key_value_tensors``): whole groups when ``tp`` divides ``ng``; when ``tp > ng``
  (allowed for ``tp`` a multiple of ``ng``) a plain row chunk of one group, e.g. ``nh=4, ng=2, tp=4``: ranks
  0/2 hold the q heads of groups 0/1, ranks 1/3 their k and v (Megatron all-gathers them in the forward).
  ``.bias`` (Qwen2 ``add_qkv_bias``) likewise; ``.layer_norm_weight`` is the fused input RMSNorm.
* ``self_attention.q_layernorm.weight`` / ``k_layernorm.weight`` ``[hd]`` (Qwen3 ``qk_layernorm``).
* ``self_attention.linear_proj.weight`` ``[H, nh*hd / tp]`` (row parallel).
* dense: ``mlp.linear_fc1.weight`` ``[2*I / tp, H]`` = ``[gate_tp; up_tp]`` (each TP-split),
  ``mlp.linear_fc1.layer_norm_weight`` (the fused post-attention RMSNorm), ``mlp.linear_fc2.weight``
  ``[H, I / tp]``.
* MoE layer: ``pre_mlp_layernorm.weight`` (not fused), ``mlp.router.weight`` ``[E, H]``,
  TEGroupedMLP ``mlp.experts.linear_fc1.weight{k}`` ``[2*I_moe / etp, H]`` / ``linear_fc2.weight{k}``
  ``[H, I_moe / etp]`` for local expert ``k`` (``grouped_gemm=False``: SequentialMLP
  ``mlp.experts.local_experts.{k}.linear_fc1.weight``).
* ``embedding.word_embeddings.weight`` (first stage) and ``output_layer.weight`` (last stage)
  ``[V_pad / tp, H]``. ``V_pad``: Megatron-LM pads the vocab to a multiple of
  ``make_vocab_size_divisible_by * tp`` (default 128: our ``vocab_divisible_by=128``); Megatron-Bridge,
  building a model from a HF checkpoint, does not pad (``GPTModelProvider.should_pad_vocab=False``, its
  default; ``True`` pads like Megatron-LM): ``vocab_divisible_by=None``. The padding rows are in the local
  tensors but in no fragment, so they are never transferred. Tied embeddings: no ``output_layer.weight`` when
  ``pp == 1``; with ``pp > 1`` the last stage holds its own copy (kept in sync by Megatron), a second source
  of ``model.embed_tokens.weight``.
* ``decoder.final_layernorm.weight`` on the last stage. Layer indices are local to the stage.

Local spec (``spec="local"``, ``get_gpt_layer_local_spec``: Megatron-Core modules only, no Transformer
Engine): the norms are separate modules, ``decoder.layers.{j}.input_layernorm.weight`` and
``pre_mlp_layernorm.weight`` (dense layers too) instead of ``linear_qkv.layer_norm_weight`` /
``linear_fc1.layer_norm_weight``; experts are SequentialMLP ``mlp.experts.local_experts.{k}.*`` (the local
spec's grouped GEMM is the legacy GroupedMLP, not placed); every other name, shape and box is the TE spec's.

Checked against real megatron-core 0.16.1 GPTModels (local spec, CPU, gloo worlds of 4 and 8;
``tests/engines/test_megatron_real.py``): ``named_parameters()`` names/shapes/dtypes and every box of
``model.sharded_state_dict()`` (Megatron's own global format) for Llama GQA, tied embeddings with PP > 1,
Qwen2 qkv bias, Qwen3 qk-norm, Qwen3-MoE with EP and expert-TP 1 / = tp, mixed dense/MoE layers, PP > 1,
TP > KV heads (also a single KV head), and Megatron-LM / Megatron-Bridge vocab padding. The TE spec's names
are read from the source, not run (Transformer Engine needs CUDA).

DeepSeek-V3 (MLA + DeepSeekMoE; ``transformer/multi_latent_attention.py`` MLASelfAttention,
``gpt_layer_specs.py`` ``get_gpt_layer_with_transformer_engine_submodules(multi_latent_attention=True,
qk_layernorm=True)``, ``moe/router.py``, ``moe/shared_experts.py``; names checked against Megatron-Bridge
``models/deepseek/common.py``):

* ``decoder.layers.{j}.input_layernorm.weight`` (a separate TENorm: MLA has no ``linear_qkv`` to fuse it into).
* ``self_attention.linear_q_down_proj.weight`` ``[q_lora_rank, H]`` and ``linear_kv_down_proj.weight``
  ``[kv_lora_rank + rope, H]``: TELinear ``parallel_mode="duplicated"``, whole on every TP rank.
* ``self_attention.linear_q_up_proj.weight`` ``[nh/tp * (nope+rope), q_lora_rank]`` and
  ``linear_kv_up_proj.weight`` ``[nh/tp * (nope+v), kv_lora_rank]``: column parallel, whole heads per rank
  (the HF rows are already head-major); their ``.layer_norm_weight`` are the fused ``q_a_layernorm`` /
  ``kv_a_layernorm`` (TELayerNormColumnParallelLinear). ``q_lora_rank=None``: ``linear_q_proj.weight``
  ``[nh/tp * (nope+rope), H]`` (column parallel) instead.
* ``self_attention.linear_proj.weight`` ``[H, nh*v / tp]`` (row parallel).
* dense layers (the first ``first_k_dense_replace``): as above (``mlp.linear_fc1.layer_norm_weight`` ...).
* MoE layers: ``pre_mlp_layernorm.weight``, ``mlp.router.weight`` ``[E, H]``, ``mlp.router.expert_bias`` ``[E]``
  (a persistent **buffer** kept in fp32, not a parameter: pass ``{**dict(model.named_parameters()),
  **dict(model.named_buffers())}``, or drop it from the layout with ``Layout.restrict``), the routed experts as
  above, and ``mlp.shared_experts.linear_fc1.weight`` ``[2*Is / tp, H]`` = ``[gate_tp; up_tp]`` /
  ``linear_fc2.weight`` ``[H, Is / tp]`` (SharedExpertMLP: an MLP on the dense TP group, not expert TP).
* Not placed: the MTP layer (``mtp.layers.0.*``), FP8 weights and their scales, the fused
  ``linear_qkv_down_proj`` of ``mla_down_proj_fusion``, and MLA under the local spec (``spec="local"``
  raises: megatron-core 0.16.1 cannot build it, its ``DotProductAttention`` takes no ``k_channels``; the spec
  would make the down projections TP-split ColumnParallelLinears and the latent norms separate
  ``q_layernorm`` / ``kv_layernorm`` modules).

Rank order: Megatron's default ``order="tp-cp-ep-dp-pp"`` with ``cp = 1``. Position ``p`` of ``ranks``
(Megatron's global rank ``p``) has ``tp_rank = p % tp``, ``dp_rank = (p // tp) % dp``,
``pp_rank = p // (tp*dp)``; the expert grid splits each stage's ``tp*dp`` ranks as
``etp_rank = q % etp``, ``ep_rank = (q // etp) % ep``, expert-DP the rest, with ``q = p % (tp*dp)``
(``expert_tensor_parallel_size`` defaults to ``tp``, as in Megatron).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..layout import Layout
from .hf import (
    LayoutBuilder,
    ModelSpec,
    check_ranks,
    gc_paused,
    layer_prefix,
    model_spec,
)


def padded_vocab_size(vocab: int, tp: int, divisible_by: int | None = 128) -> int:
    """Rows of Megatron's embedding / output layer for a ``vocab``-token model over ``tp`` ranks.

    ``divisible_by`` an int: Megatron-LM's ``_vocab_size_with_padding`` (``--make-vocab-size-divisible-by``,
    default 128; Megatron-Bridge's ``calculate_padded_vocab_size`` with ``should_pad_vocab=True``): round up
    to a multiple of ``divisible_by * tp`` (``1``: just to a multiple of ``tp``). ``None``: no padding, the
    vocab as it is (Megatron-Bridge's default ``should_pad_vocab=False`` for models converted from HF);
    ``VocabParallelEmbedding`` then needs ``tp`` to divide it.
    """
    if divisible_by is None:
        if vocab % tp:
            raise ValueError(
                f"vocab_size={vocab} is not divisible by tp={tp}: without padding (vocab_divisible_by=None, "
                f"Megatron-Bridge's should_pad_vocab=False) Megatron's VocabParallelEmbedding cannot split it"
            )
        return vocab
    if not isinstance(divisible_by, int) or divisible_by < 1:
        raise ValueError(f"vocab_divisible_by={divisible_by!r} must be an int >= 1 or None")
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def stage_layers(num_layers: int, pp: int, layers_per_stage: Sequence[int] | None = None) -> list[range]:
    """Global layer indices of each pipeline stage (contiguous; even split unless ``layers_per_stage``)."""
    if layers_per_stage is None:
        if num_layers % pp:
            raise ValueError(
                f"{num_layers} layers do not split evenly over pp={pp}; pass layers_per_stage (e.g. Megatron's "
                f"decoder_first/last_pipeline_num_layers)"
            )
        layers_per_stage = [num_layers // pp] * pp
    counts = [int(n) for n in layers_per_stage]
    if len(counts) != pp or sum(counts) != num_layers or min(counts) < 0:
        raise ValueError(f"layers_per_stage={counts} must have pp={pp} entries >= 0 summing to {num_layers}")
    out, start = [], 0
    for n in counts:
        out.append(range(start, start + n))
        start += n
    return out


@gc_paused()  # ~10^5 small objects per 128-rank layout, no cycles
def megatron_layout(
    config,
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    ranks: Sequence[int] | int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    vocab_divisible_by: int | None = 128,
    grouped_gemm: bool | None = None,
    layers_per_stage: Sequence[int] | None = None,
    spec: str = "te",
) -> Layout:
    """The layout of a Megatron-Core GPTModel trained with TP x PP x DP (x EP for MoE).

    ``ranks``: the ``tp*pp*dp`` global ranks in Megatron rank order (default ``0..``; an int is an offset,
    for training on ranks ``offset..offset+world-1``). ``ep``/``etp``: expert model / tensor parallel
    sizes (``etp`` defaults to ``tp``; ``etp*ep`` must divide ``tp*dp``). ``dtype``: the parameters' dtype.
    ``spec``: the layer spec the model was built with, ``"te"`` (``get_gpt_layer_with_transformer_engine_spec``,
    norms fused into the linears) or ``"local"`` (``get_gpt_layer_local_spec``, separate norm modules).
    ``vocab_divisible_by``: Megatron-LM's ``make_vocab_size_divisible_by`` (default 128, its default); pass
    ``None`` for a model built by Megatron-Bridge from a HF checkpoint (no padding, ``should_pad_vocab=False``)
    and see :func:`padded_vocab_size`. ``grouped_gemm``: TE spec only, ``TEGroupedMLP`` (default) or
    ``SequentialMLP`` expert names; the local spec always has ``SequentialMLP`` names.
    """
    s = model_spec(config)
    local_spec, grouped_gemm, etp = _check_spec(s, spec, grouped_gemm, tp, etp)
    has_moe = _check_grid(s, tp, pp, dp, ep, etp)
    world = tp * pp * dp
    ranks = check_ranks(ranks, world, f"megatron_layout(tp={tp}, pp={pp}, dp={dp})")
    stages = stage_layers(s.layers, pp, layers_per_stage)
    vloc = padded_vocab_size(s.vocab, tp, vocab_divisible_by) // tp

    b = LayoutBuilder.for_model(s, dtype)
    rank_of = np.asarray(ranks, dtype=np.int64)
    pos = np.arange(world)
    stage_of = pos // (tp * dp)
    for pr in range(pp):
        in_stage = stage_of == pr
        ends = (pr == 0, pr == pp - 1)
        _stage_weights(
            b, s, rank_of[in_stage], pos[in_stage] % tp, tp, pp, ends, vloc, stages[pr], local_spec
        )
        if has_moe:
            q = pos[in_stage] % (tp * dp)
            _stage_experts(b, s, rank_of[in_stage], q, ep, etp, stages[pr], grouped_gemm)
    return b.build()


def _check_spec(s: ModelSpec, spec: str, grouped_gemm: bool | None, tp: int, etp: int | None):
    """The model family and layer spec megatron_layout places: ``(local_spec, grouped_gemm, etp)`` resolved."""
    if s.family not in ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3"):
        raise NotImplementedError(f"megatron_layout: model_type {s.family!r} is not supported")
    if s.o_bias:
        raise NotImplementedError(
            "megatron_layout: attention_bias on o_proj (add_bias_linear) is not supported"
        )
    if spec not in ("te", "local"):
        raise ValueError(f"megatron_layout: spec={spec!r} must be 'te' or 'local'")
    local_spec = spec == "local"
    if grouped_gemm is None:
        grouped_gemm = not local_spec
    if local_spec and grouped_gemm:
        raise NotImplementedError(
            "megatron_layout: spec='local' with grouped_gemm=True is the legacy GroupedMLP (experts.weight1/"
            "weight2, needs the grouped_gemm CUDA package): not supported; the local spec's default is SequentialMLP"
        )
    if local_spec and s.mla:
        raise NotImplementedError(
            "megatron_layout: MLA (deepseek_v3) with spec='local' is not supported: megatron-core 0.16.1 cannot "
            "build it (the local DotProductAttention takes no k_channels; MLA needs TEDotProductAttention)"
        )
    return local_spec, grouped_gemm, tp if etp is None else etp


def _check_grid(s: ModelSpec, tp: int, pp: int, dp: int, ep: int, etp: int) -> bool:
    """The parallel sizes split the model as Megatron splits it; returns whether the model has experts."""
    for name, v in (("tp", tp), ("pp", pp), ("dp", dp), ("ep", ep), ("etp", etp)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"megatron_layout: {name}={v!r} must be an int >= 1")
    if s.heads % tp:
        raise ValueError(f"megatron_layout: tp={tp} does not divide num_attention_heads={s.heads}")
    if not s.mla and s.kv_heads % tp and (tp % s.kv_heads or (s.heads + 2 * s.kv_heads) * s.head_dim % tp):
        raise ValueError(
            f"megatron_layout: tp={tp} and num_key_value_heads={s.kv_heads}: Megatron needs tp to divide the "
            f"query groups, or (tp > groups) tp to be a multiple of them and to divide the linear_qkv rows "
            f"{(s.heads + 2 * s.kv_heads) * s.head_dim}"
        )
    if s.shared_intermediate % tp:
        raise ValueError(
            f"megatron_layout: tp={tp} does not divide the shared experts' size {s.shared_intermediate}"
        )
    dense_layers = [i for i in range(s.layers) if not s.is_moe_layer(i)]
    if dense_layers and s.intermediate % tp:
        raise ValueError(f"megatron_layout: tp={tp} does not divide intermediate_size={s.intermediate}")
    has_moe = any(s.moe_layers)
    if has_moe:
        if (tp * dp) % (etp * ep):
            raise ValueError(f"megatron_layout: etp*ep={etp * ep} does not divide tp*dp={tp * dp}")
        if s.experts % ep:
            raise ValueError(f"megatron_layout: ep={ep} does not divide num_experts={s.experts}")
        if s.moe_intermediate % etp:
            raise ValueError(
                f"megatron_layout: etp={etp} does not divide moe_intermediate_size={s.moe_intermediate}"
            )
    elif ep != 1:
        raise ValueError(f"megatron_layout: ep={ep} for a model without experts")
    return has_moe


def _stage_weights(
    b: LayoutBuilder,
    s: ModelSpec,
    rank: np.ndarray,
    t: np.ndarray,
    tp: int,
    pp: int,
    ends: tuple[bool, bool],
    vloc: int,
    layers: range,
    local_spec: bool,
) -> None:
    """The non-expert weights of one pipeline stage: one call per tensor for all its ranks, ``t`` the TP
    position of each (the DP replicas hold the same; see LayoutBuilder). ``ends``: (first stage, last stage)."""
    H = s.hidden
    first, last = ends
    if first:
        loc = b.local(rank, "embedding.word_embeddings.weight", (vloc, H))
        b.rows("model.embed_tokens.weight", rank, loc, t * vloc, vloc)
    if last:
        b.full("model.norm.weight", rank, "decoder.final_layernorm.weight")
        if not s.tied or pp > 1:
            loc = b.local(rank, "output_layer.weight", (vloc, H))
            b.rows("model.embed_tokens.weight" if s.tied else "lm_head.weight", rank, loc, t * vloc, vloc)
    if not s.mla:  # the attention and dense MLPs of every layer of the stage at once (_layer_boxes)
        _gqa_layers(b, s, rank, t, tp, layers, local_spec)
    dense = [(j, i) for j, i in enumerate(layers) if not s.is_moe_layer(i)]
    if dense:
        lb = _layer_boxes(b, rank, [j for j, _i in dense], t)
        hf = [layer_prefix(i) for _j, i in dense]
        lb.full([f"{h}.post_attention_layernorm.weight" for h in hf],
                [f"{m}.pre_mlp_layernorm.weight" if local_spec else f"{m}.mlp.linear_fc1.layer_norm_weight"
                 for m in lb.mg])
        _tp_mlp_layers(lb, s.intermediate // tp, H, [f"{h}.mlp" for h in hf], [f"{m}.mlp" for m in lb.mg])
    for j, i in enumerate(layers):
        hf, mg = layer_prefix(i), f"decoder.layers.{j}"
        if s.mla:
            _mla_attention(b, s, rank, t, tp, hf, mg)
        if not s.is_moe_layer(i):
            continue
        b.full(f"{hf}.post_attention_layernorm.weight", rank, f"{mg}.pre_mlp_layernorm.weight")
        b.full(f"{hf}.mlp.gate.weight", rank, f"{mg}.mlp.router.weight")
        if s.expert_bias:
            b.full(f"{hf}.mlp.gate.e_score_correction_bias", rank, f"{mg}.mlp.router.expert_bias")
        if s.shared_intermediate:
            _tp_mlp(
                b,
                rank,
                t,
                s.shared_intermediate // tp,
                H,
                f"{hf}.mlp.shared_experts",
                f"{mg}.mlp.shared_experts",
            )


class _LayerBoxes:
    """Boxes of one family of tensors in several layers of a stage at once: the stage's ranks repeated per layer
    (``rank``, ``li`` the layer position of each entry, ``mg`` the Megatron prefix of each layer), so that one
    builder call places a family in every layer (the builder sorts what it collects: the layout is the one the
    per-layer calls make, ~8x fewer calls for an 8-layer stage)."""

    def __init__(self, b: LayoutBuilder, rank: np.ndarray, t: np.ndarray, js: Sequence[int]) -> None:
        n = len(rank)
        self.b, self.n = b, len(js)
        self.rank, self.t = np.tile(rank, self.n), np.tile(t, self.n)
        self.li = np.repeat(np.arange(self.n, dtype=np.int64), n)
        self.mg = [f"decoder.layers.{j}" for j in js]

    def ids(self, names: Sequence[str]) -> np.ndarray:
        """The tensor id of each entry (``names``: one logical tensor per layer, all of one shape)."""
        idx = self.b.tensors.index
        return np.fromiter((idx[x] for x in names), np.int64, len(names))[self.li]

    def local(self, names: Sequence[str], shape, dtype=None) -> tuple:
        return self.b.local(self.rank, (tuple(names), self.li), shape, dtype)

    def full(self, tensors: Sequence[str], locals_: Sequence[str]) -> None:
        """``LayoutBuilder.full`` of each layer's tensor as its whole local tensor."""
        i = self.b.tensors.index[tensors[0]]
        shape = self.b.tensors.shapes[i]
        loc = self.local(locals_, shape, self.b.tensors.dtypes[i])
        self.b.box(self.ids(tensors), self.rank, loc, (0,) * len(shape), shape)


def _layer_boxes(b: LayoutBuilder, rank: np.ndarray, js: Sequence[int], t: np.ndarray | int = 0) -> _LayerBoxes:
    return _LayerBoxes(b, np.asarray(rank, dtype=np.int64), np.broadcast_to(t, np.shape(rank)), js)


def _tp_mlp_layers(lb: _LayerBoxes, I_loc: int, H: int, hf: Sequence[str], mg: Sequence[str]) -> None:
    """:func:`_tp_mlp` in every layer of ``lb`` (``hf`` / ``mg``: each layer's MLP prefixes)."""
    b, start = lb.b, lb.t * I_loc
    loc = lb.local([f"{m}.linear_fc1.weight" for m in mg], (2 * I_loc, H))
    b.rows(lb.ids([f"{h}.gate_proj.weight" for h in hf]), lb.rank, loc, start, I_loc, at=0)
    b.rows(lb.ids([f"{h}.up_proj.weight" for h in hf]), lb.rank, loc, start, I_loc, at=I_loc)
    loc = lb.local([f"{m}.linear_fc2.weight" for m in mg], (H, I_loc))
    b.cols(lb.ids([f"{h}.down_proj.weight" for h in hf]), lb.rank, loc, start, I_loc)


def _stage_experts(
    b: LayoutBuilder,
    s: ModelSpec,
    stage_ranks: np.ndarray,
    q: np.ndarray,
    ep: int,
    etp: int,
    layers: range,
    grouped_gemm: bool,
) -> None:
    """The routed experts of one stage: its rank ``q`` (``q = p % (tp*dp)``) holds experts ``er*E_loc..`` of
    expert-TP part ``et``; one call per layer for all the stage's ranks and local expert indices ``k`` at once."""
    H = s.hidden
    E_loc, Im_loc = s.experts // ep, s.moe_intermediate // etp
    rank = np.repeat(stage_ranks, E_loc)
    k = np.tile(np.arange(E_loc), len(q))
    et, e = np.repeat(q % etp, E_loc), np.repeat((q // etp) % ep, E_loc) * E_loc + k
    for j, i in enumerate(layers):
        if not s.is_moe_layer(i):
            continue
        mg = f"decoder.layers.{j}"
        ids = b.expert_ids(s)[i]  # [expert, (gate, up, down)] tensor ids
        if grouped_gemm:
            fc1 = tuple(f"{mg}.mlp.experts.linear_fc1.weight{x}" for x in range(E_loc))
            fc2 = tuple(f"{mg}.mlp.experts.linear_fc2.weight{x}" for x in range(E_loc))
        else:
            fc1 = tuple(f"{mg}.mlp.experts.local_experts.{x}.linear_fc1.weight" for x in range(E_loc))
            fc2 = tuple(f"{mg}.mlp.experts.local_experts.{x}.linear_fc2.weight" for x in range(E_loc))
        b.local(rank, (fc1, k), (2 * Im_loc, H))
        b.rows(ids[e, 0], rank, (fc1, k), et * Im_loc, Im_loc, at=0)
        b.rows(ids[e, 1], rank, (fc1, k), et * Im_loc, Im_loc, at=Im_loc)
        b.local(rank, (fc2, k), (H, Im_loc))
        b.cols(ids[e, 2], rank, (fc2, k), et * Im_loc, Im_loc)


def _tp_mlp(b: LayoutBuilder, rank: int, t: int, I_loc: int, H: int, hf: str, mg: str) -> None:
    """A TP-split gated MLP: ``linear_fc1 = [gate_tp; up_tp]``, ``linear_fc2`` row parallel."""
    loc = b.local(rank, f"{mg}.linear_fc1.weight", (2 * I_loc, H))
    b.rows(f"{hf}.gate_proj.weight", rank, loc, t * I_loc, I_loc, at=0)
    b.rows(f"{hf}.up_proj.weight", rank, loc, t * I_loc, I_loc, at=I_loc)
    loc = b.local(rank, f"{mg}.linear_fc2.weight", (H, I_loc))
    b.cols(f"{hf}.down_proj.weight", rank, loc, t * I_loc, I_loc)


def _mla_attention(b: LayoutBuilder, s: ModelSpec, rank: int, t: int, tp: int, hf: str, mg: str) -> None:
    """MLASelfAttention (TE spec): duplicated down projections, column-parallel up projections with the
    latent RMSNorms fused in, row-parallel ``linear_proj``; the input RMSNorm is a separate module."""
    H, a, att = s.hidden, f"{hf}.self_attn", f"{mg}.self_attention"
    nh_loc = s.heads // tp
    b.full(f"{hf}.input_layernorm.weight", rank, f"{mg}.input_layernorm.weight")
    q_rows = nh_loc * s.qk_head_dim
    if s.q_lora_rank is None:
        loc = b.local(rank, f"{att}.linear_q_proj.weight", (q_rows, H))
        b.rows(f"{a}.q_proj.weight", rank, loc, t * q_rows, q_rows)
    else:
        b.full(f"{a}.q_a_proj.weight", rank, f"{att}.linear_q_down_proj.weight")
        b.full(f"{a}.q_a_layernorm.weight", rank, f"{att}.linear_q_up_proj.layer_norm_weight")
        loc = b.local(rank, f"{att}.linear_q_up_proj.weight", (q_rows, s.q_lora_rank))
        b.rows(f"{a}.q_b_proj.weight", rank, loc, t * q_rows, q_rows)
    b.full(f"{a}.kv_a_proj_with_mqa.weight", rank, f"{att}.linear_kv_down_proj.weight")
    b.full(f"{a}.kv_a_layernorm.weight", rank, f"{att}.linear_kv_up_proj.layer_norm_weight")
    kv_rows = nh_loc * (s.qk_nope_head_dim + s.v_head_dim)
    loc = b.local(rank, f"{att}.linear_kv_up_proj.weight", (kv_rows, s.kv_lora_rank))
    b.rows(f"{a}.kv_b_proj.weight", rank, loc, t * kv_rows, kv_rows)
    o_cols = nh_loc * s.v_head_dim
    loc = b.local(rank, f"{att}.linear_proj.weight", (H, o_cols))
    b.cols(f"{a}.o_proj.weight", rank, loc, t * o_cols, o_cols)


def _gqa_layers(
    b: LayoutBuilder, s: ModelSpec, rank: np.ndarray, t: np.ndarray, tp: int, layers: range, local_spec: bool
) -> None:
    """SelfAttention in every layer of a stage: ``linear_qkv`` rows ``[t*R, (t+1)*R)`` of the interleaved tensor
    (per KV group ``g`` ``[q_g; k_g; v_g]``), ``R = (nh + 2*ng)*hd / tp``: whole groups when tp divides ng, a part
    of one group when tp > ng (its rows depend on the KV groups of ``t``: one set of calls per TP position, each for
    every layer at once). TE spec: the input RMSNorm fused into ``linear_qkv``; local spec: ``input_layernorm``."""
    if not layers:
        return
    H, hd = s.hidden, s.head_dim
    js = range(len(layers))
    hf = [f"{layer_prefix(i)}.self_attn" for i in layers]
    lb = _layer_boxes(b, rank, js, t)
    att = [f"{m}.self_attention" for m in lb.mg]
    lb.full([f"{layer_prefix(i)}.input_layernorm.weight" for i in layers],
            [f"{m}.input_layernorm.weight" for m in lb.mg] if local_spec
            else [f"{a}.linear_qkv.layer_norm_weight" for a in att])
    hpg = s.heads // s.kv_heads  # query heads per group
    group_rows = (hpg + 2) * hd
    rows = s.kv_heads * group_rows // tp
    for tv in range(tp):
        lt = _layer_boxes(b, rank[t == tv], js)
        lo, hi = tv * rows, (tv + 1) * rows  # this position's rows of the interleaved tensor
        for kind in ("weight", "bias") if s.qkv_bias else ("weight",):
            loc = lt.local([f"{a}.linear_qkv.{kind}" for a in att], (rows, H) if kind == "weight" else (rows,))
            for g in range(lo // group_rows, -(-hi // group_rows)):
                base = g * group_rows
                # (HF tensor, its first row in group g, where the piece starts in the group, its rows)
                for proj, src, at, n in (
                    ("q_proj", g * hpg * hd, 0, hpg * hd),
                    ("k_proj", g * hd, hpg * hd, hd),
                    ("v_proj", g * hd, (hpg + 1) * hd, hd),
                ):
                    a, e = max(lo, base + at), min(hi, base + at + n)
                    if a < e:
                        b.rows(lt.ids([f"{h}.{proj}.{kind}" for h in hf]), lt.rank, loc, src + a - base - at, e - a,
                               at=a - lo)
    if s.qk_norm:
        lb.full([f"{h}.q_norm.weight" for h in hf], [f"{a}.q_layernorm.weight" for a in att])
        lb.full([f"{h}.k_norm.weight" for h in hf], [f"{a}.k_layernorm.weight" for a in att])
    cols = s.heads * hd // tp
    loc = lb.local([f"{a}.linear_proj.weight" for a in att], (H, cols))
    b.cols(lb.ids([f"{h}.o_proj.weight" for h in hf]), lb.rank, loc, lb.t * cols, cols)
