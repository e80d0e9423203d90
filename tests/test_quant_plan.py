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


# --------------------------------------------------------------------------------------------------------
# Planner
# --------------------------------------------------------------------------------------------------------

import random  # noqa: E402

from triton_reshard import plan_reshard  # noqa: E402
from triton_reshard.ops.quantize import quantize_blocks  # noqa: E402
from triton_reshard.plan.quant import QuantRegion, quant_regions  # noqa: E402


def _frag_layout(shape, boxes, dtype, name="w"):
    """A layout of one tensor ``name`` from ``[(rank, offsets, sizes)]``, each box its own local tensor."""
    frags = [Fragment(name, r, o, s, f"{name}@{i}") for i, (r, o, s) in enumerate(boxes)]
    return Layout.from_fragments({name: (shape, dtype)}, frags)


def _grid_boxes(shape, cuts_r, cuts_c):
    """Boxes of the grid with row cuts ``cuts_r`` and column cuts ``cuts_c`` (both include 0 and the end)."""
    return [((r0, c0), (r1 - r0, c1 - c0)) for r0, r1 in zip(cuts_r[:-1], cuts_r[1:], strict=True)
            for c0, c1 in zip(cuts_c[:-1], cuts_c[1:], strict=True)]


def _simulate(plan, src_data, block, ue8m0=False):
    """Run a plan in one process with plain indexing: plain copies, ``src`` transfers quantized from the source
    box, ``dst`` transfers staged per region and the regions quantized at the end. Returns {(rank, local): tensor}
    of destination local tensors (poisoned first)."""
    dst = plan.dst
    out = {}
    for s in dst.locals:
        t = torch.empty(s.shape, dtype=s.dtype)
        if s.dtype == FP8:
            t.view(torch.uint8).fill_(0x7F)
        else:
            t.fill_(float("nan"))
        out[(s.rank, s.name)] = t
    stage = {}
    for g in [g for gs in quant_regions(plan).values() for g in gs]:
        stage[id(g)] = torch.full(g.sizes, float("nan"), dtype=g.dtype)

    def idx(t, start, sizes):
        extra = t.dim() - len(sizes)
        return tuple(start[:extra]) + tuple(slice(o, o + n) for o, n in zip(start[extra:], sizes, strict=True))

    regions = {(g.rank, i, k): g for g in [g for gs in quant_regions(plan).values() for g in gs]
               for k, ts in ((1, g.wire), (0, g.local)) for i in ts}
    for k, ts in ((1, plan.transfers), (0, plan.local_copies)):
        for i, t in enumerate(ts):
            x = src_data[t.tensor][tuple(slice(o, o + n) for o, n in zip(t.offsets, t.sizes, strict=True))]
            d = out[(t.dst_rank, t.dst_local)]
            if t.quant == "src":
                q, s = quantize_blocks(x, block, ue8m0)
                d.view(torch.uint8)[idx(d, t.dst_offsets, t.sizes)] = q.view(torch.uint8)
                sd = out[(t.dst_rank, t.scale_local)]
                sd[idx(sd, t.scale_offsets, s.shape)] = s
            elif t.quant == "dst":
                g = regions[(t.dst_rank, i, k)]
                rel = tuple(a - b for a, b in zip(t.offsets, g.offsets, strict=True))
                stage[id(g)][tuple(slice(o, o + n) for o, n in zip(rel, t.sizes, strict=True))] = x
            else:
                d[idx(d, t.dst_offsets, t.sizes)] = x.to(d.dtype)
    for g in [g for gs in quant_regions(plan).values() for g in gs]:
        q, s = quantize_blocks(stage[id(g)], g.block, g.ue8m0)
        d = out[(g.rank, g.dst_local)]
        d.view(torch.uint8)[idx(d, g.dst_offsets, g.sizes)] = q.view(torch.uint8)
        sd = out[(g.rank, g.scale_local)]
        sd[idx(sd, g.scale_offsets, s.shape)] = s
    return out


def _want(dst, data, block, ue8m0=False):
    """Reference: each quantized tensor quantized whole, sliced by the destination's weight boxes; the scales at
    ``offset // block`` of ``local + _scale_inv`` (this test's arithmetic, not the layout's scale fragments)."""
    out = {}
    for s in dst.locals:
        t = torch.empty(s.shape, dtype=s.dtype)
        if s.dtype == FP8:
            t.view(torch.uint8).fill_(0x7F)
        else:
            t.fill_(float("nan"))
        out[(s.rank, s.name)] = t
    ref = {n: quantize_blocks(data[n], block, ue8m0) for n in dst.quantized}
    for f in dst.fragments:
        if f.tensor in dst.scale_of or not f.numel:
            continue
        box = tuple(slice(o, o + n) for o, n in zip(f.offsets, f.sizes, strict=True))
        d = out[(f.rank, f.local)]
        extra = d.dim() - len(f.sizes)
        li = tuple(f.local_offsets[:extra]) + tuple(slice(o, o + n) for o, n in zip(f.local_offsets[extra:], f.sizes,
                                                                                      strict=True))
        if f.tensor not in ref:
            d[li] = data[f.tensor][box].to(d.dtype)
            continue
        q, s = ref[f.tensor]
        d.view(torch.uint8)[li] = q.view(torch.uint8)[box]
        sbox = tuple(slice(o // b, -(-(o + n) // b)) for o, n, b in zip(f.offsets, f.sizes, block, strict=True))
        sd = out[(f.rank, f.local + "_scale_inv")]
        sli = tuple(f.local_offsets[:extra]) + tuple(slice(o // b, o // b + (x.stop - x.start)) for o, b, x in
                                                     zip(f.local_offsets[extra:], block, sbox, strict=True))
        sd[sli] = s[sbox]
    return out


def _same(got, want):
    for k in want:
        a, b = got[k], want[k]
        ib = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
        bad = a.view(ib) != b.view(ib)
        assert not bool(bad.any()), f"{k}: {int(bad.sum())} elements differ, first at {bad.nonzero()[0].tolist()}"


def _data(layout, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for t in layout.tensors:
        x = torch.randn(t.shape, generator=g) * torch.linspace(0.01, 30, math.prod(t.shape)).reshape(t.shape)
        out[t.name] = x.to(t.dtype)
    return out


def _lower_bound(src, dst, block):
    """Independent lower bound: per destination fragment, its elements the rank holds in no source fragment (1
    byte each, fp8) plus 4 bytes per block with such an element; plain tensors in their wire dtype."""
    total = 0
    for spec in dst.tensors:
        if spec.name in dst.scale_of:
            continue
        sspec = src.specs[spec.name]
        for f in dst.fragments_by_tensor.get(spec.name, ()):
            held = torch.zeros(spec.shape, dtype=torch.bool)
            for h in src.fragments_by_tensor.get(spec.name, ()):
                if h.rank == f.rank:
                    held[tuple(slice(o, o + n) for o, n in zip(h.offsets, h.sizes, strict=True))] = True
            box = tuple(slice(o, o + n) for o, n in zip(f.offsets, f.sizes, strict=True))
            miss = torch.zeros(spec.shape, dtype=torch.bool)
            miss[box] = ~held[box]
            if spec.quant is None:
                total += int(miss.sum()) * min(sspec.itemsize, spec.itemsize)
                continue
            b = spec.quant.block
            pad = [(-n) % k for n, k in zip(spec.shape, b, strict=True)]
            m = torch.nn.functional.pad(miss.float(), (0, pad[1], 0, pad[0]))
            blocks = m.reshape(m.shape[0] // b[0], b[0], m.shape[1] // b[1], b[1]).amax(dim=(1, 3))
            total += int(miss.sum()) + 4 * int(blocks.sum())
    return total


def test_modes_rows24_under_blocks16():
    """Source TP split of 24 rows, blocks of 16 rows: rows 0-16 and 32-48 are whole blocks of one source rank
    (quantized by it), rows 16-32 straddle the two (sent in bf16, quantized by the destination)."""
    src = Layout.from_placements({"w": (48, 32)}, [0, 1], [Shard(0)], BF16)
    dst = block_quant_layout(Layout.from_placements({"w": (48, 32)}, [2], [Replicate()], BF16), ["w"], (16, 16))
    plan = plan_reshard(src, dst)
    got = sorted((t.src_rank, t.offsets, t.sizes, t.quant, t.wire_dtype) for t in plan.transfers)
    assert got == [(0, (0, 0), (16, 32), "src", FP8), (0, (16, 0), (8, 32), "dst", BF16),
                   (1, (24, 0), (8, 32), "dst", BF16), (1, (32, 0), (16, 32), "src", FP8)]
    (g,) = quant_regions(plan)[2]
    assert isinstance(g, QuantRegion) and (g.offsets, g.sizes, g.scale_offsets, g.dtype) == ((16, 0), (16, 32), (1, 0),
                                                                                            BF16)
    st = plan.stats()
    assert st.quant_src_bytes == 2 * (16 * 32 + 2 * 4) and st.quant_dst_bytes == 16 * 32 * 2
    assert st.wire_bytes == st.quant_src_bytes + st.quant_dst_bytes
    assert st.lower_bound_bytes == _lower_bound(src, dst, (16, 16)) == 48 * 32 + 6 * 4
    data = _data(src)
    _same(_simulate(plan, data, (16, 16)), _want(dst, data, (16, 16)))


def test_aligned_shards_are_quantized_at_the_source_and_meet_the_lower_bound():
    src = Layout.from_placements({"w": (64, 64)}, [0, 1, 2, 3], [Shard(0)], BF16)  # 16 rows each
    dst = block_quant_layout(Layout.from_placements({"w": (64, 64)}, [[4, 5], [6, 7]], [Replicate(), Shard(1)], BF16),
                             ["w"], (16, 16))
    plan = plan_reshard(src, dst)
    assert {t.quant for t in plan.transfers} == {"src"} and not quant_regions(plan)
    st = plan.stats()
    assert st.wire_bytes == st.lower_bound_bytes == _lower_bound(src, dst, (16, 16))
    # half the bf16 bytes, plus the scales
    bf16 = plan_reshard(src, Layout.from_placements({"w": (64, 64)}, [[4, 5], [6, 7]], [Replicate(), Shard(1)], BF16))
    assert st.wire_bytes == bf16.stats().wire_bytes // 2 + 2 * (64 // 16) * (64 // 16) * 4
    data = _data(src)
    _same(_simulate(plan, data, (16, 16)), _want(dst, data, (16, 16)))


def test_local_quantization_colocated():
    """A rank holding the whole blocks it needs quantizes them locally (no wire); straddling blocks mix a local
    piece and a received one in one region."""
    src = Layout.from_placements({"w": (48, 32)}, [0, 1], [Shard(0)], BF16)  # rows 0-24 | 24-48
    dst = block_quant_layout(Layout.from_placements({"w": (48, 32)}, [0, 1], [Replicate()], BF16), ["w"], (16, 16))
    plan = plan_reshard(src, dst)
    assert {t.quant for t in plan.local_copies} == {"src", "dst"}
    (g,) = quant_regions(plan)[0]
    assert g.local and g.wire  # rank 0's rows 16-24 are local, 24-32 come from rank 1
    data = _data(src)
    _same(_simulate(plan, data, (16, 16)), _want(dst, data, (16, 16)))
    assert plan.stats().wire_bytes - plan.stats().lower_bound_bytes == 2 * (8 * 32 * 2 - 8 * 32 - 2 * 4)


@pytest.mark.parametrize("seed", range(40))
def test_random_grids_simulated_equal_the_reference(seed):
    """Random source grids (any cuts, replicas on some ranks) into random block-aligned destination grids: the
    plan, run by plain indexing, writes the reference bytes and scales everywhere; exact cover is the Plan's own
    check; wire bytes are the lower bound plus exactly the straddling blocks' excess."""
    rnd = random.Random(seed)
    block = (rnd.choice([4, 8]), rnd.choice([4, 8]))
    shape = (block[0] * rnd.randint(2, 6) - rnd.choice([0, 0, 1, 3]), block[1] * rnd.randint(2, 6) - rnd.choice([0, 2]))
    world = 6

    def cuts(n, aligned_to=None):
        k = rnd.randint(0, 3)
        pts = {0, n}
        for _ in range(k):
            p = rnd.randrange(1, n)
            pts.add(p - p % aligned_to if aligned_to else p)
        return sorted(p for p in pts if p == 0 or p > 0)

    sboxes = _grid_boxes(shape, cuts(shape[0]), cuts(shape[1]))
    sfr = [(rnd.randrange(world), o, s) for o, s in sboxes]
    sfr += [(rnd.randrange(world), o, s) for o, s in rnd.sample(sboxes, min(2, len(sboxes)))]  # replicas
    src = _frag_layout(shape, sorted(set(sfr)), rnd.choice([BF16, torch.float32]))
    dboxes = _grid_boxes(shape, [c for c in cuts(shape[0], block[0]) if c == 0 or c % block[0] == 0 or c == shape[0]],
                         [c for c in cuts(shape[1], block[1])])
    dboxes = [(o, s) for o, s in dboxes if min(s) > 0]
    dfr = [(rnd.randrange(world), o, s) for o, s in dboxes]
    dfr += [(rnd.randrange(world), o, s) for o, s in rnd.sample(dboxes, min(2, len(dboxes)))]
    plain = _frag_layout(shape, sorted(set(dfr)), BF16)
    dst = block_quant_layout(plain, ["w"], block, ue8m0=bool(seed % 2))
    plan = plan_reshard(src, dst)
    data = _data(src, seed)
    _same(_simulate(plan, data, block, bool(seed % 2)), _want(dst, data, block, bool(seed % 2)))
    st = plan.stats()
    assert st.lower_bound_bytes == _lower_bound(src, dst, block)
    src_only = all(t.quant == "src" for t in plan.transfers)
    if src_only:
        assert st.wire_bytes == st.lower_bound_bytes
    assert st.wire_bytes == st.quant_src_bytes + st.quant_dst_bytes
    for t in plan.transfers + plan.local_copies:
        if t.quant == "src":
            assert all(o % b == 0 for o, b in zip(t.offsets, block, strict=True))
            assert all((o + n) % b == 0 or o + n == g for o, n, b, g in zip(t.offsets, t.sizes, block, shape,
                                                                               strict=True))


def test_schedule_cuts_quantized_transfers_at_block_multiples():
    src = Layout.from_placements({"w": (80, 72)}, [0], [Replicate()], BF16)
    dst = block_quant_layout(Layout.from_placements({"w": (80, 72)}, [1], [Replicate()], BF16), ["w"], (16, 16))
    plan = plan_reshard(src, dst)
    (t,) = plan.transfers
    sched = plan.schedule(4096)
    chunks = [c for st in sched.steps for m in st.messages for c in m.chunks]
    assert len(sched.steps) > 3
    covered = torch.zeros(80, 72, dtype=torch.int32)
    for c in chunks:
        assert all(o % 16 == 0 for o in c.offsets), c
        assert all((o + n) % 16 == 0 or o + n == g for o, n, g in zip(c.offsets, c.sizes, t.sizes, strict=True)), c
        nb = math.prod(-(-n // 16) for n in c.sizes)
        assert c.nbytes == -(-math.prod(c.sizes) // 16) * 16 + 4 * nb  # fp8 (16-aligned), then the scales
        assert c.nbytes <= 2048
        covered[tuple(slice(o, o + n) for o, n in zip(c.offsets, c.sizes, strict=True))] += 1
    assert bool((covered == 1).all())
    # a block larger than half a bucket still travels whole (one block per chunk)
    big = plan_reshard(src, block_quant_layout(Layout.from_placements({"w": (80, 72)}, [1], [Replicate()], BF16),
                                               ["w"], (64, 64)))
    for st in big.schedule(1024).steps:
        for m in st.messages:
            for c in m.chunks:
                assert all(o % 64 == 0 for o in c.offsets) and math.prod(-(-n // 64) for n in c.sizes) == 1


def test_digest_and_repr_name_the_quantization():
    src = Layout.from_placements({"w": (48, 32)}, [0, 1], [Shard(0)], BF16)
    plain = Layout.from_placements({"w": (48, 32)}, [2], [Replicate()], BF16)
    a = plan_reshard(src, block_quant_layout(plain, ["w"], (16, 16)))
    b = plan_reshard(src, block_quant_layout(plain, ["w"], (16, 16), ue8m0=True))
    c = plan_reshard(src, block_quant_layout(plain, ["w"], (16, 32)))
    assert len({a.digest, b.digest, c.digest}) == 3
    assert "quant=src" in a.describe() and "quant=dst" in a.describe()


def test_plan_errors_name_the_tensor():
    src = Layout.from_placements({"w": (48, 32)}, [0, 1], [Shard(0)], BF16)
    plain = Layout.from_placements({"w": (48, 32)}, [2, 3], [Replicate()], BF16)
    dst = block_quant_layout(plain, ["w"], (16, 16))
    with pytest.raises(ValueError, match=r"tensor 'w' is block-quantized on destination rank \d: relays of quantized"):
        plan_reshard(src, dst, gpus_per_node=2, relay=True)
    assert plan_reshard(src, dst, gpus_per_node=2, relay=False).stats().num_relays == 0
    isrc = Layout.from_placements({"w": (48, 32)}, [0, 1], [Shard(0)], torch.int32)
    with pytest.raises(ValueError, match=r"tensor 'w': a block-quantized destination needs a float16/bfloat16/float32"):
        plan_reshard(isrc, dst)
    other = block_quant_layout(Layout.from_placements({"w": (48, 32)}, [0, 1], [Shard(0)], BF16), ["w"], (8, 8))
    with pytest.raises(ValueError, match=r"tensor 'w': the source is block-quantized .*re-quantization"):
        plan_reshard(other, dst)
    with pytest.raises(ValueError, match=r"tensor 'w' .* is not in the source layout"):
        plan_reshard(Layout.from_placements({"v": (48, 32)}, [0], [Replicate()], BF16), dst)


def test_same_quantization_on_both_sides_is_a_plain_copy():
    a = block_quant_layout(Layout.from_placements({"w": (48, 32)}, [0, 1], [Shard(0)], BF16), ["w"], (8, 16))
    b = block_quant_layout(Layout.from_placements({"w": (48, 32)}, [2, 3], [Shard(1)], BF16), ["w"], (8, 16))
    plan = plan_reshard(a, b)
    assert not any(t.quant for t in plan.transfers)
    assert {t.tensor for t in plan.transfers} == {"w", "w_scale_inv"}
    assert plan.stats().wire_bytes == plan.stats().lower_bound_bytes == 48 * 32 + 6 * 2 * 4


def test_preset_plan_megatron_tp4_to_vllm_fp8():
    from triton_reshard.presets import megatron_layout

    cfg = get_config("tiny_qwen3_moe")
    src = megatron_layout(cfg, tp=4, ranks=range(4), dtype=BF16)
    dst = block_quant_layout(vllm_layout(cfg, tp=2, dp=1, ranks=range(4, 6), dtype=BF16, vllm_version="0.33.0"),
                             _proj, (16, 16))
    plan = plan_reshard(src, dst)
    by_mode = {m: {t.tensor.split(".")[-2] for t in plan.transfers if t.quant == m} for m in ("src", "dst")}
    # q/k/v/o shards are whole blocks (16 rows / 16 columns per Megatron rank); MLP and expert shards (24 and 8
    # rows) are not
    assert {"q_proj", "k_proj", "v_proj", "o_proj"} <= by_mode["src"]
    assert {"gate_proj", "up_proj", "down_proj"} <= by_mode["dst"]
    st = plan.stats()
    assert st.lower_bound_bytes == _lower_bound(src, dst, (16, 16))
    assert st.wire_bytes > st.lower_bound_bytes


def test_cli_fp8_block_mistakes_are_one_line_before_spawning(capsys):
    from triton_reshard.tools import cli

    assert cli.main(["demo", "--dst-dtype", "fp8-block", "--quant-block", "0"]) == 2
    assert "--quant-block 0" in capsys.readouterr().err
    assert cli.main(["bench", "--dst-dtype", "fp8-block", "--quant-block", "-1"]) == 2
    assert "--quant-block -1" in capsys.readouterr().err
    # 96-row blocks do not divide vLLM TP2's 512 q rows: named before any rank is spawned
    assert cli.main(["demo", "--dst-dtype", "fp8-block", "--quant-block", "96", "--size-gb", "0.05"]) == 2
    err = capsys.readouterr().err
    assert "not block-aligned" in err and "on rank" in err and "proj.weight" in err


@pytest.mark.parametrize("seed", range(20))
def test_union_boxes_is_canonical_and_exact(seed):
    """The regions a receiver stages come from ``union_boxes`` over the blocks its pieces touch; the sender
    cuts its pieces by the same regions from another set of boxes with the same union: the decomposition must
    depend on the union alone, cover it exactly, and be disjoint."""
    from triton_reshard.box import union_boxes

    rnd = random.Random(seed)
    nd = rnd.choice([1, 2, 3])
    shape = tuple(rnd.randint(3, 9) for _ in range(nd))
    boxes = []
    for _ in range(rnd.randint(1, 5)):
        off = tuple(rnd.randrange(n) for n in shape)
        boxes.append((off, tuple(rnd.randint(1, n - o) for o, n in zip(off, shape, strict=True))))
    mask = torch.zeros(shape, dtype=torch.bool)
    for o, s in boxes:
        mask[tuple(slice(a, a + b) for a, b in zip(o, s, strict=True))] = True
    got = union_boxes(boxes)
    cover = torch.zeros(shape, dtype=torch.int32)
    for o, s in got:
        cover[tuple(slice(a, a + b) for a, b in zip(o, s, strict=True))] += 1
    assert bool((cover == mask.int()).all())
    # the same set from other boxes: its own pieces, cut at extra lines, and in another order
    pieces = []
    for o, s in got:
        d = rnd.randrange(nd)
        if s[d] > 1:
            k = rnd.randint(1, s[d] - 1)
            pieces.append((o, s[:d] + (k,) + s[d + 1:]))
            pieces.append((o[:d] + (o[d] + k,) + o[d + 1:], s[:d] + (s[d] - k,) + s[d + 1:]))
        else:
            pieces.append((o, s))
    rnd.shuffle(pieces)
    assert union_boxes(pieces + boxes[:1]) == got
