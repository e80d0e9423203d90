"""The options resolved once (issue 34): the planner's ``PlanOptions`` and the schedule's ``StepBudget`` give
the very plans and steps the options passed one by one give, and a bad value is named as the user gave it."""

from __future__ import annotations

import sys

import pytest
import torch

from triton_reshard import Layout, Replicate, Shard, plan_reshard
from triton_reshard.execute.options import RefitOptions
from triton_reshard.plan import DIRECT_MIN_BYTES, MIN_STEP_BYTES, PlanOptions, StepBudget
from triton_reshard.presets import get_config, megatron_layout, vllm_layout
from triton_reshard.refit import get_resharder

from . import dist_cases as dc


def _presets(tp_dst: int = 2):
    cfg = get_config("tiny_llama")
    return (megatron_layout(cfg, tp=2, ranks=[0, 1], dtype=torch.float32),
            vllm_layout(cfg, tp=tp_dst, ranks=list(range(2, 2 + tp_dst)), dtype=torch.float32))


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("bucket", [MIN_STEP_BYTES * 2, 4096, 1 << 20])
@pytest.mark.parametrize("direct", [0, DIRECT_MIN_BYTES])
def test_step_budget_schedules_as_the_bucket_of_one_slot(bucket, overlap, direct):
    """``Plan.schedule(StepBudget)`` is ``Plan.schedule(slot_bytes, direct_min_bytes)``: the same cache entry,
    the same steps as a fresh plan scheduled the old way, whole plan and share."""
    src, dst = _presets()
    budget = StepBudget.of(bucket, overlap=overlap, direct_min_bytes=direct)
    slot = bucket // (2 if overlap else 1)
    assert (budget.bucket_bytes, budget.slot_bytes, budget.slots, budget.direct_min_bytes) == (
        bucket, slot, 2 if overlap else 1, direct)
    plan = plan_reshard(src, dst)
    assert plan.schedule(budget) is plan.schedule(slot, direct)
    plan_reshard.cache_clear()
    fresh = plan_reshard(src, dst)
    assert fresh is not plan and list(fresh.schedule(slot, direct).steps) == list(plan.schedule(budget).steps)
    mine = plan_reshard(src, dst, rank=2).schedule(budget).for_rank(2)
    plan_reshard.cache_clear()
    assert plan_reshard(src, dst, rank=2).schedule(slot, direct).for_rank(2) == mine
    assert RefitOptions.of(bucket_bytes=bucket, overlap=overlap, direct_min_bytes=direct).budget == budget


@pytest.mark.parametrize(("kw", "exc", "msg"), [
    ({"bucket_bytes": 100}, ValueError, "Resharder: bucket_bytes=100 is too small: at least 256 B"),
    ({"bucket_bytes": 0}, ValueError, "Resharder: bucket_bytes=0 is too small: at least 256 B"),
    ({"bucket_bytes": 300, "overlap": True}, ValueError,
     "Resharder: bucket_bytes=300 is too small: at least 512 B with overlap=True (two staging slots of 256 B)"),
    ({"bucket_bytes": 2.0}, TypeError, "Resharder: bucket_bytes must be an int, got 2.0"),
    ({"bucket_bytes": True}, TypeError, "Resharder: bucket_bytes must be an int, got True"),
    ({"bucket_bytes": 4096, "direct_min_bytes": -1}, ValueError, "Resharder: direct_min_bytes must be >= 0, got -1"),
    ({"bucket_bytes": 4096, "direct_min_bytes": "1M"}, TypeError, "direct_min_bytes must be an int, got '1M'"),
])
def test_step_budget_names_the_users_value(kw, exc, msg):
    """One minimum for the bucket, a staging slot of MIN_STEP_BYTES per slot, the message naming the bucket the
    user passed (not overlap's halved slot); the same from StepBudget.of and RefitOptions.of."""
    b = kw.pop("bucket_bytes")
    with pytest.raises(exc) as e:
        StepBudget.of(b, **kw)
    assert msg in str(e.value)
    with pytest.raises(exc) as e:
        RefitOptions.of(bucket_bytes=b, **kw)
    assert msg in str(e.value)


def test_step_budget_minimum_is_exact():
    assert StepBudget.of(MIN_STEP_BYTES).slot_bytes == MIN_STEP_BYTES
    assert StepBudget.of(2 * MIN_STEP_BYTES, overlap=True).slot_bytes == MIN_STEP_BYTES
    with pytest.raises(ValueError, match=f"bucket_bytes={2 * MIN_STEP_BYTES - 1} is too small"):
        StepBudget.of(2 * MIN_STEP_BYTES - 1, overlap=True)


def _fanout():
    case = dc.CASES["relay-disagg-tp2-to-tp2xdp3-gpn4"]
    return dc.side_layout(case.src), dc.side_layout(case.dst)


@pytest.mark.parametrize(("gpn", "relay", "groups", "want_relay"), [
    (None, None, None, False), (4, None, None, True), (4, False, None, False), (4, True, None, True),
    (None, None, ((2, 4), (3, 5)), True), (None, False, ((2, 4), (3, 5)), False), (2, None, ((2, 4),), True),
])
def test_plan_options_plan_as_the_options_one_by_one(gpn, relay, groups, want_relay):
    """plan_reshard(options=PlanOptions.of(...)) is the plan of the same options passed one by one: the same
    digest and transfers; relay is decided once (default_relay) and the groups kept only with relays on."""
    src, dst = _fanout()
    opts = PlanOptions.of(False, gpn, relay, groups)
    assert opts.relay is want_relay and opts.relay_groups == (groups if want_relay else None)
    assert opts.key == (False, gpn, want_relay, groups if want_relay else None)
    old = plan_reshard(src, dst, False, gpn, relay, groups)
    new = plan_reshard(src, dst, options=opts)
    assert new.digest == old.digest and new.options == old.options == opts.key
    assert list(new.transfers) == list(old.transfers) and list(new.local_copies) == list(old.local_copies)
    share = plan_reshard(src, dst, options=opts, rank=4)
    assert share.digest == plan_reshard(src, dst, False, gpn, relay, groups, rank=4).digest


@pytest.mark.parametrize(("args", "exc", "msg"), [
    ((False, 0), ValueError, "plan_reshard: gpus_per_node=0 must be an int >= 1 or None"),
    ((False, 4, "yes"), TypeError, "plan_reshard: relay='yes' must be a bool or None"),
    ((False, None, True), ValueError, "plan_reshard: relay=True needs gpus_per_node or relay_groups"),
    ((False, None, None, ((2, 3), (3, 4))), ValueError, "plan_reshard: relay_groups: rank 3 is in two groups"),
    ((False, None, None, ((2, 3), 4)), TypeError, "plan_reshard: relay_groups must be a tuple of tuples"),
])
def test_plan_options_errors_are_plan_reshards(args, exc, msg):
    """PlanOptions.of raises what plan_reshard raised for the same options (plan_reshard now raises it from
    there), before any planning."""
    src, dst = _fanout()
    for call in (lambda: PlanOptions.of(*args), lambda: plan_reshard(src, dst, *args)):
        with pytest.raises(exc) as e:
            call()
        assert msg in str(e.value)


def test_plan_reshard_options_or_one_by_one_not_both():
    src, dst = _fanout()
    with pytest.raises(TypeError, match="not both"):
        plan_reshard(src, dst, gpus_per_node=4, options=PlanOptions.of(False, 4))
    with pytest.raises(TypeError, match="must be a PlanOptions"):
        plan_reshard(src, dst, options=(False, 4, True, None))


@pytest.mark.parametrize("instances", [1, 3])
@pytest.mark.parametrize(("gpn", "relay"), [(None, None), (2, None), (2, False), (None, False)])
@pytest.mark.parametrize("verify", [False, True])
def test_refit_plans_with_the_options_resolved_once(instances, gpn, relay, verify, monkeypatch):
    """get_resharder / refit / verify_refit plan with the PlanOptions that RefitOptions.plan_options resolves:
    the planned layout and relay groups of the instances, the relay default (off for verify); the plan is the
    one the options passed one by one give (what the session planned before)."""
    src = Layout.from_placements({"w": (8, 4)}, [0, 1], [Shard(0)])
    one = Layout.from_placements({"w": (8, 4)}, [2, 3], [Replicate()])
    opts = RefitOptions.of(gpus_per_node=gpn, relay=relay, instances=instances)
    planned, popts = opts.plan_options(one, verify=verify)
    groups = one.instance_groups(instances) if instances > 1 else None
    assert planned == one.instances(instances)
    want_relay = not verify and (gpn is not None or instances > 1) and relay is None
    assert popts.relay is want_relay and popts.relay_groups == (groups if want_relay else None)
    assert opts.relay_decided(one, verify=verify).relay is want_relay
    old = plan_reshard(src, planned, False, gpn, want_relay, groups, rank=0)
    assert plan_reshard(src, planned, options=popts, rank=0).digest == old.digest

    class Planned(Exception):
        pass

    def planner(*a, **k):  # record the planner's call, then stop: one process, no group for ranks 0-3
        raise Planned(a, k)

    session_mod = sys.modules["triton_reshard.execute.session"]
    monkeypatch.setattr(session_mod, "plan_reshard", planner)
    with pytest.raises(Planned) as e:
        session_mod.SESSIONS.get(src, one, None, opts, verify=verify)
    assert e.value.args == ((src, planned), {"options": popts, "rank": 0})


def test_get_resharder_bad_planner_option_is_named_before_planning(monkeypatch):
    """A bad planner option of get_resharder is refused by RefitOptions.of with the user's value: neither the
    session's planner call nor the planner's own options check is reached."""
    session_mod = sys.modules["triton_reshard.execute.session"]
    monkeypatch.setattr(session_mod, "plan_reshard", lambda *a, **k: pytest.fail("planned with a bad option"))
    monkeypatch.setattr(PlanOptions, "of", classmethod(lambda *a, **k: pytest.fail("resolved a bad option")))
    lay = Layout.from_placements({"w": (6, 4)}, [0], [Replicate()])
    for kw, msg in [({"gpus_per_node": -2}, "gpus_per_node=-2"), ({"relay": 1}, "relay=1"),
                    ({"instances": "2"}, "instances='2'"), ({"bucket_bytes": 255}, "bucket_bytes=255")]:
        with pytest.raises((TypeError, ValueError), match=msg):
            get_resharder(lay, lay, **kw)


def test_plan_reshard_takes_the_plan_options():
    """plan_reshard's options, one by one, are PlanOptions.of's (names, order, defaults): one list, and
    ``options=`` takes them resolved."""
    import inspect

    mine = list(inspect.signature(PlanOptions.of).parameters.values())[:4]
    theirs = list(inspect.signature(plan_reshard).parameters.values())[2:6]
    assert [(p.name, p.default) for p in mine] == [(p.name, p.default) for p in theirs]
    assert [p.name for p in mine] == ["allow_cast", "gpus_per_node", "relay", "relay_groups"]
    assert PlanOptions.of().key == PlanOptions().key == (False, None, False, None)


def test_refit_options_are_checked_once_then_only_resolved(monkeypatch):
    """``RefitOptions.of`` checks every option once; the planner's options it hands over are resolved, never
    checked again (``PlanOptions.of`` is not reached), and equal to what the checking path gives. The relay rule
    is one function for both entry points, each naming its own way to fan out."""
    from triton_reshard.plan import options as po

    one = Layout.from_placements({"w": (8, 4)}, [0, 1], [Shard(0)])
    opts = RefitOptions.of(gpus_per_node=2, instances=2)
    want = PlanOptions.for_instances(one, 2, False, 2, None)

    def refused(*a, **k):
        raise AssertionError("checked again")

    monkeypatch.setattr(PlanOptions, "of", classmethod(refused))
    assert opts.plan_options(one) == want and want[1].relay
    with pytest.raises(ValueError, match=r"^refit: relay=True needs gpus_per_node or instances > 1 \(relays fan "
                                         r"out inside a node or over the engines\)$"):
        po.check_relay(True, None, False, "refit")
    with pytest.raises(ValueError, match=r"^plan_reshard: relay=True needs gpus_per_node or relay_groups \(relays "
                                         r"fan out inside a node or a group\)$"):
        po.check_relay(True, None, False, "plan_reshard")
    with pytest.raises(TypeError, match=r"^refit: relay='yes' must be a bool or None$"):
        RefitOptions.of(relay="yes")
    with pytest.raises(ValueError, match=r"^refit: gpus_per_node=0 must be an int >= 1 or None$"):
        RefitOptions.of(gpus_per_node=0)
    with pytest.raises(ValueError, match=r"^refit: relay=True needs gpus_per_node or instances > 1"):
        RefitOptions.of(relay=True)
