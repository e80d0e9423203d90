"""A stranger at a refit group's (or control plane's) port: what a process on the network without the secret
would try. Used by the security tests, in threads or as its own process (``python -m tests.strangers HOST
PORT WORLD RANKS OUT``: the outcome as JSON in OUT).

It sends crafted bytes (a pickle that would create a file, truncated JSON, huge length prefixes, random
bytes, a valid hello with a forged proof, torch's TCPStore protocol) and tries to join as each of ``ranks``
with a wrong secret and with none. Every attempt must be refused: the server closes the connection, the
join raises, and the pickle's file never appears.
"""

from __future__ import annotations

import json
import os
import pickle
import secrets
import socket
import struct
import sys
import tempfile
import time
from datetime import timedelta

EVIDENCE = os.path.join(tempfile.gettempdir(), f"triton_reshard_pwned_{os.getuid()}")


class _Evil:
    def __reduce__(self):
        return (open, (EVIDENCE, "w"))


def payloads() -> dict[str, bytes]:
    from triton_reshard.comm.auth import MAGIC

    evil = pickle.dumps(_Evil())
    return {
        "pickle": evil,
        "length+pickle": struct.pack(">I", len(evil)) + evil,
        "truncated-json": b'{"$": "Layout", "v": {"format": "triton_reshard.layout/1", "tensors": [[',
        "huge-length": struct.pack(">I", 0xFFFFFFF0) + b"x" * 64,
        "huge-length-after-hello": MAGIC + secrets.token_bytes(40) + struct.pack(">I", 0xFFFFFFF0),
        "random": secrets.token_bytes(4096),
        "hello-forged-proof": MAGIC + secrets.token_bytes(32) + struct.pack(">II", 1, 4) + secrets.token_bytes(32)
        + struct.pack(">I", len(evil)) + evil + secrets.token_bytes(32),
        "tcpstore-set": b"\x00" + struct.pack("<Q", 8) + b"tr/ws/1\x00" + struct.pack("<Q", 1) + b"4",
    }


def _knock(host: str, port: int, data: bytes, wait: float = 12.0) -> str:
    """Send ``data``; ``"closed"`` if the server then closed the connection (what it must do), else what
    happened."""
    if len(data) < 128:  # a complete hello and proof's worth: the server answers at once, not at its timeout
        data += secrets.token_bytes(128 - len(data))
    try:
        with socket.create_connection((host, port), timeout=5) as s:
            try:
                s.sendall(data)
            except OSError:
                return "closed"
            s.settimeout(wait)
            got = b""
            t0 = time.monotonic()
            while time.monotonic() - t0 < wait:
                try:
                    chunk = s.recv(4096)
                except (ConnectionResetError, BrokenPipeError):
                    return "closed"
                except TimeoutError:
                    return f"still open after {wait:g}s (got {len(got)} bytes)"
                if not chunk:
                    return "closed"
                got += chunk
            return f"still open after {wait:g}s (got {len(got)} bytes)"
    except OSError as e:
        return f"connect failed: {e}"


def knock_all(host: str, port: int, world: int, ranks, out: dict, name: str = "stranger",
              timeout: float = 8.0, port_wait: float = 60.0) -> dict:
    """Every crafted payload, then a join as each of ``ranks`` with a wrong secret and with none; the outcome
    in ``out[name]`` (``{"knocks": {payload: result}, "joins": {what: error text or "JOINED"}}``)."""
    from triton_reshard import RefitGroupError, init_refit_group
    from triton_reshard.comm.auth import NO_SECRET_KEY
    from triton_reshard.comm.group import connect_member

    res: dict = {"knocks": {}, "joins": {}}
    _wait_open(host, port, port_wait)
    for what, data in payloads().items():
        res["knocks"][what] = _knock(host, port, data)
    for rank in ranks:
        for label, secret in (("wrong", secrets.token_bytes(32)), ("none", None)):
            t0 = time.monotonic()
            try:
                if secret is not None and rank != 0:
                    init_refit_group(host, port, rank, world, secret=secret, timeout=timeout).destroy()
                else:  # a client claiming rank 0 (init_refit_group would try to serve it), or without a secret
                    # as init_refit_group runs it (the environment may hold the test's own secret)
                    connect_member(host, port, secret or NO_SECRET_KEY, timedelta(seconds=timeout), rank, world,
                             time.monotonic() + timeout, f"{host}:{port}").close()
                res["joins"][f"rank {rank} {label}"] = "JOINED"
            except RefitGroupError as e:
                res["joins"][f"rank {rank} {label}"] = f"{time.monotonic() - t0:.1f}s: {e}"
    return _finish(res, host, port, out, name)


def _wait_open(host: str, port: int, wait: float) -> None:
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)


def knock_control(host: str, port: int, out: dict, name: str = "control", port_wait: float = 60.0) -> dict:
    """The control plane's store: crafted bytes, and a client with a wrong secret and with none."""
    from triton_reshard.comm.auth import NO_SECRET_KEY, AuthError, AuthStore

    _wait_open(host, port, port_wait)
    res: dict = {"knocks": {w: _knock(host, port, d) for w, d in payloads().items()}, "joins": {}}
    for label, key in (("wrong", secrets.token_bytes(32)), ("none", NO_SECRET_KEY)):
        t0 = time.monotonic()
        try:
            AuthStore(host, port, key, timedelta(seconds=5)).close()
            res["joins"][f"client {label}"] = "JOINED"
        except AuthError as e:
            res["joins"][f"client {label}"] = f"{time.monotonic() - t0:.1f}s: refused to join: {e}"
    return _finish(res, host, port, out, name)


def _finish(res: dict, host: str, port: int, out: dict, name: str) -> dict:
    """Last, torch's TCPStore client; then whether the pickle ran; the outcome into ``out[name]``."""
    res["tcpstore"] = _tcpstore(host, port)
    res["evidence"] = os.path.exists(EVIDENCE)
    out[name] = res
    return res


def _tcpstore(host: str, port: int) -> str:
    """torch's own TCPStore client against the port (it must not get in)."""
    import torch.distributed as dist

    try:
        s = dist.TCPStore(host, port, None, False, timeout=timedelta(seconds=3))
        s.set("tr/rank/1", "1")
        return "WROTE"
    except Exception as e:  # noqa: BLE001 (the outcome is reported)
        return f"refused: {type(e).__name__}"


def assert_refused(res: dict) -> None:
    """Every attempt of :func:`knock_all` was refused, within its timeout, and nothing ran."""
    assert res, "the stranger did not run"
    bad = {k: v for k, v in res["knocks"].items() if v != "closed"}
    assert not bad, f"the server did not close on crafted bytes: {bad}"
    for what, err in res["joins"].items():
        assert err != "JOINED", f"a stranger joined ({what})"
        assert "refused to join" in err and ("did not prove the group's secret" in err or "refused" in err), \
            f"{what}: {err}"
        assert float(err.split("s:", 1)[0]) < 12, f"{what}: not refused within the timeout: {err}"
    assert res["tcpstore"] != "WROTE", "torch's TCPStore client wrote a key"
    assert not res["evidence"] and not os.path.exists(EVIDENCE), "the pickle ran: its file exists"


if __name__ == "__main__":
    host, port, world, ranks, path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    out: dict = {}
    import triton_reshard.comm.group  # noqa: F401  (imports done: the stranger is ready)

    open(path + ".ready", "w").close()
    knock_all(host, port, world, [int(r) for r in ranks.split(",")], out)
    with open(path, "w") as f:
        json.dump(out["stranger"], f)
