"""Block-FP8 destinations (issue 11), the pure tiers: the layout model (``BlockQuant``, ``TensorSpec.quant``,
``block_quant_layout``) and the planner's quantization post-pass (exact cover of weights and scales, the
source / destination quantization modes, wire bytes against the lower bound, block-aligned chunking, clear
errors). No process group here; ``tests/test_quant_refit.py`` runs the plans on gloo worlds.

Expectations are computed independently of the planner: block grids and which rank holds which box come from
the test's own arithmetic over the layouts' descriptions.
"""

from __future__ import annotations

import math

import pytest
import torch

from triton_reshard import BlockQuant, Fragment, Layout, Replicate, Shard, TensorSpec, block_quant_layout
from triton_reshard.presets import get_config, vllm_layout

FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16


def _proj(t: TensorSpec) -> bool:
    return t.name.endswith("proj.weight") or ".experts." in t.name and t.name.endswith(".weight")


# --------------------------------------------------------------------------------------------------------
# Layout
# --------------------------------------------------------------------------------------------------------


def test_block_quant_layout_names_shapes_and_scales():
    w = Layout.from_placements({"w": (64, 40), "n": (40,)}, [0, 1], {"w": [Shard(0)], "n": [Replicate()]}, BF16)
    q = block_quant_layout(w, ["w"], (16, 16))
    spec = q.specs["w"]
    assert spec.dtype == FP8 and spec.quant == BlockQuant((16, 16), "w_scale_inv", False)
    assert q.specs["w_scale_inv"] == TensorSpec("w_scale_inv", (4, 3), torch.float32)
    assert q.specs["n"] == w.specs["n"]
    for r, row in ((0, 0), (1, 2)):
        assert q.local_specs(r)["w"].dtype == FP8
        assert q.local_shapes(r)["w_scale_inv"] == (2, 3)
        (sf,) = [f for f in q.fragments if f.tensor == "w_scale_inv" and f.rank == r]
        assert (sf.offsets, sf.sizes, sf.local, sf.local_offsets) == ((row, 0), (2, 3), "w_scale_inv", (0, 0))
    assert q.quantized == {"w": spec} and q.scale_of == {"w_scale_inv": "w"}
    assert q.digest != w.digest
    # quant is part of the value: other blocks or ue8m0 make another layout
    assert block_quant_layout(w, ["w"], (16, 16), ue8m0=True).digest != q.digest
    assert block_quant_layout(w, ["w"], (16, 16)) == q
    # restrict keeps the scales of a kept quantized tensor
    assert set(q.restrict(["w"]).specs) == {"w", "w_scale_inv"}


def test_block_quant_layout_vllm_fused_and_stacked():
    cfg = get_config("small_qwen3_moe")  # H 256, 8 heads x 32, 4 KV heads, experts of I 128
    d = vllm_layout(cfg, tp=2, dp=1, enable_expert_parallel=True, ranks=range(2), dtype=BF16)
    q = block_quant_layout(d, _proj, (32, 32))
    loc = q.local_specs(1)
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    assert loc[qkv].dtype == FP8 and loc[qkv].shape == ((4 + 2 + 2) * 32, 256)
    assert loc[qkv + "_scale_inv"].shape == (8, 8)
    # k rows of rank 1 (KV heads 2-3: rows 64..128 of k_proj) at local rows 128..192 -> scale rows 4..6
    (kf,) = [f for f in q.fragments if f.tensor == "model.layers.0.self_attn.k_proj.weight_scale_inv" and f.rank == 1]
    assert (kf.offsets, kf.sizes, kf.local_offsets) == ((2, 0), (2, 8), (4, 0))
    w13 = "model.layers.1.mlp.experts.routed_experts.w13_weight"
    assert loc[w13].shape == (8, 256, 256) and loc[w13 + "_scale_inv"].shape == (8, 8, 8)
    # the norms, the router and the embeddings stay as they were
    assert loc["model.layers.1.mlp.gate.weight"].dtype == BF16
    assert loc["model.embed_tokens.weight"].dtype == BF16


def test_block_quant_layout_refuses_misaligned_shards_naming_tensor_and_rank():
    w = Layout.from_placements({"w": (48, 32)}, [0, 1], [Shard(0)], BF16)  # 24 rows per rank
    with pytest.raises(ValueError, match=r"tensor 'w' on rank 0 .*ends at 24 in dim 0.*block 16"):
        block_quant_layout(w, ["w"], (16, 16))
    # rank 1's box is aligned in the tensor but sits at an unaligned row of its local tensor
    w = Layout.from_fragments({"w": ((40, 32), BF16)}, [Fragment("w", 0, (0, 0), (16, 32)),
                                                        Fragment("w", 1, (16, 0), (24, 32), "x", (4, 0))])
    with pytest.raises(ValueError, match=r"tensor 'w' on rank 1 .*local offset 4 in dim 0"):
        block_quant_layout(w, ["w"], (16, 16))
    # a partial last block at the tensor's end is fine
    w = Layout.from_fragments({"w": ((40, 20), BF16)}, [Fragment("w", 0, (0, 0), (32, 20)),
                                                        Fragment("w", 1, (32, 0), (8, 20))])
    ok = block_quant_layout(w, ["w"], (16, 16))
    assert ok.specs["w_scale_inv"].shape == (3, 2)
    assert ok.local_shapes(1)["w_scale_inv"] == (1, 2)


def test_block_quant_layout_errors():
    w = Layout.from_fragments({"a": ((16, 16), BF16), "b": ((16, 16), BF16)},
                              [Fragment("a", 0, (0, 0), (16, 16), "ab"), Fragment("b", 0, (0, 0), (16, 16), "ab", (16, 0))])
    with pytest.raises(ValueError, match=r"local tensor 'ab' on rank 0 holds quantized tensor 'a' and plain tensor 'b'"):
        block_quant_layout(w, ["a"], (16, 16))
    with pytest.raises(KeyError, match="unknown tensor 'c'"):
        block_quant_layout(w, ["c"], (16, 16))
    with pytest.raises(TypeError, match="string"):
        block_quant_layout(w, "a", (16, 16))
    i = Layout.from_placements({"i": (16, 16)}, [0], [Replicate()], torch.int32)
    with pytest.raises(ValueError, match="not floating point"):
        block_quant_layout(i, ["i"], (16, 16))


def test_tensor_spec_quant_validation():
    s = TensorSpec("w", (4, 8, 8), FP8, BlockQuant((4, 4), "s"))
    assert s.quant.block == (1, 4, 4) and s.scale_shape == (4, 2, 2)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        TensorSpec("w", (8, 8), BF16, BlockQuant((4, 4), "s"))
    with pytest.raises(ValueError, match="more dims"):
        TensorSpec("w", (8,), FP8, BlockQuant((4, 4), "s"))
    with pytest.raises(ValueError, match="block must be"):
        BlockQuant((0, 4), "s")
    with pytest.raises(TypeError, match="scale"):
        BlockQuant((4, 4), "")


def test_layout_validation_of_quantized_fragments():
    t = {"w": ((8, 8), FP8, BlockQuant((4, 4), "s")), "s": ((2, 2), torch.float32)}
    with pytest.raises(ValueError, match=r"quantized tensor 'w' on rank 0 .*lacks the scale fragment of 's' box \(0, 0\)\+\(2, 2\)"):
        Layout.from_fragments(t, [Fragment("w", 0, (0, 0), (8, 8))])
    with pytest.raises(ValueError, match=r"rank 0 lacks the scale fragment .* at local offsets \(0, 0\)"):
        Layout.from_fragments(t, [Fragment("w", 0, (0, 0), (8, 8)), Fragment("s", 0, (0, 0), (2, 2), "s", (1, 0))],
                              {(0, "s"): (3, 2)})
    with pytest.raises(ValueError, match=r"scale tensor 's' has 2 fragments, its weight 'w' 1"):
        Layout.from_fragments(t, [Fragment("w", 0, (0, 0), (8, 8)), Fragment("s", 0, (0, 0), (2, 2)),
                                  Fragment("s", 1, (0, 0), (2, 2))])
    with pytest.raises(ValueError, match=r"scale tensor 's' is not declared"):
        Layout.from_fragments({"w": t["w"]}, [Fragment("w", 0, (0, 0), (8, 8))])
    with pytest.raises(ValueError, match=r"need a plain \(2, 2\) float32"):
        Layout.from_fragments({"w": t["w"], "s": ((2, 3), torch.float32)}, [Fragment("w", 0, (0, 0), (8, 8))])
    with pytest.raises(ValueError, match=r"'w' on rank 1 .*starts at 2 in dim 1"):
        Layout.from_fragments(t, [Fragment("w", 1, (0, 2), (8, 6))])
    ok = Layout.from_fragments(t, [Fragment("w", 0, (0, 0), (8, 8)), Fragment("s", 0, (0, 0), (2, 2))])
    assert math.prod(ok.local_shapes(0)["s"]) == 4
