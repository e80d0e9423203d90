"""Every benchmark under perf/ runs small (perf/smoke.py), in the tier whose environment it needs: here the
main suite's; tests/engines and tests/sglang_tier run theirs. A new perf script without a smoke entry fails."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "perf"))
import smoke  # noqa: E402


def test_every_perf_script_has_a_smoke_run():
    assert smoke.scripts_without_smoke() == []
    tiers = {t for t, _a, _s in smoke.SMOKE.values()}
    assert tiers <= {"main", "engines", "sglang", "cluster", "vllm-cpu", None}
    assert {"main", "engines", "sglang"} <= tiers


# Benchmarks no other test or .ci/run names run here, in test_perf_script_runs_small: kept in the main tier.
NAMED_HERE = ("bench_delta_gpu.py", "bench_integrity.py", "bench_zero.py#overhead", "bench_zero.py#copies")


def test_benchmarks_named_nowhere_else_run_in_the_main_tier():
    assert set(NAMED_HERE) <= set(smoke.entries("main"))


@pytest.mark.slow
@pytest.mark.parametrize("key", smoke.entries("main"))
def test_perf_script_runs_small(key, tmp_path):
    ok, tail, _secs = smoke.run_one(key, str(tmp_path))
    assert ok, tail


def test_cluster_versions_map_the_moe_onto_the_preset():
    """perf/cluster_versions.py: the HF Qwen3-MoE's fused experts as the preset's per-expert tensors: each mapped
    expert computes what HF's expert module computes, and one HF element changed changes exactly one mapped
    element, at its place (an element unchanged in HF stays unchanged in the versions)."""
    import cluster_versions as cv
    import torch
    import torch.nn.functional as F

    net = cv.hf_model("small_qwen3_moe")
    t = cv.preset_tensors(net, "small_qwen3_moe")
    experts = net.model.layers[1].mlp.experts
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0))
    for e in (0, 7, 15):
        with torch.no_grad():
            ref = experts(x, torch.full((5, 1), e), torch.ones(5, 1))
        pre = f"model.layers.1.mlp.experts.{e}."
        h = F.silu(x @ t[pre + "gate_proj.weight"].T) * (x @ t[pre + "up_proj.weight"].T)
        torch.testing.assert_close(h @ t[pre + "down_proj.weight"].T, ref)
    before = cv.bits(t)
    with torch.no_grad():
        experts.gate_up_proj[3, 130, 17] += 1.0  # rows 128.. of expert 3's gate_up: its up_proj, row 2
        net.model.layers[2].mlp.experts.down_proj[0, 5, 9] -= 1.0
    after = cv.bits(cv.preset_tensors(net, "small_qwen3_moe"))
    diff = {n: (after[n] != before[n]).nonzero().tolist() for n in after if (after[n] != before[n]).any()}
    assert diff == {"model.layers.1.mlp.experts.3.up_proj.weight": [[2, 17]],
                    "model.layers.2.mlp.experts.0.down_proj.weight": [[5, 9]]}


def test_cluster_versions_refuse_what_does_not_map():
    import cluster_versions as cv

    with pytest.raises(ValueError, match="small_deepseek_v3.*'deepseek_v3' model"):
        cv.hf_model("small_deepseek_v3")
    with pytest.raises(ValueError, match=r"small_llama: HF tensors do not map onto the preset's: missing "
                                          r"\['model.layers.1.mlp.down_proj.weight'.*extra "
                                          r"\['model.layers.0.self_attn.k_norm.weight'"):
        cv.preset_tensors(cv.hf_model("small_qwen3_moe"), "small_llama")
