"""The minimal control plane (``integrations/control.py``) over loopback: every worker runs each call; a
failure names every failing worker, and calls from several threads of one client stay in order."""

from __future__ import annotations

import threading

import pytest

from triton_reshard.comm.group import free_port
from triton_reshard.integrations.control import StoreClient, host_store, serve


def _workers(port: int, n: int, handlers_of) -> list[threading.Thread]:
    ts = [threading.Thread(target=serve, args=("127.0.0.1", port, w, handlers_of(w)), kwargs={"timeout": 30},
                           daemon=True) for w in range(n)]
    for t in ts:
        t.start()
    return ts


def test_a_failure_names_every_failing_worker():
    port = free_port()
    store = host_store("127.0.0.1", port)
    try:
        def handlers_of(w):
            def fail(_payload):
                raise ValueError(f"worker {w} says no")
            return {"start_weight_update": fail}

        ts = _workers(port, 3, handlers_of)
        client = StoreClient("127.0.0.1", port, 3, timeout=30)
        with pytest.raises(RuntimeError) as info:
            client.start_weight_update()
        msg = str(info.value)
        assert msg.startswith("engine workers failed start_weight_update: worker 0: ValueError: worker 0 says no")
        assert "(also worker 1: ValueError: worker 1 says no)" in msg
        assert "(also worker 2: ValueError: worker 2 says no)" in msg
        client.stop()
        for t in ts:
            t.join(30)
    finally:
        store.close()


def test_calls_from_several_threads_run_in_one_order_on_every_worker():
    port = free_port()
    store = host_store("127.0.0.1", port)
    seen: dict[int, list] = {0: [], 1: []}
    try:
        ts = _workers(port, 2, lambda w: {"update_weights": seen[w].append})
        client = StoreClient("127.0.0.1", port, 2, timeout=30)
        callers = [threading.Thread(target=lambda k=k: [client.update_weights([k, i]) for i in range(20)])
                   for k in range(4)]
        for c in callers:
            c.start()
        for c in callers:
            c.join(60)
        client.stop()
        for t in ts:
            t.join(30)
        assert len(seen[0]) == 80 and seen[0] == seen[1]
        for k in range(4):  # each caller's calls in its own order
            assert [p[1] for p in seen[0] if p[0] == k] == list(range(20))
    finally:
        store.close()
