"""vLLM inference layout: the parameters of vLLM's model runner on each worker (tensor x data parallel).

Local tensor names are what ``model.named_parameters()`` gives in a vLLM worker (V1 engine), formats from
vLLM ``main`` as of v0.10/0.11 (files read: ``model_executor/models/llama.py``, ``qwen2.py``, ``qwen3.py``,
``qwen3_moe.py``, ``layers/linear.py`` (QKVParallelLinear, MergedColumnParallelLinear,
RowParallelLinear), ``layers/vocab_parallel_embedding.py``, ``layers/fused_moe/layer.py`` and
``fused_moe/config.py`` (FusedMoEParallelConfig)):

* ``model.layers.{i}.self_attn.qkv_proj.weight`` ``[(nh/tp + 2*kv_loc)*hd, H]`` = ``[q_tp; k_tp; v_tp]``.
  With ``tp > num_kv_heads`` each rank holds ``kv_loc = 1`` head, number ``tp_rank * num_kv_heads // tp``
  (the KV heads are replicated ``tp / num_kv_heads`` times). ``.bias`` (Qwen2) likewise.
* ``self_attn.o_proj.weight`` ``[H, nh*hd/tp]`` (row parallel); ``self_attn.q_norm``/``k_norm`` (Qwen3)
  and all RMSNorms replicated.
* ``mlp.gate_up_proj.weight`` ``[2*I/tp, H]`` = ``[gate_tp; up_tp]``; ``mlp.down_proj.weight`` ``[H, I/tp]``.
* MoE (FusedMoE): ``mlp.gate.weight`` ``[E, H]`` replicated; ``mlp.experts.w13_weight``
  ``[E_loc, 2*I_loc, H]`` = per expert ``[gate; up]`` and ``mlp.experts.w2_weight`` ``[E_loc, H, I_loc]``.
  The experts are split over all ``tp*dp`` workers (``flatten_tp_across_dp``, worker ``dp_rank*tp +
  tp_rank``): over the intermediate dim without expert parallelism, by whole experts with
  ``enable_expert_parallel`` (``E_loc = E // n`` plus one for the first ``E % n`` workers, "linear"
  placement).
* ``model.embed_tokens.weight`` and ``lm_head.weight`` ``[V_pad/tp, H]`` with ``V_pad`` = vocab rounded up
  to a multiple of 64 (``pad_vocab_size``), split evenly over TP; padding rows are never transferred. With
  tied embeddings vLLM has no separate ``lm_head.weight``.

Ranks: position ``p`` of ``ranks`` is ``dp_rank = p // tp``, ``tp_rank = p % tp`` (DP-major blocks of TP);
each DP replica holds a full copy of the non-expert weights.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..layout import Layout
from .hf import LayoutBuilder, _check_ranks, expert_names, layer_prefix, logical_tensors, model_spec

VOCAB_PADDING = 64  # vllm.model_executor.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE


def pad_vocab_size(vocab: int, pad_to: int = VOCAB_PADDING) -> int:
    return -(-vocab // pad_to) * pad_to


def expert_range(num_experts: int, ep_size: int, ep_rank: int) -> tuple[int, int]:
    """``(first, count)`` of the experts of ``ep_rank`` (vLLM ``determine_expert_map``, linear placement)."""
    base, rem = divmod(num_experts, ep_size)
    return ep_rank * base + min(ep_rank, rem), base + (1 if ep_rank < rem else 0)


def vllm_layout(
    config,
    tp: int = 1,
    dp: int = 1,
    enable_expert_parallel: bool = False,
    ranks: Sequence[int] | int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    vocab_padding: int = VOCAB_PADDING,
) -> Layout:
    """The layout of vLLM workers serving the model with ``tensor_parallel_size=tp`` and
    ``data_parallel_size=dp`` (``enable_expert_parallel``: experts split whole over the ``tp*dp`` workers).

    ``ranks``: the ``tp*dp`` global ranks, DP-major (default ``0..``; an int is an offset, e.g. ``4`` for
    inference on ranks 4.. next to training on 0..3).
    """
    s = model_spec(config)
    if s.family not in ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe"):
        raise NotImplementedError(f"vllm_layout: model_type {s.family!r} is not supported")
    if s.o_bias:
        raise NotImplementedError("vllm_layout: attention_bias on o_proj is not supported")
    for name, v in (("tp", tp), ("dp", dp)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"vllm_layout: {name}={v!r} must be an int >= 1")
    if s.heads % tp:
        raise ValueError(f"vllm_layout: tp={tp} does not divide num_attention_heads={s.heads}")
    if tp >= s.kv_heads and tp % s.kv_heads:
        raise ValueError(f"vllm_layout: tp={tp} is not a multiple of num_key_value_heads={s.kv_heads}")
    if tp < s.kv_heads and s.kv_heads % tp:
        raise ValueError(f"vllm_layout: tp={tp} does not divide num_key_value_heads={s.kv_heads}")
    if any(not s.is_moe_layer(i) for i in range(s.layers)) and s.intermediate % tp:
        raise ValueError(f"vllm_layout: tp={tp} does not divide intermediate_size={s.intermediate}")
    vpad = pad_vocab_size(s.vocab, vocab_padding)
    if vpad % tp:
        raise ValueError(f"vllm_layout: tp={tp} does not divide the padded vocab {vpad}")
    has_moe = any(s.moe_layers)
    workers = tp * dp
    use_ep = has_moe and enable_expert_parallel and workers > 1
    if has_moe:
        if use_ep and s.experts < workers:
            raise ValueError(f"vllm_layout: {s.experts} experts cannot be split over {workers} EP ranks")
        if not use_ep and s.moe_intermediate % workers:
            raise ValueError(
                f"vllm_layout: tp*dp={workers} does not divide moe_intermediate_size={s.moe_intermediate}"
            )
    ranks = _check_ranks(ranks, workers, f"vllm_layout(tp={tp}, dp={dp})")

    H, hd = s.hidden, s.head_dim
    vloc = vpad // tp
    q_loc = s.heads // tp * hd
    kv_heads_loc = max(1, s.kv_heads // tp)
    kv_loc = kv_heads_loc * hd
    I_loc = s.intermediate // tp

    b = LayoutBuilder(logical_tensors(s), dtype)
    for p, rank in enumerate(ranks):
        t = p % tp
        kv_first = (t * s.kv_heads // tp) if tp >= s.kv_heads else t * kv_heads_loc
        if use_ep:
            e0, E_loc = expert_range(s.experts, workers, p)
            Im_loc, im0 = s.moe_intermediate, 0
        else:
            e0, E_loc = 0, s.experts
            Im_loc = s.moe_intermediate // workers if has_moe else 0
            im0 = p * Im_loc
        loc = b.local(rank, "model.embed_tokens.weight", (vloc, H))
        b.rows("model.embed_tokens.weight", rank, loc, t * vloc, vloc)
        if not s.tied:
            loc = b.local(rank, "lm_head.weight", (vloc, H))
            b.rows("lm_head.weight", rank, loc, t * vloc, vloc)
        b.full("model.norm.weight", rank, "model.norm.weight")
        for i in range(s.layers):
            hf = layer_prefix(i)
            att = f"{hf}.self_attn"
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
            b.full(f"{hf}.input_layernorm.weight", rank, f"{hf}.input_layernorm.weight")
            b.full(f"{hf}.post_attention_layernorm.weight", rank, f"{hf}.post_attention_layernorm.weight")
            if not s.is_moe_layer(i):
                loc = b.local(rank, f"{hf}.mlp.gate_up_proj.weight", (2 * I_loc, H))
                b.rows(f"{hf}.mlp.gate_proj.weight", rank, loc, t * I_loc, I_loc, at=0)
                b.rows(f"{hf}.mlp.up_proj.weight", rank, loc, t * I_loc, I_loc, at=I_loc)
                loc = b.local(rank, f"{hf}.mlp.down_proj.weight", (H, I_loc))
                b.cols(f"{hf}.mlp.down_proj.weight", rank, loc, t * I_loc, I_loc)
                continue
            b.full(f"{hf}.mlp.gate.weight", rank, f"{hf}.mlp.gate.weight")
            w13 = b.local(rank, f"{hf}.mlp.experts.w13_weight", (E_loc, 2 * Im_loc, H))
            w2 = b.local(rank, f"{hf}.mlp.experts.w2_weight", (E_loc, H, Im_loc))
            for k in range(E_loc):
                gate, up, down = expert_names(i, e0 + k)
                b.rows(gate, rank, w13, im0, Im_loc, at=0, lead=(k,))
                b.rows(up, rank, w13, im0, Im_loc, at=Im_loc, lead=(k,))
                b.cols(down, rank, w2, im0, Im_loc, lead=(k,))
    return b.build()
