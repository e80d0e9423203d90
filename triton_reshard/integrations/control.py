"""A minimal control plane over a TCP store, for examples and tests without Ray or an HTTP server.

In a deployment the trainer reaches the engine's workers through the engine's own control plane (the RLHF HTTP
routes, Ray actors, ``LLM.collective_rpc``): a ``VLLMWeightSyncClient``. Here :class:`StoreClient` is such a
client, and :func:`serve` is the engine worker's side: the trainer posts a call, every worker runs it and
acknowledges, the client waits for all (errors come back with the worker's traceback).
"""

from __future__ import annotations

import pickle
import traceback
from collections.abc import Callable, Mapping
from datetime import timedelta

import torch.distributed as dist


class StoreClient:
    """The trainer-side ``VLLMWeightSyncClient``: each call runs on every engine worker and waits for all."""

    def __init__(self, host: str, port: int, workers: int, timeout: float = 300.0):
        self.store = dist.TCPStore(host, port, None, False, timeout=timedelta(seconds=timeout))
        self.workers, self.timeout, self.n = workers, timeout, 0

    def _call(self, method: str, payload=None) -> None:
        n, self.n = self.n, self.n + 1
        self.store.set(f"cmd/{n}", pickle.dumps((method, payload)))
        keys = [f"ack/{n}/{w}" for w in range(self.workers)]
        self.store.wait(keys, timedelta(seconds=self.timeout))
        errors = [e for e in (pickle.loads(self.store.get(k)) for k in keys) if e]
        if errors:
            raise RuntimeError(f"engine workers failed {method}: {errors[0]}")

    def call(self, method: str, payload=None) -> None:
        """Run ``method`` on every worker (any handler name ``serve`` knows, e.g. SGLang's update API)."""
        self._call(method, payload)

    def init_weight_transfer_engine(self, init_info) -> None:
        self._call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info) -> None:
        self._call("update_weights", update_info)

    def finish_weight_update(self, weight_version=None) -> None:
        self._call("finish_weight_update", weight_version)

    def stop(self) -> None:
        """Let every worker's :func:`serve` return."""
        self._call("stop")


class SGLangStoreClient(StoreClient):
    """The trainer's handle on an SGLang engine's weight-update API (what ``sglang.Engine`` offers), over the
    store: each call runs on every engine rank (``serve`` with handlers of these names)."""

    def begin_weight_update(self) -> None:
        self._call("begin_weight_update")

    def update_weights_from_tensor(self, named_tensors, load_format=None) -> None:
        self._call("update_weights_from_tensor", {"named_tensors": named_tensors, "load_format": load_format})

    def end_weight_update(self) -> None:
        self._call("end_weight_update")


def serve(host: str, port: int, worker: int, handlers: Mapping[str, Callable], timeout: float = 300.0) -> int:
    """An engine worker's loop: run each posted call (``handlers[method](payload)``), acknowledge it, until
    ``stop``; returns the number of calls."""
    store = dist.TCPStore(host, port, None, False, timeout=timedelta(seconds=timeout))
    n = 0
    while True:
        store.wait([f"cmd/{n}"], timedelta(seconds=timeout))
        method, payload = pickle.loads(store.get(f"cmd/{n}"))
        err = ""
        if method != "stop":
            try:
                handlers[method](payload)
            except BaseException as e:  # noqa: BLE001 (sent back to the trainer)
                err = f"worker {worker}: {type(e).__name__}: {e}\n{traceback.format_exc()}"
        store.set(f"ack/{n}/{worker}", pickle.dumps(err))
        n += 1
        if method == "stop":
            return n


def host_store(host: str, port: int, timeout: float = 300.0):
    """The store both sides connect to (keep the returned object alive while they run)."""
    return dist.TCPStore(host, port, None, True, timeout=timedelta(seconds=timeout), wait_for_workers=False)
