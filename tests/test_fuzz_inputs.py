"""Invalid inputs to the pure API, property-based (issue 12, point 4): a valid description with one field
replaced by something invalid must raise ValueError or TypeError, quickly (no spinning on huge sizes), with a
message that names the tensor and the field. No process group."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from triton_reshard import Fragment, Layout, Replicate, Resharder, Shard, plan_reshard

F32 = torch.float32
FUZZ = settings(max_examples=150, deadline=timedelta(seconds=2), suppress_health_check=[HealthCheck.too_slow])
NAMES = st.sampled_from(["w", "model.layers.0.self_attn.qkv_proj.weight", "emb"])

bad_scalar = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),  # 2.0 too: a float is not an index
    st.text(max_size=3),
    st.none(),
    st.booleans(),
)
huge = st.integers(min_value=1 << 49, max_value=1 << 80)
bad_shape = st.one_of(
    st.integers(-5, 5),  # an int instead of a tuple
    st.none(),
    st.text(max_size=3),
    st.builds(lambda a, x: (a, x), st.integers(1, 4), bad_scalar),
    st.builds(lambda a, x: (a, -x), st.integers(1, 4), st.integers(1, 9)),
    st.builds(lambda a, b: (a, b), huge, st.integers(1, 1 << 40)),  # beyond what a device can address
)
bad_box = st.one_of(
    st.integers(0, 3),
    st.none(),
    st.builds(lambda x: (0, x), bad_scalar),
    st.builds(lambda x: (x, 0), bad_scalar),
)


def _check(exc: BaseException, *words: str) -> None:
    assert isinstance(exc, (ValueError, TypeError)), f"{type(exc).__name__}: {exc}"
    msg = str(exc)
    for w in words:
        assert w in msg, (w, msg)


def _raises(fn):
    try:
        fn()
    except Exception as e:  # the type is what the test checks
        return e
    pytest.fail("accepted an invalid input")


@FUZZ
@given(NAMES, bad_shape)
def test_from_placements_bad_shape(name, shape):
    e = _raises(lambda: Layout.from_placements({name: shape, "ok": (4,)}, [0, 1], [Shard(0)]))
    _check(e, f"'{name}'")


@FUZZ
@given(NAMES, bad_shape)
def test_from_fragments_bad_tensor_shape(name, shape):
    e = _raises(lambda: Layout.from_fragments({name: (shape, F32)}, [Fragment(name, 0, (0, 0), (1, 1))]))
    _check(e, f"'{name}'")


@FUZZ
@given(NAMES, st.sampled_from(["offsets", "sizes", "local_offsets"]), bad_box)
def test_fragment_bad_box_field(name, field, value):
    kw = {"offsets": (0, 0), "sizes": (2, 2), "local_offsets": (0, 0)}
    kw[field] = value

    def build():
        f = Fragment(name, 0, kw["offsets"], kw["sizes"], "", kw["local_offsets"])
        Layout.from_fragments({name: ((4, 4), F32)}, [f])

    e = _raises(build)
    _check(e, f"'{name}'")
    if isinstance(e, TypeError) and "expected" in str(e):
        assert field in str(e), str(e)


@FUZZ
@given(NAMES, st.one_of(bad_scalar, st.integers(max_value=-1)))
def test_fragment_bad_rank(name, rank):
    _check(_raises(lambda: Fragment(name, rank, (0,), (1,))), f"'{name}'", "rank")


@FUZZ
@given(NAMES, st.one_of(st.text(max_size=3), st.integers(), st.tuples(st.text(max_size=2)), st.none()),
       st.one_of(bad_shape, st.just((4, 4))))
def test_from_fragments_bad_local_shapes(name, key, shape):
    def build():
        Layout.from_fragments({name: ((4, 4), F32)}, [Fragment(name, 0, (0, 0), (4, 4))], {key: shape})

    e = _raises(build)
    assert isinstance(e, (ValueError, TypeError)), f"{type(e).__name__}: {e}"
    assert "local_shapes" in str(e) or f"'{name}'" in str(e), str(e)


@FUZZ
@given(NAMES, st.one_of(st.tuples(st.text(max_size=2)), st.integers(), st.none(), st.lists(st.integers(), max_size=3)))
def test_from_fragments_fragment_not_a_fragment(name, frag):
    e = _raises(lambda: Layout.from_fragments({name: ((4,), F32)}, [Fragment(name, 0, (0,), (2,)), frag]))
    _check(e, "fragments[1]")


@FUZZ
@given(NAMES, st.one_of(st.lists(NAMES, max_size=2), st.none(), st.integers(), st.text(max_size=3)))
def test_from_placements_shapes_not_a_dict(name, shapes):
    _check(_raises(lambda: Layout.from_placements(shapes, [0], [Replicate()])), "shapes")


def test_from_placements_dtype_dict_missing_a_tensor():
    e = _raises(lambda: Layout.from_placements({"w": (4,), "v": (4,)}, [0], [Replicate()], {"w": F32}))
    _check(e, "'v'", "dtype")


@FUZZ
@given(st.one_of(st.floats(), st.just(float("inf")), st.just(float("nan")), st.integers(max_value=0),
                 st.text(max_size=3), st.none(), st.booleans(), st.just(timedelta(0))))
def test_resharder_bad_timeout(timeout):
    lay = Layout.from_placements({"w": (4,)}, [0], [Replicate()])
    if isinstance(timeout, float) and timeout > 0 and timeout != float("inf"):
        return  # a valid timeout
    _check(_raises(lambda: Resharder(plan_reshard(lay, lay), timeout=timeout)), "timeout")


@FUZZ
@given(st.sampled_from(["bucket_bytes", "direct_min_bytes"]),
       st.one_of(st.floats(), st.text(max_size=3), st.none(), st.booleans(), st.integers(max_value=-1)))
def test_resharder_bad_sizes(field, value):
    lay = Layout.from_placements({"w": (4,)}, [0], [Replicate()])
    _check(_raises(lambda: Resharder(plan_reshard(lay, lay), **{field: value})), field)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float32])
def test_huge_tensor_rejected_up_front_instead_of_spinning(dtype):
    """A (2**62,) tensor used to make the scheduler run forever."""
    e = _raises(lambda: Layout.from_placements({"w": (1 << 62,)}, [0, 1], [Shard(0)], dtype))
    _check(e, "'w'", "2**48")


def test_tiny_bucket_for_a_big_plan_rejected_instead_of_spinning():
    src = Layout.from_placements({"w": (1 << 36,)}, [0, 1], [Shard(0)], torch.int8)
    dst = Layout.from_placements({"w": (1 << 36,)}, [0, 1], [Replicate()], torch.int8)
    _check(_raises(lambda: Resharder(plan_reshard(src, dst), bucket_bytes=4096)), "bucket_bytes")


# a placements / dtype / dtypes entry for a name that is not a tensor of the layout (issue 19, "Also"):
# almost always a typo; refused naming the key and the nearest real name
TYPO = st.sampled_from(["w ", "W", "wq", "model.layers.0.self_attn.qkv_proj.weights", "emb.weight", "x"])


@FUZZ
@given(NAMES, TYPO)
def test_placements_for_an_unknown_tensor(name, typo):
    from hypothesis import assume

    assume(typo != name)
    shapes = {name: (4, 4)}
    e = _raises(lambda: Layout.from_placements(shapes, [0, 1], {name: [Shard(0)], typo: [Replicate()]}))
    _check(e, "placements", repr(typo), "is not a tensor of the layout")
    e = _raises(lambda: Layout.from_placements(shapes, [0, 1], [Shard(0)], {name: F32, typo: torch.bfloat16}))
    _check(e, "dtype", repr(typo))


def test_unknown_names_say_the_nearest_real_one():
    from triton_reshard.layout import LogicalTensors

    shapes = {"model.layers.0.mlp.up_proj.weight": (8, 4), "model.norm.weight": (4,)}
    with pytest.raises(ValueError, match=r"placements: 'model.layers.0.mlp.up_prj.weight' is not a tensor of the "
                                         r"layout \(did you mean 'model.layers.0.mlp.up_proj.weight'\?\)"):
        Layout.from_placements(shapes, [0], {**{n: [Replicate()] for n in shapes},
                                             "model.layers.0.mlp.up_prj.weight": [Shard(0)]})
    with pytest.raises(ValueError, match=r"dtype: 'model.norm.wieght' .*did you mean 'model.norm.weight'"):
        Layout.from_placements(shapes, [0], [Replicate()], {**{n: F32 for n in shapes}, "model.norm.wieght": F32})
    with pytest.raises(ValueError, match=r"dtypes: 'model.nrm.weight' is not a tensor of the layout \(did you mean 'model.norm.weight'\?\) \(and 1 more: 'zzz'\)"):
        LogicalTensors.from_shapes(shapes, F32, {"zzz": torch.bfloat16, "model.nrm.weight": F32})
    with pytest.raises(ValueError, match=r"did you mean 'model.norm.weight'"):
        LogicalTensors.from_shapes(shapes, F32, {"model.nrm.weight": F32})
    Layout.from_placements(shapes, [0], {n: [Replicate()] for n in shapes}, {n: F32 for n in shapes})  # exact: fine
