"""Fast checks of the real-model layout presets (no process group).

* every logical tensor covered the expected number of times (exact cover per replica), every local tensor
  covered exactly except the vocab padding, which no fragment touches;
* ``Layout.shard`` of each preset equals an independent conversion written from Megatron's / vLLM's rules
  (``tests/model_cases.py``), and a plan between two presets, applied in one process, produces the vLLM
  shards bit-exactly;
* names against real formats (HF ``save_pretrained`` keys; Megatron / vLLM ``named_parameters`` names
  written out from their source), fragment counts, rank mapping, errors for impossible configs.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import model_cases  # noqa: E402

from triton_reshard import plan_reshard  # noqa: E402
from triton_reshard.presets import (  # noqa: E402
    CONFIGS,
    get_config,
    hf_layout,
    logical_tensors,
    megatron_layout,
    model_nbytes,
    model_numel,
    pad_vocab_size,
    padded_vocab_size,
    tensor_dtypes,
    vllm_layout,
)


def _sd(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in logical_tensors(cfg).items()}


def _cfg(name, **kw):
    return {**get_config(name), **kw}


# --------------------------------------------------------------------------------------------------------
# configs and logical tensors
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "params"), [
    ("llama-3-8b", 8_030_261_248),
    ("qwen3-8b", 8_190_735_360),
    ("qwen3-30b-a3b", 30_532_122_624),
    ("qwen3-235b-a22b", 235_093_634_560),
])
def test_public_config_sizes(name, params):
    assert model_nbytes(get_config(name), torch.float32) // 4 == params


def test_deepseek_v3_parameter_count():
    """DeepSeek-V3 is published as "671B total parameters" (the main model) and the HF checkpoint as 685B:
    the main model plus one multi-token-prediction layer (``model.layers.61``: a full MoE decoder layer, its own
    embedding and output head copies, enorm/hnorm and ``eh_proj [H, 2H]``). We count the main model only."""
    cfg = get_config("deepseek-v3")
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    n = model_numel(cfg)
    assert n == 671_026_419_200
    shapes = logical_tensors(cfg)
    moe_layer = sum(math.prod(s) for k, s in shapes.items() if k.startswith("model.layers.3."))
    mtp = moe_layer + 2 * V * H + 3 * H + H * 2 * H
    assert round((n + mtp) / 1e9) == 684  # 684.49B, shown as "685B params" on the HF page
    # by hand: embeddings, 3 dense + 58 MoE layers (MLA attention, 256 + 1 experts, router, bias), norms
    qk, nh = 128 + 64, 128
    attn = 1536 * H + 1536 + nh * qk * 1536 + (512 + 64) * H + 512 + nh * (128 + 128) * 512 + H * nh * 128
    dense = 3 * 18432 * H
    moe = 257 * 3 * 2048 * H + 256 * H + 256
    assert n == 2 * V * H + H + 61 * (attn + 2 * H) + 3 * dense + 58 * moe
    # bf16 everywhere except the fp32 expert-score correction bias
    assert model_nbytes(cfg, torch.bfloat16) == 2 * n + 2 * 58 * 256
    assert {d for d in tensor_dtypes(cfg).values()} == {torch.bfloat16, torch.float32}


def test_llama_demo_size():
    assert 0.5e9 <= model_nbytes(get_config("llama_demo"), torch.float32) <= 1e9


@pytest.mark.parametrize(("name", "over"), [
    ("tiny_llama", {}), ("tiny_llama_tied", {}), ("tiny_qwen2", {}), ("tiny_qwen3", {}), ("tiny_qwen3_moe", {}),
    ("small_qwen3_moe", {}), ("tiny_deepseek_v3", {}), ("tiny_deepseek_v3", {"q_lora_rank": None}),
    ("small_deepseek_v3", {"first_k_dense_replace": 2}),
], ids=lambda x: str(x))
def test_logical_tensors_match_transformers_checkpoint(name, over, tmp_path):
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    cfg = _cfg(name, **over)
    cls = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe",
           "deepseek_v3": "DeepseekV3"}[cfg["model_type"]]
    conf = getattr(transformers, cls + "Config")(**{k: v for k, v in cfg.items() if k != "model_type"})
    getattr(transformers, cls + "ForCausalLM")(conf).save_pretrained(tmp_path)
    saved = {k: tuple(v.shape) for k, v in load_file(tmp_path / "model.safetensors").items()}
    assert saved == logical_tensors(cfg)
    assert logical_tensors(conf) == logical_tensors(cfg)  # a transformers config object works too


# --------------------------------------------------------------------------------------------------------
# exact cover
# --------------------------------------------------------------------------------------------------------


def _counts(layout):
    counts = {t.name: torch.zeros(t.shape, dtype=torch.int32) for t in layout.tensors}
    for f in layout.fragments:
        counts[f.tensor][tuple(slice(o, o + s) for o, s in zip(f.offsets, f.sizes, strict=True))] += 1
    return counts


def _is_vocab(local):
    return local in model_cases.VOCAB_LOCALS


def _check_locals(layout, cfg, tp, pad):
    """Every local tensor is covered exactly once, except vocab padding rows, which nothing covers."""
    covered = {}
    for f in layout.fragments:
        key = (f.rank, f.local)
        cov = covered.setdefault(key, torch.zeros(layout.local_specs(f.rank)[f.local].shape, dtype=torch.int32))
        loff, lsz = f.local_box(f.offsets, f.sizes)
        cov[tuple(slice(o, o + s) for o, s in zip(loff, lsz, strict=True))] += 1
    positions = {r: i for i, r in enumerate(layout.ranks)}
    for spec in layout.locals:
        cov = covered.get((spec.rank, spec.name), torch.zeros(spec.shape, dtype=torch.int32))
        if _is_vocab(spec.name):
            k = model_cases.vocab_valid_rows(spec.name, cfg, tp, positions[spec.rank], pad)
            assert (cov[:k] == 1).all() and (cov[k:] == 0).all(), (spec.rank, spec.name)
            assert spec.shape[0] * tp == (padded_vocab_size(cfg["vocab_size"], tp) if pad == 128
                                         else pad_vocab_size(cfg["vocab_size"]))
        else:
            assert (cov == 1).all(), (spec.rank, spec.name)


MEGATRON_GRID = [
    ("tiny_llama", {}, dict(tp=2)),
    ("tiny_llama", {}, dict(tp=2, pp=2, dp=2)),
    ("tiny_llama_tied", {}, dict(tp=1, pp=2, dp=2)),
    ("tiny_llama_tied", {}, dict(tp=2)),
    ("tiny_qwen2", {}, dict(tp=2, dp=3)),
    ("tiny_qwen3", {"num_key_value_heads": 4}, dict(tp=4, pp=2)),
    ("tiny_llama", {}, dict(tp=4)),  # tp > 2 KV heads: linear_qkv a plain row chunk (q only, then k+v)
    ("tiny_qwen2", {"num_key_value_heads": 1}, dict(tp=4, dp=2)),  # 1 KV head, qkv bias
    ("tiny_qwen3_moe", {}, dict(tp=2, dp=2, ep=2, etp=1)),
    ("tiny_qwen3_moe", {}, dict(tp=2, dp=2, ep=2)),  # expert-TP 2 x EP 2
    ("tiny_qwen3_moe", {}, dict(tp=2, pp=2, dp=2, ep=4, etp=1, grouped_gemm=False)),
    ("small_qwen3_moe", {}, dict(tp=4, pp=2, dp=2, ep=8, etp=1)),
    ("tiny_deepseek_v3", {}, dict(tp=2)),  # experts expert-TP 2
    ("tiny_deepseek_v3", {}, dict(tp=2, pp=2, ep=2, etp=1)),
    ("tiny_deepseek_v3", {}, dict(tp=4, pp=2, dp=2, ep=8, etp=1, grouped_gemm=False)),
    ("tiny_deepseek_v3", {"q_lora_rank": None}, dict(tp=2, dp=2, ep=2)),  # linear_q_proj; ETP 2 x EP 2
    ("small_deepseek_v3", {}, dict(tp=2, pp=2, dp=4, ep=4, etp=2)),
]

VLLM_GRID = [
    ("tiny_llama", {}, dict(tp=1)),
    ("tiny_llama", {}, dict(tp=4)),  # 2 kv heads replicated over 4 ranks
    ("tiny_llama_tied", {}, dict(tp=2, dp=2)),
    ("tiny_qwen2", {"num_attention_heads": 8, "head_dim": 8}, dict(tp=8)),
    ("tiny_qwen3", {}, dict(tp=2, dp=3)),
    ("tiny_qwen3_moe", {}, dict(tp=2, dp=2)),  # experts TP-split over all 4 workers
    ("tiny_qwen3_moe", {}, dict(tp=2, dp=2, enable_expert_parallel=True)),
    ("tiny_qwen3_moe", {"num_experts": 6}, dict(tp=4, enable_expert_parallel=True)),  # 6 experts on 4: 2,2,1,1
    ("small_qwen3_moe", {}, dict(tp=4, dp=2, enable_expert_parallel=True)),
    ("tiny_deepseek_v3", {}, dict(tp=2)),
    ("tiny_deepseek_v3", {}, dict(tp=4, dp=2)),  # experts' intermediate dim over 8 workers
    ("tiny_deepseek_v3", {}, dict(tp=2, dp=2, enable_expert_parallel=True)),  # shared experts replicated (SP MoE)
    ("tiny_deepseek_v3", {}, dict(tp=4, enable_expert_parallel=True)),  # shared experts TP-split
    ("tiny_deepseek_v3", {"q_lora_rank": None}, dict(tp=2, dp=3, enable_expert_parallel=True)),  # 8 on 6: 2,2,1..
    ("small_deepseek_v3", {}, dict(tp=8, dp=2, enable_expert_parallel=True)),
]


_DUPLICATED = ("norm.weight", "mlp.gate.weight", "e_score_correction_bias", "q_a_proj.weight",
               "kv_a_proj_with_mqa.weight")  # whole on every TP rank (MLA down projections: TELinear duplicated)


def _expected_megatron_count(name, cfg, kw):
    tp, pp, dp = kw.get("tp", 1), kw.get("pp", 1), kw.get("dp", 1)
    ep = kw.get("ep", 1)
    etp = kw.get("etp") or tp
    if ".mlp.experts." in name:
        return tp * dp // (etp * ep)
    if name.endswith(_DUPLICATED):
        return tp * dp
    if name == "model.embed_tokens.weight" and cfg["tie_word_embeddings"] and pp > 1:
        return 2 * dp
    return dp


def _expected_vllm_count(name, cfg, kw):
    tp, dp = kw.get("tp", 1), kw.get("dp", 1)
    nkv = cfg["num_key_value_heads"]
    if ".mlp.experts." in name:
        return 1
    if name.endswith(_DUPLICATED):
        return tp * dp
    if ".shared_experts." in name and kw.get("enable_expert_parallel") and tp > 1 and dp > 1:
        return tp * dp  # vLLM sequence-parallel MoE: shared experts replicated
    if name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")):
        return dp * max(1, tp // nkv)
    return dp


@pytest.mark.parametrize(("name", "over", "kw"), MEGATRON_GRID, ids=lambda x: str(x))
def test_megatron_exact_cover(name, over, kw):
    cfg = _cfg(name, **over)
    layout = megatron_layout(cfg, dtype=torch.float32, **kw)
    assert {t.name: t.shape for t in layout.tensors} == logical_tensors(cfg)
    for n, c in _counts(layout).items():
        want = _expected_megatron_count(n, cfg, kw)
        assert c.min() == c.max() == want, (n, c.min().item(), c.max().item(), want)
    _check_locals(layout, cfg, kw.get("tp", 1), 128)


@pytest.mark.parametrize(("name", "over", "kw"), VLLM_GRID, ids=lambda x: str(x))
def test_vllm_exact_cover(name, over, kw):
    cfg = _cfg(name, **over)
    layout = vllm_layout(cfg, dtype=torch.float32, **kw)
    for n, c in _counts(layout).items():
        want = _expected_vllm_count(n, cfg, kw)
        assert c.min() == c.max() == want, (n, c.min().item(), c.max().item(), want)
    _check_locals(layout, cfg, kw.get("tp", 1), 64)


def test_hf_layout_replicated():
    cfg = get_config("tiny_qwen3_moe")
    layout = hf_layout(cfg, ranks=(2, 5), dtype=torch.float32)
    assert layout.ranks == (2, 5)
    assert all((c == 2).all() for c in _counts(layout).values())
    assert layout.local_shapes(5) == logical_tensors(cfg)


# --------------------------------------------------------------------------------------------------------
# against the independent conversions, and a plan applied in one process
# --------------------------------------------------------------------------------------------------------


def _assert_shards_equal(got, want, cfg, tp, position, pad, what):
    assert sorted(got) == sorted(want), (what, sorted(set(got) ^ set(want))[:6])
    for n, w in want.items():
        g = got[n]
        assert g.shape == w.shape, (what, n, g.shape, w.shape)
        if _is_vocab(n):
            k = model_cases.vocab_valid_rows(n, cfg, tp, position, pad)
            g, w = g[:k], w[:k]
        assert torch.equal(g, w), (what, n)


@pytest.mark.parametrize(("name", "over", "kw"), MEGATRON_GRID, ids=lambda x: str(x))
def test_megatron_matches_independent_conversion(name, over, kw):
    cfg = _cfg(name, **over)
    sd = _sd(cfg)
    layout = megatron_layout(cfg, dtype=torch.float32, ranks=10, **kw)  # ranks 10.. (an offset)
    world = kw.get("tp", 1) * kw.get("pp", 1) * kw.get("dp", 1)
    assert layout.ranks == tuple(range(10, 10 + world))
    conv = {k: v for k, v in kw.items() if k != "grouped_gemm"}
    for p in range(world):
        want = model_cases.megatron_shards(sd, cfg, position=p, grouped=kw.get("grouped_gemm", True), **conv)
        _assert_shards_equal(layout.shard(sd, 10 + p), want, cfg, kw.get("tp", 1), p, 128, f"megatron {p}")


@pytest.mark.parametrize(("name", "over", "kw"), VLLM_GRID, ids=lambda x: str(x))
def test_vllm_matches_independent_conversion(name, over, kw):
    cfg = _cfg(name, **over)
    sd = _sd(cfg)
    ranks = list(range(20, 20 + kw.get("tp", 1) * kw.get("dp", 1)))[::-1]  # any rank list, in position order
    layout = vllm_layout(cfg, dtype=torch.float32, ranks=ranks, **kw)
    for p, r in enumerate(ranks):
        want = model_cases.vllm_shards(sd, cfg, tp=kw.get("tp", 1), dp=kw.get("dp", 1),
                                       ep=kw.get("enable_expert_parallel", False), position=p)
        _assert_shards_equal(layout.shard(sd, r), want, cfg, kw.get("tp", 1), p, 64, f"vllm {p}")
    shards = [layout.shard(sd, r) for r in ranks]
    back = model_cases.vllm_to_hf(shards, cfg, tp=kw.get("tp", 1), dp=kw.get("dp", 1),
                                  ep=kw.get("enable_expert_parallel", False))
    assert sorted(back) == sorted(sd) and all(torch.equal(back[n], sd[n]) for n in sd)


def _apply_plan(plan, src_by_rank, dst_by_rank):
    """Run a plan in one process: every transfer is a box copy from a source local to a destination local."""
    for t in plan.transfers + plan.local_copies:
        extra_s = len(t.src_offsets) - len(t.sizes)
        extra_d = len(t.dst_offsets) - len(t.sizes)
        s = src_by_rank[t.src_rank][t.src_local][
            tuple(slice(o, o + n) for o, n in zip(t.src_offsets, (1,) * extra_s + t.sizes, strict=True))]
        d = dst_by_rank[t.dst_rank][t.dst_local][
            tuple(slice(o, o + n) for o, n in zip(t.dst_offsets, (1,) * extra_d + t.sizes, strict=True))]
        d.copy_(s.reshape(d.shape))


@pytest.mark.parametrize(("name", "over", "src_kw", "dst_kw", "dst_offset"), [
    ("tiny_llama", {}, dict(tp=2, pp=2), dict(tp=4), 0),
    ("tiny_llama_tied", {}, dict(tp=1, pp=2, dp=2), dict(tp=2, dp=2), 4),
    ("tiny_qwen2", {}, dict(tp=2, dp=2), dict(tp=1, dp=4), 0),
    ("tiny_qwen3_moe", {}, dict(tp=2, pp=2, dp=2, ep=4, etp=1), dict(tp=4, dp=2), 0),
    ("tiny_qwen3_moe", {}, dict(tp=2, dp=2, ep=2), dict(tp=2, dp=2, enable_expert_parallel=True), 4),
    ("tiny_deepseek_v3", {}, dict(tp=2, pp=2, ep=2, etp=1), dict(tp=2, dp=2, enable_expert_parallel=True), 0),
    ("tiny_deepseek_v3", {}, dict(tp=4, dp=2, ep=4, etp=1), dict(tp=2, dp=2), 8),
    ("tiny_deepseek_v3", {"q_lora_rank": None}, dict(tp=2, pp=2, dp=2, ep=4, etp=1), dict(tp=4, dp=2), 0),
], ids=lambda x: str(x))
def test_plan_megatron_to_vllm_in_one_process(name, over, src_kw, dst_kw, dst_offset):
    cfg = _cfg(name, **over)
    sd = _sd(cfg, seed=3)
    src = megatron_layout(cfg, dtype=torch.float32, **src_kw)
    dst = vllm_layout(cfg, dtype=torch.float32, ranks=dst_offset, **dst_kw)
    plan = plan_reshard(src, dst)
    if dst_offset >= len(src.ranks):
        assert not plan.local_copies  # disaggregated: everything goes over the wire
    st = plan.stats()
    assert st.wire_bytes == st.lower_bound_bytes
    # each destination element is received once: bytes = the destination's non-padding bytes
    dst_bytes = sum(f.numel for f in dst.fragments) * 4
    assert sum(t.nbytes for t in plan.transfers + plan.local_copies) == dst_bytes
    src_by_rank = {r: src.shard(sd, r) for r in src.ranks}
    dst_by_rank = {r: {n: torch.full(s, float("nan")) for n, s in dst.local_shapes(r).items()} for r in dst.ranks}
    _apply_plan(plan, src_by_rank, dst_by_rank)
    tp, dp = dst_kw.get("tp", 1), dst_kw.get("dp", 1)
    for p, r in enumerate(dst.ranks):
        want = model_cases.vllm_shards(sd, cfg, tp=tp, dp=dp, ep=dst_kw.get("enable_expert_parallel", False),
                                       position=p)
        got = dst_by_rank[r]
        for n in got:
            if _is_vocab(n):
                k = model_cases.vocab_valid_rows(n, cfg, tp, p, 64)
                assert torch.isnan(got[n][k:]).all(), f"padding of {n} written"
        _assert_shards_equal(got, want, cfg, tp, p, 64, f"plan -> vllm {p}")


# --------------------------------------------------------------------------------------------------------
# names, counts, mapping
# --------------------------------------------------------------------------------------------------------


def test_megatron_names_qwen3_moe_rank0():
    """Rank 0 of Megatron tp=2 pp=2 ep=2 etp=1 (TE spec, TEGroupedMLP): exactly these parameters."""
    cfg = _cfg("tiny_qwen3_moe", mlp_only_layers=[0], num_hidden_layers=4)
    layout = megatron_layout(cfg, tp=2, pp=2, ep=2, etp=1)
    E_loc, H, hd = 4, 64, 16
    want = {
        "embedding.word_embeddings.weight": (256, H),  # 300 -> 512 (a multiple of 128 * tp), / tp
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": (H,),
        "decoder.layers.0.self_attention.linear_qkv.weight": ((4 + 2 * 2) * hd // 2, H),
        "decoder.layers.0.self_attention.q_layernorm.weight": (hd,),
        "decoder.layers.0.self_attention.k_layernorm.weight": (hd,),
        "decoder.layers.0.self_attention.linear_proj.weight": (H, 4 * hd // 2),
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight": (H,),
        "decoder.layers.0.mlp.linear_fc1.weight": (96, H),
        "decoder.layers.0.mlp.linear_fc2.weight": (H, 48),
        "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight": (H,),
        "decoder.layers.1.self_attention.linear_qkv.weight": (64, H),
        "decoder.layers.1.self_attention.q_layernorm.weight": (hd,),
        "decoder.layers.1.self_attention.k_layernorm.weight": (hd,),
        "decoder.layers.1.self_attention.linear_proj.weight": (H, 32),
        "decoder.layers.1.pre_mlp_layernorm.weight": (H,),
        "decoder.layers.1.mlp.router.weight": (8, H),
        **{f"decoder.layers.1.mlp.experts.linear_fc1.weight{k}": (64, H) for k in range(E_loc)},
        **{f"decoder.layers.1.mlp.experts.linear_fc2.weight{k}": (H, 32) for k in range(E_loc)},
    }
    assert layout.local_shapes(0) == want
    last = layout.local_shapes(3)  # pp stage 1, tp 1: layers 2, 3 named 0, 1
    assert "output_layer.weight" in last and "decoder.final_layernorm.weight" in last
    assert "decoder.layers.1.mlp.experts.linear_fc1.weight3" in last and "decoder.layers.2.mlp.router.weight" not in last


def test_vllm_names_qwen3_moe_rank0():
    cfg = get_config("tiny_qwen3_moe")
    layout = vllm_layout(cfg, tp=2, dp=2, enable_expert_parallel=True)
    H, hd = 64, 16
    p = "model.layers.0"
    want = {
        "model.embed_tokens.weight": (160, H),  # 300 -> 320 (64), / tp
        "lm_head.weight": (160, H),
        "model.norm.weight": (H,),
        f"{p}.self_attn.qkv_proj.weight": ((2 + 2 * 1) * hd, H),
        f"{p}.self_attn.o_proj.weight": (H, 2 * hd),
        f"{p}.self_attn.q_norm.weight": (hd,),
        f"{p}.self_attn.k_norm.weight": (hd,),
        f"{p}.input_layernorm.weight": (H,),
        f"{p}.post_attention_layernorm.weight": (H,),
        f"{p}.mlp.gate.weight": (8, H),
        f"{p}.mlp.experts.routed_experts.w13_weight": (2, 64, H),  # 8 experts over 4 EP ranks, [gate; up] of 32 each
        f"{p}.mlp.experts.routed_experts.w2_weight": (2, H, 32),
    }
    got = layout.local_shapes(0)
    assert {k: v for k, v in got.items() if not k.startswith("model.layers.1.")} == want


def test_megatron_names_deepseek_v3_rank0():
    """Rank 0 of Megatron tp=2 pp=2 ep=2 etp=1 for DeepSeek-V3 (MLA + MoE, TE spec, TEGroupedMLP), names and shapes
    written out from ``multi_latent_attention.py`` / ``gpt_layer_specs.py`` / ``shared_experts.py``."""
    cfg = get_config("tiny_deepseek_v3")  # 4 layers: layer 0 dense, 1-3 MoE; stage 0 = layers 0, 1
    layout = megatron_layout(cfg, tp=2, pp=2, ep=2, etp=1)
    H, E_loc = 64, 4
    att = {
        "input_layernorm.weight": (H,),
        "self_attention.linear_q_down_proj.weight": (32, H),  # q_lora_rank x H, duplicated
        "self_attention.linear_q_up_proj.layer_norm_weight": (32,),
        "self_attention.linear_q_up_proj.weight": (2 * (8 + 4), 32),  # 2 of 4 heads x (nope + rope)
        "self_attention.linear_kv_down_proj.weight": (16 + 4, H),  # kv_lora_rank + rope, duplicated
        "self_attention.linear_kv_up_proj.layer_norm_weight": (16,),
        "self_attention.linear_kv_up_proj.weight": (2 * (8 + 8), 16),  # 2 heads x (nope + v)
        "self_attention.linear_proj.weight": (H, 2 * 8),
    }
    want = {
        "embedding.word_embeddings.weight": (256, H),
        **{f"decoder.layers.{j}.{k}": v for j in (0, 1) for k, v in att.items()},
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight": (H,),
        "decoder.layers.0.mlp.linear_fc1.weight": (96, H),
        "decoder.layers.0.mlp.linear_fc2.weight": (H, 48),
        "decoder.layers.1.pre_mlp_layernorm.weight": (H,),
        "decoder.layers.1.mlp.router.weight": (8, H),
        "decoder.layers.1.mlp.router.expert_bias": (8,),
        "decoder.layers.1.mlp.shared_experts.linear_fc1.weight": (16, H),  # [gate_tp; up_tp] of 16 / tp 2
        "decoder.layers.1.mlp.shared_experts.linear_fc2.weight": (H, 8),
        **{f"decoder.layers.1.mlp.experts.linear_fc1.weight{k}": (32, H) for k in range(E_loc)},
        **{f"decoder.layers.1.mlp.experts.linear_fc2.weight{k}": (H, 16) for k in range(E_loc)},
    }
    assert layout.local_shapes(0) == want
    assert layout.local_specs(0)["decoder.layers.1.mlp.router.expert_bias"].dtype == torch.float32
    assert layout.local_specs(0)["decoder.layers.1.mlp.router.weight"].dtype == torch.bfloat16
    qn = megatron_layout(_cfg("tiny_deepseek_v3", q_lora_rank=None), tp=2)
    assert qn.local_shapes(1)["decoder.layers.0.self_attention.linear_q_proj.weight"] == (24, H)
    assert not any("q_down" in n or "q_up" in n for n in qn.local_shapes(1))


def test_vllm_names_deepseek_v3_rank0():
    """vLLM worker 0 of TP2 x DP2 with expert parallel (DeepseekV2MLAAttention, DeepseekV2MoE, FusedMoE)."""
    cfg = get_config("tiny_deepseek_v3")
    H, p = 64, "model.layers.1"
    want = {
        "model.embed_tokens.weight": (160, H),
        "lm_head.weight": (160, H),
        "model.norm.weight": (H,),
        f"{p}.input_layernorm.weight": (H,),
        f"{p}.post_attention_layernorm.weight": (H,),
        f"{p}.self_attn.fused_qkv_a_proj.weight": (32 + 16 + 4, H),  # [q_a_proj; kv_a_proj_with_mqa], whole
        f"{p}.self_attn.q_a_layernorm.weight": (32,),
        f"{p}.self_attn.q_b_proj.weight": (2 * 12, 32),
        f"{p}.self_attn.kv_a_layernorm.weight": (16,),
        f"{p}.self_attn.kv_b_proj.weight": (2 * 16, 16),
        f"{p}.self_attn.o_proj.weight": (H, 2 * 8),
        f"{p}.mlp.gate.weight": (8, H),
        f"{p}.mlp.gate.e_score_correction_bias": (8,),
        f"{p}.mlp.shared_experts.gate_up_proj.weight": (32, H),  # sequence-parallel MoE: not TP-split
        f"{p}.mlp.shared_experts.down_proj.weight": (H, 16),
        f"{p}.mlp.experts.routed_experts.w13_weight": (2, 32, H),  # 8 experts over 4 EP ranks
        f"{p}.mlp.experts.routed_experts.w2_weight": (2, H, 16),
    }
    got = vllm_layout(cfg, tp=2, dp=2, enable_expert_parallel=True).local_shapes(0)
    assert {k: v for k, v in got.items() if not k.startswith(("model.layers.0.", "model.layers.2.",
                                                               "model.layers.3."))} == want
    assert got["model.layers.0.mlp.gate_up_proj.weight"] == (96, H)  # first_k_dense_replace=1: dense layer 0
    # without DP the shared experts are TP-split; sequence_parallel_moe overrides the rule
    tp_only = vllm_layout(cfg, tp=2, enable_expert_parallel=True).local_shapes(1)
    assert tp_only[f"{p}.mlp.shared_experts.gate_up_proj.weight"] == (16, H)
    forced = vllm_layout(cfg, tp=2, dp=2, enable_expert_parallel=True, sequence_parallel_moe=False)
    assert forced.local_shapes(3)[f"{p}.mlp.shared_experts.down_proj.weight"] == (H, 8)
    qn = vllm_layout(_cfg("tiny_deepseek_v3", q_lora_rank=None), tp=2).local_shapes(0)
    assert qn[f"{p}.self_attn.q_proj.weight"] == (24, H) and qn[f"{p}.self_attn.kv_a_proj_with_mqa.weight"] == (20, H)


def test_deepseek_v3_full_size_refit_plan():
    """The real DeepSeek-V3 shape on 16 ranks: Megatron TP2 x PP2 (31 + 30 layers) x DP4, EP8 -> vLLM TP8 x DP2
    with expert parallel on the same ranks. Distinct boxes tile the model once on each side, the expert bias is
    fp32 on both, and the plan moves exactly the lower bound."""
    cfg = get_config("deepseek-v3")
    src = megatron_layout(cfg, tp=2, pp=2, dp=4, ep=8, etp=1, layers_per_stage=[31, 30])
    dst = vllm_layout(cfg, tp=8, dp=2, enable_expert_parallel=True)
    n = model_numel(cfg)
    for layout in (src, dst):
        distinct = {(f.tensor, f.offsets, f.sizes) for f in layout.fragments}
        assert sum(math.prod(s) for _, _, s in distinct) == n
        assert layout.specs["model.layers.60.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    # 256 experts / EP8 = 32 per Megatron rank; / 16 vLLM workers = 16 per worker
    assert src.local_shapes(0)["decoder.layers.30.mlp.experts.linear_fc1.weight31"] == (2 * 2048, 7168)
    assert "decoder.layers.30.input_layernorm.weight" in src.local_shapes(0)
    assert "decoder.layers.30.input_layernorm.weight" not in src.local_shapes(8)  # stage 1 has 30 layers
    assert dst.local_shapes(15)["model.layers.60.mlp.experts.routed_experts.w13_weight"] == (16, 2 * 2048, 7168)
    st = plan_reshard(src, dst).stats()
    assert st.wire_bytes == st.lower_bound_bytes
    assert st.wire_bytes + st.local_bytes == sum(
        f.numel * dst.specs[f.tensor].itemsize for f in dst.fragments)


def test_fragment_counts():
    cfg = get_config("tiny_llama")  # 2 layers, 2 kv heads
    # per rank: embed, lm_head/output, final norm + per layer (norm, q, k, v, o, norm, gate, up, down)
    assert len(megatron_layout(cfg, tp=2).fragments) == 2 * (3 + 2 * 9)
    assert len(vllm_layout(cfg, tp=2).fragments) == 2 * (3 + 2 * 9)
    # Megatron interleaves per KV group: tp=1 has 2 groups, so q, k, v pieces twice
    assert len(megatron_layout(cfg, tp=1).fragments) == 3 + 2 * (9 + 3)
    moe = get_config("tiny_qwen3_moe")  # 8 experts, 2 layers
    v = vllm_layout(moe, tp=2, enable_expert_parallel=True)
    per_layer = 3 + 1 + 2 + 2 + 1 + 4 * 3  # qkv, o, qk norms, 2 norms, router, 4 experts x (gate, up, down)
    assert len(v.fragments) == 2 * (3 + 2 * per_layer)


def test_megatron_rank_order_tp_dp_pp():
    cfg = get_config("tiny_llama")
    layout = megatron_layout(cfg, tp=2, pp=2, dp=2, ranks=[7, 6, 5, 4, 3, 2, 1, 0])
    # position p: tp = p % 2, dp = (p // 2) % 2, pp = p // 4 -> position 5 (rank 2) is tp 1, dp 0, stage 1
    shapes = layout.local_shapes(2)
    assert "output_layer.weight" in shapes and "embedding.word_embeddings.weight" not in shapes
    frag = next(f for f in layout.fragments if f.rank == 2 and f.local == "output_layer.weight")
    assert frag.offsets == (256, 0) and frag.sizes == (300 - 256, 64)
    q = [f for f in layout.fragments if f.rank == 2 and f.tensor == "model.layers.1.self_attn.q_proj.weight"]
    assert [f.offsets[0] for f in q] == [32]  # second KV group (heads 2, 3) on tp rank 1


def test_disaggregated_and_colocated_plans():
    cfg = get_config("tiny_qwen3")
    src = megatron_layout(cfg, tp=2, dp=2)
    same = vllm_layout(cfg, tp=2, dp=2)
    apart = vllm_layout(cfg, tp=2, dp=2, ranks=range(4, 8))
    assert plan_reshard(src, apart).local_copies == ()
    colo = plan_reshard(src, same)
    # qkv/gate_up are regrouped but every box a rank needs is already on it; only the vocab rows cross
    # ranks (Megatron pads 300 to 512 = 2 x 256 rows, vLLM to 320 = 2 x 160 rows)
    assert {t.tensor for t in colo.transfers} == {"model.embed_tokens.weight", "lm_head.weight"}
    assert all(t.src_rank % 2 == 0 and t.offsets[0] >= 160 for t in colo.transfers)


@pytest.mark.parametrize(("fn", "cfg", "kw", "msg"), [
    (megatron_layout, "tiny_llama", dict(tp=3), "num_attention_heads"),
    (megatron_layout, "tiny_llama", dict(pp=3), "layers"),
    (megatron_layout, "tiny_llama", dict(ep=2), "without experts"),
    (megatron_layout, "tiny_llama", dict(tp=2, ranks=[0, 1, 2]), "needs 2 ranks"),
    (megatron_layout, "tiny_llama", dict(tp=2, ranks=[0, 0]), "distinct"),
    (megatron_layout, "tiny_qwen3_moe", dict(ep=3, dp=3), "num_experts"),
    (megatron_layout, "tiny_qwen3_moe", dict(tp=2, ep=2), "etp\\*ep"),
    (megatron_layout, "tiny_qwen3_moe", dict(dp=3, etp=3), "moe_intermediate_size"),
    (megatron_layout, "tiny_llama", dict(pp=2, layers_per_stage=[2, 1]), "layers_per_stage"),
    (vllm_layout, "tiny_llama", dict(tp=3), "num_attention_heads"),
    (vllm_layout, "tiny_qwen3_moe", dict(tp=2, dp=3), "moe_intermediate_size"),
    (vllm_layout, "tiny_qwen3_moe", dict(tp=4, dp=4, enable_expert_parallel=True), "cannot be split"),
    (vllm_layout, "tiny_llama", dict(tp=0), "must be an int"),
    (megatron_layout, "tiny_deepseek_v3", dict(tp=3), "num_attention_heads"),
    (megatron_layout, "tiny_deepseek_v3", dict(dp=16, ep=16, etp=1), "num_experts"),
    (vllm_layout, "tiny_deepseek_v3", dict(tp=2, dp=16), "moe_intermediate_size"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_impossible_configs(fn, cfg, kw, msg):
    with pytest.raises(ValueError, match=msg):
        fn(get_config(cfg), **kw)


@pytest.mark.parametrize(("over", "tp"), [
    ({"num_attention_heads": 12, "num_key_value_heads": 3}, 4),  # tp > groups, not a multiple of them
    ({"num_attention_heads": 12, "num_key_value_heads": 6}, 4),  # tp < groups, not a divisor
    ({"num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 1}, 8),  # 10 qkv rows over 8 ranks
])
def test_megatron_query_groups_vs_tp(over, tp):
    with pytest.raises(ValueError, match="num_key_value_heads"):
        megatron_layout(_cfg("tiny_llama", **over), tp=tp)


def test_megatron_tp_above_query_groups_rows():
    """tp=4 > 2 KV groups: ranks 0/2 hold the q heads of groups 0/1, ranks 1/3 their k and v."""
    layout = megatron_layout(get_config("tiny_llama"), tp=4, dtype=torch.float32)
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    got = {r: sorted((f.tensor.rsplit(".", 2)[1], f.offsets[0], f.sizes[0], f.local_offsets[0])
                     for f in layout.fragments if f.rank == r and f.local == qkv) for r in range(4)}
    assert got == {0: [("q_proj", 0, 32, 0)], 1: [("k_proj", 0, 16, 0), ("v_proj", 0, 16, 16)],
                   2: [("q_proj", 32, 32, 0)], 3: [("k_proj", 16, 16, 0), ("v_proj", 16, 16, 16)]}


def test_megatron_vocab_padding_options():
    cfg = get_config("tiny_llama")  # vocab 300
    assert padded_vocab_size(300, 2) == 512 and padded_vocab_size(300, 2, 1) == 300
    assert padded_vocab_size(301, 2, 1) == 302 and padded_vocab_size(300, 4, None) == 300
    with pytest.raises(ValueError, match="not divisible by tp"):
        padded_vocab_size(301, 2, None)
    with pytest.raises(ValueError, match="vocab_divisible_by"):
        megatron_layout(cfg, vocab_divisible_by=0)
    for div, rows in ((128, 256), (None, 150), (1, 150), (64, 192)):
        layout = megatron_layout(cfg, tp=2, vocab_divisible_by=div)
        assert layout.local_shapes(1)["embedding.word_embeddings.weight"] == (rows, 64), div
        for name in ("model.embed_tokens.weight", "lm_head.weight"):  # every vocab row once, rank 1 from row rows
            c = _counts(layout)[name]
            assert c.min() == c.max() == 1, (div, name)
            assert min(f.offsets[0] for f in layout.fragments if f.tensor == name and f.rank == 1) == rows


def test_megatron_local_spec_names():
    """get_gpt_layer_local_spec: separate norm modules, SequentialMLP experts (as a real model shows)."""
    dense = megatron_layout(get_config("tiny_qwen3"), tp=2, spec="local").local_shapes(0)
    te = megatron_layout(get_config("tiny_qwen3"), tp=2).local_shapes(0)
    p = "decoder.layers.0"
    assert dense[f"{p}.input_layernorm.weight"] == dense[f"{p}.pre_mlp_layernorm.weight"] == (64,)
    assert f"{p}.self_attention.linear_qkv.layer_norm_weight" not in dense
    assert f"{p}.mlp.linear_fc1.layer_norm_weight" not in dense
    rename = {f"{p}.self_attention.linear_qkv.layer_norm_weight": f"{p}.input_layernorm.weight",
              f"{p}.mlp.linear_fc1.layer_norm_weight": f"{p}.pre_mlp_layernorm.weight"}
    assert {rename.get(n.replace("layers.1", "layers.0"), n.replace("layers.1", "layers.0")): s
            for n, s in te.items()} == {n.replace("layers.1", "layers.0"): s for n, s in dense.items()}
    moe = megatron_layout(get_config("tiny_qwen3_moe"), tp=2, ep=2, etp=1, spec="local").local_shapes(1)
    assert moe[f"{p}.mlp.experts.local_experts.3.linear_fc1.weight"] == (64, 64)
    assert not any(".weight0" in n or "linear_fc1.layer_norm_weight" in n for n in moe)
    with pytest.raises(NotImplementedError, match="GroupedMLP"):
        megatron_layout(get_config("tiny_qwen3_moe"), spec="local", grouped_gemm=True)
    with pytest.raises(NotImplementedError, match="MLA"):
        megatron_layout(get_config("tiny_deepseek_v3"), spec="local")
    with pytest.raises(ValueError, match="spec"):
        megatron_layout(get_config("tiny_llama"), spec="transformer_engine")


def test_unsupported_families():
    with pytest.raises(NotImplementedError):
        logical_tensors({**get_config("tiny_llama"), "model_type": "mixtral"})
    with pytest.raises(NotImplementedError):
        vllm_layout({**get_config("tiny_llama"), "attention_bias": True})
    with pytest.raises(TypeError):
        logical_tensors(42)


def test_uneven_pipeline_stages():
    cfg = _cfg("tiny_llama", num_hidden_layers=3)
    layout = megatron_layout(cfg, pp=2, layers_per_stage=[1, 2])
    assert "decoder.layers.1.mlp.linear_fc2.weight" in layout.local_shapes(1)
    assert "decoder.layers.1.mlp.linear_fc2.weight" not in layout.local_shapes(0)
    f = next(f for f in layout.fragments if f.rank == 1 and f.local == "decoder.layers.1.mlp.linear_fc2.weight")
    assert f.tensor == "model.layers.2.mlp.down_proj.weight"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_config_builds(name):
    cfg = get_config(name)
    tp = math.gcd(cfg["num_key_value_heads"], 8)
    moe = cfg["model_type"] in ("qwen3_moe", "deepseek_v3")
    m = megatron_layout(cfg, tp=tp, dp=8 // tp, ep=8 if moe else 1, etp=1 if moe else None)
    vtp = math.gcd(cfg["num_attention_heads"], 8)
    v = vllm_layout(cfg, tp=vtp, dp=8 // vtp, enable_expert_parallel=moe)
    params = model_numel(cfg)
    assert model_nbytes(cfg, torch.float32) == 4 * params
    for layout in (m, v):  # replicas hold identical boxes; distinct boxes tile every tensor once
        distinct = {(f.tensor, f.offsets, f.sizes) for f in layout.fragments}
        assert sum(math.prod(s) for _, _, s in distinct) == params
    assert m.ranks == v.ranks == tuple(range(8))


def test_vllm_fused_moe_names_follow_the_vllm_version(monkeypatch):
    """FusedMoE weights moved under ``routed_experts`` in vLLM 0.24; the preset follows an explicit
    ``vllm_version``, else the installed vLLM, else the newest format checked by the engine tier."""
    from triton_reshard.presets import vllm as vp

    cfg = get_config("tiny_qwen3_moe")
    new, old = "model.layers.1.mlp.experts.routed_experts.w2_weight", "model.layers.1.mlp.experts.w2_weight"
    for version, name in (("0.23.2", old), ("0.24.0", new), ("0.33.0", new), ("1.0.0rc1", new)):
        shapes = vllm_layout(cfg, tp=2, vllm_version=version).local_shapes(1)
        assert name in shapes and (old if name == new else new) not in shapes, version
    monkeypatch.setattr(vp, "installed_vllm_version", lambda: "0.20.1")
    assert old in vllm_layout(cfg, tp=2).local_shapes(0)
    monkeypatch.setattr(vp, "installed_vllm_version", lambda: None)
    assert vp.resolve_vllm_version() == vp.NEWEST_KNOWN
    assert new in vllm_layout(cfg, tp=2).local_shapes(0)
    with pytest.raises(ValueError, match="not a version"):
        vllm_layout(cfg, tp=2, vllm_version="latest")
    # dense models have no FusedMoE: the version does not matter
    assert vllm_layout(get_config("tiny_llama"), tp=2, vllm_version="0.10.0") == vllm_layout(get_config("tiny_llama"), tp=2)
