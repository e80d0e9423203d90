"""A minimal control plane over an authenticated store, for examples and tests without Ray or an HTTP server.

In a deployment the trainer reaches the engine's workers through the engine's own control plane (the RLHF HTTP
routes, Ray actors, ``LLM.collective_rpc``): a ``VLLMWeightSyncClient``. Here :class:`StoreClient` is such a
client, and :func:`serve` is the engine worker's side: the trainer posts a call, every worker runs it and
acknowledges, the client waits for all (errors come back with the worker's traceback).

The store is :class:`~triton_reshard.comm.auth.AuthStoreServer` (:func:`host_store`): every party proves the
secret (``secret=``, or ``TRITON_RESHARD_SECRET`` / ``TRITON_RESHARD_SECRET_FILE``) before it can post or read
a call, and the calls are data-only JSON (:mod:`triton_reshard.comm.wire`), so a stranger can neither run a handler
nor plant code. Without a secret the control plane runs on loopback hosts only (or with ``insecure=True``).
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable, Mapping
from datetime import timedelta

from ..comm import wire
from ..comm.auth import AuthStore, AuthStoreServer
from ..comm.secret import group_key, resolve_secret
from .engine import message_tensors, tensor_message

# The calls the clients below post (the last three: SGLang's). A worker runs only the methods it was given
# handlers for (and "stop"): any other name is refused by name before anything runs.
METHODS = ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update", "stop",
           "begin_weight_update", "update_weights_from_tensor", "end_weight_update")


def _key(host: str, secret, insecure, where: str) -> bytes:
    return group_key(host, resolve_secret(secret, where=where), insecure, where=where)


def _connect(host: str, port: int, timeout: float, secret, insecure, where: str) -> AuthStore:
    return AuthStore(host, port, _key(host, secret, insecure, where), timedelta(seconds=timeout))


class StoreClient:
    """The trainer-side ``VLLMWeightSyncClient``: each call runs on every engine worker and waits for all."""

    def __init__(self, host: str, port: int, workers: int, timeout: float = 300.0, *,
                 secret: bytes | str | None = None, insecure: bool | None = None):
        self.store = _connect(host, port, timeout, secret, insecure, "control StoreClient")
        self.workers, self.timeout, self.n = workers, timeout, 0
        self._lock = threading.Lock()  # one call at a time: the workers run the calls in their order

    def _call(self, method: str, payload=None) -> None:
        with self._lock:
            self._call_locked(method, payload)

    def _call_locked(self, method: str, payload) -> None:
        n, self.n = self.n, self.n + 1
        self.store.set(f"cmd/{n}", wire.dumps({"method": method, "payload": payload}))
        keys = [f"ack/{n}/{w}" for w in range(self.workers)]
        self.store.wait(keys, timedelta(seconds=self.timeout))
        errors = []
        for w, raw in enumerate(self.store.multi_get(keys)):
            err = wire.loads(raw, f"engine worker {w}'s acknowledgement of call {n} ({method})")
            if not isinstance(err, str):
                raise wire.WireError(f"engine worker {w}'s acknowledgement of call {n} ({method}): expected an "
                                     f"error string, got {type(err).__name__}")
            if err:
                errors.append(err)
        if errors:
            others = "".join(f"\n(also {e.splitlines()[0]})" for e in errors[1:])  # each other worker's reason, one line
            raise RuntimeError(f"engine workers failed {method}: {errors[0]}{others}")

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
    store: each call runs on every engine rank (``serve`` with handlers of these names). The only tensor our
    plug-in passes SGLang is its JSON control message (the kit's :func:`~.engine.message_tensors`, as
    ``integrations.sglang.encode_control`` makes it): it travels here as that JSON with its tensor's name
    (data only), and the engine side rebuilds the tensor (:func:`sglang_update_kwargs`)."""

    def begin_weight_update(self) -> None:
        self._call("begin_weight_update")

    def update_weights_from_tensor(self, named_tensors, load_format=None) -> None:
        name, msg = tensor_message(named_tensors, what="SGLangStoreClient.update_weights_from_tensor")
        self._call("update_weights_from_tensor", {"name": name, "control": msg, "load_format": load_format})

    def end_weight_update(self) -> None:
        self._call("end_weight_update")


def sglang_update_kwargs(payload) -> dict:
    """An engine rank's side of :meth:`SGLangStoreClient.update_weights_from_tensor`: the keyword arguments of
    SGLang's own ``update_weights_from_tensor`` (the control message back as the plug-in's named tensor)."""
    return {"named_tensors": message_tensors(str(payload["name"]), payload["control"]),
            "load_format": payload["load_format"]}


def _command(raw: bytes, n: int, worker: int, known: tuple[str, ...]) -> tuple[str, object]:
    what = f"worker {worker}: control call {n}"
    msg = wire.loads(raw, what)
    if not isinstance(msg, dict) or set(msg) != {"method", "payload"}:
        raise wire.WireError(f"{what}: expected an object with fields 'method' and 'payload', got "
                             f"{sorted(msg) if isinstance(msg, dict) else type(msg).__name__}")
    if not isinstance(msg["method"], str) or msg["method"] not in known:
        raise wire.WireError(f"{what}.method: {msg['method']!r} is not one of {list(known)}")
    return msg["method"], msg["payload"]


def serve(host: str, port: int, worker: int, handlers: Mapping[str, Callable], timeout: float = 300.0, *,
          secret: bytes | str | None = None, insecure: bool | None = None) -> int:
    """An engine worker's loop: run each posted call (``handlers[method](payload)``), acknowledge it, until
    ``stop``; returns the number of calls. ``handlers`` may name any methods (the standard ones are
    :data:`METHODS`); a call that does not match the schema or names a method without a handler is an error."""
    known = tuple(dict.fromkeys([*handlers, "stop"]))
    store = _connect(host, port, timeout, secret, insecure, f"control serve (worker {worker})")
    n = 0
    try:
        while True:
            store.wait([f"cmd/{n}"], timedelta(seconds=timeout))
            method, payload = _command(store.get(f"cmd/{n}"), n, worker, known)
            err = ""
            if method != "stop":
                try:
                    handlers[method](payload)
                except BaseException as e:  # noqa: BLE001 (sent back to the trainer)
                    err = f"worker {worker}: {type(e).__name__}: {e}\n{traceback.format_exc()}"
            store.set(f"ack/{n}/{worker}", wire.dumps(err))
            n += 1
            if method == "stop":
                return n
    finally:
        store.close()


def host_store(host: str, port: int, timeout: float = 300.0, *, secret: bytes | str | None = None,
               insecure: bool | None = None) -> AuthStoreServer:
    """The store both sides connect to (keep the returned object alive while they run; ``close()`` it
    after). ``timeout`` is accepted for compatibility: each client bounds its own waits."""
    del timeout
    return AuthStoreServer(host, port, _key(host, secret, insecure, "control host_store"))
