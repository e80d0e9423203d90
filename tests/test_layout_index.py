"""Columnar layouts and the per-tensor / per-rank queries (``triton_reshard.layout``, ``Layout.table``).

* The vectorized presets build exactly the layouts of the per-rank builders they replaced: their digests on
  42 preset cases (Megatron TE/local specs, PP, EP/ETP, tied embeddings, Qwen2 bias, Qwen3-MoE, DeepSeek-V3
  MLA with and without q_lora, vLLM TP/DP/EP, vocab padding, instances, old FusedMoE names) are pinned below,
  computed with the per-rank builders at commit 87ce474 (before issue 13).
* Every query of a columnar layout equals the same query of the eager Layout of the same fragments
  (``Layout(l.tensors, l.fragments, l.locals)``): tables, per-rank fragments, names, local specs, ``==``,
  hash, digest, fingerprint, and the plan built from either.
* ``FragmentTable.overlapping`` against brute force on preset and random tables; the vectorized overlap
  check against a brute-force pairwise check on random boxes.
* A columnar layout with a mistake raises the eager Layout's message.
"""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest
import torch

from triton_reshard import Fragment, Layout, LocalSpec, Replicate, Shard, TensorSpec
from triton_reshard.box import boxes_overlap
from triton_reshard.layout import ColumnarLayout, ColumnBuilder, FragmentTable, columnar, overlap_free
from triton_reshard.plan import plan_reshard
from triton_reshard.presets import get_config, megatron_layout, vllm_layout

F32, BF16 = torch.float32, torch.bfloat16
M, V = "megatron", "vllm"

# (preset, config, kwargs, digest of the per-rank builder at 87ce474)
CASES = [
    (M, "tiny_llama", {}, "3376582b3f11af4a"),
    (M, "tiny_llama", dict(tp=2, pp=2, dp=2), "942d8e49eaea7c14"),
    (M, "tiny_llama", dict(tp=4, dtype=F32), "6515baa19c96b85a"),
    (M, "tiny_llama", dict(tp=2, spec="local", vocab_divisible_by=None), "ab2f66833e63fc88"),
    (M, "tiny_llama", dict(tp=2, pp=2, dp=2, ranks=[7, 6, 5, 4, 3, 2, 1, 0]), "01dee685ecc47028"),
    (M, "tiny_llama", dict(tp=2, dp=2, ranks=10, vocab_divisible_by=1), "6a56d4276ed87c1e"),
    (M, "tiny_llama_tied", dict(tp=2, pp=2), "813853f1238857c9"),
    (M, "tiny_llama_tied", dict(tp=2), "95bc39645f9dde21"),
    (M, "tiny_qwen2", dict(tp=2, dp=2), "cb3188b16365a918"),
    (M, "tiny_qwen2", dict(tp=4), "fd828dc1e0a8a967"),
    (M, "tiny_qwen3", dict(tp=2, pp=2, spec="local"), "39a6634813828079"),
    (M, "tiny_qwen3", dict(tp=2, pp=2, layers_per_stage=[1, 1]), "dd5fbf4cf086b36c"),
    (M, "tiny_qwen3_moe", dict(tp=2, pp=2, ep=2, etp=1), "2d0847fdc3a23cf1"),
    (M, "tiny_qwen3_moe", dict(tp=2, dp=2, ep=4, etp=1), "9bd721ddeed6e4e1"),
    (M, "tiny_qwen3_moe", dict(tp=2, dp=2, ep=2, grouped_gemm=False), "1530810c25dea61e"),
    (M, "tiny_qwen3_moe", dict(tp=2, ep=2, etp=1, spec="local"), "23c5b3708d09151d"),
    (M, "tiny_deepseek_v3", dict(tp=2, dp=2, ep=2, etp=1), "3c486f725c893e3b"),
    (M, "tiny_deepseek_v3", dict(tp=2, pp=2, dp=2, ep=2, etp=2, layers_per_stage=[1, 3]), "1bfb0bf8e00c313c"),
    (M, "tiny_deepseek_v3", dict(tp=2, q_lora_rank_none=True), "f2227ee4200be9db"),
    (V, "tiny_deepseek_v3", dict(tp=2, q_lora_rank_none=True), "e74b8234d4d25baf"),
    (M, "small_llama", dict(tp=2, pp=2, dp=2), "15761ab690a0e034"),
    (M, "small_qwen3_moe", dict(tp=2, pp=2, dp=2, ep=4, etp=1), "7e211c6e50ea9888"),
    (M, "small_deepseek_v3", dict(tp=2, pp=2, dp=2, ep=4, etp=1), "7ecd35b2eceaf679"),
    (M, "qwen3-30b-a3b", dict(tp=2, pp=2, dp=2, ep=4, etp=1), "7b157bb4c148ca29"),
    (M, "deepseek-v3", dict(tp=2, pp=4, dp=2, ep=4, etp=1, layers_per_stage=[16, 15, 15, 15]), "8ece374a6c0cf554"),
    (V, "tiny_llama", {}, "a113fc7fe1d870f3"),
    (V, "tiny_llama", dict(tp=2, dp=2), "4401b87c01771c13"),
    (V, "tiny_llama", dict(tp=4, ranks=4), "1034b61aaae6cbd4"),
    (V, "tiny_llama_tied", dict(tp=2), "d2e81acf21a0b5ba"),
    (V, "tiny_qwen2", dict(tp=2, dp=2, instances=2), "14e31def366f5980"),
    (V, "tiny_qwen3", dict(tp=2, ranks=[3, 1]), "0e4fc75656ddebd9"),
    (V, "tiny_qwen3_moe", dict(tp=2, dp=2, enable_expert_parallel=True), "181a4796cfae1112"),
    (V, "tiny_qwen3_moe", dict(tp=2, dp=2), "53064912a9fabb46"),
    (V, "tiny_qwen3_moe", dict(tp=2, enable_expert_parallel=True, instances=3, vllm_version="0.23.0"), "a67007b81219486a"),
    (V, "tiny_qwen3_moe", dict(tp=1, dp=3, enable_expert_parallel=True), "30a4898e3b75af63"),
    (V, "tiny_deepseek_v3", dict(tp=2, dp=2, enable_expert_parallel=True), "f22eab74149ee3c4"),
    (V, "tiny_deepseek_v3", dict(tp=2, dp=2, enable_expert_parallel=True, sequence_parallel_moe=False), "2d5cc947b19e20c1"),
    (V, "tiny_deepseek_v3", dict(tp=4, dtype=F32), "c45f2d62d6af94a8"),
    (V, "small_qwen3_moe", dict(tp=2, dp=4, enable_expert_parallel=True, instances=2), "59651ae9a24f4456"),
    (V, "small_deepseek_v3", dict(tp=4, dp=2, enable_expert_parallel=True), "474650d908ab3083"),
    (V, "qwen3-30b-a3b", dict(tp=4, dp=2, enable_expert_parallel=True, instances=2), "71e6d72427652019"),
    (V, "deepseek-v3", dict(tp=8, dp=2, enable_expert_parallel=True), "1d88c42977595e0d"),
]
BIG = ("qwen3-30b-a3b", "deepseek-v3")


def _build(kind: str, model: str, kw: dict) -> Layout:
    kw = dict(kw)
    cfg = get_config(model)
    if kw.pop("q_lora_rank_none", False):
        cfg = {**cfg, "q_lora_rank": None}
    return (megatron_layout if kind == M else vllm_layout)(cfg, **kw)


def _id(case) -> str:
    kind, model, kw, _ = case
    return f"{kind}-{model}-" + ",".join(f"{k}={v}" for k, v in kw.items())


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_presets_equal_the_per_rank_builders(case):
    kind, model, kw, digest = case
    layout = _build(kind, model, kw)
    assert isinstance(layout, ColumnarLayout)
    assert layout.digest == digest


def _eager(layout: Layout) -> Layout:
    return Layout(layout.tensors, layout.fragments, layout.locals)


def _check_tables_equal(t: FragmentTable, ref: FragmentTable) -> None:
    assert t.spec == ref.spec and t.n == ref.n
    assert np.array_equal(t.ranks, ref.ranks) and np.array_equal(t.offsets, ref.offsets)
    assert np.array_equal(t.sizes, ref.sizes) and np.array_equal(t.local_starts, ref.local_starts)
    assert [t.local(i) for i in range(t.n)] == [ref.local(i) for i in range(ref.n)]
    assert t.local_offsets == ref.local_offsets
    assert t.fragments == ref.fragments == tuple(t.fragment(i) for i in range(t.n))
    for a, b in zip(t.boxes(), ref.boxes(), strict=True):
        assert np.array_equal(a, b)


def _check_queries(layout: Layout, ref: Layout, rng: random.Random, names_per_rank: int = 10**9) -> None:
    """Every query of ``layout`` equals ``ref``'s (an eager layout of the same contents)."""
    assert layout == ref and ref == layout and hash(layout) == hash(ref)
    assert layout.ranks == ref.ranks
    assert layout.fingerprint == ref.fingerprint
    assert layout.nbytes() == ref.nbytes()
    for r in ref.ranks + (max(ref.ranks) + 1,):
        assert layout.local_specs(r) == ref.local_specs(r)
        assert layout.fragments_on_rank(r) == ref.fragments_on_rank(r)
        assert layout.tensor_names_on_rank(r) == ref.tensor_names_on_rank(r)
        assert layout.nbytes(r) == ref.nbytes(r)
    names = [t.name for t in ref.tensors]
    assert list(layout.fragments_by_tensor) == list(ref.fragments_by_tensor)
    for n in rng.sample(names, min(len(names), 300)):
        assert layout.spec(n) == ref.spec(n)
        _check_tables_equal(layout.table(n), ref.table(n))
        assert layout.fragments_by_tensor.get(n) == ref.fragments_by_tensor.get(n)
    assert layout.fragments == ref.fragments and layout.locals == ref.locals and layout.tensors == ref.tensors
    assert layout.digest == ref.digest


@pytest.mark.parametrize("case", [c for c in CASES if c[1] not in BIG], ids=[_id(c) for c in CASES if c[1] not in BIG])
def test_columnar_queries_equal_the_eager_layout(case):
    kind, model, kw, _ = case
    layout = _build(kind, model, kw)
    _check_queries(layout, _eager(layout), random.Random(0))
    _check_queries(columnar(layout.tensors, layout.fragments, layout.locals), _eager(layout), random.Random(1))


def test_columnar_queries_at_scale():
    """A DeepSeek-V3 pair the query API is for: tables and per-rank answers on a few ranks equal the eager
    layout's, and a fresh columnar layout equals the first (array comparison, no eager objects)."""
    cfg = get_config("deepseek-v3")
    dst = vllm_layout(cfg, tp=8, dp=2, enable_expert_parallel=True, instances=2)
    assert dst == vllm_layout(cfg, tp=8, dp=2, enable_expert_parallel=True, instances=2)
    assert "fragments" not in dst.__dict__  # equality and hashing built no Fragment objects
    ref = _eager(dst)
    rng = random.Random(2)
    for r in rng.sample(ref.ranks, 4):
        assert dst.local_specs(r) == ref.local_specs(r)
        assert dst.fragments_on_rank(r) == ref.fragments_on_rank(r)
        names = dst.tensor_names_on_rank(r)
        assert names == ref.tensor_names_on_rank(r)
        for n in rng.sample(names, min(50, len(names))):
            _check_tables_equal(dst.table(n), ref.table(n))
    assert dst.fingerprint == ref.fingerprint and dst.digest == ref.digest


def test_instances_tiling_and_interleaved_strides():
    one = vllm_layout(get_config("tiny_qwen3_moe"), tp=2, enable_expert_parallel=True)
    for stride in (None, 2 + 1, 1):  # consecutive, with a gap, interleaved (ranks 0,1 -> 1,2 clash: refused)
        if stride == 1:
            with pytest.raises(ValueError, match="share ranks"):
                one.instances(3, stride)
            continue
        tiled = one.instances(3, stride)
        ref = Layout.instances(_eager(one), 3, stride)
        _check_queries(tiled, ref, random.Random(3))
    # interleaved without clashes: ranks 0, 2 and stride 1 -> 0,2 / 1,3
    sparse = vllm_layout(get_config("tiny_qwen3_moe"), tp=2, ranks=[0, 2])
    tiled = sparse.instances(2, 1)
    _check_queries(tiled, Layout.instances(_eager(sparse), 2, 1), random.Random(4))


def test_pickle_round_trip():
    one = vllm_layout(get_config("tiny_deepseek_v3"), tp=2, dp=2, enable_expert_parallel=True)
    for layout in (one, one.instances(2)):
        back = pickle.loads(pickle.dumps(layout))
        assert back == layout and back.digest == layout.digest and back.fingerprint == layout.fingerprint
        assert back.table("model.norm.weight").fragments == layout.table("model.norm.weight").fragments


@pytest.mark.parametrize("name", ["tiny_qwen3_moe", "tiny_deepseek_v3"])
def test_plans_from_columnar_layouts_equal_eager_plans(name):
    cfg = get_config(name)
    src = megatron_layout(cfg, tp=2, pp=2, ep=2, etp=1)
    dst = vllm_layout(cfg, tp=2, dp=2, enable_expert_parallel=True, ranks=2, instances=2)
    a = plan_reshard.__wrapped__(src, dst)
    b = plan_reshard.__wrapped__(_eager(src), _eager(dst))
    assert a.digest == b.digest and a.transfers == b.transfers and a.local_copies == b.local_copies


# --------------------------------------------------------------------------------------------------------
# Overlap queries and the vectorized overlap check, against brute force
# --------------------------------------------------------------------------------------------------------


def _brute_overlapping(t: FragmentTable, off, size) -> list[int]:
    if min(size, default=1) <= 0:
        return []
    return [i for i in range(t.n) if min(t.sizes[i], default=1) > 0
            and boxes_overlap(tuple(t.offsets[i]), tuple(t.sizes[i]), tuple(off), tuple(size))]


def _random_queries(t: FragmentTable, rng: random.Random, n: int):
    shape = t.spec.shape
    for _ in range(n):
        off = [rng.randrange(0, max(1, d)) for d in shape]
        size = [rng.randrange(0, max(1, d - o) + 1) for o, d in zip(off, shape, strict=True)]
        yield off, size


@pytest.mark.parametrize("case", [c for c in CASES if c[1].startswith("tiny")][:12], ids=lambda c: _id(c))
def test_overlapping_equals_brute_force_on_presets(case):
    layout = _build(*case[:3])
    rng = random.Random(5)
    names = sorted(layout.specs)
    for name in rng.sample(names, min(25, len(names))):
        t = layout.table(name)
        for off, size in _random_queries(t, rng, 20):
            assert layout.overlapping(name, off, size).tolist() == _brute_overlapping(t, off, size)
        for i in range(t.n):  # each fragment's own box: at least itself
            assert i in t.overlapping(t.offsets[i], t.sizes[i]).tolist()


def test_overlapping_equals_brute_force_on_random_tables():
    rng = random.Random(6)
    for _ in range(300):
        nd = rng.randrange(0, 4)
        shape = tuple(rng.randrange(1, 9) for _ in range(nd))
        n = rng.randrange(0, 12) if rng.random() < 0.5 else rng.randrange(17, 60)  # (small tables: no index)
        frags = []
        for k in range(n):
            off = tuple(rng.randrange(0, d) for d in shape)
            size = tuple(rng.randrange(0, d - o + 1) for o, d in zip(off, shape, strict=True))
            frags.append(Fragment("w", k, off, size))
        t = FragmentTable.from_fragments(TensorSpec("w", shape, F32), frags)
        for off, size in _random_queries(t, rng, 10):
            assert t.overlapping(off, size).tolist() == _brute_overlapping(t, off, size)
        boxes, sizes, row_box = t.boxes()
        for i in range(t.n):
            assert tuple(boxes[row_box[i]]) == frags[i].offsets and tuple(sizes[row_box[i]]) == frags[i].sizes
        with pytest.raises(ValueError, match="dims"):
            t.overlapping((0,) * (nd + 1), (1,) * (nd + 1))


def test_vectorized_overlap_check_equals_brute_force():
    rng = random.Random(7)
    for trial in range(1500):
        L = rng.randrange(1, 4)
        n = rng.randrange(2, 14)
        groups = np.array([rng.randrange(0, 3) for _ in range(n)], dtype=np.int64)
        if trial % 2:  # structured: stacked rows / columns, like fused and stacked local tensors
            lo = np.array([[rng.randrange(0, 3) * 2 for _ in range(L)] for _ in range(n)], dtype=np.int64)
            ls = np.array([[rng.choice((1, 2, 2, 3)) for _ in range(L)] for _ in range(n)], dtype=np.int64)
        else:
            lo = np.array([[rng.randrange(0, 6) for _ in range(L)] for _ in range(n)], dtype=np.int64)
            ls = np.array([[rng.randrange(0, 4) for _ in range(L)] for _ in range(n)], dtype=np.int64)
        want = not any(groups[i] == groups[j] and min(ls[i]) > 0 and min(ls[j]) > 0
                       and boxes_overlap(tuple(lo[i]), tuple(ls[i]), tuple(lo[j]), tuple(ls[j]))
                       for i in range(n) for j in range(i + 1, n))
        assert overlap_free(groups, lo, ls, ls) == want, (groups, lo, ls)


# --------------------------------------------------------------------------------------------------------
# Errors: the eager Layout's messages
# --------------------------------------------------------------------------------------------------------

W2 = TensorSpec("w", (4, 4), F32)


@pytest.mark.parametrize(
    ("tensors", "frags", "locs"),
    [
        pytest.param((W2, TensorSpec("w", (3,), F32)), (), (), id="tensor-twice"),
        pytest.param((W2,), (Fragment("w", 0, (0, 0), (4, 4)),), (LocalSpec(0, "w", (4, 4), F32),) * 2, id="local-twice"),
        pytest.param((W2,), (Fragment("w", 0, (0, 0), (4, 4)),), (), id="local-missing"),
        pytest.param((W2,), (Fragment("v", 0, (0, 0), (4, 4)),), (LocalSpec(0, "v", (4, 4), F32),), id="unknown-tensor"),
        pytest.param((W2,), (Fragment("w", 0, (0, 0), (4, 4)),), (LocalSpec(0, "w", (4, 4), BF16),), id="local-dtype"),
        pytest.param((W2,), (Fragment("w", 0, (2, 0), (3, 4)),), (LocalSpec(0, "w", (4, 4), F32),), id="out-of-bounds"),
        pytest.param((W2,), (Fragment("w", 0, (0, 0), (2, 4), "x", (3, 0)),), (LocalSpec(0, "x", (4, 4), F32),),
                     id="local-out-of-bounds"),
        pytest.param((W2,), (Fragment("w", 0, (0,), (4,)),), (LocalSpec(0, "w", (4,), F32),), id="box-dims"),
        pytest.param((W2,), (Fragment("w", 0, (0, 0), (4, 4)),), (LocalSpec(0, "w", (1, 4, 4), F32),), id="local-dims"),
        pytest.param((W2,), (Fragment("w", 0, (0, 0), (2, 4), "x"), Fragment("w", 0, (2, 0), (2, 4), "x", (1, 0))),
                     (LocalSpec(0, "x", (4, 4), F32),), id="overlap-rows"),
        pytest.param((W2,), (Fragment("w", 1, (0, 0), (1, 4), "x", (0, 0, 0)), Fragment("w", 1, (1, 0), (1, 4), "x", (1, 0, 0)),
                             Fragment("w", 1, (2, 0), (2, 2), "x", (0, 0, 2))),
                     (LocalSpec(1, "x", (2, 1, 4), F32),), id="overlap-stacked"),
        pytest.param((W2,), (Fragment("w", 0, (0, 0), (2, 2), "x"), Fragment("w", 0, (0, 2), (2, 2), "x")),
                     (LocalSpec(0, "x", (2, 2), F32),), id="overlap-identical-local-box"),
    ],
)
def test_errors_are_the_eager_layouts(tensors, frags, locs):
    with pytest.raises((ValueError, TypeError)) as eager:
        Layout(tensors, frags, locs)
    with pytest.raises(type(eager.value)) as col:
        columnar(tensors, frags, locs)
    assert str(col.value) == str(eager.value)


def test_valid_parts_make_no_false_alarm():
    frags = (Fragment("w", 1, (0, 0), (1, 4), "x", (0, 0, 0)), Fragment("w", 1, (1, 0), (1, 4), "x", (1, 0, 0)),
             Fragment("w", 1, (2, 0), (2, 4), "y", (0, 0)), Fragment("w", 1, (0, 0), (0, 4), "y", (0, 0)))
    locs = (LocalSpec(1, "x", (2, 1, 4), F32), LocalSpec(1, "y", (2, 4), F32))
    assert columnar((W2,), frags, locs) == Layout((W2,), frags, locs)


def test_builder_errors():
    b = ColumnBuilder([W2], F32)
    b.local(np.arange(2), "w", (4, 4))
    b.box("w", np.arange(2), "w", (np.array([0, 2]), 0), (np.array([4, 3]), 4))  # rank 1: rows 2..5 of 4
    with pytest.raises(ValueError, match=r"out of bounds in dim 0: \[2, 5\) outside \[0, 4\)"):
        b.build()
    b = ColumnBuilder([W2], F32)
    b.local(np.arange(2), "w", (4, 4))
    b.box("w", np.arange(2), "w", (np.array([0, -1]), 0), (4, 4))
    with pytest.raises(ValueError, match="negative offset"):
        b.build()
    b = ColumnBuilder([W2], F32)
    b.local(0, "w", (4, 4))
    b.local(np.arange(1), "w", (4, 5))
    b.box("w", 0, "w", (0, 0), (4, 4))
    with pytest.raises(AssertionError, match="declared twice with different shapes"):
        b.build()
    with pytest.raises(AssertionError, match="unknown logical tensor"):
        ColumnBuilder([W2], F32).box(["w", "v"], np.arange(2), "w", (0, 0), (4, 4))


def test_from_placements_layout_as_columns():
    shapes = {"a": (6, 4), "b": (5,), "c": ()}
    pl = {"a": [Shard(0), Shard(1)], "b": [Replicate(), Shard(0)], "c": [Replicate(), Replicate()]}
    eager = Layout.from_placements(shapes, [[3, 1, 0], [2, 5, 4]], pl)
    col = columnar(eager.tensors, eager.fragments, eager.locals)
    _check_queries(col, eager, random.Random(8))


def test_tensor_rows_hold_each_tensors_fragments_on_both_storages():
    """``Layout.tensor_rows(names)`` (what a rank plan queries in batches): per tensor exactly its fragments, on a
    columnar layout, its tiled copies (engine instances) and the same layouts made eager."""
    from triton_reshard.presets import get_config, megatron_layout, vllm_layout

    cfg = get_config("tiny_qwen3_moe")
    src = megatron_layout(cfg, tp=2, pp=2, dp=2, ep=2, etp=1, ranks=range(8), dtype=torch.bfloat16)
    dst = vllm_layout(cfg, tp=2, dp=2, enable_expert_parallel=True, ranks=range(4, 8), dtype=torch.bfloat16).instances(3)
    key = lambda f: (f.rank, f.local, f.offsets, f.local_offsets)  # noqa: E731
    for lay in (src, dst):
        names = [t.name for t in lay.tensors][::-3]  # not in layout order
        for view in (lay, Layout(lay.tensors, lay.fragments, lay.locals)):
            rows = view.tensor_rows(names)
            assert list(rows.names) == names and len(rows) == rows.starts[-1]
            for k, n in enumerate(names):
                got = [rows.fragment(i, k) for i in range(rows.starts[k], rows.starts[k + 1])]
                assert sorted(got, key=key) == sorted(lay.fragments_by_tensor.get(n, ()), key=key), n
