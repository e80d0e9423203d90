"""Real Megatron-Core GPTModels on CPU over gloo: the stubs they need without CUDA and the TransformerConfig of a
Hugging Face config. Shared by the engine tier's Megatron tests (``tests/engines/megatron_worker.py``) and
``perf/bench_megatron.py`` (what a benchmark shares with tests lives in the package, not in ``tests/``).

Three stubs make the model build without CUDA (``shared/FACTS.md``): ``model_parallel_cuda_manual_seed`` is never
called (it asserts CUDA; ``use_cpu_initialization=True`` does not need it), ``Tensor.cuda`` is a no-op, and
``torch.cuda.Stream`` is :class:`DummyStream`. Megatron-Core is imported only when a function needs it."""

from __future__ import annotations

import torch


class DummyStream:
    """``torch.cuda.Stream`` without CUDA (the MoE token dispatcher and GlooCopyService make one)."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def wait_stream(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass


def install_cpu_stubs() -> None:
    """``Tensor.cuda`` a no-op (called on the tied output layer when PP > 1), ``torch.cuda.Stream`` a dummy."""
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.cuda.Stream = DummyStream


def moe_layer_pattern(cfg: dict) -> list[int] | None:
    """Per layer 1 (MoE) or 0 (dense), the HF Qwen3-MoE rule, as Megatron's ``moe_layer_freq`` list."""
    if not cfg.get("num_experts"):
        return None
    step = cfg.get("decoder_sparse_step", 1) or 1
    dense = set(cfg.get("mlp_only_layers") or ())
    return [int(i not in dense and (i + 1) % step == 0) for i in range(cfg["num_hidden_layers"])]


def transformer_config(cfg: dict, tp: int, pp: int, ep: int, etp: int, **extra):
    """Megatron's TransformerConfig of a HF config (how Megatron-Bridge's providers map the fields);
    ``extra``: more (or overriding) TransformerConfig fields, e.g. ``num_layers_in_first_pipeline_stage``."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    H, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    family = cfg["model_type"]
    kw = dict(
        num_layers=cfg["num_hidden_layers"],
        hidden_size=H,
        num_attention_heads=nh,
        num_query_groups=cfg.get("num_key_value_heads") or nh,
        kv_channels=cfg.get("head_dim") or H // nh,
        ffn_hidden_size=cfg["intermediate_size"],
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=family == "qwen2",
        qk_layernorm=family in ("qwen3", "qwen3_moe"),
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        bf16=False,
        fp16=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        sequence_parallel=False,
    )
    pattern = moe_layer_pattern(cfg)
    if pattern is not None:
        kw.update(
            num_moe_experts=cfg["num_experts"],
            moe_ffn_hidden_size=cfg["moe_intermediate_size"],
            moe_router_topk=cfg.get("num_experts_per_tok", 2),
            moe_grouped_gemm=False,  # the local spec's grouped GEMM is the legacy GroupedMLP (needs CUDA)
            # an int for a model of MoE layers only (homogeneous layers: one checkpoint key per tensor with a
            # layer axis), the per-layer list for a mixed one (per-layer checkpoint keys)
            moe_layer_freq=1 if all(pattern) else pattern,
        )
    kw.update(extra)
    return TransformerConfig(**kw)
