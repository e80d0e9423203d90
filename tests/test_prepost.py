"""The first step's receives posted with the plan handshake (issue 32: ``handshake.handshake_post``).

On gloo a message leaves the sender only after the receiver's "ready to receive" notice arrived, so a receive
posted after the handshake costs a round trip more than one posted with it. These tests check, in one world of
4 gloo ranks (trainer 0-1, engine 2-3), that the path is taken where it may be (staged receives, one per peer),
not where it may not (in place), that the result is exact, and that every refusal (a bad input on a sender or
on a receiver, ranks planning differently so their first steps disagree, a rank that could not plan) raises on
every rank, writes nothing, and leaves no receive open: the same group then refits exactly, several times.
All of it twice: with the handshake rows going peer to peer ("direct") and through rank 0 ("rooted", what
groups of 8 or more gloo ranks use: ``transport.rows_shape``), the threshold lowered to take it at 4 ranks.
"""

from __future__ import annotations

import pytest
import torch

from triton_reshard.testing.launch import run_world

pytestmark = pytest.mark.slow

SRC_RANKS, DST_RANKS = [0, 1], [2, 3]


def _layouts(rows: int = 4, cols: int = 16, dst_shard: int = 1):
    from triton_reshard import Layout, Shard

    src = Layout.from_placements({"t": (rows, cols)}, SRC_RANKS, [Shard(0)], torch.bfloat16)
    dst = Layout.from_placements({"t": (rows, cols)}, DST_RANKS, [Shard(dst_shard)], torch.bfloat16)
    return src, dst


def _global(rows: int = 4, cols: int = 16) -> torch.Tensor:
    return (torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) + 1).to(torch.bfloat16)


def _attempt(fn, dst: dict) -> dict:
    before = {n: t.view(torch.int16).clone() for n, t in dst.items()}
    try:
        fn()
        out = {"error": None, "message": ""}
    except Exception as e:
        out = {"error": type(e).__name__, "message": str(e)}
    out["untouched"] = all(torch.equal(dst[n].view(torch.int16), b) for n, b in before.items())
    return out


def _good(rank: int, src, dst, resharder=None, **kw) -> bool:
    """A refit into a poisoned destination, compared bit for bit with slicing the global tensor."""
    from triton_reshard import refit

    g = _global(*src.tensors[0].shape)
    s = src.shard({"t": g}, rank) if rank in src.ranks else {}
    d = dst.allocate(rank) if rank in dst.ranks else {}
    for t in d.values():
        t.view(torch.int16).fill_(-1)
    if resharder is not None:
        resharder.run(s, d)
    else:
        refit(s, d, src, dst, timeout=20, **kw)
    want = dst.shard({"t": g}, rank) if rank in dst.ranks else {}
    return all(torch.equal(d[n].view(torch.int16), want[n].view(torch.int16)) for n in want)


def _session(src, dst, **kw):
    from triton_reshard.execute.options import RefitOptions
    from triton_reshard.execute.session import SESSIONS

    return SESSIONS.get(src, dst, None, RefitOptions.of(timeout=20, **kw)).resharder


def _rows(rank: int, world: int) -> dict:
    """post_rows in each shape, on rows of several fields and of one (the verify counts), with per-peer last
    fields: every rank must get the same rows from both, as "direct" defines them."""
    from datetime import timedelta

    import torch.distributed as dist

    from triton_reshard.comm.group import as_transport
    from triton_reshard.execute import transport

    comm = as_transport(None)
    got = {}
    for shape, floor in (("direct", 99), ("rooted", 2)):
        transport.ROOTED_ROWS_MIN_RANKS = floor
        assert transport.rows_shape(comm) == shape
        for fields in (21, 1):
            mine = torch.arange(fields, dtype=torch.int64) * 100 + rank * 7 + 1
            last = {p: 1000 * rank + p for p in range(world) if p != rank and (p + rank) % 3}
            out, works = transport.post_rows(comm, mine, last)
            for w in works:
                assert w.wait(timeout=timedelta(seconds=20)) is not False
            got[shape, fields] = [o.tolist() for o in out]
    dist.barrier()
    want = {}
    for fields in (21, 1):
        rows = []
        for p in range(world):
            row = [int(v) for v in torch.arange(fields, dtype=torch.int64) * 100 + p * 7 + 1]
            if p != rank and (p + rank) % 3:
                row[-1] = 1000 * p + rank
            rows.append(row)
        want[fields] = rows
    return {"rows_" + s: all(got[s, f] == want[f] for f in (21, 1)) for s in ("direct", "rooted")}


def _world(rank: int, world: int, shape: str = "direct") -> dict:
    from triton_reshard import refit
    from triton_reshard.comm.group import as_transport
    from triton_reshard.execute import transport

    out: dict = _rows(rank, world)
    transport.ROOTED_ROWS_MIN_RANKS = 2 if shape == "rooted" else 99
    out["shape"], out["asked"] = transport.rows_shape(as_transport(None)), shape
    src, dst = _layouts()
    out["first"] = _good(rank, src, dst)
    r = _session(src, dst)
    out["preposted"] = sorted(p for p, _ in r._prepost_recvs or ())
    out["second"] = _good(rank, src, dst)
    # in place: a destination shard contiguous and big enough is received into directly: never pre-posted
    src_big, dst_big = _layouts(8, 4096, dst_shard=0)
    from triton_reshard import Resharder, plan_reshard

    rb = Resharder(plan_reshard(src_big, dst_big), direct_min_bytes=1024, timeout=20)
    out["in_place"] = _good(rank, src_big, dst_big, resharder=rb) and _good(rank, src_big, dst_big, resharder=rb)
    out["in_place_bytes"] = rb._bound.in_place_bytes
    out["in_place_preposted"] = sorted(p for p, _ in rb._prepost_recvs or ())
    g = _global()
    for case, bad in (("bad-sender", 0), ("bad-receiver", 3)):
        s = src.shard({"t": g}, rank) if rank in src.ranks else {}
        d = dst.allocate(rank) if rank in dst.ranks else {}
        if rank == bad:
            (s if rank in src.ranks else d)["t"] = torch.zeros(3, 3, dtype=torch.bfloat16)  # wrong shape
        out[case] = _attempt(lambda s=s, d=d: refit(s, d, src, dst, timeout=20), d)
        out[case + "-then"] = _good(rank, src, dst)
    # rank 3 plans another destination: its first step's receives differ from what the senders planned
    other_src, other_dst = _layouts(4, 32, dst_shard=1) if rank == 3 else (src, dst)
    s = other_src.shard({"t": _global(*other_src.tensors[0].shape)}, rank) if rank in src.ranks else {}
    d = other_dst.allocate(rank) if rank in dst.ranks else {}
    out["different-plans"] = _attempt(lambda: refit(s, d, other_src, other_dst, timeout=20), d)
    out["different-plans-then"] = _good(rank, src, dst)
    # rank 1 cannot even plan (an unknown option value): refuse() answers the handshake
    d = dst.allocate(rank) if rank in dst.ranks else {}
    s = src.shard({"t": g}, rank) if rank in src.ranks else {}
    kw = {"bucket_bytes": -5} if rank == 1 else {}
    out["could-not-plan"] = _attempt(lambda: refit(s, d, src, dst, timeout=20, **kw), d)
    out["could-not-plan-then"] = [_good(rank, src, dst) for _ in range(3)]
    # verify goes the same way (every receive staged)
    from triton_reshard import verify_refit

    d = dst.shard({"t": g}, rank) if rank in dst.ranks else {}
    s = src.shard({"t": g}, rank) if rank in src.ranks else {}
    out["verify_ok"] = verify_refit(s, d, src, dst, timeout=20).ok
    return out


@pytest.fixture(scope="module", params=["direct", "rooted"])
def results(request) -> list[dict]:
    return run_world(_world, 4, request.param, timeout=300, pg_timeout=60)


def test_both_row_shapes_give_every_rank_the_same_rows(results):
    for rank, res in enumerate(results):
        assert res["rows_direct"] and res["rows_rooted"], (rank, res)


def test_first_step_receives_go_with_the_handshake_and_land_exactly(results):
    for rank, res in enumerate(results):
        assert res["shape"] == res["asked"], (rank, res["shape"], res["asked"])
        assert res["first"] and res["second"], (rank, res)
        want = SRC_RANKS if rank in DST_RANKS else []
        assert res["preposted"] == want, (rank, res["preposted"])
        assert res["verify_ok"], rank


def test_in_place_receives_are_not_preposted(results):
    for rank, res in enumerate(results):
        assert res["in_place"], rank
        if rank in DST_RANKS:
            assert res["in_place_bytes"] > 0, (rank, "the case should receive in place")
        assert res["in_place_preposted"] == [], (rank, res["in_place_preposted"])


@pytest.mark.parametrize("case", ["bad-sender", "bad-receiver", "different-plans", "could-not-plan"])
def test_refusals_raise_everywhere_write_nothing_and_leave_the_group_usable(results, case):
    for rank, res in enumerate(results):
        got = res[case]
        assert got["error"] is not None, (rank, case, got)
        assert got["untouched"], (rank, case, "destination written although the refit was refused")
        then = res[case + "-then"]
        assert all(then) if isinstance(then, list) else then, (rank, case, "the next refit was not exact")
    messages = [res[case]["message"] for res in results]
    if case == "different-plans":
        assert all("different plans" in m for m in messages), messages
    if case == "could-not-plan":
        assert all("could not plan" in m for r, m in enumerate(messages) if r != 1), messages
