"""The real vLLM (0.33.0 in the engine env) against our layouts, on CPU over gloo, at TP 2 and 4.

Tiny random ``transformers`` checkpoints are saved locally; one spawned world per TP size builds every
model with vLLM's own model classes and loads it with vLLM's own ``DefaultModelLoader`` (see
``vllm_cases.py`` for what each rank checks). Here we read the per-rank reports:

* every parameter equals, element by element, what ``vllm_layout`` says (names, shapes, dtypes, values);
* the layout recorded from vLLM's ``load_weights`` (``triton_reshard.integrations.record_load``) has the
  preset's digest, and slices the checkpoint exactly as vLLM's loader did;
* ``refit`` into ``dict(model.named_parameters())`` (poisoned) writes exactly the loader's values, ignores
  only the parameters the layout does not cover (MLA's ``W_UV`` / ``W_UK_T``, which share storage with
  ``kv_b_proj``: their post-load values come back by themselves), and writes nothing else;
* ``verify_refit`` proves the right layout (0 mismatches) and counts a wrong one exactly;
* architectures we have no preset for (Gemma-2, Phi-3, GLM-4) get a layout from the engine alone.
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
transformers = pytest.importorskip("transformers")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.engines import vllm_cases as vc  # noqa: E402
from triton_reshard.comm import wire  # noqa: E402

# registers LoadRecord's wire codec: the worlds send records back to this process (run alone, nothing else did)
from triton_reshard.integrations import record as _record  # noqa: E402,F401
from triton_reshard.presets import get_config  # noqa: E402
from triton_reshard.testing.launch import run_world  # noqa: E402

pytestmark = pytest.mark.slow

_TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
             num_hidden_layers=2, vocab_size=300)
# architectures without a preset: their layout comes from vLLM's loader alone
NO_PRESET = {
    "tiny_gemma2": {"model_type": "gemma2", **_TINY, "query_pre_attn_scalar": 16, "sliding_window": 64,
                    "tie_word_embeddings": True, "no_preset": True},
    "tiny_phi3": {"model_type": "phi3", **_TINY, "tie_word_embeddings": False, "pad_token_id": 0,
                  "no_preset": True},  # the checkpoint itself holds fused qkv_proj / gate_up_proj
    "tiny_glm4": {"model_type": "glm4", **_TINY, "partial_rotary_factor": 0.5, "tie_word_embeddings": False,
                  "pad_token_id": 0, "no_preset": True},
}
_CLASSES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe",
            "deepseek_v3": "DeepseekV3", "gemma2": "Gemma2", "phi3": "Phi3", "glm4": "Glm4"}
PRESET_MODELS = ["tiny_llama", "tiny_qwen2", "tiny_qwen3", "tiny_qwen3_moe", "tiny_deepseek_v3"]
VLLM_VERSION = vllm.__version__


def _cases(tp: int) -> list[vc.Case]:
    out = [vc.Case(m, tp, ep) for m in PRESET_MODELS for ep in ((False, True) if "moe" in m else (False,))]
    if tp == 2:
        out += [vc.Case(m, tp) for m in NO_PRESET]
    return out


CASES = [c for tp in (2, 4) for c in _cases(tp)]


def _configs() -> dict[str, dict]:
    return {**{m: get_config(m) for m in PRESET_MODELS}, **NO_PRESET}


@functools.cache
def _checkpoints() -> str:
    root = tempfile.mkdtemp(prefix="tr-vllm-ckpt-")
    for name, cfg in _configs().items():
        cls = _CLASSES[cfg["model_type"]]
        kw = {k: v for k, v in cfg.items() if k not in ("model_type", "no_preset")}
        conf = getattr(transformers, f"{cls}Config")(**kw)
        torch.manual_seed(sum(map(ord, name)))
        model = getattr(transformers, f"{cls}ForCausalLM")(conf).float()
        model.save_pretrained(os.path.join(root, name))
    return root


@functools.cache
def _world(tp: int) -> list[dict]:
    return run_world(vc.run_cases, tp, _cases(tp), _checkpoints(), _configs(), timeout=900, pg_timeout=300)


def _reports(case: vc.Case) -> list[dict]:
    return [r[case.id] for r in _world(case.tp)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_vllm_model_matches_layout(case):
    reps = _reports(case)
    problems = [p for r in reps for p in r["problems"]]
    assert not problems, "\n".join(problems)
    derived = {r["derived_digest"] for r in reps}
    assert len(derived) == 1, derived
    if not _configs()[case.model].get("no_preset"):
        # the layout read off vLLM's own loader is the preset, digest for digest
        assert reps[0]["preset_digest"] == derived.pop()
    unused = set.intersection(*(set(wire.loads(r["record"], "record").unused) for r in reps))  # with EP a rank skips others' experts
    assert not unused, f"checkpoint tensors vLLM loaded on no rank: {sorted(unused)[:6]}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_refit_and_verify_into_real_vllm_model(case):
    """refit takes the model's named_parameters() as they are; only MLA's derived matrices are ignored; the
    verify pass proves the right layout and counts the permuted one exactly (every rank agrees)."""
    reps = _reports(case)
    problems = [p for r in reps for p in r["problems"]]
    assert not problems, "\n".join(problems)
    for r in reps:
        ignored = set(r["ignored"])
        if _configs()[case.model].get("model_type") == "deepseek_v3":
            assert r["mla_post_load"] == _configs()[case.model]["num_hidden_layers"]
            assert ignored and all(n.endswith((".mla_attn.mla_attn.W_UV", ".mla_attn.mla_attn.W_UK_T"))
                                   for n in ignored), ignored
        else:
            assert not ignored, ignored
        assert r["verify_ok"] is True and r["verify_total"] == 0
        ok, count, expect = r["verify_perm"]
        assert ok is False and count == expect > 0


def test_vllm_version_followed():
    """The installed vLLM decides the FusedMoE names (routed_experts since 0.24)."""
    from triton_reshard.presets import vllm_layout
    from triton_reshard.presets.vllm import installed_vllm_version

    assert installed_vllm_version() == VLLM_VERSION
    names = vllm_layout(get_config("tiny_qwen3_moe"), tp=2).local_shapes(0)
    routed = "model.layers.0.mlp.experts.routed_experts.w13_weight"
    assert (routed in names) == (tuple(int(x) for x in VLLM_VERSION.split(".")[:2]) >= (0, 24))


def test_cli_verify_checkpoint_against_vllm(capsys):
    """``triton-reshard verify``: the preset and the engine-recorded layout both verify against what vLLM's
    loader loaded, and are identical; a preset in the wrong vLLM format fails closed, naming the tensor."""
    from triton_reshard.tools.cli import main

    ckpt = os.path.join(_checkpoints(), "tiny_qwen3_moe")
    assert main(["verify", "--checkpoint", ckpt, "--tp", "2", "--ep"]) == 0
    out = capsys.readouterr().out
    assert "preset  layout" in out and "engine  layout" in out and "identical" in out, out
    assert main(["verify", "--checkpoint", ckpt, "--tp", "2", "--layout", "preset", "--vllm-version", "0.23.0"]) == 1
    err = capsys.readouterr().err
    assert "mlp.experts.w13_weight" in err and "is missing" in err, err
