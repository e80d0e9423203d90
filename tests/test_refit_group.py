"""``init_refit_group``: a refit-only process group across separately launched jobs.

Two jobs are spawned separately (two ``run_world`` calls at once, each with its own default gloo world on
its own port): a "trainer" job of 2 ranks holding a Megatron TP2 layout and an "engine" job of 2 ranks
holding vLLM TP1 x DP2. Each job runs collectives on its own default group before and after, and both join a
refit group of 4 (trainer ranks 0-1, engine ranks 2-3). The refit over it must be bit-exact against slicing
the global tensors (poisoned destinations: what no fragment covers stays poisoned), ``verify_refit`` must
prove it, and the jobs' own groups must still work afterwards. The rendezvous errors (port taken, a rank
that never arrives, disagreeing world sizes, a rank taken twice) are checked in this process with threads.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

from triton_reshard import RefitGroupError, Resharder, init_refit_group, plan_reshard, refit, verify_refit
from triton_reshard.comm.group import free_port
from triton_reshard.presets import get_config, logical_tensors, megatron_layout, vllm_layout
from triton_reshard.testing.launch import run_jobs

MODEL = "tiny_qwen3"


def _layouts():
    cfg = get_config(MODEL)
    return (megatron_layout(cfg, tp=2, ranks=range(2), dtype=torch.float32),
            vllm_layout(cfg, tp=1, dp=2, ranks=range(2, 4), dtype=torch.float32))


def _globals():
    g = torch.Generator().manual_seed(7)
    return {n: torch.randn(s, generator=g) for n, s in sorted(logical_tensors(get_config(MODEL)).items())}


def _job(rank: int, world: int, role: str, port: int) -> dict:
    """One rank of a job: its own default world (made by run_world) plus the refit group."""
    out: dict = {"problems": []}
    ones = torch.ones(1)
    dist.all_reduce(ones)  # the job's own default group, before
    out["own_before"] = float(ones)
    offset = 0 if role == "trainer" else 2
    g = init_refit_group("127.0.0.1", port, offset + rank, 4, timeout=60)
    try:
        out["group"] = (g.rank, g.size, g.backend, dist.get_world_size())  # the default world is untouched
        src_l, dst_l = _layouts()
        full = _globals()
        src = src_l.shard(full, g.rank) if role == "trainer" else {}
        dst = dst_l.allocate(g.rank, fill=float("nan")) if role == "engine" else {}
        for step in range(2):  # twice: cached plan and buffers, new data
            if role == "trainer":
                for t in src.values():
                    t.mul_(-1.0 if step else 1.0)
            rep = refit(src, dst, src_l, dst_l, group=g, timeout=60)
            out.setdefault("recv", []).append(rep.recv_bytes)
            if role == "engine":
                want = dst_l.shard({n: t * (-1.0 if step else 1.0) for n, t in full.items()}, g.rank)
                mask = dst_l.shard({n: torch.ones_like(t) for n, t in full.items()}, g.rank)
                for n, t in dst.items():
                    m = mask[n].bool()
                    if not torch.equal(t[m], want[n][m]):
                        out["problems"].append(f"{role} rank {rank}: {n}: wrong elements after refit {step}")
                    if not bool(torch.isnan(t[~m]).all()):
                        out["problems"].append(f"{role} rank {rank}: {n}: refit wrote outside the layout")
        v = verify_refit(src, dst, src_l, dst_l, group=g, timeout=60)
        out["verify"] = (v.ok, v.total_mismatches)
    finally:
        g.destroy()
    dist.all_reduce(ones)  # the job's own group still works afterwards
    out["own_after"] = float(ones)
    return out


@pytest.mark.slow
def test_two_separate_jobs_refit_over_a_refit_group(monkeypatch):
    import os

    monkeypatch.setenv("TRITON_RESHARD_SECRET", os.urandom(32).hex())  # both jobs inherit it: init_refit_group's default
    port = free_port()
    results = run_jobs({role: (_job, 2, role, port) for role in ("trainer", "engine")}, timeout=180)
    for role in ("trainer", "engine"):
        assert not isinstance(results[role], Exception), f"{role} job failed: {results[role]}"
    trainer, engine = results["trainer"], results["engine"]
    problems = [p for r in trainer + engine for p in r["problems"]]
    assert not problems, "\n".join(problems)
    assert [r["group"] for r in trainer + engine] == [(i, 4, "gloo", 2) for i in range(4)]
    assert all(r["own_before"] == 2.0 and r["own_after"] == 4.0 for r in trainer + engine)
    assert all(r["verify"] == (True, 0) for r in trainer + engine)
    assert all(r["recv"][0] == r["recv"][1] > 0 for r in engine) and all(r["recv"] == [0, 0] for r in trainer)


def test_port_taken():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(RefitGroupError, match=rf"rank 0 cannot open .*127\.0\.0\.1:{port}.*port taken"):
            init_refit_group("127.0.0.1", port, 0, 2, timeout=5)


def test_a_rank_that_never_arrives_is_named_within_the_timeout():
    t0 = time.monotonic()
    with pytest.raises(RefitGroupError, match=r"rank 0: ranks \[1, 2\] .*world_size=3.* did not arrive within 1.5s"):
        init_refit_group("127.0.0.1", free_port(), 0, 3, timeout=1.5)
    assert time.monotonic() - t0 < 10


def test_rank_0_unreachable():
    with pytest.raises(RefitGroupError, match=r"rank 1 could not reach"):
        init_refit_group("127.0.0.1", free_port(), 1, 2, timeout=1.5)


def _threads(calls):
    errors: dict[int, BaseException | None] = {}
    groups = {}

    def run(i, args, kw):
        try:
            groups[i] = init_refit_group(*args, **kw)
            errors[i] = None
        except BaseException as e:  # noqa: BLE001
            errors[i] = e

    ts = [threading.Thread(target=run, args=(i, a, k)) for i, (a, k) in enumerate(calls)]
    for t in ts:
        t.start()
        time.sleep(0.2)  # rank 0 first
    for t in ts:
        t.join(30)
    for g in groups.values():
        g.destroy()
    return errors


def test_world_size_disagreement_is_named_on_both_sides():
    port = free_port()
    errors = _threads([(("127.0.0.1", port, 0, 2), {"timeout": 10}), (("127.0.0.1", port, 1, 3), {"timeout": 10})])
    assert "rank 1 says world_size=3, but rank 0 says 2" in str(errors[1])
    assert "rank 0 says world_size=2, but rank 1 says 3" in str(errors[0])


def test_a_rank_taken_twice():
    port = free_port()
    calls = [(("127.0.0.1", port, 0, 3), {"timeout": 3}), (("127.0.0.1", port, 1, 3), {"timeout": 3}),
             (("127.0.0.1", port, 1, 3), {"timeout": 3})]
    errors = _threads(calls)
    assert "rank 1 of the refit group at" in str(errors[2]) and "taken twice" in str(errors[2])
    assert "did not arrive" in str(errors[0])  # rank 2 never came


def test_single_rank_group_and_plan_ranks_outside_it():
    g = init_refit_group("127.0.0.1", free_port(), 0, 1, timeout=10)
    try:
        src_l, dst_l = _layouts()
        with pytest.raises(ValueError, match=r"rank 0: the plan uses ranks \[1, 2, 3\] that are not in the process "
                                             r"group \[0\]"):
            Resharder(plan_reshard(src_l, dst_l), group=g)
    finally:
        g.destroy()
    with pytest.raises(RefitGroupError, match="destroyed"):
        g.barrier()
    with pytest.raises(ValueError, match="not in"):
        init_refit_group("127.0.0.1", 1234, 2, 2)
    with pytest.raises(TypeError, match="timeout"):
        init_refit_group("127.0.0.1", 1234, 0, 1, timeout=float("inf"))


def test_all_gather_object_over_the_store():
    port = free_port()
    got = {}

    def run(r):
        g = init_refit_group("127.0.0.1", port, r, 3, timeout=20)
        got[r] = [g.all_gather_object({"rank": r, "x": list(range(r))}), g.all_gather_object(r * 10)]
        g.barrier()  # rank 0 serves the rendezvous: its destroy() must not cut another rank's last read short
        g.destroy()

    ts = [threading.Thread(target=run, args=(r,)) for r in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    for r in range(3):
        assert got[r] == [[{"rank": i, "x": list(range(i))} for i in range(3)], [0, 10, 20]]


def test_rank_0_names_the_members_that_left():
    """Rank 0 serves the rendezvous every member stays connected to: a member whose connection closed (its
    process died, or it destroyed its group) is named by ``lost_members``, in the order they left; the other
    ranks cannot tell (None)."""
    port = free_port()
    groups, ready = {}, threading.Barrier(3)

    def run(r):
        groups[r] = init_refit_group("127.0.0.1", port, r, 3, timeout=20)
        ready.wait(30)

    ts = [threading.Thread(target=run, args=(r,)) for r in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    try:
        assert groups[0].lost_members() == [] and groups[1].lost_members() is None
        groups[2].destroy()
        deadline = time.monotonic() + 10
        while groups[0].lost_members() != [2] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert groups[0].lost_members() == [2]
        time.sleep(0.05)
        groups[1].destroy()  # who left first is named first
        while groups[0].lost_members() != [2, 1] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert groups[0].lost_members() == [2, 1]
    finally:
        groups[1].destroy()
        groups[0].destroy()
    assert groups[0].lost_members() is None


def test_rank_0_destroying_right_after_an_exchange_lets_the_others_read_it():
    """Every rank raising the same refusal right after an exchange (the SGLang / vLLM plug-ins' refusals): rank
    0 destroys its group at once; a member still reading that exchange's reply gets it (rank 0 lingers until
    the members hang up), not a lost rendezvous."""
    port = free_port()
    got, errors = {}, {}

    def run(r):
        try:
            g = init_refit_group("127.0.0.1", port, r, 3, timeout=20)
            if r:  # slow readers: the reply is asked for well after rank 0 has read its own
                fast = g._store.multi_get

                def slow(keys):
                    time.sleep(0.4 * r)
                    return fast(keys)

                g._store.multi_get = slow
            got[r] = g.all_gather_object(("refused", f"rank {r}"))
            g.destroy()
        except BaseException as e:  # noqa: BLE001
            errors[r] = e

    ts = [threading.Thread(target=run, args=(r,)) for r in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors, errors
    for r in range(3):
        assert got[r] == [("refused", f"rank {i}") for i in range(3)]


def test_a_self_connected_socket_is_not_taken_for_rank_0(monkeypatch):
    """Retrying a loopback port in the ephemeral range while nobody listens can connect a socket to itself
    (TCP simultaneous open); the retry loop drops such a socket and tries again until rank 0 listens."""
    import socket

    from triton_reshard.comm import auth

    real = socket.create_connection
    tries = []

    def first_to_itself(addr, timeout=None):
        tries.append(addr)
        if len(tries) == 1:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            s.connect(s.getsockname())  # a socket connected to itself, as the kernel can make one
            return s
        return real(addr, timeout=timeout)

    port = free_port()
    srv = socket.socket()
    srv.bind(("127.0.0.1", port))
    srv.listen()
    monkeypatch.setattr(auth.socket, "create_connection", first_to_itself)
    try:
        sock = auth.AuthStore._connect("127.0.0.1", port, time.monotonic() + 5)
        assert sock.getpeername() == ("127.0.0.1", port) and len(tries) == 2
        sock.close()
    finally:
        srv.close()


def test_free_port_is_below_the_ephemeral_range_and_never_handed_out_twice():
    """A free port in the kernel's ephemeral range can be given to any outgoing connection before rank 0 binds
    it (rank 0 then fails: port taken), and retrying it before anyone listens can self-connect: free_port
    takes ports below that range, each once per process, each bindable when handed out."""
    import socket

    try:  # the kernel's range, read here (the test's own reading, not the package's)
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo = int(f.read().split()[0])
    except (OSError, ValueError):
        lo = 32768
    ports = [free_port() for _ in range(100)]
    assert len(set(ports)) == 100 and all(20000 <= p < lo for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))
