"""Real-client check: tiny random Hugging Face models (transformers, CPU, fp32; Llama, Qwen2/3, Qwen3-MoE,
DeepSeek-V3 with MLA and shared experts), Megatron-Core training shards or FSDP2/TP DTensors built
independently from the HF tensors, ``refit`` into the vLLM layout over gloo, every vLLM shard compared bit-exactly with an independent vLLM conversion, the vLLM shards reassembled
into an HF checkpoint, loaded into a fresh model, and its logits compared exactly with the original's.

Two spawned worlds (4 and 8 ranks) run all cases; the models are built in this (parent) process only.
"""

from __future__ import annotations

import io
import os
import sys
import tempfile
import zlib

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import model_cases  # noqa: E402

from triton_reshard.presets import get_config  # noqa: E402
from triton_reshard.testing.launch import run_world  # noqa: E402

pytestmark = pytest.mark.slow

_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
}


def _hf_config(cfg):
    conf_cls, _ = _CLASSES[cfg["model_type"]]
    kw = {k: v for k, v in cfg.items() if k != "model_type"}
    return getattr(transformers, conf_cls)(**kw)


def _model_cls(cfg):
    return getattr(transformers, _CLASSES[cfg["model_type"]][1])


def _checkpoint(model):
    """The model's checkpoint-format state dict (what save_pretrained writes: per-expert MoE tensors)."""
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        return {k: v.clone() for k, v in load_file(os.path.join(d, "model.safetensors")).items()}


def _load(cfg, sd):
    """A fresh model from a checkpoint state dict, through transformers' own loader."""
    with tempfile.TemporaryDirectory() as d:
        _hf_config(cfg).save_pretrained(d)
        save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(d, "model.safetensors"),
                  metadata={"format": "pt"})
        return _model_cls(cfg).from_pretrained(d, dtype=torch.float32).eval()


def _logits(model, vocab):
    ids = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(input_ids=ids).logits


_MODELS: dict[str, tuple[dict, dict, torch.Tensor]] = {}


def _model(key: str, **overrides):
    """(config, checkpoint state dict, reference logits) of a tiny random model, built once."""
    if key not in _MODELS:
        base, _, _ = key.partition("+")
        cfg = {**get_config(base), **overrides}
        torch.manual_seed(zlib.crc32(key.encode()))
        model = _model_cls(cfg)(_hf_config(cfg)).float().eval()
        with torch.no_grad():  # norms are ones at init: randomise them so a misplaced norm shows
            for n, p in model.named_parameters():
                if n.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)
            for n, b in model.named_buffers():  # DeepSeek's expert-score bias (zeros at init) picks experts
                if n.endswith("e_score_correction_bias"):
                    b.normal_(0, 1)
        sd = _checkpoint(model)
        _MODELS[key] = (cfg, sd, _logits(model, cfg["vocab_size"]))
    return _MODELS[key]


def _mg(offset=0, **kw):
    return {"kind": "megatron", "offset": offset, **kw}


def _dt(offset=0, **kw):
    return {"kind": "dtensor", "offset": offset, **kw}


def _vl(offset=0, **kw):
    return {"offset": offset, **kw}


# name, model key (+overrides), training side, inference side
CASES_4 = [
    ("llama_gqa_pp2_tp2_to_tp4", "tiny_llama", {}, _mg(tp=2, pp=2), _vl(tp=4)),  # kv heads 2 < tp 4
    ("llama_tied_pp2_dp2_to_tp2dp2", "tiny_llama_tied", {}, _mg(tp=1, pp=2, dp=2), _vl(tp=2, dp=2)),
    ("qwen2_bias_tp2dp2_to_tp1dp4", "tiny_qwen2", {}, _mg(tp=2, dp=2), _vl(tp=1, dp=4)),
    ("qwen3_mha_tp4_to_tp2dp2", "tiny_qwen3+mha", {"num_key_value_heads": 4}, _mg(tp=4), _vl(tp=2, dp=2)),
    ("qwen3moe_ep2_to_vllm_ep4", "tiny_qwen3_moe", {}, _mg(tp=2, dp=2, ep=2, etp=1), _vl(tp=2, dp=2, ep=True)),
    ("qwen3moe_ep4_etp1_seq_to_vllm_tp4", "tiny_qwen3_moe", {},
     _mg(tp=2, dp=2, ep=4, etp=1, grouped=False, steps=2), _vl(tp=4)),
    ("qwen3moe_pp2_etp2_to_vllm_ep2dp2", "tiny_qwen3_moe+dense0", {"mlp_only_layers": [0]},
     _mg(tp=2, pp=2), _vl(tp=1, dp=4, ep=True)),
    ("dtensor_llama_fsdp2_tp2_to_tp4", "tiny_llama", {}, _dt(dp=2, tp=2, strided=True), _vl(tp=4)),
    ("dtensor_qwen3moe_to_vllm_ep", "tiny_qwen3_moe", {}, _dt(dp=2, tp=2), _vl(tp=2, dp=2, ep=True)),
    # DeepSeek-V3: MLA, shared experts (replicated in vLLM under sequence-parallel MoE), fp32 expert bias
    ("deepseek_tp2pp2_ep2_to_vllm_tp2dp2_ep", "tiny_deepseek_v3", {}, _mg(tp=2, pp=2, ep=2, etp=1),
     _vl(tp=2, dp=2, ep=True)),
    ("deepseek_qnone_tp2dp2_etp2_to_vllm_tp4", "tiny_deepseek_v3+qnone", {"q_lora_rank": None},
     _mg(tp=2, dp=2, ep=1, steps=2), _vl(tp=4)),
]

CASES_8 = [  # disaggregated: training on 0-3, inference on 4-7; then colocated on all 8
    # gpus_per_node=4: both inference DP replicas share node 1 (ranks 4-7), no source there: relays
    ("disagg_llama_pp2_dp2_to_tp2dp2_relay", "tiny_llama", {}, _mg(tp=1, pp=2, dp=2),
     _vl(4, tp=2, dp=2, gpus_per_node=4)),
    ("disagg_qwen3moe_tp2pp2_ep2_to_vllm_ep4", "tiny_qwen3_moe", {}, _mg(tp=2, pp=2, ep=2, etp=1),
     _vl(4, tp=4, ep=True)),
    ("disagg_qwen3_dtensor_to_tp2dp2", "tiny_qwen3", {}, _dt(dp=2, tp=2, strided=True), _vl(4, tp=2, dp=2)),
    ("coloc8_qwen3moe_tp2pp2dp2_ep4_to_vllm_tp4dp2", "tiny_qwen3_moe", {}, _mg(tp=2, pp=2, dp=2, ep=4, etp=1),
     _vl(tp=4, dp=2)),
    ("disagg_deepseek_tp2dp2_ep4_to_vllm_ep4", "tiny_deepseek_v3", {}, _mg(tp=2, dp=2, ep=4, etp=1),
     _vl(4, tp=4, ep=True)),
    ("coloc8_qwen2_tp2pp2dp2_to_tp8", "tiny_qwen2+kv8", {"num_attention_heads": 8, "num_key_value_heads": 2,
                                                          "head_dim": 8}, _mg(tp=2, pp=2, dp=2), _vl(tp=8)),
]


def _cases(table):
    out = []
    for name, key, overrides, src, dst in table:
        cfg, sd, _ = _model(key, **overrides)
        src = dict(src)
        steps = src.pop("steps", 1)
        out.append({"name": name, "cfg": cfg, "sd": sd, "src": src, "dst": dst, "steps": steps, "key": key})
    return out


def _check_world(table, world):
    cases = _cases(table)
    results = run_world(model_cases.world_main, world, [{k: v for k, v in c.items() if k != "key"}
                                                        for c in cases], timeout=240)
    merged = {}
    for r in results:
        merged.update(torch.load(io.BytesIO(r)))
    for c in cases:
        cfg, sd, ref = _MODELS[c["key"]]
        got = merged[c["name"]]
        assert sorted(got) == sorted(sd), f"{c['name']}: reassembled names differ"
        for n in sd:
            assert torch.equal(got[n], sd[n]), f"{c['name']}: reassembled {n} differs"
        logits = _logits(_load(cfg, got), cfg["vocab_size"])
        assert torch.equal(logits, ref), f"{c['name']}: logits differ"


def test_world_of_4():
    _check_world(CASES_4, 4)


def test_world_of_8():
    _check_world(CASES_8, 8)
