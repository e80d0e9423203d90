"""MXFP8 and NVFP4 destinations against vLLM 0.33's own model classes, on CPU over gloo (see
``vllm_quant_model_cases.py``).

Tiny ModelOpt checkpoints (``quant_algo`` NVFP4 with ``group_size`` 16, and MXFP8; weights quantized by vLLM's
own ``ref_nvfp4_quant`` / ``_mxfp8_e4m3_quantize_torch``) of Llama and Qwen3-MoE are built by vLLM's model
classes and loaded by its ``DefaultModelLoader`` at TP 2 (Qwen3-MoE NVFP4 also with expert parallelism):

* every parameter ``vllm_layout`` names is a vLLM parameter of that name, shape and dtype (uint8 packed E2M1
  ``[N, K/2]``, float8_e4m3fn ``weight_scale``, float32 ``weight_scale_2`` ``[3]`` / ``[2]`` / ``[1]``,
  ``w13_weight_scale_2`` ``[E, 2]``; MXFP8 float8_e4m3fn and uint8 E8M0 ``weight_scale``), and the only vLLM
  parameters outside it are ``input_scale`` (calibrated activation scales, left to the engine) and the
  kv-cache scales;
* every parameter the loader filled equals the preset's shard of the checkpoint, bit for bit;
* end to end: ``refit`` of the BF16 originals (Megatron TP 2 / EP 2, and a source that cuts every last dim
  through a block) into the model's poisoned ``named_parameters()`` writes exactly the loader's bytes, global
  scales included (the amax exchange inside the refit), and ``verify_refit`` finds 0 mismatches;
* after vLLM's ``process_weights_after_loading`` (NVFP4: ``weight_scale_2`` replaced by ``weight_global_scale``)
  a refit into the rewritten parameters refuses by name and writes nothing.

One spawned world of 2 ranks builds all 5 cases (~3 min on 2 cores).
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here: the engine tier runs in the env "
                                          "tests/engines/install.sh builds (bash .ci/run does both)")
pytest.importorskip("transformers")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.engines import vllm_quant_model_cases as qc  # noqa: E402
from triton_reshard.testing.launch import run_world  # noqa: E402

pytestmark = pytest.mark.slow

CONFIGS = qc.quant_configs()
CASES = [qc.Case(m, 2) for m in CONFIGS] + [qc.Case("nvfp4_qwen3_moe", 2, ep=True)]
KV_CACHE_SCALES = (".attn.q_scale", ".attn.k_scale", ".attn.v_scale", ".attn.prob_scale")


@functools.cache
def _root() -> str:
    root = tempfile.mkdtemp(prefix="tr-vllm-quant-")
    qc.build_checkpoints(root, CONFIGS)
    return root


@functools.cache
def _world() -> list[dict]:
    return run_world(qc.run_cases, 2, CASES, _root(), CONFIGS, timeout=1200, pg_timeout=300)


def _reports(case):
    reps = [r[case.id] for r in _world()]
    problems = [p for r in reps for p in r["problems"]]
    assert not problems, "\n".join(problems)
    return reps


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_vllm_parameters_are_the_preset(case):
    reps = _reports(case)
    nvfp4 = case.model.startswith("nvfp4")
    for r in reps:
        extra = [n for n in r["not_in_preset"] if not n.endswith(KV_CACHE_SCALES)
                 and not (nvfp4 and n.endswith("input_scale"))]
        assert not extra, extra
        assert any(n.endswith("weight_scale") for n in r["preset_locals"])
        if nvfp4:
            assert any(n.endswith("input_scale") for n in r["not_in_preset"])
            assert any(n.endswith("weight_scale_2") for n in r["preset_locals"])
    params = reps[0]["params"]
    if case.model == "nvfp4_llama":
        assert params["model.layers.0.self_attn.qkv_proj.weight_scale_2"] == ((3,), "torch.float32")
        assert params["model.layers.0.mlp.gate_up_proj.weight"][1] == "torch.uint8"
        assert params["model.layers.1.self_attn.o_proj.weight"][1] == "torch.bfloat16"  # excluded
    if case.model == "nvfp4_qwen3_moe":
        e = CONFIGS[case.model]["num_experts"] // (2 if case.ep else 1)
        assert params["model.layers.0.mlp.experts.routed_experts.w13_weight_scale_2"] == ((e, 2), "torch.float32")
        assert params["model.layers.1.mlp.gate.weight"][1] == "torch.bfloat16"  # the excluded router
        assert params["model.layers.0.mlp.gate.weight"][1] == "torch.uint8"
    if case.model == "mxfp8_llama":
        assert params["model.layers.0.self_attn.qkv_proj.weight_scale"][1] == "torch.uint8"
        assert params["model.layers.0.mlp.down_proj.weight"][1] == "torch.bfloat16"  # "model.layers.0.mlp*"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_refit_bf16_into_real_vllm_model(case):
    reps = _reports(case)
    problems = [p for r in reps for p in r["refit_problems"]]
    assert not problems, "\n".join(problems)
    for r in reps:
        assert set(r["refit"]) == {"megatron", "last_dim_split"}
        for res in r["refit"].values():
            assert res["wrong"] == {} and res["verify"] == (True, 0), res


@pytest.mark.parametrize("model", ["nvfp4_llama", "mxfp8_llama"])
def test_after_vllms_post_load_step(model):
    """NVFP4: vLLM's post-load step removes ``weight_scale_2`` (its max becomes ``weight_global_scale``): a refit
    with the checkpoint-format layout refuses, naming a missing tensor, and writes nothing. MXFP8's step keeps
    the parameters (on GPUs its kernel may repack them in place: refit before that step and re-run it)."""
    reps = _reports(qc.Case(model, 2))
    for r in reps:
        post = r["post_load"]
        assert post["untouched"], post
        if model == "nvfp4_llama":
            assert any(n.endswith("weight_scale_2") for n in post["removed"])
            assert any(n.endswith("weight_global_scale") for n in post["added"])
            assert post["refit"] != "ran" and "weight_scale_2" in post["refit"], post["refit"]
        else:
            assert post["removed"] == [n for n in post["removed"] if n.endswith(KV_CACHE_SCALES)], post
            assert post["refit"] == "ran", post["refit"]


def test_preset_refuses_what_vllm_refuses():
    """MXFP8 needs whole 1x32 blocks in every TP partition: vLLM raises "MXFP8 requires input size divisible by
    32" for tiny_llama's down_proj at TP 2 (48 columns a rank); the preset refuses it too, naming the tensor."""
    from triton_reshard.presets import get_config, vllm_layout

    cfg = {**get_config("tiny_llama"), "quantization_config": {
        "quant_method": "modelopt", "quantization": {"quant_algo": "MXFP8", "exclude_modules": ["lm_head"]}}}
    with pytest.raises(ValueError, match="down_proj"):
        vllm_layout(cfg, tp=2, dtype=torch.bfloat16)
