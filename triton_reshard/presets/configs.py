"""Model configs as Hugging Face ``config.json``-style dicts.

The public models carry the figures of their published ``config.json`` (only the keys the layout builders
read). ``tiny_*``/``small_*`` are test-sized models of each family, and ``llama_demo`` is a Llama-style model
of about 0.8 GB in fp32 (200M parameters) for demos and benchmarks on one machine.

``get_config(name)`` returns a fresh copy; any of these dicts (or a ``transformers`` config object) can be
passed to ``logical_tensors``, ``hf_layout``, ``megatron_layout`` and ``vllm_layout``.
"""

from __future__ import annotations

import copy

_LLAMA_3_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "attention_bias": False,
}

_QWEN3_8B = {
    "model_type": "qwen3",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "attention_bias": False,
}

_QWEN3_30B_A3B = {
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_hidden_layers": 48,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "attention_bias": False,
}

_QWEN3_235B_A22B = {
    "model_type": "qwen3_moe",
    "hidden_size": 4096,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_hidden_layers": 94,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "attention_bias": False,
}

# MLA attention + DeepSeekMoE (deepseek-ai/DeepSeek-V3 config.json). Layouts are bf16/fp32: the published
# checkpoint is block-fp8 with ``weight_scale_inv`` tensors, and its MTP layer (num_nextn_predict_layers=1,
# ``model.layers.61.*``) is not placed by any preset.
_DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "n_group": 8,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "num_nextn_predict_layers": 1,
    "num_hidden_layers": 61,
    "vocab_size": 129280,
    "tie_word_embeddings": False,
    "attention_bias": False,
}

_TINY_DEEPSEEK_V3 = {  # every DeepSeek-V3 piece at test size: MLA with q_lora, 1 dense + 3 MoE layers
    "model_type": "deepseek_v3",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 8,
    "intermediate_size": 96,
    "moe_intermediate_size": 16,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "n_group": 2,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "num_hidden_layers": 4,
    "vocab_size": 300,
    "tie_word_embeddings": False,
    "attention_bias": False,
}

_TINY = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "vocab_size": 300,  # not a multiple of 64 or 128: the vocab padding matters
    "tie_word_embeddings": False,
    "attention_bias": False,
}

CONFIGS: dict[str, dict] = {
    "llama-3-8b": _LLAMA_3_8B,
    "qwen3-8b": _QWEN3_8B,
    "qwen3-30b-a3b": _QWEN3_30B_A3B,
    "qwen3-235b-a22b": _QWEN3_235B_A22B,
    "deepseek-v3": _DEEPSEEK_V3,
    "tiny_llama": {**_TINY, "model_type": "llama"},
    "tiny_llama_tied": {**_TINY, "model_type": "llama", "tie_word_embeddings": True},
    "tiny_qwen2": {**_TINY, "model_type": "qwen2", "tie_word_embeddings": True},
    "tiny_qwen3": {**_TINY, "model_type": "qwen3"},
    "tiny_qwen3_moe": {
        **_TINY,
        "model_type": "qwen3_moe",
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "tiny_deepseek_v3": _TINY_DEEPSEEK_V3,
    "small_deepseek_v3": {
        **_TINY_DEEPSEEK_V3,
        "hidden_size": 256,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "q_lora_rank": 64,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "intermediate_size": 512,
        "moe_intermediate_size": 64,
        "n_routed_experts": 16,
        "n_shared_experts": 2,
        "num_experts_per_tok": 4,
        "n_group": 4,
        "topk_group": 2,
        "vocab_size": 1000,
    },
    "small_llama": {
        "model_type": "llama",
        "hidden_size": 256,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "vocab_size": 1000,
        "tie_word_embeddings": False,
        "attention_bias": False,
    },
    "small_qwen3_moe": {
        "model_type": "qwen3_moe",
        "hidden_size": 256,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0],
        "num_hidden_layers": 4,
        "vocab_size": 1000,
        "tie_word_embeddings": False,
        "attention_bias": False,
    },
    # ~200M parameters, ~0.8 GB in fp32: big enough to time, small enough for one CPU box.
    "llama_demo": {
        "model_type": "llama",
        "hidden_size": 1024,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "intermediate_size": 2816,
        "num_hidden_layers": 12,
        "vocab_size": 32000,
        "tie_word_embeddings": False,
        "attention_bias": False,
    },
}


def get_config(name: str) -> dict:
    """A fresh copy of the config called ``name`` (see ``CONFIGS``)."""
    try:
        return copy.deepcopy(CONFIGS[name])
    except KeyError:
        raise KeyError(f"unknown config {name!r}; known: {sorted(CONFIGS)}") from None
