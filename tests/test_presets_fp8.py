"""vllm_layout with a block-FP8 ``quantization_config`` (issue 11): which tensors are FP8, the scale tensors'
names, shapes and TP split by blocks, ``modules_to_not_convert``, and the errors (misaligned TP partitions,
unsupported quantization configs). The same layouts are checked against the real vLLM 0.33 in
``tests/engines/test_vllm_fp8.py``; here every local tensor is checked against an independent slicing: the
dequantized shard of every rank = the plain (unquantized) preset's shard of the dequantized checkpoint, so each
scale element sits with exactly the weight elements it scales."""

from __future__ import annotations

import pytest
import torch

from triton_reshard.layout import QUANT_DTYPE, SCALE_DTYPE
from triton_reshard.ops.quantize import dequantize_blocks, quantize_blocks
from triton_reshard.presets import get_config, logical_tensors, tensor_dtypes, vllm_layout
from triton_reshard.presets.vllm import block_fp8_config, fp8_tensors

QC = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}


def fp8(name, ignored=None, qc=None, **over):
    cfg = {**get_config(name), **over}
    cfg["quantization_config"] = {**QC, **(qc or {})}
    if ignored is not None:
        cfg["quantization_config"]["modules_to_not_convert"] = list(ignored)
    return cfg


DS = dict(qk_rope_head_dim=8, moe_intermediate_size=32)  # every TP-2 partition of tiny_deepseek_v3 whole blocks
MODELS = {
    "llama": fp8("tiny_llama"),
    "qwen3": fp8("tiny_qwen3"),
    "qwen2": fp8("tiny_qwen2"),  # q/k/v biases (stay BF16 in qkv_proj.bias), tied embeddings
    "qwen3_moe": fp8("tiny_qwen3_moe"),
    "deepseek_v3": fp8("tiny_deepseek_v3", **DS),
    "deepseek_v3_no_q_lora": fp8("tiny_deepseek_v3", q_lora_rank=None, **DS),
}
CASES = [(m, ep, 2) for m in MODELS for ep in ((False, True) if "moe" in m or "deepseek" in m else (False,))]
CASES.append(("qwen3_moe", True, 4))  # TP 4 > 2 KV heads: each rank's k/v scale rows those of its replica


def _plain(cfg):
    return {k: v for k, v in cfg.items() if k != "quantization_config"}


def _checkpoint(cfg, seed=0):
    """A random BF16 model, block-quantized like an FP8 checkpoint: (fp8 checkpoint, dequantized weights)."""
    g = torch.Generator().manual_seed(seed)
    q = set(fp8_tensors(cfg))
    dts = tensor_dtypes(_plain(cfg), torch.bfloat16)
    ckpt, deq = {}, {}
    for n, shape in logical_tensors(_plain(cfg)).items():
        x = (torch.randn(shape, generator=g) * 0.1).to(dts[n])
        if n in q:
            ckpt[n], ckpt[n + "_scale_inv"] = quantize_blocks(x, (16, 16))
            deq[n] = dequantize_blocks(ckpt[n], ckpt[n + "_scale_inv"], (16, 16))
        else:
            ckpt[n], deq[n] = x, x.float()
    return ckpt, deq


@pytest.mark.parametrize(("model", "ep", "tp"), CASES, ids=lambda v: str(v))
def test_fp8_layout_scales_sit_with_their_blocks(model, ep, tp):
    cfg = MODELS[model]
    quant = vllm_layout(cfg, tp=tp, enable_expert_parallel=ep)
    plain = vllm_layout(_plain(cfg), tp=tp, enable_expert_parallel=ep)
    names = set(fp8_tensors(cfg))
    assert set(quant.quantized) == names and names
    for n in names:
        t = quant.specs[n]
        assert t.dtype == QUANT_DTYPE and t.quant.scale == n + "_scale_inv" and t.quant.block[-2:] == (16, 16)
        s = quant.specs[n + "_scale_inv"]
        assert s.dtype == SCALE_DTYPE and s.shape == tuple(-(-d // 16) for d in t.shape)
    ckpt, deq = _checkpoint(cfg)
    for rank in range(tp):
        specs, pspecs = quant.local_specs(rank), plain.local_specs(rank)
        qlocals = {n for n, s in specs.items() if s.dtype == QUANT_DTYPE}
        assert set(specs) == set(pspecs) | {n + "_scale_inv" for n in qlocals}
        local = quant.shard(ckpt, rank)
        want = _plain_shard_float(plain, deq, rank)
        for n, ps in pspecs.items():
            if n in qlocals:
                sc = local[n + "_scale_inv"]
                assert specs[n + "_scale_inv"].shape == ps.shape[:-2] + (-(-ps.shape[-2] // 16), -(-ps.shape[-1] // 16))
                got = dequantize_blocks(local[n], sc, (16, 16))
            else:
                assert specs[n].dtype == ps.dtype and specs[n].dtype != QUANT_DTYPE
                got = local[n].float()
            assert torch.equal(got, want[n]), (rank, n)


def _plain_shard_float(plain, deq, rank):
    """The plain layout's shard of the dequantized (float32) tensors, padding zero."""
    out = {}
    for n, s in plain.local_specs(rank).items():
        out[n] = torch.zeros(s.shape, dtype=torch.float32)
    for f in plain.fragments:
        if f.rank != rank or not f.numel:
            continue
        src = deq[f.tensor][tuple(slice(o, o + k) for o, k in zip(f.offsets, f.sizes, strict=True))]
        loff, lsz = f.local_box(f.offsets, f.sizes)
        out[f.local][tuple(slice(o, o + k) for o, k in zip(loff, lsz, strict=True))] = src.reshape(lsz)
    return out


def test_fp8_vllm_names_and_shapes_tp2():
    """vLLM 0.33's parameter names and shapes at TP 2 (as the engine tier saw them in named_parameters())."""
    L = vllm_layout(MODELS["qwen3_moe"], tp=2).local_specs(1)
    p = "model.layers.1"
    exp = {
        f"{p}.self_attn.qkv_proj.weight": ((64, 64), QUANT_DTYPE),
        f"{p}.self_attn.qkv_proj.weight_scale_inv": ((4, 4), SCALE_DTYPE),
        f"{p}.self_attn.o_proj.weight_scale_inv": ((4, 2), SCALE_DTYPE),
        f"{p}.mlp.gate.weight": ((8, 64), QUANT_DTYPE),
        f"{p}.mlp.gate.weight_scale_inv": ((1, 4), SCALE_DTYPE),
        f"{p}.mlp.experts.routed_experts.w13_weight": ((8, 32, 64), QUANT_DTYPE),
        f"{p}.mlp.experts.routed_experts.w13_weight_scale_inv": ((8, 2, 4), SCALE_DTYPE),
        f"{p}.mlp.experts.routed_experts.w2_weight": ((8, 64, 16), QUANT_DTYPE),
        f"{p}.mlp.experts.routed_experts.w2_weight_scale_inv": ((8, 4, 1), SCALE_DTYPE),
        f"{p}.self_attn.q_norm.weight": ((16,), torch.bfloat16),
        "model.embed_tokens.weight": ((160, 64), torch.bfloat16),
        "lm_head.weight": ((160, 64), torch.bfloat16),
    }
    assert {n: (L[n].shape, L[n].dtype) for n in exp} == exp
    D = vllm_layout(MODELS["deepseek_v3"], tp=2).local_specs(0)
    a = "model.layers.1.self_attn"
    assert D[f"{a}.fused_qkv_a_proj.weight"].shape == (56, 64)  # [q_a 32; kv_a 16+8]: last part 1.5 blocks
    assert D[f"{a}.fused_qkv_a_proj.weight_scale_inv"].shape == (4, 4)
    assert D["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16  # DeepSeek's router: never FP8
    assert D["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert D["model.layers.1.mlp.shared_experts.gate_up_proj.weight_scale_inv"].shape == (2, 4)


def test_fp8_fused_scale_offsets():
    """qkv_proj on TP rank 1: k's scale rows right after q's (q_loc / 16), its rows those of kv head 1."""
    L = vllm_layout(MODELS["llama"], tp=2)
    fr = {f.tensor: f for f in L.fragments if f.rank == 1 and f.local.endswith("layers.0.self_attn.qkv_proj.weight_scale_inv")}
    p = "model.layers.0.self_attn"
    assert (fr[f"{p}.q_proj.weight_scale_inv"].offsets, fr[f"{p}.q_proj.weight_scale_inv"].local_offsets) == ((2, 0), (0, 0))
    assert (fr[f"{p}.k_proj.weight_scale_inv"].offsets, fr[f"{p}.k_proj.weight_scale_inv"].local_offsets) == ((1, 0), (2, 0))
    assert (fr[f"{p}.v_proj.weight_scale_inv"].offsets, fr[f"{p}.v_proj.weight_scale_inv"].local_offsets) == ((1, 0), (3, 0))
    moe = vllm_layout(MODELS["qwen3_moe"], tp=2)
    up = [f for f in moe.fragments if f.rank == 1 and f.tensor == "model.layers.0.mlp.experts.3.up_proj.weight_scale_inv"]
    assert [(f.offsets, f.sizes, f.local_offsets) for f in up] == [((1, 0), (1, 4), (3, 1, 0))]


def test_modules_to_not_convert():
    ign = ["model.layers.1.self_attn.o_proj", "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]
    L = vllm_layout(fp8("tiny_llama", ign), tp=2)
    q = set(L.quantized)
    assert "model.layers.1.self_attn.o_proj.weight" not in q and "model.layers.0.self_attn.o_proj.weight" in q
    assert not {"model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"} & q
    assert "model.layers.1.mlp.gate_proj.weight" in q
    assert L.local_specs(0)["model.layers.0.mlp.gate_up_proj.weight"].dtype == torch.bfloat16
    assert "model.layers.0.mlp.gate_up_proj.weight_scale_inv" not in L.local_specs(0)
    # the fused name itself also skips it; ignored_layers wins over modules_to_not_convert (vLLM's order)
    assert "model.layers.0.self_attn.q_proj.weight" not in set(
        vllm_layout(fp8("tiny_llama", ["model.layers.0.self_attn.qkv_proj"]), tp=2).quantized)
    both = fp8("tiny_llama", ["model.layers.0.self_attn.o_proj"], qc={"ignored_layers": ["lm_head"]})
    assert "model.layers.0.self_attn.o_proj.weight" in vllm_layout(both, tp=2).quantized
    # experts: any listed name containing the layer's "mlp.experts" skips all of them; the router by name
    M = vllm_layout(fp8("tiny_qwen3_moe", ["model.layers.1.mlp.experts.5.down_proj", "model.layers.0.mlp.gate"]),
                    tp=2, enable_expert_parallel=True)
    q = set(M.quantized)
    assert not any(".layers.1.mlp.experts." in n for n in q) and "model.layers.0.mlp.experts.5.down_proj.weight" in q
    assert "model.layers.0.mlp.gate.weight" not in q and "model.layers.1.mlp.gate.weight" in q
    with pytest.raises(ValueError, match=r"some but not all of .*q_proj.*qkv_proj"):
        vllm_layout(fp8("tiny_llama", ["model.layers.0.self_attn.k_proj"]), tp=2)


def test_misaligned_tp_names_the_tensor():
    with pytest.raises(ValueError, match=r"tp=4.*'model\.layers\.0\.mlp\.down_proj\.weight' on rank 0.*block 16"):
        vllm_layout(MODELS["llama"], tp=4)  # intermediate 96 / 4 = 24 columns per rank
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.experts\.0\.(gate|up|down)_proj\.weight'.*refine"):
        vllm_layout(fp8("tiny_qwen3_moe", moe_intermediate_size=48), tp=2)  # 24 rows per rank
    with pytest.raises(ValueError, match=r"q_b_proj\.weight"):
        vllm_layout(fp8("tiny_deepseek_v3", moe_intermediate_size=32), tp=2)  # q heads of 12 rows
    with pytest.raises(ValueError, match=r"block FP8 \[128, 128\].*not block-aligned"):
        vllm_layout(fp8("tiny_llama", qc={"weight_block_size": [128, 128]}), tp=2)
    # TP 1: nothing is split; the last part of a fused tensor may end in a partial block (vLLM allows it too)
    assert vllm_layout(fp8("tiny_llama", qc={"weight_block_size": [32, 128]}), tp=1).quantized


def test_unsupported_quantization_configs():
    base = get_config("tiny_llama")
    for qc, err, pat in [
        ({"quant_method": "awq", "bits": 4}, NotImplementedError, "quant_method='awq'"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, NotImplementedError, "per-tensor FP8"),
        ({**QC, "activation_scheme": "static"}, ValueError, "activation_scheme='static'"),
        ({**QC, "weight_block_size": [16]}, ValueError, "weight_block_size"),
        ({**QC, "fmt": "e5m2"}, NotImplementedError, "fmt='e5m2'"),
        ({**QC, "modules_to_not_convert": "lm_head"}, ValueError, "modules_to_not_convert"),
    ]:
        with pytest.raises(err, match=pat):
            vllm_layout({**base, "quantization_config": qc}, tp=2)
    assert block_fp8_config(base) is None and fp8_tensors(base) == []
    b = block_fp8_config({**base, "quantization_config": {**QC, "scale_fmt": "ue8m0"}})
    assert b.block == (16, 16) and b.ue8m0
    L = vllm_layout({**base, "quantization_config": {**QC, "scale_fmt": "ue8m0"}}, tp=2)
    assert all(t.quant.ue8m0 for t in L.quantized.values())


def test_fp8_digest_and_plain_unchanged():
    """The quantized layout has its own digest; the unquantized preset is the same as before (no
    quantization_config: no scale tensors, BF16 everywhere)."""
    cfg = MODELS["qwen3_moe"]
    q, p = vllm_layout(cfg, tp=2), vllm_layout(_plain(cfg), tp=2)
    assert q.digest != p.digest and not p.quantized
    assert vllm_layout(_plain(cfg), tp=2).digest == p.digest
    ep = vllm_layout(cfg, tp=2, enable_expert_parallel=True)
    assert vllm_layout(fp8("tiny_qwen3_moe", qc={"weight_block_size": [16, 32]}), tp=2,
                       enable_expert_parallel=True).digest != ep.digest


def test_published_fp8_configs_build():
    """DeepSeek-V3's published quantization_config (blocks of 128) at vLLM TP 8 with EP; Qwen3-30B-A3B-FP8's
    at TP 4 with EP, and at TP 8 without EP its experts' 96-row partitions are refused, naming the tensor."""
    ds = get_config("deepseek-v3")
    ds["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                 "weight_block_size": [128, 128]}
    qw = {**get_config("qwen3-30b-a3b"), "num_hidden_layers": 2}  # 2 of its 48 layers: the same shapes
    qw["quantization_config"] = dict(ds["quantization_config"])
    L = vllm_layout(qw, tp=4, enable_expert_parallel=True)
    sp = L.local_specs(0)
    assert sp["model.layers.0.mlp.experts.routed_experts.w13_weight_scale_inv"].shape == (32, 12, 16)
    assert sp["model.layers.0.self_attn.qkv_proj.weight_scale_inv"].shape == (10, 16)  # (8+1+1)*128 rows
    with pytest.raises(ValueError, match=r"experts\.\d+\.(gate|up|down)_proj\.weight"):
        vllm_layout(qw, tp=8)
    if __import__("os").environ.get("TRITON_RESHARD_BIG"):  # ~11 s: every DeepSeek-V3 expert
        D = vllm_layout(ds, tp=8, enable_expert_parallel=True)
        assert D.local_specs(0)["model.layers.3.mlp.experts.routed_experts.w13_weight_scale_inv"].shape == (32, 32, 56)


def test_fp8_instances_and_qwen2_bias():
    """Several engines (instances=N) each hold the quantized layout; Qwen2's qkv bias stays in ``dtype``."""
    cfg = MODELS["qwen2"]
    one, two = vllm_layout(cfg, tp=2), vllm_layout(cfg, tp=2, instances=2)
    assert two.quantized == one.quantized
    assert two.local_specs(3) == {n: type(s)(3, s.name, s.shape, s.dtype) for n, s in one.local_specs(1).items()}
    sp = one.local_specs(0)
    assert sp["model.layers.0.self_attn.qkv_proj.bias"].dtype == torch.bfloat16
    assert sp["model.layers.0.self_attn.qkv_proj.weight"].dtype == QUANT_DTYPE
