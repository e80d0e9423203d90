"""The kit's background send (``integrations/inflight.py``): a snapshot of the trainer's tensors sent in a
thread while the trainer changes them, one send in flight at a time, its error raised where it is joined.

The gloo world (three processes, a refit group, no engine): trainer rank 0 holds the full tensors, engine ranks
1-2 receive row halves into poisoned buffers. The trainer starts a background send of version A, changes its
tensors to B at once (the send waits 0.3 s before its refit, as a plug-in's engine RPC does), then joins: the
engine ranks hold A bit for bit. The same with ``copied=True`` on the live tensors (no snapshot) delivers B: the
check tells the two apart. Then a background delta send, and a failing one (a tensor of the wrong shape): the
error, naming the tensor, is raised by the join on the trainer; the engine ranks keep what they held."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import pytest
import torch

from triton_reshard import Layout, Replicate, Shard, refit
from triton_reshard.comm.group import free_port
from triton_reshard.integrations import engine as kit
from triton_reshard.integrations.inflight import BackgroundSender, Snapshot

SHAPES = {"w": (8, 6), "b": (33,)}


def _version(v: int) -> dict[str, torch.Tensor]:
    if v == 11:  # version 10 with three elements changed: what a delta sends in a few bytes
        out = _version(10)
        out["w"][0, :3] += 1
        return out
    g = torch.Generator().manual_seed(v)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def _layouts():
    train = Layout.from_placements(SHAPES, [0], {n: [Replicate()] for n in SHAPES})
    infer = Layout.from_placements(SHAPES, [1, 2], {"w": [Shard(0)], "b": [Replicate()]})
    return train, infer


def _want(full: dict, rank: int) -> dict:
    return {"w": full["w"][(rank - 1) * 4:rank * 4], "b": full["b"]}


def _same(got: dict, want: dict) -> bool:
    return all(torch.equal(got[n].view(torch.int32), want[n].view(torch.int32)) for n in want)


def _world_rank(rank: int, port: int, out) -> None:
    try:
        torch.set_num_threads(1)
        group = kit.join_group("127.0.0.1", port, rank, 3, backend="gloo", timeout=60.0, insecure=True)
        train, infer = _layouts()
        res = {}
        if rank == 0:
            bg = BackgroundSender("trainer rank 0")
            live = _version(1)

            def send(tensors, **kw):
                time.sleep(0.3)  # the engine's update RPC goes first in a plug-in: the trainer moves on meanwhile
                return refit(tensors, {}, train, infer, group=group, timeout=60.0, **kw).sent_bytes

            for case, copied in (("snapshot", False), ("no_snapshot", True)):
                with torch.no_grad():
                    for n, t in live.items():
                        t.copy_(_version(1)[n])
                bg.start(send, live, version=case, copied=copied)
                try:
                    bg.start(send, live, version="second")
                    res[f"{case}_second"] = None
                except RuntimeError as e:
                    res[f"{case}_second"] = str(e)
                with torch.no_grad():  # the next training step, while the bytes are in flight
                    for n, t in live.items():
                        t.copy_(_version(2)[n])
                res[f"{case}_sent"] = bg.join(60.0)
                res[f"{case}_snapshot_bytes"] = bg.last["snapshot_bytes"]
            # a delta send in the background (after a dense one at version 10), then a failing one
            for v in (10, 11):
                bg.start(lambda t, v=v: send(t, version=v, delta=True), _version(v), version=v)
                res[f"delta_{v}"] = bg.join(60.0)
            bad = {**_version(12), "w": _version(12)["w"][:7]}
            bg.start(send, bad, version=12)
            try:
                bg.join(60.0)
                res["bad_error"] = None
            except Exception as e:  # noqa: BLE001 (the error is what the test checks)
                res["bad_error"] = f"{type(e).__name__}: {e}"
            res["free_after_error"] = not bg.in_flight
        else:
            held: dict = {}
            for case, want in (("snapshot", 1), ("no_snapshot", 2), ("delta_10", 10), ("delta_11", 11),
                               ("bad", 11)):
                if case in ("delta_11", "bad"):  # a delta applies in place onto what the engine holds
                    got = held
                else:
                    got = {n: t.fill_(float("nan")) for n, t in infer.allocate(rank).items()}
                kw = {"version": want, "delta": True} if case.startswith("delta") else {}
                try:
                    refit({}, got, train, infer, group=group, timeout=60.0, **kw)
                    err = None
                except Exception as e:  # noqa: BLE001 (the bad case's error is what the test checks)
                    err = f"{type(e).__name__}: {e}"
                    if case != "bad":
                        raise
                res["bad_error"] = err
                held = got
                res[case] = _same(got, _want(_version(want), rank))
        out.put((rank, res))
        group.destroy()
    except BaseException as e:  # noqa: BLE001 (reported to the test)
        out.put((rank, {"error": f"{type(e).__name__}: {e}"}))


@pytest.mark.slow
def test_a_background_send_sends_its_snapshot_and_raises_at_the_join():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_world_rank, args=(r, port, out)) for r in range(3)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in procs:
            rank, res = out.get(timeout=240)
            got[rank] = res
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert all("error" not in r for r in got.values()), got
    t = got[0]
    for case in ("snapshot", "no_snapshot"):
        assert "refused" in t[f"{case}_second"] and "in flight" in t[f"{case}_second"], t
    assert t["snapshot_snapshot_bytes"] == 4 * (8 * 6 + 33) and t["no_snapshot_snapshot_bytes"] == 0
    assert t["snapshot_sent"] > 0 and t["delta_11"] < t["delta_10"]
    assert t["bad_error"] and "'w'" in t["bad_error"], t["bad_error"]
    assert t["free_after_error"]
    for rank in (1, 2):
        r = got[rank]
        assert r["snapshot"], "the engine did not get the version snapshotted at the send"
        assert r["no_snapshot"], "without the snapshot the trainer's change reaches the engine (the control)"
        assert r["delta_10"] and r["delta_11"] and r["bad"], r
        assert "rank(s) [0] rejected their input" in r["bad_error"] and "nothing was moved" in r["bad_error"]


def test_snapshot_copies_once_into_reused_buffers():
    src = {"a": torch.arange(12, dtype=torch.float32).reshape(3, 4), "t": torch.randn(4, 5).t()}
    snap = Snapshot()
    first = snap.take(src)
    ptrs = {n: t.data_ptr() for n, t in first.items()}
    assert first["t"].stride() == src["t"].stride() and snap.nbytes == 12 * 4 + 20 * 4
    src["a"].add_(1)
    assert torch.equal(first["a"], torch.arange(12, dtype=torch.float32).reshape(3, 4))
    second = snap.take(src)
    assert {n: t.data_ptr() for n, t in second.items()} == ptrs and torch.equal(second["a"], src["a"])
    third = snap.take({"a": src["a"].double()})
    assert list(third) == ["a"] and third["a"].dtype == torch.float64 and snap.nbytes == 12 * 8
    snap.release()
    assert snap.nbytes == 0


def test_one_send_in_flight_its_error_at_the_join_and_a_bounded_close():
    bg = BackgroundSender("trainer rank 3")
    assert bg.join(1.0) is None  # nothing in flight
    gate = threading.Event()
    bg.start(lambda snap: gate.wait(10) and sum(t.numel() for t in snap.values()), {"x": torch.ones(5)}, version=7)
    with pytest.raises(RuntimeError, match=r"trainer rank 3: send_weights refused: the background send of "
                                           r"version 7 is in flight \(running\); commit\(\) joins it first"):
        bg.start(lambda snap: 0, {}, version=8)
    with pytest.raises(TimeoutError, match="version 7 did not complete within 0.05s"):
        bg.join(0.05)
    assert bg.in_flight
    gate.set()
    assert bg.join(10.0) == 5 and not bg.in_flight and bg.last["send_s"] >= 0

    def boom(snap):
        raise ValueError("rank 0: tensor 'w': shape (7, 6), the layout says (8, 6)")

    bg.start(boom, {}, version=9)
    with pytest.raises(ValueError, match="tensor 'w'"):
        bg.join(10.0)
    assert not bg.in_flight and bg.last["failed"]
    stuck = threading.Event()
    bg.start(lambda snap: stuck.wait(30), {"x": torch.ones(2)}, version=10)
    t0 = time.perf_counter()
    err = bg.close(0.1)
    assert isinstance(err, TimeoutError) and time.perf_counter() - t0 < 5 and not bg.in_flight
    assert bg.snapshot.nbytes == 0
    stuck.set()
