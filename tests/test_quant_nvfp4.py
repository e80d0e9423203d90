"""NVFP4 (issue 33): the torch reference (``ops/quantize.quantize_nvfp4``, vLLM 0.33's ``ref_nvfp4_quant`` op for
op, plus the packing vLLM's ``break_fp4_bytes`` reads) on hand-checked blocks, the global scale, and the layout
``block_quant_layout(..., format="nvfp4")`` makes (vLLM's ModelOpt NVFP4 parameters: names, packed shapes, TP
splits, fused tensors sharing a global scale). vLLM's own functions are compared in
``tests/engines/test_quant_formats_vllm.py``."""

from __future__ import annotations

import pytest
import torch

from triton_reshard import Layout, Replicate, Shard, block_quant_layout
from triton_reshard.layout import NVFP4
from triton_reshard.ops import quantize as Q

FP8 = torch.float8_e4m3fn


def codes(packed: torch.Tensor) -> list[int]:
    """The E2M1 nibbles of packed bytes, element order (low nibble first)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(-1).tolist()


def test_hand_checked_block_rounding_and_packing():
    # gs = 1 and amax 6: scale = e4m3(1 * (6 * fp32(1/6))) = 1, so each value is rounded to E2M1 directly
    vals = [6.0, 3.0, 1.5, 0.75, 0.25, -0.1, 5.0, 5.01, -2.5, 2.75, -0.5, 1.25, 1.75, -6.0, 0.0, 4.5]
    want = [0x7, 0x5, 0x3, 0x2, 0x0, 0x8, 0x6, 0x7, 0xC, 0x5, 0x9, 0x2, 0x4, 0xF, 0x0, 0x6]
    # 0.75 -> 1.0 and 0.25 -> 0 (ties to even), -0.1 -> -0 (sign kept: 0x8), 5.0 -> 4 (tie), 5.01 -> 6,
    # -2.5 -> -2 (tie), 2.75 -> 3, 1.25 -> 1 (tie), 1.75 -> 2 (tie)
    x = torch.tensor([vals], dtype=torch.float32)
    packed, scale = Q.quantize_nvfp4(x, (16,), global_scale=torch.tensor([1.0]))
    assert packed.dtype == torch.uint8 and packed.shape == (1, 8) and scale.dtype == FP8 and scale.shape == (1, 1)
    assert scale.float().item() == 1.0
    assert codes(packed) == want
    assert int(packed[0, 0]) == 0x57  # element 0 in the low nibble, element 1 in the high one


def test_zero_block_and_global_scale():
    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    x[0, 16:] = torch.linspace(-3, 3, 16)
    x[1, :16] = -0.0
    amax = x.abs().amax().float()
    gs, ws2 = Q.nvfp4_global_scale(amax)
    assert gs.dtype == ws2.dtype == torch.float32
    assert gs.item() == pytest.approx(2688 / 3) and ws2.item() == pytest.approx(3 / 2688)
    packed, scale = Q.quantize_nvfp4(x, (16,), global_scale=gs)
    assert scale.float()[0, 0] == 0 and scale.float()[1].eq(0).all()  # all-zero blocks: scale 0
    c = codes(packed)
    # an input -0.0 gives +0 (vLLM multiplies by torch.sign(-0.0), which is 0); a small negative value gives -0
    assert c[:16] == [0] * 16 and c[32:48] == [0] * 16
    assert scale.float()[0, 1] == 448.0  # the tensor's amax block reaches the top of e4m3
    deq = Q.dequantize_nvfp4(packed, scale, ws2)
    assert (deq[0, 16:] - x[0, 16:].float()).abs().max() <= 1.0 * 3 / 6  # half the 4..6 step, at scale 3/6


def test_global_scale_floor_and_reference_checks():
    gs, ws2 = Q.nvfp4_global_scale(torch.tensor(0.0))
    assert gs.item() == pytest.approx(2688 / 1e-8, rel=1e-6) and torch.isfinite(ws2)
    with pytest.raises(ValueError, match="global scale"):
        Q.quantize_nvfp4(torch.zeros(1, 16))
    with pytest.raises(ValueError, match="multiple of 16"):
        Q.quantize_nvfp4(torch.zeros(1, 24), global_scale=gs)


def test_quantize_views_items_carry_the_global_scale():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 64, generator=g).to(torch.bfloat16)
    gs, _ = Q.nvfp4_global_scale(x.abs().amax().float())
    q = torch.full((6, 32), 0x5A, dtype=torch.uint8)
    s = torch.full((6, 4), 0x5A, dtype=torch.uint8).view(FP8)
    Q.quantize_views([(x, q, s, gs.reshape(1))], (1, 16), fmt="nvfp4")
    rq, rs = Q.quantize_nvfp4(x, (16,), global_scale=gs)
    assert torch.equal(q, rq) and torch.equal(s.view(torch.uint8), rs.view(torch.uint8))
    with pytest.raises(TypeError, match="global_scale"):
        Q.quantize_views([(x, q, s)], (1, 16), fmt="nvfp4")


def test_layout_vllm_shapes_names_and_groups():
    from triton_reshard.presets import get_config, vllm_layout

    cfg = dict(get_config("tiny_qwen3_moe"), intermediate_size=128, moe_intermediate_size=64)
    plain = vllm_layout(cfg, dtype=torch.bfloat16, vllm_version="0.33.0", tp=2, dp=1, enable_expert_parallel=True,
                        ranks=range(2))
    q = block_quant_layout(plain, lambda t: t.name.endswith("proj.weight"), None, format="nvfp4")
    loc = q.local_specs(0)
    a, m = "model.layers.0.self_attn.", "model.layers.0.mlp.experts.routed_experts."
    # vLLM's ModelOpt NVFP4 parameters at TP2 (q 64 + k 32 + v 32 rows over 2 ranks; hidden 64)
    assert (loc[a + "qkv_proj.weight"].shape, loc[a + "qkv_proj.weight"].dtype) == ((64, 32), torch.uint8)
    assert (loc[a + "qkv_proj.weight_scale"].shape, loc[a + "qkv_proj.weight_scale"].dtype) == ((64, 4), FP8)
    assert (loc[a + "qkv_proj.weight_scale_2"].shape, loc[a + "qkv_proj.weight_scale_2"].dtype) == ((3,), torch.float32)
    assert loc[a + "o_proj.weight"].shape == (64, 16) and loc[a + "o_proj.weight_scale_2"].shape == (1,)
    assert loc[m + "w13_weight"].shape == (4, 128, 32) and loc[m + "w13_weight_scale_2"].shape == (4, 2)
    assert loc[m + "w2_weight"].shape == (4, 64, 32) and loc[m + "w2_weight_scale_2"].shape == (4,)
    qs = {n: q.specs[f"model.layers.0.self_attn.{n}_proj.weight"].quant for n in "qkvo"}
    assert qs["q"].format is NVFP4 and qs["q"].block == (1, 8) and qs["q"].logical_block == (1, 16)
    assert qs["q"].global_group == qs["k"].global_group == qs["v"].global_group != qs["o"].global_group
    e = "model.layers.0.mlp.experts.3."
    assert q.specs[e + "gate_proj.weight"].quant.global_group == q.specs[e + "up_proj.weight"].quant.global_group
    assert q.specs[e + "down_proj.weight"].quant.global_group == e + "down_proj.weight"  # alone: itself
    # the global scales sit in the order the parts sit in the fused tensor (q 0, k 1, v 2; gate 0, up 1)
    where = {(f.tensor, f.rank): (f.local, f.local_offsets) for f in q.fragments if f.tensor.endswith("_scale_2")}
    assert where[(a.replace("self_attn.", "self_attn.") + "k_proj.weight_scale_2", 1)] == (a + "qkv_proj.weight_scale_2", (1,))
    assert where[(e + "up_proj.weight_scale_2", 0)] == (m + "w13_weight_scale_2", (3, 1))


def test_layout_refuses_misaligned_and_bad_shapes():
    w = Layout.from_placements({"w.weight": (8, 96)}, [0, 1, 2, 3], [Shard(1)], torch.bfloat16)  # 24 columns a rank
    with pytest.raises(ValueError, match="not block-aligned"):
        block_quant_layout(w, ["w.weight"], None, format="nvfp4")
    v = Layout.from_placements({"v.weight": (8, 40)}, [0], [Replicate()], torch.bfloat16)
    with pytest.raises(ValueError, match="whole blocks of 16"):
        block_quant_layout(v, ["v.weight"], None, format="nvfp4")


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    Q.clear_cache()
    yield
    Q.clear_cache()


def _nv_items(shapes, dtype, seed, strided=False):
    g = torch.Generator().manual_seed(seed)
    items = []
    for k, sh in enumerate(shapes):
        x = (torch.randn(sh, generator=g) * torch.logspace(-3, 3, sh[-1])).to(dtype)
        x.view(-1)[:16] = 0  # a zero block
        if strided:
            x = x.t().contiguous().t()
        gs, _ = Q.nvfp4_global_scale(x.abs().amax().float() * (1 + k))  # one item with headroom: small scales
        q = torch.full(sh[:-1] + (sh[-1] // 2,), 0x5A, dtype=torch.uint8)
        s = torch.full(sh[:-1] + (sh[-1] // 16,), 0x5A, dtype=torch.uint8).view(FP8)
        items.append((x, q, s, gs.reshape(1)))
    return items


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("strided", [False, True])
def test_triton_matches_reference(interpret, dtype, strided):
    items = _nv_items([(5, 64), (3, 32), (2, 16)], dtype, 1, strided)
    Q.quantize_views(items, (1, 16), backend="triton", fmt="nvfp4", key="nv")
    for x, q, s, gs in items:
        rq, rs = Q.quantize_nvfp4(x, (16,), global_scale=gs)
        assert torch.equal(q, rq)
        assert torch.equal(s.view(torch.uint8), rs.view(torch.uint8))


def test_triton_rounding_boundaries_and_tiny_scales(interpret):
    """Values on and next to every E2M1 rounding threshold (gs = 1, block scale 1), and blocks whose scale
    underflows e4m3 (the 1e8 rule), through the kernel = the reference."""
    th = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    bits = th.view(torch.int32)
    vals = torch.cat([(bits + d).view(torch.float32) for d in (-1, 0, 1)] + [th.new_tensor([6.0, 7.0, 0.0])])
    x = torch.zeros(4, 32)
    x[0, :24] = vals
    x[1, :24] = -vals
    x[2, :] = torch.linspace(-1e-6, 1e-6, 32)  # tiny blocks
    x[3, :] = torch.linspace(-6.0, 6.0, 32)
    x[:2, 31] = 6.0  # amax 6 in every block of rows 0-1
    x[:2, 15] = 6.0
    gs = torch.ones(1)
    q = torch.empty(4, 16, dtype=torch.uint8)
    s = torch.empty(4, 2, dtype=FP8)
    Q.quantize_views([(x, q, s, gs)], (16,), backend="triton", fmt=NVFP4)
    rq, rs = Q.quantize_nvfp4(x, (16,), global_scale=gs)
    assert torch.equal(q, rq) and torch.equal(s.view(torch.uint8), rs.view(torch.uint8))


def test_one_launch_for_many_items(interpret, monkeypatch):
    """One launch of the 1 x B kernel for every block of every item, many blocks per program (its grid: the
    blocks over G, not one program per block)."""
    calls = []
    kernel = Q.get_rows_kernel()

    class Counter:
        def __getitem__(self, grid):
            def run(*a, **k):
                calls.append((k["FMT"], grid, k["G"]))
                return kernel[grid](*a, **k)
            return run

    monkeypatch.setattr(Q, "get_rows_kernel", lambda: Counter())
    items = _nv_items([(2, 64), (4, 32), (1, 128), (300, 64)], torch.bfloat16, 2)
    Q.quantize_views(items, (1, 16), backend="triton", fmt="nvfp4")
    blocks = 8 + 8 + 8 + 1200
    assert len(calls) == 1 and calls[0][0] == 2 and calls[0][2] > 1
    assert calls[0][1] == (-(-blocks // calls[0][2]),)
    for x, q, s, gs in items:
        rq, rs = Q.quantize_nvfp4(x, (16,), global_scale=gs)
        assert torch.equal(q, rq) and torch.equal(s.view(torch.uint8), rs.view(torch.uint8))


@pytest.mark.parametrize("algo", ["MXFP8", "NVFP4"])
def test_vllm_preset_of_a_modelopt_config(algo):
    """``vllm_layout`` of a ModelOpt config = ``block_quant_layout`` over the plain layout of every linear weight
    vLLM builds with the quantization config (Qwen3-MoE's router gate included), minus ``exclude_modules`` (exact
    names, contained names, wildcards)."""
    from triton_reshard.presets import get_config, vllm_layout

    base = dict(get_config("tiny_qwen3_moe"), intermediate_size=128, moe_intermediate_size=64)
    cfg = dict(base, quantization_config={"quant_method": "modelopt", "quantization": {
        "quant_algo": algo, "group_size": 16, "kv_cache_quant_algo": None,
        "exclude_modules": ["lm_head", "model.layers.1.self_attn*", "model.layers.0.mlp.experts"]}})
    got = vllm_layout(cfg, tp=2, ranks=range(2), enable_expert_parallel=True, vllm_version="0.33.0")
    plain = vllm_layout(base, tp=2, ranks=range(2), enable_expert_parallel=True, vllm_version="0.33.0")
    want = [t.name for t in plain.tensors if t.name.endswith(("proj.weight", "mlp.gate.weight"))
            and not t.name.startswith(("model.layers.1.self_attn", "model.layers.0.mlp.experts"))]
    assert got == block_quant_layout(plain, want, None, format=algo.lower())
    flat = dict(base, quantization_config={"quant_method": "mxfp8", "ignored_layers": ["lm_head"]})
    assert vllm_layout(flat, tp=2, ranks=range(2), vllm_version="0.33.0").quantized
    bad = dict(base, quantization_config={"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32})
    with pytest.raises(NotImplementedError, match="group_size"):
        vllm_layout(bad, tp=2, ranks=range(2), vllm_version="0.33.0")


@pytest.mark.parametrize("algo,why", [("NVFP4", "VocabParallelEmbedding"), ("MXFP8", "weight_scale_inv")])
def test_sglang_preset_refuses_modelopt_configs_saying_why(algo, why):
    """SGLang 0.5.23 does not load ModelOpt NVFP4 / MXFP8 checkpoints as vLLM does (checked with its model classes
    on CPU): ``sglang_layout`` refuses them, naming the format and what SGLang does instead."""
    from triton_reshard.presets import get_config, sglang_layout

    cfg = dict(get_config("tiny_llama"), quantization_config={"quant_method": "modelopt", "quantization": {
        "quant_algo": algo, "group_size": 16, "exclude_modules": ["lm_head"]}})
    with pytest.raises(NotImplementedError, match=f"ModelOpt {algo}.*{why}"):
        sglang_layout(cfg, tp=2)
    with pytest.raises(NotImplementedError, match="quant_method='fp8'"):
        sglang_layout(dict(get_config("tiny_llama"), quantization_config={"quant_method": "fp8"}), tp=2)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_layout_round_trips_through_the_wire_format(fmt):
    """A quantized layout sent as JSON (``triton_reshard.comm.wire``) comes back equal, its format and global scales
    included (block FP8 keeps its three-entry encoding)."""
    import json

    from triton_reshard.comm.wire import layout_from_dict, layout_to_dict

    w = Layout.from_placements({"a.proj.weight": (8, 64), "b.proj.weight": (4, 32)}, [0, 1], [Shard(0)],
                               torch.bfloat16)
    q = block_quant_layout(w, ["a.proj.weight", "b.proj.weight"], None, format=fmt)
    d = layout_to_dict(q)
    back = layout_from_dict(json.loads(json.dumps(d)))
    assert back == q and back.digest == q.digest
    assert back.specs["a.proj.weight"].quant.format.name == fmt
    f8 = layout_to_dict(block_quant_layout(w, ["a.proj.weight"], (4, 16)))
    assert all(len(t[3]) == 3 for t in f8["tensors"] if t[3] is not None)


_COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton_reshard.kernels import quant as kq

fmt, bn, g = (int(a) for a in sys.argv[1:4])
sig = {"src_ptr": "*i16", "q_ptr": "*u8", "s_ptr": "*u8", "table_ptr": "*i64", "thr_ptr": "*i32",
       "num_blocks": "i64", "g_ptr": "*fp32" if fmt == 2 else "constexpr"}
cx = {"SRC_BF16": True, "BN": bn, "G": g, "CONTIG": True, "FMT": fmt, **({} if fmt == 2 else {"g_ptr": None}),
      "coef_ptr": None, "sums_ptr": None, "DIGEST": False, "SLOTS": 1}  # the digest off (its arguments unused)
sig.update(dict.fromkeys([k for k in cx if k != "g_ptr"], "constexpr"))
src = ASTSource(fn=kq.quant_rows_kernel, signature=sig, constexprs=cx)
for cap in (90, 100):
    compiled = triton.compile(src, target=GPUTarget("cuda", cap, 32), options={"num_warps": 4})
    assert "st.global" in compiled.asm["ptx"], cap
print("compiled")
"""


@pytest.mark.parametrize(("fmt", "bn", "g"), [(1, 32, 64), (2, 16, 128)], ids=["mxfp8", "nvfp4"])
def test_rows_kernel_compiles_for_hopper_and_blackwell(fmt, bn, g, tmp_path):
    """The interpreter accepts code the compiler rejects: compile the many-blocks-per-program kernel (MXFP8 and
    NVFP4, bf16 source, the GPU's G) for sm_90 and sm_100 (no GPU needed), in a fresh process (triton.language
    imported in compiled mode) with an empty Triton cache (a cache hit would compile nothing)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", _COMPILE, str(fmt), str(bn), str(g)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-3000:]
