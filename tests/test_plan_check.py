"""Plan validation once, on the columns (``plan/validate.py``): on random layouts (sharded or replicated,
overlapping rank sets, relays within nodes) and random bad plans made from their plans (a transfer dropped,
doubled, shifted, sent from or to another rank, read or written at other local offsets, made a relay or not, a
wire transfer made a local copy, a relay reading what its rank gets by relay), the whole plan's check and every
rank's share check raise exactly what the object form (``tests/oracles/plan_check.py``) raises, or pass where
it passes."""

from __future__ import annotations

import dataclasses
import re
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from triton_reshard import Layout, Replicate, Shard
from triton_reshard.plan import plan_reshard
from triton_reshard.plan.table import TransferTable
from triton_reshard.plan.validate import validate_plan, validate_share

from .oracles import plan_check

F32, BF16 = torch.float32, torch.bfloat16
_SHAPES = st.lists(st.integers(1, 12), min_size=1, max_size=3).map(tuple)


def _outcome(check, plan) -> str | None:
    try:
        check(plan)
    except ValueError as e:
        return str(e)
    return None


def _mutate(rng, plan, ranks: list[int]):
    """``(wire, local)`` of ``plan`` with one random change (most of them make it invalid)."""
    wire, local = list(plan.transfers), list(plan.local_copies)
    pool = [(wire, i) for i in range(len(wire))] + [(local, i) for i in range(len(local))]
    if not pool:
        return wire, local
    ts, i = rng.choice(pool)
    t = ts[i]
    kind = rng.randrange(9)
    if kind == 0:
        del ts[i]
    elif kind == 1:
        ts.insert(rng.randrange(len(ts) + 1), t)
    elif kind == 2 and t.sizes and t.sizes[0] > 1:  # one row less, from the next row on
        d = len(t.src_offsets) - len(t.offsets), len(t.dst_offsets) - len(t.offsets)
        bump = lambda o, k: o[:k] + (o[k] + 1,) + o[k + 1:]  # noqa: E731
        ts[i] = dataclasses.replace(t, offsets=bump(t.offsets, 0), sizes=(t.sizes[0] - 1, *t.sizes[1:]),
                                    src_offsets=bump(t.src_offsets, d[0]), dst_offsets=bump(t.dst_offsets, d[1]))
    elif kind == 3:
        other = [r for r in ranks if r != t.dst_rank]
        if other:
            ts[i] = dataclasses.replace(t, src_rank=rng.choice(other), dst_rank=t.dst_rank)
    elif kind == 4:
        other = [r for r in ranks if r != t.src_rank]
        if other and ts is wire:
            ts[i] = dataclasses.replace(t, dst_rank=rng.choice(other))
    elif kind == 5 and t.dst_offsets:
        ts[i] = dataclasses.replace(t, dst_offsets=(t.dst_offsets[0] + 1, *t.dst_offsets[1:]))
    elif kind == 6 and t.src_offsets:
        ts[i] = dataclasses.replace(t, src_offsets=(t.src_offsets[0] + 1, *t.src_offsets[1:]))
    elif kind == 7 and ts is wire:
        ts[i] = dataclasses.replace(t, relay=not t.relay)
    elif kind == 8 and ts is wire:
        del ts[i]
        local.append(dataclasses.replace(t, src_rank=t.dst_rank))  # a local copy (a relay: one that stays)
    relays = [k for k, w in enumerate(wire) if w.relay]
    if len(relays) > 1 and rng.random() < 0.3:  # a relay reading from another relay's receiver: a chain
        a, b = rng.sample(relays, 2)
        if wire[b].dst_rank != wire[a].dst_rank:
            wire[a] = dataclasses.replace(wire[a], src_rank=wire[b].dst_rank, src_offsets=wire[a].dst_offsets)
    return wire, local


@settings(max_examples=120, deadline=None)
@given(shapes=st.lists(_SHAPES, min_size=1, max_size=2), src_n=st.integers(1, 4), dst_n=st.integers(1, 5),
       src_dim=st.integers(-1, 2), dst_dim=st.integers(-1, 2), gpn=st.sampled_from([None, 2]),
       rng=st.randoms(use_true_random=False))
def test_check_equals_the_object_oracle_on_random_bad_plans(shapes, src_n, dst_n, src_dim, dst_dim, gpn, rng):
    named = {f"t{i}": s for i, s in enumerate(shapes)}

    def side(n, dim, first, dt):
        pls = {k: [Shard(dim) if 0 <= dim < len(s) else Replicate()] for k, s in named.items()}
        return Layout.from_placements(named, list(range(first, first + n)), pls, dt)

    src, dst = side(src_n, src_dim, 0, BF16), side(dst_n, dst_dim, src_n // 2, BF16)
    plan = plan_reshard(src, dst, gpus_per_node=gpn)
    ranks = sorted(set(src.ranks) | set(dst.ranks))
    for _ in range(4):
        wire, local = _mutate(rng, plan, ranks)
        bad = types.SimpleNamespace(src=src, dst=dst, transfers=TransferTable.of(wire),
                                    local_copies=TransferTable.of(local), rank=None)
        assert _outcome(validate_plan, bad) == _outcome(plan_check.validate_plan, bad)
        for r in ranks:  # every rank's share of the bad plan
            mine = [t for t in wire if r in (t.src_rank, t.dst_rank)]
            share = types.SimpleNamespace(src=src, dst=dst, transfers=TransferTable.of(mine),
                                          local_copies=TransferTable.of([t for t in local if r in (t.src_rank,
                                                                                                   t.dst_rank)]),
                                          rank=r)
            assert _outcome(validate_share, share) == _outcome(plan_check.validate_share, share), r
        other = [t for t in wire if ranks[0] not in (t.src_rank, t.dst_rank)][:1]
        share = types.SimpleNamespace(src=src, dst=dst, transfers=TransferTable.of(other), local_copies=TransferTable.of(()),
                                      rank=ranks[0])
        assert _outcome(validate_share, share) == _outcome(plan_check.validate_share, share)


@pytest.mark.parametrize("model", ["llama-3-8b"])
def test_check_passes_the_planner_s_plans(model):
    """The planner's plans and shares pass both forms (the package's check runs in ``Plan`` itself)."""
    from triton_reshard.presets import get_config, megatron_layout, vllm_layout

    cfg = {**get_config(model), "num_hidden_layers": 2}
    src = megatron_layout(cfg, tp=2, pp=2, dp=2, ranks=range(8), dtype=BF16)
    dst = vllm_layout(cfg, tp=4, dp=2, ranks=range(8), dtype=BF16)
    for kw in ({}, {"gpus_per_node": 4}):
        plan = plan_reshard(src, dst, **kw)
        plan_check.validate_plan(plan)
        for r in (0, 7):
            plan_check.validate_share(plan_reshard(src, dst, rank=r, **kw))


class _Bad(types.SimpleNamespace):
    """A plan-like value (``memo``: the derived tables a check reads, kept with it)."""

    def memo(self, key, compute):
        got = self.__dict__.setdefault("_memo", {})
        if key not in got:
            got[key] = compute()
        return got[key]


def _mutate_quant(rng, plan):
    """``(wire, local)`` of a block-quantized plan with one quantized row changed (or one random change)."""
    wire, local = list(plan.transfers), list(plan.local_copies)
    rows = [(ts, i) for ts in (wire, local) for i, t in enumerate(ts) if t.quant]
    if not rows or rng.random() < 0.3:
        return _mutate(rng, plan, sorted(set(plan.src.ranks) | set(plan.dst.ranks)))
    ts, i = rng.choice(rows)
    t = ts[i]
    kind = rng.randrange(6)
    if kind == 0:
        ts[i] = dataclasses.replace(t, quant="dst" if t.quant == "src" else "src")
    elif kind == 1:
        ts[i] = dataclasses.replace(t, block=tuple(b * 2 for b in t.block))
    elif kind == 2:
        ts[i] = dataclasses.replace(t, wire_dtype=F32)
    elif kind == 3 and t.scale_offsets:
        ts[i] = dataclasses.replace(t, scale_offsets=(t.scale_offsets[0] + 1, *t.scale_offsets[1:]))
    elif kind == 4:
        ts[i] = dataclasses.replace(t, quant="", block=(), scale_local="", scale_offsets=())
    else:
        del ts[i]
    return wire, local


@pytest.mark.parametrize("case", ["moe-tp4-to-vllm-tp2dp2-ep-colocated", "raw-fp32-rows24-to-cols-ue8m0"])
def test_quant_check_equals_the_object_oracle_on_random_bad_plans(case):
    """Block-quantized plans (source- and destination-quantized rows, their scales): random bad plans made from
    them raise in the package what they raise in the object form (the whole plan and every rank's share)."""
    import random

    from .quant_cases import CASES, layouts

    src, dst = layouts(CASES[case])
    plan = plan_reshard(src, dst, relay=False)
    assert any(t.quant for t in plan.transfers + plan.local_copies)
    rng = random.Random(case)
    kinds = set()
    for _ in range(20):
        wire, local = _mutate_quant(rng, plan)
        bad = _Bad(src=src, dst=dst, transfers=TransferTable.of(wire), local_copies=TransferTable.of(local), rank=None)
        got = _outcome(validate_plan, bad)
        assert got == _outcome(plan_check.validate_plan, bad)
        kinds.add(re.sub(r"[\d ]+", "", got or "pass")[-16:])  # the message's end: which check failed
        for r in sorted(dst.ranks):
            share = _Bad(src=src, dst=dst, rank=r,
                         transfers=TransferTable.of([t for t in wire if r in (t.src_rank, t.dst_rank)]),
                         local_copies=TransferTable.of([t for t in local if t.dst_rank == r]))
            assert _outcome(validate_share, share) == _outcome(plan_check.validate_share, share), r
    assert len(kinds) >= 4, kinds
