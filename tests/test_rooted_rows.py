"""The "rooted" handshake rows (``execute/transport.RootedRows``: groups of 8 or more gloo ranks send their
row to rank 0, which sends the table back) when a row never reaches the root. Peer to peer, every rank would
see the dead rank's connection close; here only the root does, so it sends the others the table's status row
naming the rank it lost, and every survivor raises a named transport error at once, not at its timeout.
Worlds of 4 gloo ranks with the threshold lowered (``ROOTED_ROWS_MIN_RANKS = 2``); what the shapes share
(every refusal, the drain, verify, exact refits) is in ``tests/test_prepost.py``, run in both shapes.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from triton_reshard.testing.launch import run_world

pytestmark = pytest.mark.slow

LOST = 2  # the rank whose row the root does not get
TIMEOUT = 30.0  # the refit's timeout: a survivor must raise well before it when the lost rank died


def _world(rank: int, world: int, how: str) -> dict:
    from triton_reshard import Layout, Shard, refit
    from triton_reshard.comm.group import as_transport
    from triton_reshard.execute import transport
    from triton_reshard.execute.errors import ReshardConnectionError, ReshardTimeoutError

    transport.ROOTED_ROWS_MIN_RANKS = 2
    assert transport.rows_shape(as_transport(None)) == "rooted"
    src = Layout.from_placements({"t": (4, 16)}, [0, 1], [Shard(0)], torch.bfloat16)
    dst = Layout.from_placements({"t": (4, 16)}, [2, 3], [Shard(1)], torch.bfloat16)
    g = torch.arange(64, dtype=torch.float32).reshape(4, 16).to(torch.bfloat16)
    s = src.shard({"t": g}, rank) if rank in src.ranks else {}
    d = dst.allocate(rank) if rank in dst.ranks else {}
    timeout = TIMEOUT if how == "dies" else 3.0
    refit(s, d, src, dst, timeout=timeout)  # warm: every connection made
    exact = all(torch.equal(t, dst.shard({"t": g}, rank)[n]) for n, t in d.items())
    if rank == LOST:
        if how == "dies":
            os._exit(3)
        time.sleep(timeout + 4)  # never comes: the others time out
        return {"exact": exact, "lost": True}
    t0 = time.perf_counter()
    try:
        refit(s, d, src, dst, timeout=timeout)
        err = None
    except Exception as e:
        err = e
    return {"exact": exact, "seconds": time.perf_counter() - t0, "error": type(err).__name__,
            "message": str(err), "connection": isinstance(err, ReshardConnectionError),
            "timeout": isinstance(err, ReshardTimeoutError)}


@pytest.mark.parametrize("how", ["dies", "never-comes"])
def test_a_lost_row_is_named_on_every_survivor(how):
    res = run_world(_world, 4, how, timeout=240, pg_timeout=60, allow_errors=True)
    for rank, r in enumerate(res):
        if rank == LOST:
            continue
        assert isinstance(r, dict), (rank, r)
        assert r["exact"], rank
        if how == "dies":  # the root saw the connection close; the others hear it from the root, at once
            assert r["connection"], (rank, r)
            assert r["seconds"] < TIMEOUT / 2, (rank, r)
            if rank != 0:  # named by the root's table, or (since the same-host lanes' setup all-gathers connect
                # every pair, session 58) by gloo closing this rank's pair with the lost one: named either way
                assert f"the row of rank {LOST}" in r["message"] or "lost the connection" in r["message"], r["message"]
        else:  # nobody can tell before the timeout: every survivor raises at it, named (a survivor may see
            # another's connection close first, as gloo drops a pair that timed out: their deadlines are the same)
            assert r["timeout"] or r["connection"], (rank, r)
            assert r["seconds"] < 3.0 + 3.0, (rank, r)
        assert "plan handshake" in r["message"], r["message"]
