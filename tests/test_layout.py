"""Layout, Fragment, Shard/Replicate: value semantics, builders and validation (no process group).

Expected boxes come from ``tests/dist_cases.chunk_box`` (nested ``torch.chunk`` over index ranges) or are
written out by hand; they never come from the layout under test.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from triton_reshard import Fragment, Layout, LocalSpec, Replicate, Shard, TensorSpec

from . import dist_cases as dc

F32, BF16 = torch.float32, torch.bfloat16


# --------------------------------------------------------------------------------------------------------
# Placements and value types
# --------------------------------------------------------------------------------------------------------


def test_placements_are_values():
    assert Shard(1) == Shard(1) and Shard(1) != Shard(0) and Replicate() == Replicate()
    assert len({Shard(0), Shard(0), Replicate(), Replicate()}) == 2
    assert repr(Shard(2)) == "Shard(2)" and repr(Replicate()) == "Replicate()"


@pytest.mark.parametrize("bad", [pytest.param(True, id="bool"), pytest.param("0", id="str"), pytest.param(1.0, id="float")])
def test_shard_dim_must_be_int(bad):
    with pytest.raises(TypeError):
        Shard(bad)


def test_tensor_spec_normalises_shape_and_dtype():
    t = TensorSpec("w", torch.Size([3, 4]), "bfloat16")
    assert t.shape == (3, 4) and isinstance(t.shape, tuple) and t.dtype is torch.bfloat16
    assert t.itemsize == 2
    assert TensorSpec("w", [3, 4], BF16) == t


@pytest.mark.parametrize(
    ("kwargs", "exc"),
    [
        pytest.param({"name": "", "shape": (1,), "dtype": F32}, TypeError, id="empty-name"),
        pytest.param({"name": "w", "shape": (2, -1), "dtype": F32}, ValueError, id="negative-size"),
        pytest.param({"name": "w", "shape": (2, True), "dtype": F32}, TypeError, id="bool-size"),
        pytest.param({"name": "w", "shape": "12", "dtype": F32}, TypeError, id="str-shape"),
        pytest.param({"name": "w", "shape": (2,), "dtype": "notadtype"}, TypeError, id="bad-dtype"),
    ],
)
def test_tensor_spec_rejects(kwargs, exc):
    with pytest.raises(exc, match="w|name"):
        TensorSpec(**kwargs)


def test_fragment_defaults_and_local_box():
    f = Fragment("w", 2, (4, 0), (3, 5))
    assert f.local == "w" and f.local_offsets == (0, 0) and f.numel == 15 and f.local_sizes == (3, 5)
    # a sub-box of the fragment, in local coordinates
    assert f.local_box((5, 1), (2, 3)) == ((1, 1), (2, 3))
    # expert 1 of a stacked [E, rows, cols] local tensor: one extra leading dim of size 1
    e = Fragment("e1.w", 0, (0, 0), (5, 3), "experts.w", (1, 0, 0))
    assert e.local_sizes == (1, 5, 3)
    assert e.local_box((2, 1), (3, 2)) == ((1, 2, 1), (1, 3, 2))
    # a fused local tensor: the box starts at row 8 of the local tensor
    q = Fragment("k", 1, (2, 0), (2, 6), "qkv", (8, 0))
    assert q.local_box((3, 2), (1, 4)) == ((9, 2), (1, 4))


@pytest.mark.parametrize(
    ("args", "exc"),
    [
        pytest.param(("w", 0, (0,), (1, 2)), ValueError, id="offsets-sizes-length"),
        pytest.param(("w", 0, (0, -1), (1, 2)), ValueError, id="negative-offset"),
        pytest.param(("w", 0, (0, 0), (1, -2)), ValueError, id="negative-size"),
        pytest.param(("w", 0, (0, 0), (1, 2), "x", (0,)), ValueError, id="local-offsets-too-short"),
        pytest.param(("w", -1, (0,), (1,)), TypeError, id="negative-rank"),
        pytest.param(("w", True, (0,), (1,)), TypeError, id="bool-rank"),
    ],
)
def test_fragment_rejects(args, exc):
    with pytest.raises(exc, match="'w'"):
        Fragment(*args)


# --------------------------------------------------------------------------------------------------------
# from_placements against the independent chunk reference
# --------------------------------------------------------------------------------------------------------

MESHES = [
    pytest.param([0], id="1x-rank0"),
    pytest.param([5], id="1x-rank5"),
    pytest.param([0, 1, 2], id="3"),
    pytest.param([3, 0, 2, 1], id="4-permuted"),
    pytest.param([[0, 1], [2, 3]], id="2x2"),
    pytest.param([[4, 2, 0], [5, 3, 1]], id="2x3-permuted"),
    pytest.param([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], id="2x2x2"),
    pytest.param([[[7], [1]], [[3], [5]]], id="2x2x1-sparse-ranks"),
]
SHAPES = [(7,), (0, 3), (1, 5), (6, 5, 3), (2, 3, 1, 4)]


def _placement_choices(ndim, mdims):
    options = [Replicate()] + [Shard(d) for d in range(ndim)] + [Shard(-1)]
    combos = list(itertools.product(options, repeat=mdims))
    random.Random(ndim * 10 + mdims).shuffle(combos)
    return combos[:12]


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)) or "scalar")
def test_from_placements_matches_nested_torch_chunk(mesh, shape):
    mdims = torch.as_tensor(mesh).dim()
    ranks = sorted(torch.as_tensor(mesh).flatten().tolist())
    for pl in _placement_choices(len(shape), mdims):
        lay = Layout.from_placements({"w": shape}, mesh, list(pl), BF16)
        assert lay.ranks == tuple(ranks)
        frags = {f.rank: f for f in lay.fragments}
        for r in ranks:
            off, size = dc.chunk_box(shape, mesh, pl, r)
            assert lay.local_shapes(r) == {"w": size}, (pl, r)
            assert lay.local_specs(r)["w"].dtype == BF16
            if all(size):
                f = frags[r]
                assert (f.offsets, f.sizes, f.local, f.local_offsets) == (off, size, "w", (0,) * len(shape)), (pl, r)
            else:
                assert r not in frags, f"empty shard on rank {r} must not be a fragment"
        assert lay.local_shapes(max(ranks) + 1) == {}


def test_from_placements_uneven_by_hand():
    """10 rows over 4 ranks: torch.chunk gives 3, 3, 3, 1; 3 rows over 4 ranks: 1, 1, 1, 0 (last one empty)."""
    lay = Layout.from_placements({"a": (10, 2), "b": (3,)}, [0, 1, 2, 3], [Shard(0)], {"a": F32, "b": torch.int8})
    assert [lay.local_shapes(r)["a"] for r in range(4)] == [(3, 2), (3, 2), (3, 2), (1, 2)]
    assert [lay.local_shapes(r)["b"] for r in range(4)] == [(1,), (1,), (1,), (0,)]
    assert [f.offsets for f in lay.fragments_by_tensor["a"]] == [(0, 0), (3, 0), (6, 0), (9, 0)]
    assert [f.rank for f in lay.fragments_by_tensor["b"]] == [0, 1, 2]
    assert lay.specs["b"].dtype == torch.int8


def test_from_placements_scalar_replicated():
    lay = Layout.from_placements({"s": ()}, [0, 1], [Replicate()])
    assert lay.local_shapes(1) == {"s": ()}
    assert [(f.rank, f.offsets, f.sizes) for f in lay.fragments] == [(0, (), ()), (1, (), ())]


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        pytest.param(lambda: Layout.from_placements({"w": (4,)}, [0, 0], [Shard(0)]), ValueError, "distinct", id="duplicate-ranks"),
        pytest.param(lambda: Layout.from_placements({"w": (4,)}, [0, -1], [Shard(0)]), ValueError, "distinct", id="negative-rank"),
        pytest.param(lambda: Layout.from_placements({"w": (4,)}, [0.0, 1.0], [Shard(0)]), TypeError, "mesh", id="float-mesh"),
        pytest.param(lambda: Layout.from_placements({"w": (4,)}, [], [Shard(0)]), TypeError, "mesh", id="empty-mesh"),
        pytest.param(lambda: Layout.from_placements({"w": (4,)}, [[0, 1]], [Shard(0)]), ValueError, "'w'.*placements", id="too-few-placements"),
        pytest.param(lambda: Layout.from_placements({"w": (4,)}, [0, 1], [Shard(1)]), ValueError, "'w'.*out of range", id="shard-dim-out-of-range"),
        pytest.param(lambda: Layout.from_placements({"w": (4,)}, [0, 1], ["shard"]), TypeError, "'w'.*unsupported", id="unsupported-placement"),
        pytest.param(lambda: Layout.from_placements({"w": (4,), "b": (2,)}, [0, 1], {"w": [Shard(0)]}), ValueError, "'b'.*no placements", id="missing-placements"),
        pytest.param(lambda: Layout.from_placements({"w": (4, -1)}, [0], [Replicate()]), ValueError, "'w'", id="negative-shape"),
    ],
)
def test_from_placements_rejects(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# --------------------------------------------------------------------------------------------------------
# from_fragments, validation, value semantics
# --------------------------------------------------------------------------------------------------------


def _qkv_layout(order=None):
    frags = [
        Fragment("q", 0, (0, 0), (4, 3), "qkv", (0, 0)),
        Fragment("k", 0, (0, 0), (2, 3), "qkv", (4, 0)),
        Fragment("v", 0, (0, 0), (2, 3), "qkv", (6, 0)),
        Fragment("q", 1, (4, 0), (4, 3), "qkv", (0, 0)),
        Fragment("k", 1, (2, 0), (2, 3), "qkv", (4, 0)),
        Fragment("v", 1, (2, 0), (2, 3), "qkv", (6, 0)),
    ]
    if order is not None:
        frags = [frags[i] for i in order]
    tensors = {"q": ((8, 3), F32), "k": ((4, 3), F32), "v": ((4, 3), F32)}
    return Layout.from_fragments(tensors, frags, local_shapes={(1, "qkv"): (9, 3)})


def test_from_fragments_local_shapes():
    lay = _qkv_layout()
    assert lay.local_shapes(0) == {"qkv": (8, 3)}  # smallest shape holding its fragments
    assert lay.local_shapes(1) == {"qkv": (9, 3)}  # given explicitly (one padding row)
    assert lay.nbytes(0) == 8 * 3 * 4 and lay.nbytes() == (8 + 9) * 3 * 4
    assert lay.ranks == (0, 1)


def test_layout_equal_and_hashable_when_built_twice():
    a, b = _qkv_layout(), _qkv_layout(order=[5, 3, 1, 0, 2, 4])
    assert a is not b and a == b and hash(a) == hash(b) and a.digest == b.digest
    assert {a: 1}[b] == 1
    other = Layout.from_fragments(
        {"q": ((8, 3), F32), "k": ((4, 3), F32), "v": ((4, 3), F32)},
        [Fragment("q", 0, (0, 0), (8, 3)), Fragment("k", 0, (0, 0), (4, 3)), Fragment("v", 0, (0, 0), (4, 3))],
    )
    assert a != other and a.digest != other.digest
    p1 = Layout.from_placements({"w": (6, 4)}, [[0, 1], [2, 3]], [Shard(0), Replicate()])
    p2 = Layout.from_placements({"w": (6, 4)}, [[0, 1], [2, 3]], [Shard(0), Replicate()])
    p3 = Layout.from_placements({"w": (6, 4)}, [[0, 1], [2, 3]], [Replicate(), Shard(0)])
    assert p1 == p2 and hash(p1) == hash(p2) and p1 != p3
    assert p1 != Layout.from_placements({"w": (6, 4)}, [[0, 1], [2, 3]], [Shard(0), Replicate()], BF16)
    assert p1.digest in repr(p1)


def test_shard_places_boxes_and_zeroes_padding():
    lay = _qkv_layout()
    g = {n: dc.synthetic_global(n, s, F32) for n, s in (("q", (8, 3)), ("k", (4, 3)), ("v", (4, 3)))}
    got = lay.shard(g, 1)["qkv"]
    want = torch.cat([g["q"][4:8], g["k"][2:4], g["v"][2:4], torch.zeros(1, 3)])
    assert dc.mismatch(got, want, "rank 1 qkv") is None
    assert lay.shard(g, 7) == {}


def test_shard_stacked_experts():
    frags = [Fragment(f"e{e}.w", 0, (0, 0), (2, 3), "experts.w", (i, 0, 0)) for i, e in enumerate((3, 1))]
    lay = Layout.from_fragments({f"e{e}.w": ((2, 3), BF16) for e in (1, 3)}, frags)
    assert lay.local_shapes(0) == {"experts.w": (2, 2, 3)}
    g = {n: dc.synthetic_global(n, (2, 3), BF16) for n in ("e1.w", "e3.w")}
    got = lay.shard(g, 0)["experts.w"]
    assert dc.mismatch(got, torch.stack([g["e3.w"], g["e1.w"]]), "experts") is None


def test_allocate():
    lay = Layout.from_placements({"a": (5, 2), "b": (3,)}, [0, 1], [Shard(0)], {"a": BF16, "b": torch.int32})
    t = lay.allocate(1, fill=7)
    assert {n: (tuple(x.shape), x.dtype) for n, x in t.items()} == {"a": ((2, 2), BF16), "b": ((1,), torch.int32)}
    assert all(bool((x == 7).all()) for x in t.values())
    assert lay.allocate(9) == {}


def test_merge_pipeline_stages():
    s0 = Layout.from_placements({"embed": (10, 4), "l0": (4, 4)}, [0, 1], [Shard(0)])
    s1 = Layout.from_placements({"l1": (4, 4), "head": (4, 10)}, [2, 3], [Shard(1)])
    m = s0 | s1
    assert m == s0.merge(s1) == s1.merge(s0)
    assert sorted(m.specs) == ["embed", "head", "l0", "l1"]
    assert m.local_shapes(0) == {"embed": (5, 4), "l0": (2, 4)}
    assert m.local_shapes(3) == {"l1": (4, 2), "head": (4, 5)}
    assert m | s0 == m  # merging what is already there changes nothing
    assert len(m.fragments) == 8


def test_merge_rejects_conflicts():
    a = Layout.from_placements({"w": (4, 4)}, [0], [Replicate()])
    with pytest.raises(ValueError, match="'w'"):
        a | Layout.from_placements({"w": (4, 5)}, [1], [Replicate()])
    with pytest.raises(ValueError, match="'w'"):
        a | Layout.from_placements({"w": (4, 4)}, [1], [Replicate()], BF16)
    # same tensor, same rank, same local name, different local shape
    with pytest.raises(ValueError, match="local tensor 'w' on rank 0"):
        a | Layout.from_placements({"w": (4, 4)}, [0, 1], [Shard(0)])


def test_restrict():
    lay = _qkv_layout() | Layout.from_placements({"o": (3, 3)}, [0, 1, 2, 3], [Shard(0)])
    r = lay.restrict(["q", "o"])
    assert sorted(r.specs) == ["o", "q"]
    assert {f.tensor for f in r.fragments} == {"q", "o"}
    assert r.local_shapes(0) == {"qkv": (8, 3), "o": (1, 3)}
    assert r.local_shapes(3) == {"o": (0, 3)}  # an empty shard stays declared
    assert lay.restrict(["o"]).local_shapes(1) == {"o": (1, 3)}  # qkv holds no 'o': dropped


@pytest.mark.parametrize(
    ("build", "match"),
    [
        pytest.param(lambda: Layout((TensorSpec("w", (2,), F32), TensorSpec("w", (3,), F32)), (), ()), "'w' is declared twice", id="tensor-twice"),
        pytest.param(lambda: Layout((TensorSpec("w", (2,), F32),), (Fragment("w", 0, (0,), (2,)),),
                                    (LocalSpec(0, "w", (2,), F32), LocalSpec(0, "w", (2,), F32))), "declared twice", id="local-twice"),
        pytest.param(lambda: Layout((TensorSpec("w", (2,), F32),), (Fragment("w", 0, (0,), (2,)),), ()), "lacks", id="local-missing"),
        pytest.param(lambda: Layout((TensorSpec("w", (2,), F32),), (Fragment("w", 0, (0,), (2,)),),
                                    (LocalSpec(0, "w", (2,), BF16),)), "bfloat16", id="local-dtype"),
        pytest.param(lambda: Layout((TensorSpec("w", (2, 2), F32),), (Fragment("w", 0, (0,), (2,)),),
                                    (LocalSpec(0, "w", (2,), F32),)), "dims", id="box-dims"),
        pytest.param(lambda: Layout((TensorSpec("w", (2,), F32),), (Fragment("w", 0, (0,), (2,)),),
                                    (LocalSpec(0, "w", (1, 2), F32),)), "local_offsets", id="local-dims"),
        pytest.param(lambda: Layout.from_fragments({"a": ((2,), F32), "b": ((2,), BF16)},
                                                   [Fragment("a", 0, (0,), (2,), "x"), Fragment("b", 0, (0,), (2,), "x", (2,))]),
                     "dtypes", id="mixed-dtypes-in-one-local"),
        pytest.param(lambda: Layout.from_fragments({"a": ((2,), F32)}, [Fragment("a", 0, (0,), (2,))],
                                                   local_shapes={(1, "a"): (2,)}), "holds no fragment", id="shape-for-empty-local"),
        pytest.param(lambda: Layout.from_fragments({"a": ((2, 2), F32)}, [Fragment("a", 0, (0, 0), (1, 2), "x"),
                                                                          Fragment("a", 0, (1, 0), (1, 2), "x", (0, 0, 0))]),
                     "number of dims", id="local-dims-disagree"),
    ],
)
def test_layout_validation(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_empty_fragments_never_overlap():
    # two empty boxes at the same local offset are fine (DTensor's empty trailing shards)
    lay = Layout.from_fragments(
        {"a": ((0, 3), F32), "b": ((2, 3), F32)},
        [Fragment("a", 0, (0, 0), (0, 3), "x"), Fragment("b", 0, (0, 0), (2, 3), "x")],
    )
    assert lay.local_shapes(0) == {"x": (2, 3)}
