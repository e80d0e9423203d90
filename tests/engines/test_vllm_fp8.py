"""Block-FP8 destinations against the real vLLM 0.33, on CPU over gloo (see ``vllm_fp8_cases.py``).

Tiny FP8 checkpoints (weights quantized by vLLM's own ``per_block_cast_to_fp8``, blocks of 16x16) are loaded
by vLLM's model classes and ``DefaultModelLoader`` at TP 2, MoE with and without expert parallelism:

* vLLM's ``create_weights`` makes FP8 exactly the parameters ``vllm_layout`` says (names, shapes, dtypes), and
  the FP8 checkpoint tensors are exactly the preset's quantized tensors;
* every parameter vLLM's loader filled equals the preset's slice of the checkpoint, bit for bit (FP8 values,
  float32 ``weight_scale_inv`` / ``w13_weight_scale_inv`` / ``w2_weight_scale_inv``, BF16 rest);
* the layout recorded from vLLM's ``load_weights`` (fp8 weights with their block quantization, scales as
  their own tensors) has the preset's digest, and slices the checkpoint exactly as vLLM's loader did;
* end to end: ``refit`` of the BF16 originals (Megatron TP 2 shards, and a source cut through the middle of
  blocks so that receivers quantize too) into the model's poisoned ``named_parameters()`` writes exactly
  the loader's bytes (so our quantizer's numbers are vLLM's), nothing outside the layout;
* ``triton_reshard.ops.quantize.quantize_blocks`` = vLLM's ``per_block_cast_to_fp8`` bit for bit.

One spawned world of 2 ranks builds all 6 cases (~50 s on 2 cores).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import tempfile

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here: the engine tier runs in the env "
                                          "tests/engines/install.sh builds (bash .ci/run does both)")
pytest.importorskip("transformers")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.engines import vllm_fp8_cases as fc  # noqa: E402
from triton_reshard.testing.launch import run_world  # noqa: E402

pytestmark = pytest.mark.slow

CONFIGS = fc.fp8_configs()
# the end-to-end refit needs the planner's block-quant post-pass and the executor's quantizing pack/unpack
E2E = importlib.util.find_spec("triton_reshard.plan.quant") is not None
CASES = [fc.Case(m, 2, ep) for m, c in CONFIGS.items()
         for ep in ((False, True) if ("num_experts" in c or "n_routed_experts" in c) else (False,))]


@functools.cache
def _root() -> str:
    root = tempfile.mkdtemp(prefix="tr-vllm-fp8-")
    fc.build_checkpoints(root, CONFIGS)
    return root


@functools.cache
def _world() -> list[dict]:
    return run_world(fc.run_cases, 2, CASES, _root(), CONFIGS, E2E, timeout=900, pg_timeout=300)


def _reports(case: fc.Case) -> list[dict]:
    return [r[case.id] for r in _world()]


def _ok(reps):
    problems = [p for r in reps for p in r["problems"]]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_vllm_fp8_parameters_are_the_preset(case):
    reps = _reports(case)
    _ok(reps)
    for r in reps:
        # the only parameters outside the layout: the kv-cache scales of GQA attention (not checkpoint tensors)
        assert all(n.endswith(fc.KV_CACHE_SCALES) for n in r["not_in_preset"]), r["not_in_preset"]
        assert bool(r["not_in_preset"]) == (CONFIGS[case.model]["model_type"] != "deepseek_v3")
        assert r["checkpoint_fp8"] == r["preset_quantized"]
        assert r["fp8_params"], "no FP8 parameter at all"
    quantized = set(reps[0]["preset_quantized"])
    ignored = CONFIGS[case.model]["quantization_config"].get("modules_to_not_convert") or ()
    for m in ignored:  # modules_to_not_convert honoured by vLLM and the preset alike
        assert not any(n.startswith(m + ".") for n in quantized), m
    if case.model == "fp8_qwen3_moe":
        fp8 = set(reps[0]["fp8_params"])
        assert "model.layers.1.mlp.gate.weight" in fp8 and "model.layers.0.mlp.gate.weight" not in fp8
        assert not any(".layers.1.mlp.experts." in n for n in fp8)
        assert any(".layers.0.mlp.experts." in n for n in fp8)
    if case.model == "fp8_deepseek_v3":  # DeepSeek's router is a GateLinear built without the quant config
        assert not any(n.endswith("mlp.gate.weight") for n in reps[0]["fp8_params"])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_vllm_fp8_recorded_layout_is_the_preset(case):
    reps = _reports(case)
    _ok(reps)
    assert {r["derived_digest"] for r in reps} == {reps[0]["preset_digest"]}
    assert {r["derived_from_bf16_digest"] for r in reps} == {reps[0]["preset_digest"]}  # scales found by the loader
    q = reps[0]["derived_quant"]
    assert sorted(q) == reps[0]["preset_quantized"]
    ue8m0 = CONFIGS[case.model]["quantization_config"].get("scale_fmt") == "ue8m0"
    assert all(block[-2:] == tuple(fc.BLOCK) and scale == n + "_scale_inv" and u == ue8m0
               for n, (block, scale, u) in q.items())


def test_our_quantizer_is_vllms():
    """triton_reshard.ops.quantize.quantize_blocks = vLLM's per_block_cast_to_fp8, bit for bit (blocks of 16 and 128,
    partial edge blocks, bf16 and fp32 inputs, an all-zero block, fp32 and UE8M0 scales)."""
    from triton_reshard.ops.quantize import quantize_blocks

    cast = fc.vllm_per_block_cast()
    g = torch.Generator().manual_seed(0)
    for shape, block, dt in [((64, 48), (16, 16), torch.bfloat16), ((56, 64), (16, 16), torch.bfloat16),
                             ((300, 200), (128, 128), torch.bfloat16), ((40, 24), (16, 16), torch.float32)]:
        x = (torch.randn(shape, generator=g) * 3).to(dt)
        x[:16, :16] = 0
        for ue8m0 in (False, True):
            q, s = quantize_blocks(x, block, ue8m0=ue8m0)
            q2, s2 = cast(x, list(block), use_ue8m0=ue8m0)
            assert fc.differs(q, q2) == 0 and fc.differs(s, s2.contiguous()) == 0, (shape, block, dt, ue8m0)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_refit_bf16_into_real_vllm_fp8_model(case):
    """End to end: BF16 trainer shards (Megatron TP 2, and a source cut through the middle of blocks) refit
    into the real model's poisoned named_parameters() = the bytes vLLM's loader put there from the FP8
    checkpoint quantized by vLLM's per_block_cast_to_fp8; only the kv-cache scales are ignored. The FP8
    checkpoint itself as a (quantized) source: the same bytes, copied."""
    if not E2E:
        pytest.skip("this triton_reshard has no block-quant planner (triton_reshard.plan.quant)")
    reps = _reports(case)
    _ok(reps)
    problems = [p for r in reps for p in r["refit_problems"]]
    assert not problems, "\n".join(problems)
    for r in reps:
        assert set(r["refit"]) == {"megatron", "odd_split", "fp8_checkpoint"}
        for got in r["refit"].values():
            assert not got["wrong"]
            assert all(n.endswith(fc.KV_CACHE_SCALES) for n in got["ignored"]), got["ignored"]
            assert set(got["ignored"]) == set(r["not_in_preset"])
            assert got["verify"] == (True, 0)  # verify_refit proves the layout on the FP8 model
            assert got["verify_swapped"][0] is False and got["verify_swapped"][1] > 0


def test_weight_transfer_backend_into_fp8_engine():
    """vLLM's weight-transfer API with the triton_reshard backend on an FP8 engine (Qwen3-MoE, TP 2, its own
    job) and a BF16 trainer job (Megatron TP 2): the worker records its FP8 loader from the trainer's BF16
    tensor list (the scale tensors found by the loader), the update quantizes on the way, and every element
    the recorded layout covers is the byte vLLM's loader put there; the rest (vocab padding, kv-cache
    scales) stays poisoned."""
    if not E2E:
        pytest.skip("this triton_reshard has no block-quant planner (triton_reshard.plan.quant)")
    from triton_reshard.comm.group import free_port
    from triton_reshard.integrations.control import host_store
    from triton_reshard.presets import vllm_layout
    from triton_reshard.testing.launch import run_jobs

    name = "fp8_qwen3_moe"
    cfg = CONFIGS[name]
    ctl_port, refit_port = free_port(), free_port()
    ctl = host_store("127.0.0.1", ctl_port)
    results = run_jobs({"engine": (fc.backend_engine_job, 2, os.path.join(_root(), name), ctl_port),
                        "trainer": (fc.backend_trainer_job, 2, cfg, os.path.join(_root(), f"{name}.bf16.safetensors"),
                                    refit_port, ctl_port, 2)}, timeout=400)
    ctl.close()
    for job in ("engine", "trainer"):
        assert not isinstance(results.get(job), Exception), f"{job} job failed: {results.get(job)}"
    engine, trainer = results["engine"], results["trainer"]
    problems = [p for r in engine for p in r["problems"]]
    assert not problems, "\n".join(problems)
    # the recorded layout, shifted past the trainer's 2 ranks, is the preset on engine ranks 2, 3
    assert {r["digest"] for r in engine} == {vllm_layout(cfg, tp=2, ranks=(2, 3)).digest}
    for rank, r in enumerate(engine):
        pad = 20 * cfg["hidden_size"] if rank == 1 else 0  # vocab 300 padded to 320: rank 1's last 20 rows
        kv = {n: c for n, c in r["unwritten"].items() if n.endswith(fc.KV_CACHE_SCALES)}
        assert kv and all(c == 1 for c in kv.values())
        rest = {n: c for n, c in r["unwritten"].items() if c and n not in kv}
        assert rest == ({} if not pad else {"model.embed_tokens.weight": pad, "lm_head.weight": pad})
    assert sum(r["sent"] for r in trainer) == sum(r["recv_bytes"] for r in engine) > 0


@pytest.mark.parametrize("case", [c for c in CASES if c.model == "fp8_deepseek_v3"], ids=lambda c: c.id)
def test_fp8_mla_post_load_after_refit(case):
    """FP8 MLA: vLLM's post-load step makes W_UV / W_UK_T as BF16 copies (dequantized kv_b_proj); refit
    ignores exactly them, and rerunning the step after the refit restores them bit for bit."""
    if not E2E:
        pytest.skip("this triton_reshard has no block-quant planner (triton_reshard.plan.quant)")
    reps = _reports(case)
    _ok(reps)
    problems = [p for r in reps for p in r["refit_problems"]]
    assert not problems, "\n".join(problems)
    layers = CONFIGS[case.model]["num_hidden_layers"]
    for r in reps:
        assert r["mla_post_load"] == r["mla_rerun"] == layers
        derived = r["mla_derived"]
        assert len(derived) == 2 * layers and all(dt == "torch.bfloat16" for _, dt in derived.values())
        assert set(r["mla_ignored"]) == set(derived)
