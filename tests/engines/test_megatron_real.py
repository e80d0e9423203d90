"""``megatron_layout`` against real Megatron-Core GPTModels (megatron-core 0.16.1, CPU, gloo).

Two spawned worlds (4 and 8 ranks, see ``megatron_worker.py``) build every case's real ``GPTModel`` with
``get_gpt_layer_local_spec`` (Transformer Engine does not install without CUDA) and the layout with
``spec="local"``. Per case and rank:

* ``test_local_specs``: ``megatron_layout(...).local_specs(rank)`` equals ``{name: (shape, dtype)}`` of the
  real model's ``named_parameters()`` (+ ``named_buffers()``), exactly.
* ``test_boxes``: the HF tensors hold unique ids, every rank's parameters are overwritten with
  ``layout.shard(...)`` (vocab padding, which no fragment covers, with a sentinel), and the Megatron-global
  tensors are assembled from all ranks' ``sharded_state_dict()`` boxes (the model's own statement of which
  global box each rank holds): replicas must agree, every element must be written, and each global tensor
  must equal the conversion below, written from Megatron's documented global (checkpoint) format:

  - ``embedding.word_embeddings.weight`` / ``output_layer.weight`` ``[V_pad, H]``: the HF rows, then
    padding rows (``V_pad``: Megatron-LM's ``_vocab_size_with_padding``, or no padding as Megatron-Bridge
    builds HF models); a tied model's last stage (PP > 1) saves its output layer as a replica of the
    embedding.
  - ``decoder.layers.self_attention.linear_qkv.weight`` / ``.bias`` ``[L, (nh + 2 ng) hd, ...]``: per KV
    group ``[q_g; k_g; v_g]``; ``linear_proj.weight`` ``[L, H, nh hd]`` = o_proj.
  - ``decoder.layers.self_attention.linear_qkv.layer_norm_weight`` / ``mlp.linear_fc1.layer_norm_weight``
    ``[L, H]``: the input / post-attention norms (the local spec maps its ``input_layernorm`` /
    ``pre_mlp_layernorm`` to the TE checkpoint keys); ``q_layernorm`` / ``k_layernorm`` ``[L, hd]``.
  - ``decoder.layers.mlp.linear_fc1.weight`` ``[L, 2I, H]`` = ``[gate; up]`` (the swiglu sharded factory
    splits each rank's ``[gate_tp; up_tp]`` into two boxes), ``linear_fc2.weight`` ``[L, H, I]``.
  - MoE layers: ``mlp.router.weight`` ``[L, E, H]``; ``mlp.experts.experts.linear_fc1.weight``
    ``[L, E, 2 I_moe, H]`` = per global expert ``[gate_e; up_e]``, ``linear_fc2.weight`` ``[L, E, H, I_moe]``.
  - A model mixing dense and MoE layers (``moe_layer_freq`` a list) is "non-homogeneous": per-layer keys
    ``decoder.layers.{global layer}.…`` without the layer axis.

Skips (with the reason) when ``megatron.core`` cannot be imported.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron.core cannot be imported (tests/engines/install.sh installs megatron-core 0.16.1)")

sys.path.insert(0, os.path.dirname(__file__))
import megatron_worker  # noqa: E402

from triton_reshard.presets import get_config, logical_tensors  # noqa: E402
from triton_reshard.testing.launch import run_world  # noqa: E402

pytestmark = pytest.mark.slow

SENTINEL = megatron_worker.SENTINEL


def megatron_vocab(vocab: int, tp: int, divisible_by: int | None) -> int:
    """Megatron-LM ``_vocab_size_with_padding`` (grow until a multiple of ``divisible_by * tp``); ``None``:
    Megatron-Bridge's ``should_pad_vocab=False`` (the HF vocab as it is)."""
    if divisible_by is None:
        return vocab
    after = vocab
    while after % (divisible_by * tp):
        after += 1
    return after


def _case(name, model, tp, pp=1, ep=1, etp=None, over=None, vocab_divisible_by=128):
    cfg = {**get_config(model), **(over or {})}
    layout_kw = {} if vocab_divisible_by == 128 else {"vocab_divisible_by": vocab_divisible_by}
    return dict(name=name, cfg=cfg, tp=tp, pp=pp, ep=ep, etp=etp, layout_kw=layout_kw,
                megatron_vocab=megatron_vocab(cfg["vocab_size"], tp, vocab_divisible_by))


# (world 4: dp = 4 / (tp * pp)) dense Llama GQA, tied, Qwen2 bias, Qwen3 qk-norm, Qwen3-MoE, PP, TP > KV heads
CASES_4 = [
    _case("llama_tp2_pp2", "tiny_llama", tp=2, pp=2),
    _case("llama_tp4_above_kv2", "tiny_llama", tp=4),
    _case("llama_tied_tp2_pp2", "tiny_llama_tied", tp=2, pp=2),
    _case("llama_tied_tp2_dp2", "tiny_llama_tied", tp=2),
    _case("qwen3_qknorm_tp2_dp2", "tiny_qwen3", tp=2),
    _case("qwen3_qknorm_tp1_pp2_dp2", "tiny_qwen3", tp=1, pp=2),
    _case("qwen2_bias_tied_tp4_above_kv2", "tiny_qwen2", tp=4),
    _case("qwen2_bias_kv1_tp4", "tiny_qwen2", tp=4, over={"num_key_value_heads": 1}),
    _case("qwen3moe_tp2_dp2_ep2_etp1", "tiny_qwen3_moe", tp=2, ep=2, etp=1),
    _case("qwen3moe_tp2_dp2_ep2_etp2", "tiny_qwen3_moe", tp=2, ep=2),  # etp = tp
    _case("qwen3moe_dense0_tp1_pp2_dp2_ep2", "tiny_qwen3_moe", tp=1, pp=2, ep=2,
          over={"mlp_only_layers": [0]}),
    _case("llama_bridge_vocab_tp4", "tiny_llama", tp=4, vocab_divisible_by=None),  # no padding: 300 rows
    _case("llama_vocab301_div1_tp2_pp2", "tiny_llama", tp=2, pp=2, over={"vocab_size": 301},
          vocab_divisible_by=1),  # padded to 302 only
]
CASES_8 = [
    _case("llama_tp4_pp2_above_kv2", "tiny_llama", tp=4, pp=2),
    _case("qwen3moe_tp2_pp2_dp2_ep4_etp1", "tiny_qwen3_moe", tp=2, pp=2, ep=4, etp=1),
    _case("qwen3moe_tp4_dp2_ep2_etp4", "tiny_qwen3_moe", tp=4, ep=2),  # etp = tp = 4
    _case("qwen3moe_tp2_dp4_ep4_etp2_bridge_vocab", "tiny_qwen3_moe", tp=2, ep=4, vocab_divisible_by=None),
]
WORLDS = {4: CASES_4, 8: CASES_8}
ALL = [(w, c) for w, cases in WORLDS.items() for c in cases]

_RESULTS: dict[int, list[dict]] = {}


def _world(world: int) -> list[dict]:
    """Per rank ``{case name: result}`` of the spawned world (run once per module)."""
    if world not in _RESULTS:
        t = time.monotonic()
        _RESULTS[world] = run_world(megatron_worker.world_main, world, WORLDS[world], timeout=600, pg_timeout=60)
        print(f"\nworld {world}: {len(WORLDS[world])} cases in {time.monotonic() - t:.1f}s", file=sys.stderr)
    return _RESULTS[world]


def _results(world: int, case: dict) -> list[dict]:
    per_rank = [r[case["name"]] for r in _world(world)]
    errors = {rank: r["error"] for rank, r in enumerate(per_rank) if r["error"]}
    if errors:
        rank = min(errors)
        pytest.fail(f"{case['name']}: the real model did not build on ranks {sorted(errors)}; rank {rank}:\n"
                    f"{errors[rank]}")
    return per_rank


def _layout(world: int, case: dict):
    from triton_reshard.presets import megatron_layout

    tp, pp = case["tp"], case["pp"]
    return megatron_layout(case["cfg"], tp=tp, pp=pp, dp=world // (tp * pp), ep=case["ep"], etp=case["etp"],
                           spec="local", dtype=torch.float32, **case["layout_kw"])


_IDS = [f"w{w}-{c['name']}" for w, c in ALL]


@pytest.mark.parametrize(("world", "case"), ALL, ids=_IDS)
def test_local_specs(world, case):
    per_rank = _results(world, case)
    layout = _layout(world, case)
    problems = []
    for rank, res in enumerate(per_rank):
        want = {n: (s.shape, s.dtype) for n, s in layout.local_specs(rank).items()}
        got = res["params"]
        for n in sorted(set(want) | set(got)):
            if want.get(n) != got.get(n):
                problems.append(f"rank {rank} {n}: layout {want.get(n)} vs model {got.get(n)}")
    assert not problems, f"{case['name']}: {len(problems)} local tensors differ:\n" + "\n".join(problems[:20])


# --------------------------------------------------------------------------------------------------------
# HF -> Megatron-global conversion (independent of the presets: Megatron's checkpoint format)
# --------------------------------------------------------------------------------------------------------


def _is_moe(cfg, i):
    if not cfg.get("num_experts"):
        return False
    return i not in (cfg.get("mlp_only_layers") or []) and (i + 1) % (cfg.get("decoder_sparse_step") or 1) == 0


def megatron_globals(hf: dict, cfg: dict, vpad: int) -> dict[str, dict]:
    """``{Megatron checkpoint key: {index of the prepended axes (None, layer or (layer, expert)): tensor}}``."""
    H, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads") or nh
    hd = cfg.get("head_dim") or H // nh
    hpg, V = nh // nkv, cfg["vocab_size"]
    L = cfg["num_hidden_layers"]
    per_layer = len({_is_moe(cfg, i) for i in range(L)}) > 1  # non-homogeneous layers
    out: dict[str, dict] = {}

    def put(key, index, t):
        if per_layer and key.startswith("decoder.layers."):  # decoder.layers.{i}.*, no layer axis
            i, index = (index, None) if isinstance(index, int) else (index[0], index[1:])
            key = f"decoder.layers.{i}.{key.removeprefix('decoder.layers.')}"
        out.setdefault(key, {})[index] = t

    def pad(w):
        return torch.cat([w, torch.full((vpad - V, H), SENTINEL)])

    put("embedding.word_embeddings.weight", None, pad(hf["model.embed_tokens.weight"]))
    if not cfg.get("tie_word_embeddings"):
        put("output_layer.weight", None, pad(hf["lm_head.weight"]))
    put("decoder.final_layernorm.weight", None, hf["model.norm.weight"])
    d = "decoder.layers"
    for i in range(L):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        put(f"{d}.self_attention.linear_qkv.layer_norm_weight", i, hf[f"{p}.input_layernorm.weight"])
        for kind in ("weight", "bias") if cfg["model_type"] == "qwen2" else ("weight",):
            q, k, v = (hf[f"{a}.{x}_proj.{kind}"] for x in "qkv")
            parts = []
            for g in range(nkv):
                parts += [q[g * hpg * hd:(g + 1) * hpg * hd], k[g * hd:(g + 1) * hd], v[g * hd:(g + 1) * hd]]
            put(f"{d}.self_attention.linear_qkv.{kind}", i, torch.cat(parts))
        if cfg["model_type"] in ("qwen3", "qwen3_moe"):
            put(f"{d}.self_attention.q_layernorm.weight", i, hf[f"{a}.q_norm.weight"])
            put(f"{d}.self_attention.k_layernorm.weight", i, hf[f"{a}.k_norm.weight"])
        put(f"{d}.self_attention.linear_proj.weight", i, hf[f"{a}.o_proj.weight"])
        put(f"{d}.mlp.linear_fc1.layer_norm_weight", i, hf[f"{p}.post_attention_layernorm.weight"])
        m = f"{p}.mlp"
        if not _is_moe(cfg, i):
            put(f"{d}.mlp.linear_fc1.weight", i, torch.cat([hf[f"{m}.gate_proj.weight"], hf[f"{m}.up_proj.weight"]]))
            put(f"{d}.mlp.linear_fc2.weight", i, hf[f"{m}.down_proj.weight"])
            continue
        put(f"{d}.mlp.router.weight", i, hf[f"{m}.gate.weight"])
        for e in range(cfg["num_experts"]):
            x = f"{m}.experts.{e}"
            put(f"{d}.mlp.experts.experts.linear_fc1.weight", (i, e),
                torch.cat([hf[f"{x}.gate_proj.weight"], hf[f"{x}.up_proj.weight"]]))
            put(f"{d}.mlp.experts.experts.linear_fc2.weight", (i, e), hf[f"{x}.down_proj.weight"])
    return out


def _box(goff, prepend, shape):
    return tuple(slice(o, o + n) for o, n in zip(goff, (1,) * prepend + tuple(shape), strict=True))


def _owners(records, key, index):
    """``rank:param`` of the boxes of ``key`` holding global element ``index``."""
    hits = []
    for rank, (k, _, goff, prepend, _, data, param) in records:
        sizes = (1,) * prepend + tuple(data.shape)
        if k == key and all(o <= i < o + n for i, o, n in zip(index, goff, sizes, strict=True)):
            hits.append(f"rank {rank} ({param})")
    return ", ".join(hits) or "no rank"


@pytest.mark.parametrize(("world", "case"), ALL, ids=_IDS)
def test_boxes(world, case):
    per_rank = _results(world, case)
    if any(r["shards"] is None for r in per_rank):
        pytest.fail(f"{case['name']}: the layout's local tensors differ from the model's (see test_local_specs)")
    cfg = case["cfg"]
    records = [(rank, rec) for rank, r in enumerate(per_rank) for rec in r["shards"]]
    glob: dict[str, torch.Tensor] = {}
    written: dict[str, torch.Tensor] = {}
    replicas = []
    for rank, (key, gshape, goff, prepend, replica_id, data, param) in records:
        if key not in glob:
            glob[key] = torch.full(gshape, float("nan"))
            written[key] = torch.zeros(gshape, dtype=torch.bool)
        assert tuple(glob[key].shape) == gshape, f"{key}: global shape {gshape} on rank {rank} ({param})"
        box = _box(goff, prepend, data.shape)
        if any(replica_id):
            replicas.append((rank, key, box, data, param))
            continue
        assert not written[key][box].any(), f"{key}: main replica written twice (rank {rank}, {param})"
        glob[key][box] = data.reshape(glob[key][box].shape)
        written[key][box] = True
    for rank, key, box, data, param in replicas:
        assert written[key][box].all(), f"{key}: replica on rank {rank} ({param}) has no main copy"
        assert torch.equal(glob[key][box], data.reshape(glob[key][box].shape)), (
            f"{case['name']}: {key}: the replica on rank {rank} ({param}) differs from the main copy")

    shapes = logical_tensors(cfg)
    hf = megatron_worker.hf_ids(shapes)
    vpad = case["megatron_vocab"]
    want = megatron_globals(hf, cfg, vpad)
    assert sorted(glob) == sorted(want), (
        f"{case['name']}: Megatron keys {sorted(set(glob) ^ set(want))} are only on one side")
    for key, parts in want.items():
        exp = torch.full(glob[key].shape, float("nan"))
        mask = torch.zeros(glob[key].shape, dtype=torch.bool)
        for index, t in parts.items():
            idx = () if index is None else (index,) if isinstance(index, int) else index
            exp[idx] = t
            mask[idx] = True
        holes = mask & ~written[key]
        if holes.any():
            i = tuple(holes.nonzero()[0].tolist())
            pytest.fail(f"{case['name']}: {key} element {i} written by no rank")
        extra = written[key] & ~mask
        if extra.any():
            i = tuple(extra.nonzero()[0].tolist())
            pytest.fail(f"{case['name']}: {key} element {i} written by {_owners(records, key, i)} but not expected")
        bad = mask & (glob[key] != exp)
        if bad.any():
            i = tuple(bad.nonzero()[0].tolist())
            pytest.fail(f"{case['name']}: {key} differs at {i} ({int(bad.sum())} elements): got "
                        f"{glob[key][i].item()}, want {exp[i].item()}; held by {_owners(records, key, i)}")
