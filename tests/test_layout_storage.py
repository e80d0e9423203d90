"""One layout storage: every Layout is stored as columns, however it was built; the object view is built from the
columns on demand; the column check is the one validation decision (the eager checks only word its refusals);
the planner reads the query interface, never the object view of a preset layout."""

from __future__ import annotations

import pickle
from dataclasses import FrozenInstanceError

import numpy as np
import pytest
import torch

from triton_reshard.layout import ColumnarLayout, Fragment, Layout, LocalSpec, Shard, TensorSpec, columnar
from triton_reshard.plan import plan_reshard
from triton_reshard.plan.contiguity import Contiguity

F32 = torch.float32
_COLS = ("ft", "fr", "fl", "foff", "fsz", "flo", "flnd", "lr", "ln", "lsh", "lnd", "ldt")


def _presets():
    from triton_reshard.presets import get_config, megatron_layout, vllm_layout

    cfg = get_config("tiny_qwen3_moe")
    src = megatron_layout(cfg, tp=2, pp=2, dp=2, ep=2, etp=1, ranks=range(8), dtype=torch.bfloat16)
    dst = vllm_layout(cfg, tp=2, dp=2, enable_expert_parallel=True, ranks=range(4, 8), dtype=torch.bfloat16)
    return src, dst


def _same_columns(a: Layout, b: Layout) -> None:
    ca, cb = a._cols, b._cols
    assert (ca.names, ca.lnames, ca.dtypes) == (cb.names, cb.lnames, cb.dtypes)
    for k in _COLS:
        x, y = getattr(ca, k), getattr(cb, k)
        assert x.shape == y.shape and np.array_equal(x, y), k


def test_a_layout_built_from_objects_has_the_builders_columns_and_identity():
    """The preset's layout (ColumnBuilder) and the layout of its objects: the same columns, equal, one hash, one
    digest and fingerprint; one class (``ColumnarLayout`` is the same class, kept for its importers)."""
    assert ColumnarLayout is Layout
    for lay in _presets():
        assert not lay.objects_built
        ob = Layout(lay.tensors, reversed(lay.fragments), reversed(lay.locals))  # any order: the layout sorts
        assert type(ob) is type(lay) is Layout
        _same_columns(lay, ob)
        assert ob == lay and hash(ob) == hash(lay)
        assert ob.digest == lay.digest and ob.fingerprint == lay.fingerprint
        assert columnar(lay.tensors, lay.fragments, lay.locals) == lay


def test_the_object_view_is_the_objects_given_and_is_rebuilt_from_the_columns():
    """A layout built from objects reads them back in layout order; released, the view is built again from the
    columns and equals them (order included); a column-built layout's view equals its objects' layout's."""
    t = TensorSpec("w", (8, 6), F32)
    frags = [Fragment("w", 1, (4, 0), (4, 6), "w"), Fragment("w", 0, (0, 0), (4, 3), "p", (0, 0)),
             Fragment("w", 0, (0, 3), (4, 3), "p", (4, 0))]
    locs = [LocalSpec(1, "w", (4, 6), F32), LocalSpec(0, "p", (8, 3), F32)]
    lay = Layout((t,), frags, locs)
    want_f = tuple(sorted(frags, key=lambda f: (f.tensor, f.rank, f.local, f.offsets, f.local_offsets)))
    want_l = tuple(sorted(locs, key=lambda s: (s.rank, s.name)))
    assert lay.objects_built and lay.fragments == want_f and lay.locals == want_l
    digest, by_local = lay.digest, dict(lay.fragments_by_local)
    lay.release_objects()
    assert not lay.objects_built
    assert lay.fragments_on_rank(0) == want_f[:2] and lay.local_specs(0) == {"p": want_l[0]}
    assert not lay.objects_built  # the per-rank queries read the columns
    assert lay.fragments == want_f and lay.locals == want_l and lay.objects_built
    assert lay.digest == digest and dict(lay.fragments_by_local) == by_local


def test_layouts_pickle_as_columns_and_stay_immutable():
    a = Layout.from_placements({"w": (8, 4), "b": (3,)}, [0, 1], [Shard(0)])
    for lay in (a, a.instances(2), _presets()[1].instances(2)):
        back = pickle.loads(pickle.dumps(lay))
        assert not back.objects_built  # the columns travel, not the objects
        assert back == lay and back.digest == lay.digest and back.fingerprint == lay.fingerprint
    with pytest.raises(FrozenInstanceError):
        a.fragments = ()
    with pytest.raises(FrozenInstanceError):
        del a.tensors


def test_the_column_check_is_the_one_decision(monkeypatch):
    """Whatever built the layout, the column check decides; the eager checks only word a refusal (the same
    message either way). A column check that refused a layout the eager checks accept would be a bug: it raises,
    rather than the eager checks overruling it."""
    import importlib

    columnar_mod = importlib.import_module("triton_reshard.layout.columnar")  # (the package's ``columnar`` is a function)

    t = TensorSpec("w", (8,), F32)
    frags = [Fragment("w", 0, (0,), (4,), "x"), Fragment("w", 0, (4,), (4,), "x", (2,))]
    locs = [LocalSpec(0, "x", (8,), F32)]
    with pytest.raises(ValueError, match=r"overlapping fragments on rank 0 in local tensor 'x'") as objs:
        Layout((t,), frags, locs)
    with pytest.raises(ValueError) as cols:  # the same parts through the builders' entry (columns)
        Layout((t,), Layout((t,), frags, locs, validate=False)._cols)
    assert str(objs.value) == str(cols.value)
    good = [Fragment("w", 0, (0,), (8,), "x")]
    monkeypatch.setattr(columnar_mod, "columns_valid", lambda c, lt: False)
    with pytest.raises(AssertionError, match="column checks refuse"):
        Layout((t,), good, locs)
    monkeypatch.setattr(columnar_mod, "columns_valid", lambda c, lt: True)
    Layout((t,), frags, locs)  # (what the column check accepts is a layout: no second opinion)


def test_the_planner_never_builds_a_preset_layouts_object_view():
    """Whole plan, a rank's share and both schedules run on the query interface: the presets' layouts (and their
    engine instances) never build their fragments or local tensors as objects."""
    src, dst = _presets()
    dst = dst.instances(2)
    plan_reshard.cache_clear()
    whole = plan_reshard(src, dst)
    whole.schedule(1 << 20, 0).for_rank(0)
    for r in (0, 5, 11):
        plan_reshard(src, dst, rank=r).schedule(1 << 20, 0).for_rank(r)
    assert not src.objects_built and not dst.objects_built
    assert not any(k in lay.__dict__ for lay in (src, dst) for k in ("locals", "fragments_by_tensor", "_key"))


def test_one_contiguity_for_whole_plans_and_shares():
    """The schedule asks one :class:`Contiguity` whether a chunk may travel in place, for the whole plan and for
    each share; on the same transfer both answer alike, chunk by chunk."""
    src, dst = _presets()
    whole = plan_reshard(src, dst)
    cw = whole._contiguity(0)
    assert type(cw) is Contiguity
    seen = 0
    for r in (0, 5):
        share = plan_reshard(src, dst, rank=r)
        cs = share._contiguity(0)
        assert type(cs) is Contiguity
        for t in share.transfers:
            halves = [((0,) * len(t.sizes), t.sizes)]
            if t.sizes and t.sizes[0] > 1:
                h = t.sizes[0] // 2
                halves.append(((h,) + (0,) * (len(t.sizes) - 1), (t.sizes[0] - h,) + t.sizes[1:]))
            for off, size in halves:
                assert cs.direct(t, off, size) == cw.direct(t, off, size)
                seen += cw.direct(t, off, size)
        assert cs.shapes(t) == cw.shapes(t)
    assert seen  # some chunks travel in place
