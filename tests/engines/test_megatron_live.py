"""``layout_from_megatron`` on live Megatron-Core GPTModels (megatron-core 0.16.1, CPU, gloo).

One spawned world of 4 ranks (and one of 8) builds, case after case, the case's real ``GPTModel`` (local layer
spec: Transformer Engine does not install without CUDA; ``megatron_worker.build_model``), optionally wrapped
(a list of one chunk, a DDP-like ``.module`` wrapper, Megatron's own ``Float16Module``), and calls
``layout_from_megatron(model, hf_config)`` on every rank. Per case:

* ``test_live_layout``: every rank's Layout has the digest of the ``megatron_layout(...)`` the case states
  explicitly (``expect``), all ranks agree, and ``megatron_layout_args`` gives exactly those arguments.
* ``test_wrong_inputs``: a wrong HF config (hidden size, tied flag, vocab, layer count), a wrong dtype, a list of
  two model chunks, no config: every rank raises, with a message that names the rank and (for mismatched
  tensors) one of this rank's local tensors.

Skips (with the reason) when ``megatron.core`` cannot be imported.
"""

from __future__ import annotations

import os
import re
import sys
import time

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron.core cannot be imported (tests/engines/install.sh installs megatron-core 0.16.1)")

sys.path.insert(0, os.path.dirname(__file__))
import megatron_worker  # noqa: E402

from triton_reshard.presets import get_config, megatron_layout  # noqa: E402
from triton_reshard.testing.launch import run_world  # noqa: E402

pytestmark = pytest.mark.slow

F32 = torch.float32


def _case(name, model, tp, pp=1, ep=1, etp=None, over=None, megatron_vocab=None, tc_kw=None, wrap=None,
          live_kw=None, wrong=(), expect=None, **flags):
    """``expect``: the ``megatron_layout`` arguments (besides the config) the live model must give."""
    cfg = {**get_config(model), **(over or {})}
    return dict(name=name, cfg=cfg, tp=tp, pp=pp, ep=ep, etp=etp, tc_kw=tc_kw or {}, wrap=wrap,
                live_kw=live_kw or {}, megatron_vocab=megatron_vocab or cfg["vocab_size"],
                wrong={w: WRONG[w](cfg) for w in wrong}, expect=expect, **flags)


# wrong inputs: label -> the layout_from_megatron arguments (cfg: the HF config) built from the right config
WRONG = {
    "hidden_size": lambda cfg: {"cfg": {**cfg, "hidden_size": 2 * cfg["hidden_size"]}},
    "tied_flag": lambda cfg: {"cfg": {**cfg, "tie_word_embeddings": not cfg.get("tie_word_embeddings")}},
    "vocab_too_big": lambda cfg: {"cfg": {**cfg, "vocab_size": 4096}},
    "layers": lambda cfg: {"cfg": {**cfg, "num_hidden_layers": cfg["num_hidden_layers"] + 2}},
    "dtype": lambda cfg: {"dtype": torch.float16},  # no case is built in fp16
    "intermediate": lambda cfg: {"cfg": {**cfg, "intermediate_size": 2 * cfg["intermediate_size"],
                                         "moe_intermediate_size": 2 * cfg.get("moe_intermediate_size", 0)}},
}


def _args(tp, pp=1, dp=1, ep=1, etp=None, vocab_divisible_by=None, layers_per_stage=None, dtype=F32,
          grouped_gemm=None, ranks=None):
    return dict(tp=tp, pp=pp, dp=dp, ep=ep, etp=etp, ranks=ranks, dtype=dtype, vocab_divisible_by=vocab_divisible_by,
                grouped_gemm=grouped_gemm, layers_per_stage=layers_per_stage, spec="local")


# world 4 (dp = 4 / (tp * pp)). megatron_vocab: the rows Megatron was built with (HF vocab 300).
CASES_4 = [
    _case("llama_tp2_pp2_pad128", "tiny_llama", tp=2, pp=2, megatron_vocab=512,
          wrong=("hidden_size", "tied_flag", "vocab_too_big", "layers", "dtype", "intermediate"),
          chunks2=True, no_config=True,
          expect=_args(tp=2, pp=2, vocab_divisible_by=128, layers_per_stage=[1, 1])),
    _case("llama_tied_tp2_pp2_list", "tiny_llama_tied", tp=2, pp=2, megatron_vocab=512, wrap="list",
          wrong=("hidden_size", "tied_flag"),
          expect=_args(tp=2, pp=2, vocab_divisible_by=128, layers_per_stage=[1, 1])),
    _case("llama_uneven_first1_tp2_pp2", "tiny_llama", tp=2, pp=2, over={"num_hidden_layers": 3},
          tc_kw={"num_layers_in_first_pipeline_stage": 1}, megatron_vocab=512, wrong=("hidden_size", "layers"),
          expect=_args(tp=2, pp=2, vocab_divisible_by=128, layers_per_stage=[1, 2])),
    _case("llama_uneven_first2_tp1_pp4_bridge_vocab", "tiny_llama", tp=1, pp=4, over={"num_hidden_layers": 5},
          tc_kw={"num_layers_in_first_pipeline_stage": 2}, wrong=("hidden_size",),
          expect=_args(tp=1, pp=4, layers_per_stage=[2, 1, 1, 1])),  # middle stages: no embedding
    _case("llama_uneven_last3_tp1_pp4_offset_ranks", "tiny_llama", tp=1, pp=4, over={"num_hidden_layers": 6},
          tc_kw={"num_layers_in_last_pipeline_stage": 3}, live_kw={"ranks": 100}, wrong=("hidden_size",),
          expect=_args(tp=1, pp=4, layers_per_stage=[1, 1, 1, 3], ranks=100)),
    _case("llama_pp_layout_tp1_pp4", "tiny_llama", tp=1, pp=4, over={"num_hidden_layers": 5},
          tc_kw={"pipeline_model_parallel_layout": "Et|tt|t|tL"}, wrong=("hidden_size", "layers"),
          expect=_args(tp=1, pp=4, layers_per_stage=[1, 2, 1, 1])),
    _case("llama_embedding_in_split_tp2_pp2", "tiny_llama", tp=2, pp=2, over={"num_hidden_layers": 3},
          tc_kw={"account_for_embedding_in_pipeline_split": True}, megatron_vocab=512, wrong=("hidden_size",),
          expect=_args(tp=2, pp=2, vocab_divisible_by=128, layers_per_stage=[1, 2])),
    _case("qwen2_bias_tied_kv1_tp4_above_kv_reversed_ranks", "tiny_qwen2", tp=4, over={"num_key_value_heads": 1},
          megatron_vocab=512, live_kw={"ranks": [7, 5, 3, 1]}, wrong=("hidden_size", "tied_flag"),
          expect=_args(tp=4, vocab_divisible_by=128, ranks=[7, 5, 3, 1])),
    _case("llama_bridge_vocab_tp4_above_kv2_wrapped", "tiny_llama", tp=4, wrap="wrapper_list",
          wrong=("hidden_size", "vocab_too_big"), expect=_args(tp=4)),
    _case("llama_vocab301_div1_tp2_dp2", "tiny_llama", tp=2, over={"vocab_size": 301}, megatron_vocab=302,
          wrong=("hidden_size",), expect=_args(tp=2, dp=2, vocab_divisible_by=1)),
    _case("qwen3_qknorm_tp2_dp2_bf16_float16module", "tiny_qwen3", tp=2, megatron_vocab=512, wrap="float16",
          tc_kw={"bf16": True}, wrong=("hidden_size", "dtype"),
          expect=_args(tp=2, dp=2, vocab_divisible_by=128, dtype=torch.bfloat16)),
    _case("qwen3moe_tp2_dp2_ep2_etp1", "tiny_qwen3_moe", tp=2, ep=2, etp=1, megatron_vocab=512,
          wrong=("hidden_size", "intermediate"),
          expect=_args(tp=2, dp=2, ep=2, etp=1, vocab_divisible_by=128, grouped_gemm=False)),
    _case("qwen3moe_dense0_tp1_pp2_dp2_ep2_etp1", "tiny_qwen3_moe", tp=1, pp=2, ep=2,
          over={"mlp_only_layers": [0]}, megatron_vocab=384, wrong=("hidden_size", "intermediate"),
          expect=_args(tp=1, pp=2, dp=2, ep=2, etp=1, vocab_divisible_by=128, layers_per_stage=[1, 1],
                       grouped_gemm=False)),
]
CASES_8 = [
    _case("llama_tp4_pp2_above_kv2", "tiny_llama", tp=4, pp=2, megatron_vocab=512, wrong=("hidden_size",),
          expect=_args(tp=4, pp=2, vocab_divisible_by=128, layers_per_stage=[1, 1])),
    _case("qwen3moe_tp2_pp2_dp2_ep4_etp1", "tiny_qwen3_moe", tp=2, pp=2, ep=4, etp=1, megatron_vocab=512,
          wrong=("hidden_size",),
          expect=_args(tp=2, pp=2, dp=2, ep=4, etp=1, vocab_divisible_by=128, layers_per_stage=[1, 1],
                       grouped_gemm=False)),
    _case("qwen3moe_tp4_dp2_ep2_etp4_bridge_vocab", "tiny_qwen3_moe", tp=4, ep=2,
          wrong=("hidden_size",), expect=_args(tp=4, dp=2, ep=2, etp=4, grouped_gemm=False)),
]
WORLDS = {4: CASES_4, 8: CASES_8}
ALL = [(w, c) for w, cases in WORLDS.items() for c in cases]
_IDS = [f"w{w}-{c['name']}" for w, c in ALL]

_RESULTS: dict[int, list[dict]] = {}


def _results(world: int, case: dict) -> list[dict]:
    if world not in _RESULTS:
        t = time.monotonic()
        _RESULTS[world] = run_world(megatron_worker.live_world_main, world, WORLDS[world], timeout=600, pg_timeout=60)
        print(f"\nworld {world}: {len(WORLDS[world])} cases in {time.monotonic() - t:.1f}s", file=sys.stderr)
    per_rank = [r[case["name"]] for r in _RESULTS[world]]
    errors = {rank: r["error"] for rank, r in enumerate(per_rank) if r["error"]}
    if errors:
        rank = min(errors)
        pytest.fail(f"{case['name']}: failed on ranks {sorted(errors)}; rank {rank}:\n{errors[rank]}")
    return per_rank


def _expected(case: dict):
    return megatron_layout(case["cfg"], **case["expect"])


@pytest.mark.parametrize(("world", "case"), ALL, ids=_IDS)
def test_live_layout(world, case):
    per_rank = _results(world, case)
    want = _expected(case)
    digests = {rank: r["digest"] for rank, r in enumerate(per_rank)}
    assert len(set(digests.values())) == 1, f"{case['name']}: the ranks' layouts differ: {digests}"
    args = {**case["expect"], "dtype": str(case["expect"]["dtype"])}
    for rank, r in enumerate(per_rank):
        got = {k: (list(v) if isinstance(v, tuple) else v) for k, v in r["args"].items()}
        assert got == args, f"{case['name']}: rank {rank} derived {got}, expected {args}"
    assert digests[0] == want.digest, f"{case['name']}: the live layout is not megatron_layout(**{case['expect']})"


_TENSOR = re.compile(r"(embedding\.word_embeddings|output_layer|decoder\.)[\w.]*")


@pytest.mark.parametrize(("world", "case"), ALL, ids=_IDS)
def test_wrong_inputs(world, case):
    per_rank = _results(world, case)
    layout = _expected(case)
    labels = sorted(per_rank[0]["errors"])
    assert labels, f"{case['name']}: no wrong inputs tried"
    for rank, r in enumerate(per_rank):
        local = set(layout.local_specs(_layout_rank(case, rank)))
        for label in labels:
            msg = r["errors"][label]
            assert msg is not None, f"{case['name']}: wrong input {label!r} raised nothing on rank {rank}"
            if label == "two_chunks":
                assert msg.startswith("NotImplementedError") and "virtual pipeline" in msg, msg
                continue
            if label == "no_config":
                assert msg.startswith("ValueError") and "HF config" in msg, msg
                continue
            assert msg.startswith("ValueError"), f"{case['name']} {label} rank {rank}: {msg}"
            assert re.search(rf"\brank {rank}\b", msg), f"{case['name']} {label}: rank {rank} not named: {msg}"
            if label in ("hidden_size", "dtype", "intermediate"):  # mismatched tensors: one of this rank's named
                named = {m.group(0) for m in _TENSOR.finditer(msg)}
                assert named & local, f"{case['name']} {label} rank {rank}: no local tensor named: {msg}"
            if label == "hidden_size":  # and the TransformerConfig field that differs
                H = case["cfg"]["hidden_size"]
                assert f"TransformerConfig.hidden_size={H} vs HF hidden_size={2 * H}" in msg, msg


def _layout_rank(case: dict, rank: int) -> int:
    r = case["expect"]["ranks"]
    if r is None:
        return rank
    return r + rank if isinstance(r, int) else list(r)[rank]
