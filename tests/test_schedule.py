"""Schedule structure: direct messages (one big contiguous chunk, moved in place by the executor), their place
in the staging areas, and the order both sides post a pair's messages in. Pure: no process group."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from triton_reshard import Layout, Replicate, Shard, plan_reshard
from triton_reshard.box import is_contiguous_box
from triton_reshard.plan import ALIGN, DIRECT_MIN_BYTES

from .oracles.first_fit import build_schedule

F32, BF16 = torch.float32, torch.bfloat16


def _plan(src_pl, dst_pl, shape=(64, 32), src_ranks=(0, 1), dst_ranks=(2, 3), sdt=F32, ddt=F32):
    src = Layout.from_placements({"w": shape}, list(src_ranks), src_pl, sdt)
    dst = Layout.from_placements({"w": shape}, list(dst_ranks), dst_pl, ddt)
    return plan_reshard(src, dst, allow_cast=sdt != ddt)


@pytest.mark.parametrize(
    ("shape", "start", "off", "size", "want"),
    [
        ((8, 4), (0, 0), (2, 0), (3, 4), True),  # whole rows
        ((8, 4), (0, 0), (2, 1), (3, 2), False),  # part of several rows
        ((8, 4), (0, 0), (2, 1), (1, 2), True),  # part of one row
        ((2, 8, 4), (1, 0, 0), (0, 0), (8, 4), True),  # extra leading dim, one whole slab
        ((2, 8, 4), (0, 3, 0), (0, 0), (2, 4), True),
        ((3, 8, 4), (0, 0, 0), (0, 0, 0), (2, 8, 3), False),
        ((5,), (0,), (1,), (3,), True),
        ((), (), (), (), True),
    ],
)
def test_is_contiguous_box(shape, start, off, size, want):
    assert is_contiguous_box(shape, start, off, size) is want


def test_row_shards_become_direct_messages_and_column_shards_do_not():
    rows = _plan([Shard(0)], [Shard(0)], src_ranks=(0, 1), dst_ranks=(3, 2))
    cols = _plan([Shard(1)], [Shard(1)], src_ranks=(0, 1), dst_ranks=(2, 3, 4, 5))
    sched = rows.schedule(1 << 20, direct_min_bytes=0)
    assert all(m.direct and len(m.chunks) == 1 for s in sched.steps for m in s.messages)
    # column shards TP2 -> TP4: each destination's [64, 8] is a column slab of a source [64, 16] (not
    # contiguous there) but the whole destination tensor (contiguous): direct, received in place
    sched = cols.schedule(1 << 20, direct_min_bytes=0)
    assert all(m.direct for s in sched.steps for m in s.messages)
    # split along the last dim -> split along the middle dim of a 3-D tensor: each piece [4, 4, 4] is
    # contiguous on neither side -> packed
    mixed = _plan([Shard(2)], [Shard(1)], shape=(4, 8, 8), src_ranks=(0, 1), dst_ranks=(2, 3))
    sched = mixed.schedule(1 << 20, direct_min_bytes=0)
    assert not any(m.direct for s in sched.steps for m in s.messages)


def test_default_threshold_keeps_small_chunks_packed():
    plan = _plan([Shard(0)], [Shard(0)], shape=(64, 32))  # 4 KiB chunks
    assert not any(m.direct for s in plan.schedule(1 << 20).steps for m in s.messages)
    big = _plan([Replicate()], [Shard(0)], shape=(1024, 1024), src_ranks=(0,), dst_ranks=(1, 2))  # 2 MiB each
    msgs = [m for s in big.schedule(64 << 20).steps for m in s.messages]
    assert len(msgs) == 2 and all(m.direct and m.payload == 2 << 20 >= DIRECT_MIN_BYTES for m in msgs)


def test_cast_on_the_sender_keeps_the_receiver_side_direct():
    """fp32 -> bf16: the sender must cast (packs), the receiver can still receive in place; the other way
    round (bf16 -> fp32) the wire is bf16 and the receiver casts, the sender sends in place."""
    for sdt, ddt in ((F32, BF16), (BF16, F32)):
        plan = _plan([Shard(0)], [Shard(0)], sdt=sdt, ddt=ddt, dst_ranks=(2, 3))
        contig = plan._contiguity()
        for t in plan.transfers:
            s_shape, d_shape = contig.shapes(t)
            assert t.wire_dtype == BF16
            assert (s_shape is not None) == (sdt == BF16) and (d_shape is not None) == (ddt == BF16)
        assert all(m.direct for s in plan.schedule(1 << 20, 0).steps for m in s.messages)


def test_packed_messages_first_in_the_staging_areas_and_the_same_order_on_both_sides():
    # rows of "a" are contiguous on both sides (direct); the [4, 4, 4] pieces of "b" on neither (packed)
    src = Layout.from_placements({"a": (64, 32)}, [0], [Replicate()], F32) | Layout.from_placements(
        {"b": (4, 8, 8)}, [0, 3], [Shard(2)], F32
    )
    dst = Layout.from_placements({"a": (64, 32)}, [1, 2], [Shard(0)], F32) | Layout.from_placements(
        {"b": (4, 8, 8)}, [1, 2], [Shard(1)], F32
    )
    plan = plan_reshard(src, dst)
    sched = plan.schedule(1 << 20, direct_min_bytes=0)
    steps, send_area, recv_area = sched.for_rank(0)
    assert len(steps) == 1
    sends = steps[0].sends
    kinds = [m.direct for _p, _a, m in sends]
    assert kinds == sorted(kinds) and True in kinds and False in kinds  # packed first, then direct
    offs = [at for _p, at, _m in sends]
    assert offs == sorted(offs) and all(o % ALIGN == 0 for o in offs)
    for peer in (1, 2):
        mine = [m for p, _a, m in sends if p == peer]
        theirs = [m for p, _a, m in sched.for_rank(peer)[0][0].recvs if p == 0]
        assert mine == theirs


def test_build_schedule_without_contiguity_packs_everything():
    plan = _plan([Shard(0)], [Shard(0)], dst_ranks=(3, 2))
    sched = build_schedule(plan.transfers, 1 << 20)
    assert not any(m.direct for s in sched.steps for m in s.messages)
    with pytest.raises(ValueError, match="direct_min_bytes"):
        build_schedule(plan.transfers, 1 << 20, None, -1)


def test_schedule_is_cached_per_threshold():
    plan = _plan([Shard(0)], [Shard(0)], dst_ranks=(3, 2))
    assert plan.schedule(4096, 0) is plan.schedule(4096, 0)
    assert plan.schedule(4096, 0) is not plan.schedule(4096)


@pytest.mark.parametrize("bucket", [16 * ALIGN, 4096, 1 << 20])
@pytest.mark.parametrize("direct_min", [0, 1024, DIRECT_MIN_BYTES])
def test_pair_schedule_columns_agree_with_its_messages(bucket, direct_min):
    """The pair-rule schedule's columns (per load: step, pair, payload; found without building messages) say
    what its messages say: ``pair_bytes`` per step, ``step_phase``, and ``for_rank`` built from one rank's pairs
    equals the generic ``Schedule.for_rank`` over the materialized steps. Small buckets cut big transfers into
    runs of chunks (each more than half a load: one load per chunk)."""
    from triton_reshard.plan.pair_schedule import PairSchedule
    from triton_reshard.plan.types import Schedule

    shapes = {"w": (96, 37), "b": (301,), "e": (5, 24, 8)}
    src = Layout.from_placements(shapes, [0, 1], [Replicate()], F32)
    dst = Layout.from_placements(shapes, [2, 3, 4], [Shard(0)], F32)
    plan = plan_reshard(src, dst)
    sched = plan.schedule(bucket, direct_min_bytes=direct_min)
    assert isinstance(sched, PairSchedule)
    ranks = plan.ranks
    first = {r: sched.for_rank(r) for r in ranks}  # before any step is built
    pb = sched.pair_bytes()
    steps = list(sched.steps)
    assert len(pb) == len(steps) == len(sched.steps) > 0
    for i, step in enumerate(steps):
        want: dict = {}
        for m in step.messages:
            want[(m.src, m.dst)] = want.get((m.src, m.dst), 0) + m.payload
        assert dict(pb[i]) == want and len(pb[i]) == len(want)
        assert sched.step_phase(i) == step.phase
    generic = Schedule(sched.bucket_bytes, tuple(steps))
    for r in ranks:
        assert first[r] == generic.for_rank(r) == sched.for_rank(r)
    assert sched == generic and sched.steps[-1] is steps[-1]


# --------------------------------------------------------------------------------------------------------
# The schedule on the columns equals the schedule over the objects
# --------------------------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=0, max_size=4).flatmap(
    lambda shape: st.tuples(st.just(tuple(shape)), st.tuples(*[st.integers(1, n) for n in shape]),
                            st.integers(0, 2))))
def test_contiguous_columns_equal_is_contiguous_box(case):
    """``box.contiguous_boxes`` (right-aligned shapes, left-aligned padded sizes) answers as
    ``is_contiguous_box`` on every (local shape, sub-box sizes), with extra leading dims in the local tensor."""
    import numpy as np

    from triton_reshard.box import contiguous_boxes

    shape, size, extra = case
    local = (2,) * extra + shape
    want = is_contiguous_box(local, (0,) * len(local), (0,) * len(size), size)
    W, D = len(local) + 1, len(size) + 2  # wider than needed: padding must not change the answer
    shapes = np.ones((1, W), np.int64)
    if local:
        shapes[0, W - len(local):] = local
    sizes = np.ones((1, D), np.int64)
    sizes[0, :len(size)] = size
    assert bool(contiguous_boxes(shapes, sizes, np.array([len(size)]))[0]) is want


def _preset_plans():
    from triton_reshard.presets import get_config, megatron_layout, vllm_layout

    cfg = get_config("qwen3-30b-a3b")
    src = megatron_layout(cfg, tp=2, pp=2, dp=2, ep=4, etp=1, ranks=range(8), dtype=BF16)
    dst = vllm_layout(cfg, tp=2, dp=2, enable_expert_parallel=True, ranks=0, dtype=BF16, instances=2)
    return [("presets, two instances", plan_reshard(src, dst)),
            ("presets, relays", plan_reshard(src, dst, gpus_per_node=4)),
            ("presets, rank 5's share", plan_reshard(src, dst, gpus_per_node=4, rank=5))]


def _oracle_loads(sched, min_bytes: int, cont):
    """Per pair of ``sched`` its loads by the object-form step rule (``tests/oracles/pair_loads.py``)."""
    from .oracles.pair_loads import direct_of, in_key_order, pair_loads

    pairs, table = sched._pairs, sched._table
    out = []
    for j in range(len(pairs)):
        rows = pairs.rows(j)
        ts = in_key_order(list(zip(rows.tolist(), table.objects_at(rows), strict=True)))
        out.append(pair_loads(ts, sched._cap, direct_of(cont, min_bytes)))
    return out


def _assert_same_loads(sched, min_bytes: int, cont, what) -> int:
    """The package's loads of every pair (messages, and payloads on the step columns) equal the oracle's;
    returns the number of direct messages."""
    want = _oracle_loads(sched, min_bytes, cont)
    n_direct = 0
    pay: dict = {}
    for j, loads in enumerate(want):
        assert sched._pair_loads(j) == loads, (what, j)
        n_direct += sum(m.direct for load in loads for m in load)
        for m, load in enumerate(loads):
            pay[(j, m)] = sum(x.payload for x in load)
    got: dict = {}
    pairs = sched._pairs
    for i, pb in enumerate(sched.pair_bytes()):
        ph, num = sched.numbers[i]
        for (s, d), nb in dict(pb).items():
            j = pairs.find(ph, s, d)
            got[(j, (num - int(sched._firsts[j])) // sched._windows)] = nb
    assert got == pay, what
    return n_direct


@pytest.mark.parametrize("bucket", [1 << 22, 1 << 30])
def test_column_loads_equal_the_object_loads_on_every_pair(bucket):
    """Each pair's loads cut on the columns (``_cut``: chunks, contiguity by the layouts' batched
    ``local_shape_columns``, the next fit as arrays) are the loads the object-form oracle cuts over the pair's
    objects with the per-object contiguity, on preset layouts (tiled engine instances, relays, a share)."""
    from triton_reshard.plan.contiguity import contiguity

    for what, plan in _preset_plans():
        sched = plan.schedule(bucket, direct_min_bytes=1 << 12)
        cont = contiguity(plan.transfers, plan.src, plan.dst, 1 << 12, plan.rank)
        n_direct = _assert_same_loads(sched, 1 << 12, cont, what)
        assert len(sched.numbers) and n_direct > 0, what  # the direct path is exercised


_SHAPES = st.lists(st.integers(1, 40), min_size=1, max_size=3).map(tuple)


@settings(max_examples=60, deadline=None)
@given(shapes=st.lists(_SHAPES, min_size=1, max_size=3), src_n=st.integers(1, 4), dst_n=st.integers(1, 4),
       src_dim=st.integers(-1, 2), dst_dim=st.integers(-1, 2), bucket_log=st.integers(10, 16),
       min_log=st.integers(-1, 10), dtypes=st.sampled_from([(F32, F32), (BF16, BF16), (F32, BF16)]),
       shuffle=st.randoms(use_true_random=False), hand=st.booleans())
def test_step_rule_equals_the_object_oracle_on_random_cases(shapes, src_n, dst_n, src_dim, dst_dim, bucket_log,
                                                            min_log, dtypes, shuffle, hand):
    """The step rule on the columns equals the object-form oracle on random layouts (sharded or replicated,
    overlapping rank sets, casts), random buckets (small ones split transfers into runs of chunks) and
    thresholds; ``hand``: the transfers handed over shuffled (pairs not in key order)."""
    from triton_reshard.plan.contiguity import Contiguity
    from triton_reshard.plan.pair_schedule import build_pair_schedule, world_of

    named = {f"t{i}": s for i, s in enumerate(shapes)}

    def side(n, dim, first, dt):
        pls = {k: [Shard(dim) if 0 <= dim < len(s) else Replicate()] for k, s in named.items()}
        return Layout.from_placements(named, list(range(first, first + n)), pls, dt)

    src, dst = side(src_n, src_dim, 0, dtypes[0]), side(dst_n, dst_dim, src_n // 2, dtypes[1])
    plan = plan_reshard(src, dst, allow_cast=dtypes[0] != dtypes[1])
    bucket, min_bytes = 1 << bucket_log, (0 if min_log < 0 else 1 << min_log)
    ts = list(plan.transfers)
    if hand:
        shuffle.shuffle(ts)
    cont = Contiguity(ts, src, dst, min_bytes)
    sched = build_pair_schedule(ts, bucket, cont, min_bytes, world_of(src, dst))
    _assert_same_loads(sched, min_bytes, cont, "random")
    if plan.transfers and not hand:
        assert sched == plan.schedule(bucket, direct_min_bytes=min_bytes)


def test_step_rule_equals_the_object_oracle_on_source_quantized_rows():
    """Source-quantized rows (cut only at block multiples, never direct) and destination-quantized pieces go
    through the same rule as plain rows: the loads equal the oracle's, small buckets included."""
    from triton_reshard import block_quant_layout
    from triton_reshard.plan.contiguity import contiguity

    shapes = {"w": (96, 64), "b": (40,)}
    src = Layout.from_placements(shapes, [0, 1], {"w": [Shard(1)], "b": [Replicate()]}, BF16)
    dst = Layout.from_placements(shapes, [2, 3, 4], [Shard(0)], BF16)
    plan = plan_reshard(src, block_quant_layout(dst, ["w"], (16, 16)))
    assert {t.quant for t in plan.transfers} >= {"src"}
    for bucket in (1 << 12, 1 << 14, 1 << 20):
        sched = plan.schedule(bucket, direct_min_bytes=0)
        _assert_same_loads(sched, 0, contiguity(plan.transfers, plan.src, plan.dst, 0), bucket)


def test_local_shape_columns_agree_on_both_storages():
    """``Layout.local_shape_columns`` (the schedule's batched local-tensor query): a columnar layout's vectorized
    answer (engine instances included) equals the generic one from ``local_spec``, missing ranks and names -1."""
    import numpy as np

    from triton_reshard.presets import get_config, vllm_layout

    cfg = get_config("qwen3-30b-a3b")
    lay = vllm_layout(cfg, tp=2, dp=2, enable_expert_parallel=True, ranks=0, dtype=BF16, instances=3)
    names = sorted(lay.local_specs(0)) + sorted(lay.local_specs(5))[:3] + ["no.such.local"]
    rng = np.random.default_rng(0)
    ranks = rng.choice(list(lay.ranks) + [99], 500)
    codes = rng.integers(0, len(names), 500)
    got = lay.local_shape_columns(ranks, names, codes)
    want = Layout.local_shape_columns(lay, ranks, names, codes)

    def rows(res):
        shp, code, dts = res
        return [None if c < 0 else (tuple(int(v) for v in s), dts[c]) for s, c in zip(shp, code.tolist(), strict=True)]

    def strip(r):
        if r is None:
            return None
        sh = list(r[0])
        while len(sh) > 1 and sh[0] == 1:
            sh.pop(0)
        return tuple(sh), r[1]

    g, w = [strip(r) for r in rows(got)], [strip(r) for r in rows(want)]
    assert g == w
    assert 0 < sum(r is not None for r in g) < len(g)
    for r, c, row in zip(ranks.tolist(), codes.tolist(), g, strict=True):
        spec = lay.local_spec(r, names[c])
        assert (row is None) == (spec is None)
        if spec is not None:
            assert row[1] == spec.dtype and row[0][-len(spec.shape):] == spec.shape


def test_local_shape_columns_of_a_layout_without_local_tensors():
    """A columnar layout that holds no local tensor answers "none" for every row (it used to index an empty
    column)."""
    import numpy as np

    from triton_reshard.layout import TensorSpec
    from triton_reshard.layout.columnar import columnar

    lay = columnar([TensorSpec("w", (0,), F32)], [], [])
    shapes, codes, _dts = lay.local_shape_columns(np.array([0, 3]), ["w"], np.array([0, 0]))
    assert codes.tolist() == [-1, -1] and len(shapes) == 2
