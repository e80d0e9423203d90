"""Bad inputs: one test per kind, each checking the exception type and that the message names the tensor and
the rank. Planner and layout errors need no process group; ``run()`` errors are checked both in-process (a
one-rank plan, no process group) and in a spawned world of 4, where the rank with the bad input must raise
ValueError/TypeError and every other rank ReshardError, quickly, with nothing moved. The peer that never
arrives runs last in that world (a gloo timeout breaks the group, FACTS.md)."""

from __future__ import annotations

import re

import pytest
import torch

from triton_reshard import Fragment, Layout, Replicate, Resharder, ReshardError, Shard, plan_reshard

from . import dist_cases as dc

F32 = torch.float32


def names(msg: str, tensor: str, rank: int) -> bool:
    return f"'{tensor}'" in msg and re.search(rf"\brank {rank}\b", msg) is not None


# --------------------------------------------------------------------------------------------------------
# Planner and layout (no process group)
# --------------------------------------------------------------------------------------------------------


def test_global_shape_mismatch():
    src = Layout.from_placements({"w": (8, 6)}, [0, 1], [Shard(0)])
    dst = Layout.from_placements({"w": (8, 7)}, [2, 3], [Shard(1)])
    with pytest.raises(ValueError, match="global shape") as e:
        plan_reshard(src, dst)
    assert names(str(e.value), "w", 2), str(e.value)


def test_dtype_mismatch():
    src = Layout.from_placements({"w": (8, 6)}, [0, 1], [Shard(0)], torch.float32)
    dst = Layout.from_placements({"w": (8, 6)}, [3], [Replicate()], torch.bfloat16)
    with pytest.raises(ValueError, match="dtype") as e:
        plan_reshard(src, dst)
    assert names(str(e.value), "w", 3), str(e.value)


def test_destination_element_held_by_no_source():
    # the source holds rows 0..2 and 4..7 of w; row 3 is missing
    src = Layout.from_fragments(
        {"w": ((8, 4), F32)}, [Fragment("w", 0, (0, 0), (3, 4)), Fragment("w", 1, (4, 0), (4, 4))]
    )
    dst = Layout.from_placements({"w": (8, 4)}, [2, 3], [Shard(0)])  # rank 2 needs rows 0..3
    with pytest.raises(ValueError, match="held by no source rank") as e:
        plan_reshard(src, dst)
    assert names(str(e.value), "w", 2), str(e.value)
    assert "(3, 0)" in str(e.value)  # the first missing element


def test_destination_tensor_missing_from_source():
    src = Layout.from_placements({"w": (4, 4)}, [0, 1], [Shard(0)])
    dst = Layout.from_placements({"w": (4, 4), "extra": (3,)}, [1], [Replicate()])
    with pytest.raises(ValueError, match="not in the source layout") as e:
        plan_reshard(src, dst)
    assert names(str(e.value), "extra", 1), str(e.value)


def test_overlapping_destination_boxes():
    """Two local tensors of one rank both claim rows 2..3 of w: the planner must refuse (double write)."""
    src = Layout.from_placements({"w": (6, 4)}, [0], [Replicate()])
    dst = Layout.from_fragments(
        {"w": ((6, 4), F32)},
        [Fragment("w", 1, (0, 0), (4, 4), "a"), Fragment("w", 1, (2, 0), (4, 4), "b")],
    )
    with pytest.raises(ValueError, match="overlapping destination boxes") as e:
        plan_reshard(src, dst)
    assert names(str(e.value), "w", 1), str(e.value)


def test_overlapping_fragments_in_one_local_tensor():
    with pytest.raises(ValueError, match="overlapping fragments") as e:
        Layout.from_fragments(
            {"q": ((4, 2), F32), "k": ((4, 2), F32)},
            [Fragment("q", 3, (0, 0), (4, 2), "qk", (0, 0)), Fragment("k", 3, (0, 0), (4, 2), "qk", (3, 0))],
        )
    assert names(str(e.value), "q", 3) and "'k'" in str(e.value), str(e.value)


def test_fragment_out_of_bounds_of_its_tensor():
    with pytest.raises(ValueError, match="out of bounds") as e:
        Layout.from_fragments({"w": ((4, 4), F32)}, [Fragment("w", 2, (2, 0), (3, 4))])
    assert names(str(e.value), "w", 2), str(e.value)


def test_fragment_out_of_bounds_of_its_local_tensor():
    with pytest.raises(ValueError, match="out of bounds of local tensor") as e:
        Layout.from_fragments(
            {"w": ((4, 4), F32)}, [Fragment("w", 1, (0, 0), (4, 4), "buf", (1, 0))], local_shapes={(1, "buf"): (4, 4)}
        )
    assert names(str(e.value), "w", 1), str(e.value)


def test_fragment_of_unknown_tensor():
    with pytest.raises(ValueError, match="unknown tensor") as e:
        Layout.from_fragments({"w": ((4, 4), F32)}, [Fragment("nope", 5, (0, 0), (1, 1))])
    assert names(str(e.value), "nope", 5), str(e.value)


# --------------------------------------------------------------------------------------------------------
# run() inputs, one rank, no process group
# --------------------------------------------------------------------------------------------------------


def _one_rank():
    src = Layout.from_placements({"w": (6, 4), "ids": (5,)}, [0], [Replicate()], {"w": F32, "ids": torch.int64})
    dst = Layout.from_fragments(
        {"w": ((6, 4), F32), "ids": ((5,), torch.int64)},
        [Fragment("w", 0, (0, 0), (6, 4), "w_t"), Fragment("ids", 0, (0,), (5,), "ids_t")],
    )
    r = Resharder(plan_reshard(src, dst), bucket_bytes=4096, timeout=5)
    src_t = {"w": torch.randn(6, 4), "ids": torch.arange(5)}
    dst_t = {"w_t": torch.full((6, 4), float("nan")), "ids_t": torch.full((5,), -1)}
    return r, src_t, dst_t


@pytest.mark.parametrize("bucket, overlap, need", [(100, False, 256), (300, True, 512), (511, True, 512)])
def test_bucket_too_small_is_named_with_the_users_value_before_planning(bucket, overlap, need, monkeypatch):
    """One minimum (a staging slot of plan.MIN_STEP_BYTES), checked where the options are resolved, naming the
    value the user passed (not the halved slot of overlap=True); the planner is never reached."""
    import sys

    from triton_reshard.refit import get_resharder

    session_mod = sys.modules["triton_reshard.execute.session"]

    src, dst = Layout.from_placements({"w": (6, 4)}, [0], [Replicate()]), Layout.from_placements({"w": (6, 4)}, [0], [Replicate()])
    monkeypatch.setattr(session_mod, "plan_reshard", lambda *a, **k: pytest.fail("planned with a bad option"))
    msg = rf"bucket_bytes={bucket} is too small: at least {need} B" + (r" with overlap=True" if overlap else "")
    with pytest.raises(ValueError, match=msg):
        Resharder(plan_reshard(src, dst), bucket_bytes=bucket, overlap=overlap)
    if not overlap:
        with pytest.raises(ValueError, match=msg):
            get_resharder(src, dst, bucket_bytes=bucket)
    Resharder(plan_reshard(src, dst), bucket_bytes=need, overlap=overlap)  # the minimum itself is fine


BAD_OPTIONS = [
    pytest.param({"bucket_bytes": "1M"}, TypeError, "bucket_bytes must be an int, got '1M'", id="bucket-str"),
    pytest.param({"bucket_bytes": 0}, ValueError, "bucket_bytes=0 is too small: at least 256 B", id="bucket-zero"),
    pytest.param({"bucket_bytes": 100}, ValueError, "bucket_bytes=100 is too small: at least 256 B", id="bucket-100"),
    pytest.param({"bucket_bytes": -4096}, ValueError, "bucket_bytes=-4096 is too small", id="bucket-negative"),
    pytest.param({"timeout": -1}, TypeError, "got -1", id="timeout-negative"),
    pytest.param({"backend": "cuda"}, ValueError, "unknown copy backend 'cuda'", id="backend"),
    pytest.param({"gpus_per_node": 0}, ValueError, "gpus_per_node=0 must be", id="gpus-zero"),
    pytest.param({"gpus_per_node": True}, ValueError, "gpus_per_node=True must be", id="gpus-bool"),
    pytest.param({"gpus_per_node": 4.0}, ValueError, "gpus_per_node=4.0 must be", id="gpus-float"),
    pytest.param({"relay": "yes"}, TypeError, "relay='yes' must be a bool or None", id="relay-str"),
    pytest.param({"relay": True}, ValueError, "relay=True needs gpus_per_node or instances", id="relay-nowhere"),
    pytest.param({"instances": 0}, ValueError, "instances=0 must be an int >= 1", id="instances-zero"),
    pytest.param({"instances": 2.0}, ValueError, "instances=2.0 must be an int >= 1", id="instances-float"),
    pytest.param({"bucket": 1 << 20}, TypeError, "unexpected keyword argument 'bucket'", id="unknown-option"),
]


@pytest.mark.parametrize("entry", ["get_resharder", "refit", "verify_refit"])
@pytest.mark.parametrize(("options", "exc", "msg"), BAD_OPTIONS)
def test_bad_option_is_named_with_the_users_value_before_planning(entry, options, exc, msg, monkeypatch):
    """Every option of the public entry points is checked where the options are resolved (RefitOptions.of),
    the message naming the option and the value the user passed; the planner is never reached."""
    import sys

    import triton_reshard as ts
    from triton_reshard.refit import get_resharder

    session_mod = sys.modules["triton_reshard.execute.session"]
    monkeypatch.setattr(session_mod, "plan_reshard", lambda *a, **k: pytest.fail("planned with a bad option"))
    lay = Layout.from_placements({"w": (6, 4)}, [0], [Replicate()])
    tensors = ({"w": torch.zeros(6, 4)}, {"w": torch.zeros(6, 4)})
    call = {"get_resharder": lambda: get_resharder(lay, lay, **options),
            "refit": lambda: ts.refit(*tensors, lay, lay, **options),
            "verify_refit": lambda: ts.verify_refit(*tensors, lay, lay, **options)}[entry]
    with pytest.raises(exc, match=re.escape(msg)):
        call()


def test_entry_point_signatures_are_the_options_definition():
    """refit, verify_refit and get_resharder take exactly RefitOptions' refit options, with its defaults (the
    signatures are written out in the source; this holds them to the one table); Resharder takes the executor
    ones, positional after group in field order, with the same defaults."""
    import inspect
    from dataclasses import fields

    import triton_reshard as ts
    from triton_reshard.execute.options import EXECUTOR_OPTIONS, REFIT_OPTIONS, RefitOptions
    from triton_reshard.refit import get_resharder

    defaults = {f.name: f.default for f in fields(RefitOptions)}
    assert set(REFIT_OPTIONS) | set(EXECUTOR_OPTIONS) == set(defaults)
    assert EXECUTOR_OPTIONS == ("bucket_bytes", "timeout", "backend", "overlap", "direct_min_bytes", "digest")
    for fn in (ts.refit, ts.verify_refit, get_resharder):
        params = inspect.signature(fn).parameters
        opts = [n for n in params if n in defaults]
        assert opts == list(REFIT_OPTIONS), (fn.__name__, opts)
        assert all(params[n].kind is inspect.Parameter.KEYWORD_ONLY and params[n].default == defaults[n]
                   for n in opts), fn.__name__
        assert "options" not in params
    params = inspect.signature(Resharder).parameters
    assert list(params) == ["plan", "group", *EXECUTOR_OPTIONS, "options", "snapshot"]
    assert all(params[n].default == defaults[n] and params[n].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
               for n in EXECUTOR_OPTIONS)


def test_resharder_options_by_position_and_by_name_are_the_same():
    """Resharder's signature binds as written: the executor options by position after group, by name, or as a
    validated RefitOptions; a doubled, unknown or extra argument is Python's TypeError."""
    from datetime import timedelta

    from triton_reshard.execute.options import RefitOptions

    lay = Layout.from_placements({"w": (6, 4)}, [0], [Replicate()])
    plan = plan_reshard(lay, lay)
    by_pos = Resharder(plan, None, 4096, 7, "torch", True, 0)
    by_name = Resharder(plan, bucket_bytes=4096, timeout=7, backend="torch", overlap=True, direct_min_bytes=0)
    given = RefitOptions.of(bucket_bytes=4096, timeout=7, backend="torch", overlap=True, direct_min_bytes=0)
    assert by_pos.options == by_name.options == Resharder(plan, options=given).options == given
    assert (by_pos.bucket_bytes, by_pos.timeout, by_pos.slots) == (4096, timedelta(seconds=7), 2)
    assert Resharder(plan).options == RefitOptions.of()
    with pytest.raises(TypeError, match="multiple values for argument 'bucket_bytes'"):
        Resharder(plan, None, 4096, bucket_bytes=8192)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bucket'"):
        Resharder(plan, bucket=4096)
    with pytest.raises(TypeError, match="positional arguments but 10 were given"):
        Resharder(plan, None, 4096, 7, "torch", True, 0, True, "extra")
    with pytest.raises(TypeError, match="pass options= or bucket_bytes, not both"):
        Resharder(plan, bucket_bytes=4096, options=given)
    with pytest.raises(ValueError, match=r"bucket_bytes=300 is too small: at least 512 B with overlap=True"):
        Resharder(plan, None, 300, 7, None, True)


def _meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


SINGLE_RANK = [
    pytest.param(lambda s, d: d.update(w_t=torch.empty(6, 5)), ValueError, "w_t", id="wrong-shape"),
    pytest.param(lambda s, d: s.update(ids=torch.arange(5, dtype=torch.int32)), ValueError, "ids", id="wrong-dtype"),
    pytest.param(lambda s, d: s.update(w=_meta(s["w"])), ValueError, "w", id="meta-device-one-tensor"),
    pytest.param(lambda s, d: d.update({n: _meta(t) for n, t in d.items()}), ValueError, None,
                 id="meta-device-whole-side"),
    pytest.param(lambda s, d: d.pop("ids_t"), ValueError, "ids_t", id="missing-name"),
    pytest.param(lambda s, d: s.update(extra=torch.zeros(1)), ValueError, "extra", id="unknown-name"),
    pytest.param(lambda s, d: d.update(w_t=[[0.0] * 4] * 6), TypeError, "w_t", id="not-a-tensor"),
]


@pytest.mark.parametrize(("mutate", "exc", "tensor"), SINGLE_RANK)
def test_run_rejects_bad_local_tensors_without_process_group(mutate, exc, tensor):
    r, src_t, dst_t = _one_rank()
    mutate(src_t, dst_t)
    before = {n: t.clone() for n, t in dst_t.items() if isinstance(t, torch.Tensor) and t.device.type == "cpu"}
    with pytest.raises(exc) as e:
        r.run(src_t, dst_t)
    msg = str(e.value)
    if tensor is None:  # any of the rank's destination tensors may be named
        assert names(msg, "w_t", 0) or names(msg, "ids_t", 0), msg
    else:
        assert names(msg, tensor, 0), msg
    for n, t in before.items():  # nothing written
        assert dc.mismatch(dst_t[n], t, n) is None


def test_run_one_rank_good_input_still_works():
    r, src_t, dst_t = _one_rank()
    r.run(src_t, dst_t)
    assert torch.equal(dst_t["w_t"], src_t["w"]) and torch.equal(dst_t["ids_t"], src_t["ids"])


# --------------------------------------------------------------------------------------------------------
# run() inputs in a spawned world of 4
# --------------------------------------------------------------------------------------------------------


def _bad_world() -> list[dict]:
    results = dc.world_results(4)
    failed = {r: v for r, v in enumerate(results) if not isinstance(v, dict)}
    if failed:
        pytest.fail("world of 4 ranks failed: " + "\n".join(f"rank {r}: {v}" for r, v in failed.items()))
    return [r["bad"] for r in results]


@pytest.mark.slow
@pytest.mark.parametrize("scenario", [pytest.param(k, id=k) for k in dc.BAD_INPUTS])
def test_bad_input_rank_raises_and_peers_get_reshard_error(scenario):
    bad, _mutate, exc, tensors = dc.BAD_INPUTS[scenario]
    per_rank = [r[scenario] for r in _bad_world()]
    got = per_rank[bad]
    assert got["error"] == exc, got
    assert not got["is_reshard_error"], got
    assert any(names(got["message"], t, bad) for t in tensors), got["message"]
    for rank, res in enumerate(per_rank):
        assert res["dst_untouched"], f"rank {rank}: destination written although the run was rejected"
        assert res["seconds"] < 10, f"rank {rank} took {res['seconds']:.1f}s: it waited instead of failing"
        if rank != bad:
            assert res["error"] == "ReshardError", (rank, res)
            assert f"[{bad}]" in res["message"] and re.search(rf"\brank {rank}\b", res["message"]), res["message"]


@pytest.mark.slow
@pytest.mark.parametrize("scenario", [pytest.param(k, id=k) for k in dc.BAD_PLANS])
def test_ranks_with_different_plans_all_raise(scenario):
    per_rank = [r[scenario] for r in _bad_world()]
    bad, how = dc.BAD_PLANS[scenario]
    for rank, res in enumerate(per_rank):
        assert res["dst_untouched"] and res["seconds"] < 10, (rank, res)
        if how == "backend" and rank == bad:  # on CPU without the interpreter its own check fires first
            assert res["error"] in ("ValueError", "ReshardError") and "triton" in res["message"], res
            continue
        assert res["error"] == "ReshardError", (rank, res)
        assert "different plans" in res["message"], res["message"]
        if how == "backend":
            assert "'triton'" in res["message"] and "'auto'" in res["message"], res["message"]


@pytest.mark.slow
def test_group_still_usable_after_rejected_runs():
    for rank, res in enumerate(r["good-run-after-errors"] for r in _bad_world()):
        assert res["error"] is None, (rank, res)
        assert not res["problems"], res["problems"]


@pytest.mark.slow
def test_peer_that_never_arrives_times_out():
    per_rank = [r["peer-never-arrives"] for r in _bad_world()]
    absent = len(per_rank) - 1
    assert per_rank[absent]["message"] == "absent"
    for rank, res in enumerate(per_rank[:absent]):
        assert res["error"] == "ReshardTimeoutError", (rank, res)
        assert res["is_reshard_error"]  # a subclass of ReshardError
        assert 0.8 * dc.BAD_TIMEOUT <= res["seconds"] <= dc.BAD_TIMEOUT + 3, (rank, res["seconds"])
        assert re.search(rf"\brank {rank}\b", res["message"]) and f"{dc.BAD_TIMEOUT:g}s" in res["message"]
        assert res["dst_untouched"]


def test_reshard_timeout_error_is_a_reshard_error_and_timeout_error():
    from triton_reshard import ReshardTimeoutError

    assert issubclass(ReshardTimeoutError, ReshardError) and issubclass(ReshardTimeoutError, TimeoutError)
