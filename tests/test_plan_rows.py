"""Routing as rows (``plan/rows.py``) and the checks it feeds: the same transfers as the object router
(``tests/oracles/route_objects.py``: ``route_box`` box by box), whole and per rank, and the vectorized disjointness check of
``validate.overlapping_writes`` against ``find_overlap``."""

from __future__ import annotations

import dataclasses
import random
import types

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from triton_reshard.box import boxes_meet, find_overlap
from triton_reshard.plan import plan_reshard
from triton_reshard.plan.local import route_rank
from triton_reshard.plan.routing import check_relay_groups, held_numel
from triton_reshard.plan.rows import missing_elements, route_tables
from triton_reshard.plan.table import TransferTable
from triton_reshard.plan.validate import overlapping_writes
from triton_reshard.presets import get_config, megatron_layout, vllm_layout

from .oracles.route_objects import route_all


def _pair(model="qwen3-30b-a3b"):
    cfg = get_config(model)
    moe = model == "qwen3-30b-a3b"
    src = megatron_layout(cfg, tp=2, pp=2, dp=2, ep=2 if moe else 1, etp=1 if moe else None, ranks=range(8),
                          dtype=torch.bfloat16)
    dst = vllm_layout(cfg, tp=4, dp=2, enable_expert_parallel=moe, ranks=range(8), dtype=torch.bfloat16)
    return src, dst


def _same(table: TransferTable, objects: list) -> None:
    assert table.sorted("wire").keys_digest() == TransferTable.of(objects).sorted("wire").keys_digest()


@pytest.mark.parametrize("gpn,relay,inst", [(None, False, 1), (4, True, 1), (4, False, 1), (None, True, 2)])
def test_rows_equal_objects_and_cut_into_shares(gpn, relay, inst):
    src, one = _pair()
    dst = one.instances(inst)
    groups = check_relay_groups(one.instance_groups(inst)) if inst > 1 else {}
    order = dst.tensor_order()
    lt, wt = route_tables(src, dst, gpn, relay, groups, order)
    lo, wo = route_all(src, dst, gpn, relay, groups)
    _same(lt, lo)
    _same(wt, wo)
    whole = plan_reshard(src, dst, gpus_per_node=gpn, relay=relay,
                         relay_groups=one.instance_groups(inst) if inst > 1 else None)
    for r in (0, 5, max(dst.ranks)):  # the shares (objects, route_rank) cut the whole plan (rows)
        share = plan_reshard(src, dst, gpus_per_node=gpn, relay=relay,
                             relay_groups=one.instance_groups(inst) if inst > 1 else None, rank=r)
        assert set(share.transfers) == {t for t in whole.transfers if r in (t.src_rank, t.dst_rank)}
        assert set(share.local_copies) == {t for t in whole.local_copies if t.dst_rank == r}


@pytest.mark.parametrize("model", ["llama-3-8b", "qwen3-30b-a3b"])
def test_missing_elements_equal_the_object_count(model):
    src, dst = _pair(model)
    names = [t.name for t in dst.tensors]
    got = missing_elements(src, dst, names)
    for k, n in enumerate(names):  # per fragment: its elements less those of its rank's source boxes (objects)
        want = 0
        for df in dst.fragments_by_tensor[n]:
            own = {(f.offsets, f.sizes) for f in src.fragments_by_tensor[n] if f.rank == df.rank and f.numel}
            boxes = [b for b in own if boxes_meet(b[0], b[1], df.offsets, df.sizes)]
            want += df.numel - (held_numel(df.offsets, df.sizes, boxes) if boxes else 0)
        assert got[k] == want, n
    st = plan_reshard(src, dst).stats()
    assert st.lower_bound_bytes == st.wire_bytes


def _writes(boxes_per_frag):
    """Whether the boxes of each fragment are disjoint (``overlapping_writes`` finds none): a one-table layout of
    writes, per fragment its boxes, as ``overlapping_writes`` reads them."""
    rows = [(fi, o, s) for fi, bs in enumerate(boxes_per_frag) for o, s in bs]

    class T:
        offsets = np.array([o for _f, o, _s in rows], np.int64).reshape(len(rows), -1)
        sizes = np.array([s for _f, _o, s in rows], np.int64).reshape(len(rows), -1)
        ndim = np.full(len(rows), offsets.shape[1], np.int8)
        numel = sizes.prod(axis=1)

    d = np.array([f for f, _o, _s in rows], np.int64)
    cnt = np.bincount(d, minlength=len(boxes_per_frag))
    bad = overlapping_writes(cnt, (T,), (d,))
    assert set(bad.tolist()) == {i for i, bs in enumerate(boxes_per_frag)
                                 if find_overlap([(o, s, None) for o, s in bs]) is not None}
    return not len(bad)


@pytest.mark.parametrize("seed", range(40))
def test_overlapping_agrees_with_find_overlap(seed):
    rng = random.Random(seed)
    frags = []
    for _ in range(rng.randint(1, 6)):
        n = rng.choice([1, 2, 3, 5, 70])  # 70: more than BIG_GROUP, the sweep
        bs = []
        for _ in range(n):
            o = (rng.randrange(0, 40), rng.randrange(0, 40))
            bs.append((o, (rng.randint(1, 6), rng.randint(1, 6))))
        if rng.random() < 0.5:  # a disjoint grid
            bs = [((i * 7, j), (7, 1)) for i in range(n) for j in range(1)][:n]
        frags.append(bs)
    want = all(find_overlap([(o, s, None) for o, s in bs]) is None for bs in frags)
    assert _writes(frags) is want


@pytest.mark.parametrize("chunk", [7, 1 << 18])
def test_check_in_chunks(monkeypatch, chunk):
    """``validate_plan`` locates rows and tests pairs of writes in chunks (memory at 1,024 ranks): tiny chunks give
    the same answers as whole columns, on a valid plan and on one with a wire transfer moved one row down (its
    destination fragment then misses its first row)."""
    from triton_reshard.plan import validate
    from triton_reshard.plan.table import TransferTable as TT

    from .oracles.plan_check import validate_plan as oracle_validate_plan

    monkeypatch.setattr(validate, "LOCATE_CHUNK", chunk)
    monkeypatch.setattr(validate, "PAIR_CHUNK", chunk)
    src, dst = _pair("llama-3-8b")
    plan = plan_reshard(src, dst)
    validate.validate_plan(plan)
    ts = list(plan.transfers)
    k = next(i for i, t in enumerate(ts) if t.sizes[0] > 1)
    t = ts[k]
    ts[k] = dataclasses.replace(t, offsets=(t.offsets[0] + 1, *t.offsets[1:]),
                                dst_offsets=(t.dst_offsets[0] + 1, *t.dst_offsets[1:]),
                                src_offsets=(t.src_offsets[0] + 1, *t.src_offsets[1:]),
                                sizes=(t.sizes[0] - 1, *t.sizes[1:]))
    bad = types.SimpleNamespace(src=src, dst=dst, transfers=TT.of(ts), local_copies=plan.local_copies)
    with pytest.raises(ValueError, match="gets 131330048 of its 131334144 elements") as got:
        validate.validate_plan(bad)
    with pytest.raises(ValueError) as want:
        oracle_validate_plan(bad)  # the object form names the same local tensor
    assert str(got.value) == str(want.value)


def _random_pair(seed: int):
    """Two small random layouts of one [8, 4] tensor: source row blocks replicated on some ranks (a rank may
    hold the same block in two local tensors, or a block inside another), destination blocks (disjoint per
    rank) on others; the holder of a block may also hold it as a destination (a local copy)."""
    from triton_reshard import Fragment, Layout, LocalSpec, TensorSpec

    rng = random.Random(seed)
    blocks = [(0, 8), (0, 4), (4, 4), (2, 4), (4, 2), (6, 2)]
    spec = TensorSpec("w", (8, 4), torch.bfloat16)

    def frag(rank, a, n, name):
        return (Fragment("w", rank, (a, 0), (n, 4), name, (0, 0)), LocalSpec(rank, name, (n, 4), torch.bfloat16))

    src, dst = [frag(rng.randrange(8), 0, 8, "full")], []
    for r in range(8):
        taken = {b for f, _l in src if f.rank == r for b in [(f.offsets[0], f.sizes[0])]}
        for j in range(rng.choice((0, 1, 1, 2))):
            a, n = rng.choice(blocks)
            if (a, n) not in taken or rng.random() < 0.5:  # the same block again: in another local tensor
                src.append(frag(r, a, n, f"s{j}{'b' if (a, n) in taken else ''}"))
                taken.add((a, n))
        if rng.random() < 0.8:
            a, n = rng.choice(blocks)
            dst.append(frag(r, a, n, "d0"))
            if a + n <= 4 and rng.random() < 0.5:
                dst.append(frag(r, 4, 4, "d1"))

    def layout(parts):  # one fragment per (rank, local name)
        seen, fr, lo = set(), [], []
        for f, loc in parts:
            if (f.rank, f.local) not in seen:
                seen.add((f.rank, f.local))
                fr.append(f)
                lo.append(loc)
        return Layout((spec,), tuple(fr), tuple(lo))

    return layout(src), layout(dst)


@given(seed=st.integers(0, 10**6), gpn=st.sampled_from([None, 2, 4]), relay=st.booleans(),
       grouped=st.booleans())
@settings(max_examples=60, deadline=None)
def test_column_router_equals_the_object_router_random(seed, gpn, relay, grouped):
    """The package's one router (``rows.route_tables``: the whole plan, and each rank's share through
    ``route_rank``) routes exactly what the object form (``tests/oracles/route_objects.py``, ``route_box`` box by
    box) does, on random layouts, with and without ``gpus_per_node``, relays and relay groups."""
    src, dst = _random_pair(seed)
    relay = relay and (gpn is not None or grouped)
    groups = check_relay_groups(((0, 2, 4, 6), (1, 3, 5, 7))) if relay and grouped else {}
    try:
        lo, wo = route_all(src, dst, gpn, relay, groups)
    except ValueError as e:  # bad input: the column router raises the same words
        with pytest.raises(ValueError) as got:
            route_tables(src, dst, gpn, relay, groups, dst.tensor_order())
        assert str(got.value) == str(e)
        return
    lt, wt = route_tables(src, dst, gpn, relay, groups, dst.tensor_order())
    _same(lt, lo)
    _same(wt, wo)
    for r in range(8):
        ls, ws = route_rank(src, dst, r, gpn, relay, groups)
        assert set(ws) == {t for t in wo if r in (t.src_rank, t.dst_rank)}, r
        assert set(ls) == {t for t in lo if t.dst_rank == r}, r


@pytest.mark.parametrize("seed", range(40))
def test_shares_cut_the_whole_plan_random(seed):
    """A rank's share (``route_rank``: the column router on the boxes it touches, cut to the rank) is the whole
    plan's transfers of that rank (routed as rows), on small random layouts with replicas in two local tensors
    of one rank, holders that are also receivers, partial covers."""
    src, dst = _random_pair(seed)
    whole = plan_reshard(src, dst)
    for r in range(9):
        share = plan_reshard(src, dst, rank=r)
        assert set(share.transfers) == {t for t in whole.transfers if r in (t.src_rank, t.dst_rank)}, r
        assert set(share.local_copies) == {t for t in whole.local_copies if t.dst_rank == r}, r


def _random_grid_pair(seed: int):
    """Two random layouts of a [12, 6] bf16 and a [10] fp32 tensor on 12 ranks: source boxes from a grid of row
    and column blocks (replicated, a rank may hold two, one rank holds everything), destination boxes from
    another grid (one per rank and tensor, or none), so boxes are cut by source boxes on both dims."""
    from triton_reshard import Fragment, Layout, LocalSpec, TensorSpec

    rng = random.Random(seed)
    specs = (TensorSpec("a", (12, 6), torch.bfloat16), TensorSpec("b", (10,), torch.float32))
    grids = {"a": ([(0, 12), (0, 6), (6, 6), (0, 4), (4, 4), (8, 4), (3, 6)], [(0, 6), (0, 3), (3, 3), (2, 4)]),
             "b": ([(0, 10), (0, 5), (5, 5), (2, 6)], [None])}
    src, dst = [], []
    for spec in specs:
        rows, cols = grids[spec.name]

        def box(r, c):
            return ((r[0],), (r[1],)) if c is None else ((r[0], c[0]), (r[1], c[1]))

        full = ((0,) * len(spec.shape), spec.shape)
        src.append((spec, rng.randrange(12), full, "full"))
        for rank in range(12):
            for j in range(rng.choice((0, 1, 1, 2))):
                src.append((spec, rank, box(rng.choice(rows), rng.choice(cols)), f"s{j}"))
            if rng.random() < 0.85:
                dst.append((spec, rank, box(rng.choice(rows[1:] if rng.random() < 0.7 else rows),
                                            rng.choice(cols)), "d"))

    def layout(parts):  # one fragment per (rank, local name)
        seen, fr, lo = set(), [], []
        for spec, rank, (o, z), name in parts:
            name = f"{spec.name}.{name}"
            if (rank, name) not in seen:
                seen.add((rank, name))
                fr.append(Fragment(spec.name, rank, o, z, name, (0,) * len(z)))
                lo.append(LocalSpec(rank, name, z, spec.dtype))
        return Layout(specs, tuple(fr), tuple(lo))

    return layout(src), layout(dst)


@given(seed=st.integers(0, 10**6), gpn=st.sampled_from([None, 2, 3, 4]), relay=st.booleans(),
       grouped=st.booleans(), split=st.sampled_from([1 << 20, 8, 24]))
@settings(max_examples=60, deadline=None)
def test_topology_pieces_equal_the_object_router_random(seed, gpn, relay, grouped, split):
    """Pieces routed one by one on ranks (``holders.route_piece``: ``gpus_per_node``, relays, relay groups) equal
    the object form box by box, whole plan and every rank's share, on layouts whose boxes are cut on both dims,
    with parts of fan-outs small enough (``split``: ``RELAY_SPLIT_MIN_BYTES``) that a piece fans out in several
    parts with rotating heads."""
    from triton_reshard.plan import relay as relay_mod

    src, dst = _random_grid_pair(seed)
    relay = relay and (gpn is not None or grouped)
    groups = check_relay_groups(((0, 3, 6, 9), (1, 4, 7, 10), (2, 5))) if relay and grouped else {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(relay_mod, "RELAY_SPLIT_MIN_BYTES", split)
        try:
            lo, wo = route_all(src, dst, gpn, relay, groups)
        except ValueError as e:  # bad input: the column router raises the same words
            with pytest.raises(ValueError) as got:
                route_tables(src, dst, gpn, relay, groups, dst.tensor_order())
            assert str(got.value) == str(e)
            return
        lt, wt = route_tables(src, dst, gpn, relay, groups, dst.tensor_order())
        _same(lt, lo)
        _same(wt, wo)
        for r in range(12):
            ls, ws = route_rank(src, dst, r, gpn, relay, groups)
            assert set(ws) == {t for t in wo if r in (t.src_rank, t.dst_rank)}, r
            assert set(ls) == {t for t in lo if t.dst_rank == r}, r
