"""Reliability, in one process (issue 12): inputs that would corrupt or crash a run are refused before any byte
moves (source/destination memory overlap, self-overlapping destinations, freed storage, a second concurrent
run on one group), with messages naming the tensor and the rank. The multi-process failures (a peer killed
or raising mid-run, the retry) are in ``test_faults.py``."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch

from triton_reshard import Fragment, Layout, Replicate, Resharder, ReshardError, plan_reshard
from triton_reshard.comm.group import free_port, init_refit_group

F32 = torch.float32


def names(msg: str, tensor: str, rank: int = 0) -> bool:
    return f"'{tensor}'" in msg and re.search(rf"\brank {rank}\b", msg) is not None


def _rows_swapped(n: int = 8, cols: int = 4):
    """One rank; the destination holds w with its two halves of rows swapped in the local tensor."""
    src = Layout.from_placements({"w": (n, cols)}, [0], [Replicate()])
    h = n // 2
    dst = Layout.from_fragments({"w": ((n, cols), F32)}, [
        Fragment("w", 0, (0, 0), (h, cols), "w", (h, 0)), Fragment("w", 0, (h, 0), (h, cols), "w", (0, 0))])
    return plan_reshard(src, dst)


# --------------------------------------------------------------------------------------------------------
# Source and destination sharing memory
# --------------------------------------------------------------------------------------------------------


def test_same_tensor_as_source_and_destination_rejected_when_unsafe():
    t = torch.arange(32, dtype=F32).reshape(8, 4)
    before = t.clone()
    r = Resharder(_rows_swapped(), bucket_bytes=4096)
    with pytest.raises(ValueError, match="share memory") as e:
        r.run({"w": t}, {"w": t})
    assert names(str(e.value), "w") and "nothing was moved" in str(e.value), str(e.value)
    assert torch.equal(t, before)
    r.run({"w": t.clone()}, {"w": t})  # separate tensors: fine
    assert torch.equal(t[:4], before[4:]) and torch.equal(t[4:], before[:4])


def test_same_tensor_allowed_when_every_write_is_a_no_op():
    """An identical mapping (a colocated engine sharing the trainer's tensors) writes each element where it is."""
    lay = Layout.from_placements({"w": (8, 4), "b": (5,)}, [0], [Replicate()])
    t = {"w": torch.randn(8, 4), "b": torch.randn(5)}
    before = {n: x.clone() for n, x in t.items()}
    Resharder(plan_reshard(lay, lay), bucket_bytes=4096).run(t, t)
    assert all(torch.equal(t[n], before[n]) for n in t)


def test_destination_a_box_of_the_source_allowed_when_it_maps_the_same_elements():
    """The engine's shard is a view into the trainer's full tensor, at the place that shard belongs."""
    src = Layout.from_placements({"w": (8, 4)}, [0], [Replicate()])
    dst = Layout.from_fragments({"w": ((8, 4), F32)}, [Fragment("w", 0, (2, 0), (3, 4), "shard")])
    full = torch.randn(8, 4)
    before = full.clone()
    plan = plan_reshard(src, dst)
    Resharder(plan).run({"w": full}, {"shard": full[2:5]})
    assert torch.equal(full, before)
    # the same view at the wrong place: rows 0..2 of the storage would receive rows 2..4
    with pytest.raises(ValueError, match="share memory") as e:
        Resharder(plan).run({"w": full}, {"shard": full[0:3]})
    assert names(str(e.value), "shard") and "'w'" in str(e.value)


def test_partly_overlapping_views_rejected_and_disjoint_interleaved_views_allowed():
    src = Layout.from_placements({"w": (4, 4)}, [0], [Replicate()])
    both = Layout.from_placements({"w": (4, 4), "v": (4, 4)}, [0], [Replicate()])
    plan = plan_reshard(both, both.restrict(["v"]))
    storage = torch.arange(64, dtype=F32)
    w = storage[:16].view(4, 4)
    with pytest.raises(ValueError, match="share memory") as e:  # v starts in the middle of w
        Resharder(plan).run({"w": w, "v": storage[40:56].view(4, 4)}, {"v": storage[8:24].view(4, 4)})
    assert names(str(e.value), "v") and "'w'" in str(e.value)
    # interleaved columns of one storage: byte ranges overlap, bytes do not
    big = torch.arange(32, dtype=F32).reshape(4, 8)
    plan2 = plan_reshard(src, Layout.from_placements({"w": (4, 4)}, [0], [Replicate()]))
    Resharder(plan2).run({"w": big[:, 0::2]}, {"w": big[:, 1::2]})
    assert torch.equal(big[:, 1::2], big[:, 0::2])


def test_verify_allows_shared_memory():
    """verify writes nothing: the same tensor on both sides is what a colocated check does."""
    t = torch.arange(32, dtype=F32).reshape(8, 4)
    rep = Resharder(_rows_swapped()).verify({"w": t}, {"w": t})
    assert not rep.ok and rep.total_mismatches == 32


# --------------------------------------------------------------------------------------------------------
# Destinations overlapping themselves, tensors without storage
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [
    pytest.param(lambda: torch.zeros(8, 1).expand(8, 4), id="expand"),
    pytest.param(lambda: torch.zeros(40).as_strided((8, 4), (2, 1)), id="as_strided-rows-overlap"),
])
def test_self_overlapping_destination_rejected(make):
    lay = Layout.from_placements({"w": (8, 4)}, [0], [Replicate()])
    d = make()
    with pytest.raises(ValueError, match="overlap") as e:
        Resharder(plan_reshard(lay, lay)).run({"w": torch.randn(8, 4)}, {"w": d})
    assert names(str(e.value), "w"), str(e.value)
    assert not d.any()


@pytest.mark.parametrize("side", ["source", "destination"])
def test_freed_storage_rejected_without_crash(side):
    lay = Layout.from_placements({"w": (8, 4)}, [0], [Replicate()])
    s, d = torch.randn(8, 4), torch.zeros(8, 4)
    (s if side == "source" else d).untyped_storage().resize_(0)  # what FSDP does between steps
    with pytest.raises(ValueError, match="no valid storage") as e:
        Resharder(plan_reshard(lay, lay)).run({"w": s}, {"w": d})
    assert names(str(e.value), "w") and side in str(e.value), str(e.value)


def test_sparse_tensor_rejected():
    lay = Layout.from_placements({"w": (8, 4)}, [0], [Replicate()])
    with pytest.raises(ValueError, match="strided") as e:
        Resharder(plan_reshard(lay, lay)).run({"w": torch.randn(8, 4).to_sparse()}, {"w": torch.zeros(8, 4)})
    assert names(str(e.value), "w")


def test_triton_backend_on_cpu_rejected_before_the_run():
    lay = Layout.from_placements({"w": (8, 4)}, [0], [Replicate()])
    if __import__("os").environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter runs Triton on CPU")
    with pytest.raises(ValueError, match="triton"):
        Resharder(plan_reshard(lay, lay), backend="triton").run({"w": torch.randn(8, 4)}, {"w": torch.zeros(8, 4)})


# --------------------------------------------------------------------------------------------------------
# Two runs on one group at once (two threads of one process)
# --------------------------------------------------------------------------------------------------------


def test_second_concurrent_run_on_one_group_is_refused_before_it_sends():
    """Ranks 0 and 1 of a refit group live in threads of this process. Rank 0 starts a run (it waits for rank
    1); a second run on rank 0's group is refused at once; then rank 1 runs and the first run completes."""
    port = free_port()
    groups: dict[int, object] = {}

    def join(rank):
        groups[rank] = init_refit_group("127.0.0.1", port, rank, 2, backend="gloo", timeout=20)

    ts = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    try:
        src = Layout.from_placements({"w": (8, 4)}, [0], [Replicate()])
        dst = Layout.from_placements({"w": (8, 4)}, [1], [Replicate()])
        plan = plan_reshard(src, dst)
        r0, r1 = (Resharder(plan, group=groups[r], timeout=20) for r in (0, 1))
        w = torch.randn(8, 4)
        out = torch.zeros(8, 4)
        first: dict = {}
        a = threading.Thread(target=lambda: first.setdefault("report", r0.run({"w": w}, {})))
        a.start()
        time.sleep(0.3)  # rank 0's first run is in its handshake now, waiting for rank 1
        t0 = time.perf_counter()
        with pytest.raises(ReshardError, match="refused") as e:
            Resharder(plan, group=groups[0], timeout=20).run({"w": w}, {})
        assert time.perf_counter() - t0 < 1.0 and "nothing was sent" in str(e.value)
        r1.run({}, {"w": out})
        a.join(20)
        assert "report" in first and torch.equal(out, w)
        out2 = torch.zeros(8, 4)
        b = threading.Thread(target=lambda: r1.run({}, {"w": out2}))
        b.start()
        r0.run({"w": w * 2}, {})  # one after the other is fine
        b.join(20)
        assert torch.equal(out2, w * 2)
    finally:
        for g in groups.values():
            g.destroy()


@pytest.mark.parametrize("verify", [False, True])
def test_a_rank_that_cannot_plan_its_share_stops_its_peers_at_once(verify):
    """With rank plans only the rank that receives an element held by no source finds out (here rank 1);
    refit/verify_refit there takes part in the handshake before raising, so rank 0, whose own share plans
    fine, raises a named ReshardError at once instead of waiting out the timeout."""
    from triton_reshard import refit, verify_refit

    port = free_port()
    groups: dict[int, object] = {}

    def join(rank):
        groups[rank] = init_refit_group("127.0.0.1", port, rank, 2, backend="gloo", timeout=30)

    ts = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(40)
    try:
        specs = {"w": ((8, 4), torch.float32), "v": ((4,), torch.float32)}
        src = Layout.from_fragments(specs, [Fragment("w", 0, (0, 0), (4, 4)), Fragment("v", 0, (0,), (4,))])
        dst = Layout.from_fragments(specs, [Fragment("w", 1, (4, 0), (4, 4)), Fragment("v", 0, (0,), (4,))])
        plan_reshard(src, dst, rank=0)  # rank 0's own share is fine: only rank 1 can see the problem
        call = verify_refit if verify else refit
        tensors = {0: ({"w": torch.randn(4, 4), "v": torch.randn(4)}, {"v": torch.zeros(4)}),
                   1: ({}, {"w": torch.full((4, 4), float("nan"))})}
        errors: dict[int, BaseException] = {}
        took: dict[int, float] = {}

        def go(rank):
            t0 = time.perf_counter()
            try:
                call(*tensors[rank], src, dst, group=groups[rank], timeout=30)
            except BaseException as e:  # noqa: BLE001 - recorded and checked below
                errors[rank] = e
            took[rank] = time.perf_counter() - t0

        ts = [threading.Thread(target=go, args=(r,)) for r in (0, 1)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        assert isinstance(errors.get(1), ValueError) and names(str(errors[1]), "w", 1), errors
        assert "held by no source rank" in str(errors[1])
        assert isinstance(errors.get(0), ReshardError) and "rank(s) [1] could not plan" in str(errors[0]), errors
        assert max(took.values()) < 10, took  # not the 30 s timeout
        assert torch.equal(tensors[0][1]["v"], torch.zeros(4))  # nothing was moved on rank 0 either
    finally:
        for g in groups.values():
            g.destroy()


# --------------------------------------------------------------------------------------------------------
# refit: torn-weight fencing and the Resharder cache
# --------------------------------------------------------------------------------------------------------


def test_refit_state_records_torn_weights_and_a_retry_repairs(monkeypatch):
    import triton_reshard.ops as ops
    from triton_reshard import ReshardAbortedError, clear_cache, refit, refit_state

    clear_cache()
    src = Layout.from_placements({"w": (8, 4), "b": (4,)}, [0], [Replicate()])
    dst = Layout.from_fragments({"w": ((8, 4), F32), "b": ((4,), F32)},
                                [Fragment("w", 0, (0, 0), (8, 4), "w_t"), Fragment("b", 0, (0,), (4,), "b_t")])
    assert refit_state(dst).version is None and not refit_state(dst).torn
    s1 = {"w": torch.randn(8, 4), "b": torch.randn(4)}
    d = {"w_t": torch.zeros(8, 4), "b_t": torch.zeros(4)}
    refit(s1, d, src, dst, version=1)
    assert refit_state(dst).version == 1 and not refit_state(dst).torn
    real = ops.copy_views

    def broken(pairs, backend="torch", key=None):
        real(pairs[:1], backend, key)  # one copy lands, then the run fails
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(ops, "copy_views", broken)
    s2 = {"w": torch.randn(8, 4), "b": torch.randn(4)}
    with pytest.raises(ReshardAbortedError, match="disk on fire") as e:
        refit(s2, d, src, dst, version=2)
    assert e.value.torn == ("b_t", "w_t") and "possibly partly written" in str(e.value)
    st = refit_state(dst)
    assert st.version == 1 and st.torn and st.torn_tensors == ("b_t", "w_t") and st.failed_version == 2
    # a rejected input writes nothing: the torn state stays as it was
    with pytest.raises(ValueError):
        refit(s2, {"w_t": torch.zeros(8, 5), "b_t": torch.zeros(4)}, src, dst, version=2)
    assert refit_state(dst).torn
    monkeypatch.setattr(ops, "copy_views", real)
    refit(s2, d, src, dst, version=2)  # the failed Resharder is not reused: a fresh one repairs
    assert torch.equal(d["w_t"], s2["w"]) and torch.equal(d["b_t"], s2["b"])
    st = refit_state(dst)
    assert st.version == 2 and not st.torn and st.torn_tensors == ()


def test_resharder_refuses_to_run_again_after_failing_part_way(monkeypatch):
    import triton_reshard.ops as ops

    lay = Layout.from_placements({"w": (8, 4)}, [0], [Replicate()])
    r = Resharder(plan_reshard(lay, lay))
    monkeypatch.setattr(ops, "copy_views", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(ReshardError):
        r.run({"w": torch.randn(8, 4)}, {"w": torch.zeros(8, 4)})
    monkeypatch.undo()
    with pytest.raises(ReshardError, match="failed part way before"):
        r.run({"w": torch.randn(8, 4)}, {"w": torch.zeros(8, 4)})


def test_cache_never_returns_a_resharder_of_a_destroyed_group():
    import torch.distributed as dist

    from triton_reshard.refit import get_resharder

    src = Layout.from_placements({"w": (8, 4)}, [0], [Replicate()])
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    # refit group: destroy() keeps the object (and its id); the cache must not hand back its Resharder
    g = init_refit_group("127.0.0.1", free_port(), 0, 1, backend="gloo", timeout=10)
    r1 = get_resharder(src, src, group=g)
    assert get_resharder(src, src, group=g) is r1
    g.destroy()
    assert get_resharder(src, src, group=g) is not r1
    # the default group (group=None): a new default group after destroy_process_group gets a new Resharder
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        r2 = get_resharder(src, src)
        sub = dist.new_group([0])
        r3 = get_resharder(src, src, group=sub)
        assert get_resharder(src, src, group=sub) is r3
        dist.destroy_process_group(sub)
        with pytest.raises(ValueError, match="destroyed"):  # not the cached one, and named
            get_resharder(src, src, group=sub)
    finally:
        dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert get_resharder(src, src) is not r2
    finally:
        dist.destroy_process_group()
