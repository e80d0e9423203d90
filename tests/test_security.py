"""Security of the refit path (issue 19): secrets, strangers, data-only messages.

Real sockets on loopback. The legit ranks of a refit group live in threads of this process (as in
test_refit_group); a stranger without the secret runs as a separate process (``tests/strangers.py``) or in a
thread: crafted bytes at the port (a pickle that would create a file, truncated JSON, huge length prefixes,
random bytes, a forged handshake, torch's TCPStore protocol) and joins claiming a trainer rank and an engine
rank with a wrong secret and with none, before and after the legit ranks. Every one is refused within its
timeout, takes no rank, writes nothing; the legit exchanges and the refit complete bit-exactly into poisoned
destinations. A member never joins a fake rank 0; a member's malformed message is a clear error naming the
rank and field; the control plane is held to the same rules.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch

from tests import strangers
from triton_reshard import RefitGroupError, init_refit_group, refit
from triton_reshard.comm import wire
from triton_reshard.comm.auth import AuthError, AuthStore, AuthStoreServer, resolve_secret
from triton_reshard.comm.group import free_port
from triton_reshard.integrations import control
from triton_reshard.layout import BlockQuant, Fragment, Layout, Replicate, Shard, TensorSpec

SECRET = b"s" * 8 + os.urandom(24)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _no_env_secret(monkeypatch):
    for k in ("TRITON_RESHARD_SECRET", "TRITON_RESHARD_SECRET_FILE", "TRITON_RESHARD_INSECURE"):
        monkeypatch.delenv(k, raising=False)
    if os.path.exists(strangers.EVIDENCE):
        os.remove(strangers.EVIDENCE)


# --------------------------------------------------------------------------------------------------------
# secrets and addresses (no group)
# --------------------------------------------------------------------------------------------------------

def test_secret_from_argument_env_and_file(tmp_path, monkeypatch):
    assert resolve_secret() is None
    assert resolve_secret("x" * 16) == b"x" * 16 and resolve_secret(b"\0" * 32) == b"\0" * 32
    monkeypatch.setenv("TRITON_RESHARD_SECRET", "e" * 20)
    assert resolve_secret() == b"e" * 20
    assert resolve_secret(SECRET) == SECRET  # the argument wins
    f = tmp_path / "secret"
    f.write_text("f" * 40 + "\n")
    f.chmod(0o600)
    monkeypatch.setenv("TRITON_RESHARD_SECRET_FILE", str(f))
    with pytest.raises(ValueError, match="both TRITON_RESHARD_SECRET and TRITON_RESHARD_SECRET_FILE"):
        resolve_secret()
    monkeypatch.delenv("TRITON_RESHARD_SECRET")
    assert resolve_secret() == b"f" * 40
    monkeypatch.setenv("TRITON_RESHARD_SECRET_FILE", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="cannot read the secret file"):
        resolve_secret()


@pytest.mark.parametrize("bad", ["", "short", b"15-bytes-secret"])
def test_empty_or_short_secrets_are_refused(bad, monkeypatch):
    with pytest.raises(ValueError, match=r"is \d+ bytes; use at least 16"):
        init_refit_group("127.0.0.1", 1234, 0, 1, secret=bad)
    monkeypatch.setenv("TRITON_RESHARD_SECRET", bad if isinstance(bad, str) else bad.decode())
    with pytest.raises(ValueError, match=r"TRITON_RESHARD_SECRET\) is \d+ bytes"):
        init_refit_group("127.0.0.1", 1234, 0, 1)
    with pytest.raises(TypeError, match="bytes or str"):
        init_refit_group("127.0.0.1", 1234, 0, 1, secret=12345678901234567)


def _routable() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: picks the outgoing interface
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


def test_a_routable_address_needs_a_secret_or_an_explicit_opt_in(monkeypatch):
    host = _routable() or "10.255.255.1"
    with pytest.raises(ValueError, match=r"is not a loopback address and no secret is set.*insecure=True"):
        init_refit_group(host, free_port(), 0, 1, timeout=2)
    for opt in ({"insecure": True}, {"secret": SECRET}):
        try:  # past the check: it opens (this machine's address) or fails to bind (not ours), never refuses
            init_refit_group(host, free_port(), 0, 1, timeout=2, **opt).destroy()
        except RefitGroupError as e:
            assert "cannot open" in str(e)
    for every in ("0.0.0.0", "::", "[::]", "", "0"):  # every interface: not loopback
        with pytest.raises(ValueError, match="not a loopback"):
            init_refit_group(every, free_port(), 0, 1, timeout=2)
    monkeypatch.setenv("TRITON_RESHARD_INSECURE", "1")
    try:
        init_refit_group(host, free_port(), 0, 1, timeout=2).destroy()
    except RefitGroupError as e:
        assert "cannot open" in str(e)
    with pytest.raises(ValueError, match="not a loopback"):
        init_refit_group(host, free_port(), 0, 1, timeout=2, insecure=False)  # the parameter wins
    for loop in ("127.0.0.1", "localhost", "127.3.4.5"):  # loopback: no secret needed
        init_refit_group(loop, free_port(loop if loop != "localhost" else "127.0.0.1"), 0, 1, timeout=5).destroy()


# --------------------------------------------------------------------------------------------------------
# data-only messages
# --------------------------------------------------------------------------------------------------------

def _layouts() -> list[Layout]:
    from triton_reshard.presets import get_config, megatron_layout, vllm_layout

    cfg = get_config("tiny_qwen3")
    shapes = {"a": (7, 5), "b": (33,), "c": (2, 3, 4)}
    dts = {"a": torch.bfloat16, "b": torch.int8, "c": torch.float16}
    eager = Layout.from_placements(shapes, [[0, 1], [2, 3]], {"a": [Shard(0), Shard(1)], "b": [Replicate(), Shard(0)],
                                                              "c": [Shard(2), Replicate()]}, dts)
    stacked = Layout.from_fragments({"e0": ((4, 3), torch.float32), "e1": ((4, 3), torch.float32)},
                                    [Fragment("e0", 0, (0, 0), (4, 3), "experts", (0, 0, 0)),
                                     Fragment("e1", 0, (0, 0), (4, 3), "experts", (1, 0, 0))])
    out = [eager, stacked, megatron_layout(cfg, tp=2, ranks=range(2), dtype=torch.float32),
           vllm_layout(cfg, tp=2, dp=1, ranks=range(2, 4), dtype=torch.bfloat16)]
    spec = TensorSpec("w", (256, 384), torch.float8_e4m3fn, BlockQuant((128, 128), "w_scale", True))
    out.append(Layout.from_fragments([spec, TensorSpec("w_scale", spec.scale_shape, torch.float32)],
                                     [Fragment("w", 0, (0, 0), (128, 384)), Fragment("w", 1, (128, 0), (128, 384)),
                                      Fragment("w_scale", 0, (0, 0), (1, 3)), Fragment("w_scale", 1, (1, 0), (1, 3))]))
    return out


def test_layouts_round_trip_through_json(tmp_path):
    from triton_reshard.layout import ColumnarLayout

    lays = _layouts()
    assert any(isinstance(x, ColumnarLayout) for x in lays) and any(x.quantized for x in lays)
    for lay in lays:
        back = wire.loads(wire.dumps({"layout": lay, "part": (lay,)}))
        assert back["layout"] == lay and back["layout"].digest == lay.digest
        assert type(back["layout"]) is type(lay) and isinstance(back["part"], tuple)
        path = tmp_path / "l.json"
        wire.save_layout(lay, path)
        assert wire.load_layout(path) == lay
    x = {"t": (1, 2.5, None, "s", True), "d": torch.bfloat16, 3: [float("nan"), -float("inf")], "$": 1,
         "f": Fragment("a", 1, (0,), (3,), "la", (2,))}
    y = wire.loads(wire.dumps(x))
    assert y["t"] == x["t"] and y["d"] is torch.bfloat16 and y["$"] == 1 and y["f"] == x["f"]
    assert torch.isnan(torch.tensor(y[3][0])) and y[3][1] == -float("inf")
    with pytest.raises(TypeError, match="cannot send a Tensor"):
        wire.dumps(torch.ones(2))
    from triton_reshard.integrations.record import LoadRecord

    rec = LoadRecord(3, {"w": ((4, 6), torch.float8_e4m3fn), "w_s": ((1, 1), torch.float32)},
                     {"p": ((2, 6), torch.float8_e4m3fn)}, [Fragment("w", 3, (2, 0), (2, 6), "p", (0, 0))],
                     ["p: a fill"], ["q"], ["z"], 2, {"w": BlockQuant((128, 128), "w_s")})
    back = wire.loads(wire.dumps([rec, None]))
    assert back == [rec, None] and back[0].quant["w"].block == (128, 128)


def test_malformed_layouts_and_messages_are_named():
    good = wire.layout_to_dict(_layouts()[0])

    def bad(fn):
        d = json.loads(json.dumps(good))
        fn(d)
        return json.dumps({"$": "Layout", "v": d}).encode()

    cases = {
        "fragments[0][1] (rank)": bad(lambda d: d["fragments"][0].__setitem__(1, -1)),
        "tensors[0][2] (dtype)": bad(lambda d: d["tensors"][0].__setitem__(2, "os.system")),
        "fragments[0][0] (tensor)": bad(lambda d: d["fragments"][0].__setitem__(0, 99)),
        "unknown fields ['evil']": bad(lambda d: d.__setitem__("evil", 1)),
        "digest": bad(lambda d: d.__setitem__("digest", "0" * 16)),
        "tensor 'a' on rank 1 is out of bounds": bad(lambda d: d["fragments"][1].__setitem__(3, [10**6, 1])),
    }
    for field, raw in cases.items():
        with pytest.raises(wire.WireError, match=r"rank 3's thing") as e:
            wire.loads(raw, "rank 3's thing")
        assert field in str(e.value), (field, str(e.value))
    for raw, what in ((b'{"$": "Layout", "v": {', "not a data-only JSON"), (b"\x80\x04K\x01.", "not a data-only"),
                      (b"[" * 100000 + b"]" * 100000, "rank 3's thing"), (b"NaN", "not a data-only"),
                      (b'{"$": "pickle", "v": "x"}', "unknown type tag 'pickle'")):
        with pytest.raises(wire.WireError, match=what):
            wire.loads(raw, "rank 3's thing")


def test_registered_codecs_only():
    """A type outside the control plane crosses only through the codec its own module registers
    (``LoadRecord`` does, in ``integrations/record``): a registered tag round-trips and is checked field by
    field, an unregistered object is refused by name on send, a built-in tag cannot be taken over."""
    from triton_reshard.integrations.record import LoadRecord

    rec = LoadRecord(rank=2, tensors={"w": ((4, 6), torch.bfloat16)}, locals={"w": ((2, 6), torch.bfloat16)},
                     fragments=[Fragment("w", 2, (0, 0), (2, 6), "w")], problems=[], uncovered=[], unused=["x"],
                     fills=1, quant={})
    back = wire.loads(wire.dumps({"r": rec}))["r"]
    assert isinstance(back, LoadRecord) and back == rec
    raw = json.loads(wire.dumps(rec))
    raw["v"]["fills"] = -1
    with pytest.raises(wire.WireError, match=r"<LoadRecord>\.fills"):
        wire.loads(json.dumps(raw).encode())

    class Stranger:
        pass

    with pytest.raises(TypeError, match="cannot send a Stranger .*LoadRecord"):
        wire.dumps(Stranger())
    with pytest.raises(ValueError, match="'Layout' is already taken"):
        wire.register_codec("Layout", Stranger, lambda x: 0, lambda v, p: Stranger())
    with pytest.raises(ValueError, match="'LoadRecord' is already taken"):
        wire.register_codec("LoadRecord", Stranger, lambda x: 0, lambda v, p: Stranger())


# --------------------------------------------------------------------------------------------------------
# a group with strangers
# --------------------------------------------------------------------------------------------------------

W = 4  # refit ranks: trainer 0-1, engine 2-3
SHAPES = {"w": (13, 6), "b": (9,)}


def _refit_layouts():
    src = Layout.from_placements(SHAPES, [0, 1], {"w": [Shard(0)], "b": [Replicate()]})
    dst = Layout.from_placements(SHAPES, [2, 3], {"w": [Shard(1)], "b": [Shard(0)]})
    return src, dst


def _member(rank: int, port: int, out: dict, release: threading.Event, rounds: int = 3) -> None:
    """One legit rank: joins, then ``rounds`` times exchanges objects and refits into poisoned buffers;
    keeps the group (and rank 0 its rendezvous) until ``release``."""
    try:
        g = init_refit_group("127.0.0.1", port, rank, W, secret=SECRET, timeout=40)
        try:
            src_l, dst_l = _refit_layouts()
            res = {"exact": [], "size": g.size}
            for k in range(rounds):
                g_ = torch.Generator().manual_seed(k)
                full = {n: torch.randn(s, generator=g_) for n, s in SHAPES.items()}
                res["objs"] = g.all_gather_object({"rank": rank, "layout": src_l if rank == 0 else None})
                res["recs"] = g.all_gather_object((rank, [rank] * rank))
                src = src_l.shard(full, rank) if rank < 2 else {}
                dst = dst_l.allocate(rank, fill=float("nan")) if rank >= 2 else {}
                refit(src, dst, src_l, dst_l, group=g, timeout=40)
                res["exact"].append(all(torch.equal(t, dst_l.shard(full, rank)[n]) for n, t in dst.items()))
                time.sleep(0.5)
            out[rank] = res
            release.wait(90)
        finally:
            g.destroy()
    except BaseException as e:  # noqa: BLE001 (asserted by the test)
        out[rank] = e


def _check_members(out: dict) -> None:
    src_l, _ = _refit_layouts()
    for r in range(W):
        assert not isinstance(out.get(r), BaseException) and r in out, f"rank {r}: {out.get(r)}"
        assert out[r]["exact"] == [True] * 3 and out[r]["size"] == W
        assert out[r]["objs"] == [{"rank": i, "layout": src_l if i == 0 else None} for i in range(W)]
        assert out[r]["recs"] == [(i, [i] * i) for i in range(W)]


def _stranger_process(port: int, ranks: str, path: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITON_RESHARD_")}
    env["PYTHONPATH"] = ROOT
    return subprocess.Popen([sys.executable, "-m", "tests.strangers", "127.0.0.1", str(port), str(W), ranks, path],
                            cwd=ROOT, env=env)


@pytest.mark.slow
def test_strangers_before_and_after_the_members_are_refused(tmp_path):
    """A stranger process arrives first (it waits for the port to open: rank 0 comes 1 s later) and claims a
    trainer rank (1) and an engine rank (2); a stranger thread knocks after the members have formed the
    group and while they exchange objects and refit."""
    port = free_port()
    path = str(tmp_path / "before.json")
    before = _stranger_process(port, "1,2", path)
    t0 = time.monotonic()
    while not os.path.exists(path + ".ready") and time.monotonic() - t0 < 60:
        time.sleep(0.1)
    out: dict = {}
    release = threading.Event()
    ts = [threading.Thread(target=_member, args=(r, port, out, release)) for r in range(W)]
    ts[0].start()
    time.sleep(1.5)  # the stranger claims ranks 1 and 2 before the members 1-3 arrive
    for t in ts[1:]:
        t.start()
    while len(out) < W and any(t.is_alive() for t in ts):  # the group is formed and exchanging
        time.sleep(0.05)
        if out:
            break
    after: dict = {}
    strangers.knock_all("127.0.0.1", port, W, [0, 3], after, "after")
    before.wait(60)
    release.set()
    for t in ts:
        t.join(60)
    _check_members(out)
    with open(tmp_path / "before.json") as f:
        strangers.assert_refused(json.load(f))
    strangers.assert_refused(after["after"])


def test_a_member_never_joins_a_fake_rank_0():
    """Something else listens on the port first: our store with another secret, a server that answers
    random bytes, torch's TCPStore. Rank 1 refuses each within its timeout, and rank 0 cannot open."""
    for kind in ("wrong-secret", "random", "tcpstore"):
        port = free_port()
        stop = threading.Event()
        if kind == "wrong-secret":
            fake = AuthStoreServer("127.0.0.1", port, os.urandom(32))
        elif kind == "tcpstore":
            import torch.distributed as dist

            fake = dist.TCPStore("127.0.0.1", port, None, True, timeout=timedelta(seconds=5), wait_for_workers=False)
        else:
            lsock = socket.socket()
            lsock.bind(("127.0.0.1", port))
            lsock.listen()

            def answer(lsock=lsock, stop=stop):
                while not stop.is_set():
                    try:
                        c, _ = lsock.accept()
                    except OSError:
                        return
                    c.sendall(os.urandom(88) + os.urandom(64))
            threading.Thread(target=answer, daemon=True).start()
        t0 = time.monotonic()
        with pytest.raises(RefitGroupError, match=r"rank 1 refused to join the refit group at .*:"
                                                  r".*(did not prove the group's secret|handshake)"):
            init_refit_group("127.0.0.1", port, 1, 2, secret=SECRET, timeout=5)
        assert time.monotonic() - t0 < 8, kind
        with pytest.raises(RefitGroupError, match="rank 0 cannot open"):
            init_refit_group("127.0.0.1", port, 0, 2, secret=SECRET, timeout=5)
        stop.set()
        if kind == "wrong-secret":
            fake.close()
        elif kind == "random":
            lsock.close()


def test_a_members_malformed_message_is_named_and_nothing_runs():
    """A process holding the secret is trusted to be a member, not to send well-formed data: rank 1 writes
    crafted bytes under its all_gather_object key; rank 0 raises naming rank 1 and the field, and the
    pickle never runs."""
    import pickle

    port = free_port()
    evil = pickle.dumps(strangers._Evil())
    junk = [evil, b'{"$": "Layout", "v": {"format"', b'{"$": "tuple", "v": 5}', os.urandom(64),
            json.dumps({"$": "Layout", "v": {**wire.layout_to_dict(_layouts()[0]), "locals": [[0, 0, [1], "evil"]]}}).encode()]
    fields = ["not a data-only JSON", "not a data-only JSON", "<tuple>: expected a list", "not a data-only JSON",
              "locals[0][3] (dtype)"]
    groups: dict = {}

    def join(r):
        groups[r] = init_refit_group("127.0.0.1", port, r, 2, secret=SECRET, timeout=20)

    ts = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    try:
        for gen, (raw, field) in enumerate(zip(junk, fields, strict=True), start=1):
            groups[1]._store.set(f"tr/obj/{gen}/1", raw)
            with pytest.raises(RefitGroupError, match=rf"rank 0: rank 1's object in exchange {gen}") as e:
                groups[0].all_gather_object({"ok": 1})
            assert field in str(e.value), (field, str(e.value))
        assert not os.path.exists(strangers.EVIDENCE)
    finally:
        for g in groups.values():
            g.destroy()


def test_forged_replayed_and_oversized_frames_close_the_connection():
    """A man in the middle who cannot make the MAC: flip a bit, replay a frame, announce a huge frame."""
    import struct

    from triton_reshard.comm import auth

    srv = AuthStoreServer("127.0.0.1", 0, SECRET)
    try:
        for attack in ("flip", "replay", "huge"):
            s = AuthStore("127.0.0.1", srv.port, SECRET, timedelta(seconds=5))
            s.set("k", b"v")
            ch = s._ch
            body = bytes([auth.SET]) + auth._pack(b"k", b"forged")
            head = struct.pack(">I", len(body))
            tag = auth.hmac.new(ch.send_key, struct.pack(">Q", ch.send_seq) + head + body, "sha256").digest()
            if attack == "flip":
                frame = head + body[:-1] + bytes([body[-1] ^ 1]) + tag
            elif attack == "replay":
                tag0 = auth.hmac.new(ch.send_key, struct.pack(">Q", 0) + head + body, "sha256").digest()
                frame = head + body + tag0  # a MAC made for sequence number 0
            else:
                frame = struct.pack(">I", auth.MAX_FRAME + 1)
            ch.sock.sendall(frame)
            ch.sock.settimeout(5)
            assert ch.sock.recv(100) == b"", attack  # closed, no reply
            s.close()
        check = AuthStore("127.0.0.1", srv.port, SECRET, timedelta(seconds=5))
        assert check.get("k") == b"v"  # nothing forged was written
        check.close()
        with pytest.raises(AuthError, match="did not prove"):
            AuthStore("127.0.0.1", srv.port, b"w" * 32, timedelta(seconds=5))
    finally:
        srv.close()


# --------------------------------------------------------------------------------------------------------
# the control plane
# --------------------------------------------------------------------------------------------------------

def test_control_plane_needs_the_secret_and_carries_data_only():
    port = free_port()
    srv = control.host_store("127.0.0.1", port, secret=SECRET)
    calls: list = []
    done: dict = {}

    def worker():
        try:
            done["n"] = control.serve("127.0.0.1", port, 0, {
                "init_weight_transfer_engine": calls.append, "update_weights": calls.append,
                "start_weight_update": calls.append, "finish_weight_update": calls.append}, timeout=20,
                secret=SECRET)
        except BaseException as e:  # noqa: BLE001
            done["n"] = e

    t = threading.Thread(target=worker)
    t.start()
    try:
        with pytest.raises(AuthError, match="did not prove"):
            control.StoreClient("127.0.0.1", port, 1, timeout=5, secret=os.urandom(32))
        with pytest.raises(AuthError):  # no secret on loopback: the public key, refused by a secret server
            control.StoreClient("127.0.0.1", port, 1, timeout=5)
        knocks = {k: strangers._knock("127.0.0.1", port, v) for k, v in strangers.payloads().items()}
        assert set(knocks.values()) == {"closed"}, knocks
        c = control.StoreClient("127.0.0.1", port, 1, timeout=20, secret=SECRET)
        info = {"host": "127.0.0.1", "port": 1, "timeout": 2.5, "secret_env": "X", "nested": [1, (2, 3)]}
        c.init_weight_transfer_engine(info)
        c.update_weights({"version": "v1"})
        c.finish_weight_update("v1")
        c.stop()
        t.join(20)
        assert done["n"] == 4 and calls == [info, {"version": "v1"}, "v1"]
        assert not os.path.exists(strangers.EVIDENCE)
    finally:
        srv.close()
        t.join(5)


def test_control_plane_refuses_a_malformed_call():
    port = free_port()
    srv = control.host_store("127.0.0.1", port, secret=SECRET)
    try:
        poster = AuthStore("127.0.0.1", port, SECRET, timedelta(seconds=5))
        poster.set("cmd/0", wire.dumps({"method": "__import__", "payload": "os"}))
        with pytest.raises(wire.WireError,
                           match=r"worker 0: control call 0.method: '__import__' is not one of \['update_weights', 'stop'\]"):
            control.serve("127.0.0.1", port, 0, {"update_weights": print}, timeout=5, secret=SECRET)
        poster.close()
    finally:
        srv.close()


def test_control_plane_runs_a_worker_s_own_method_names_and_only_those():
    """A worker may serve methods beyond the standard ones (perf/bench_sglang.py's ``sglang_update``): a call
    naming one of its handlers runs with its JSON payload; the same name at a worker without it is refused."""
    port = free_port()
    srv = control.host_store("127.0.0.1", port, secret=SECRET)
    got = []
    try:
        client = control.StoreClient("127.0.0.1", port, workers=1, timeout=20, secret=SECRET)
        t = threading.Thread(target=lambda: control.serve("127.0.0.1", port, 0, {"sglang_update": got.append},
                                                          timeout=20, secret=SECRET))
        t.start()
        client.call("sglang_update", {"names": ["w"], "load_format": None})
        client.stop()
        t.join(20)
        assert got == [{"names": ["w"], "load_format": None}]
    finally:
        srv.close()


def test_a_flood_of_idle_connections_delays_a_member_but_does_not_stop_it(monkeypatch):
    """Strangers hold more connections open than the server takes in its handshake at once, sending nothing:
    the extra ones are closed at once, the holders at the handshake timeout; a member keeps trying until its
    own deadline and gets in."""
    from triton_reshard.comm import auth

    monkeypatch.setattr(auth, "MAX_PENDING", 4)
    monkeypatch.setattr(auth, "HANDSHAKE_TIMEOUT", 1.0)
    srv = AuthStoreServer("127.0.0.1", 0, SECRET)
    holders = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(6)]
    try:
        time.sleep(0.2)
        t0 = time.monotonic()
        s = AuthStore("127.0.0.1", srv.port, SECRET, timedelta(seconds=10))
        s.set("k", b"v")
        assert s.get("k") == b"v" and time.monotonic() - t0 < 5
        s.close()
        assert srv.refused >= 2
    finally:
        for h in holders:
            h.close()
        srv.close()


# --------------------------------------------------------------------------------------------------------
# adversarial review: malformed input from a buggy member, the secret file, the server's own errors
# --------------------------------------------------------------------------------------------------------

def test_huge_ints_are_a_named_error_not_a_crash(tmp_path):
    """An int of over 4300 digits (Python's str->int limit: a ValueError from json, not a JSONDecodeError)
    or one too big for the columnar layout's index arrays (an OverflowError) is a WireError naming the
    message and the field, like every other malformed message."""
    for raw in (b"1" * 5000, b'{"$": "tuple", "v": [' + b"9" * 5000 + b"]}"):
        with pytest.raises(wire.WireError, match="rank 3's thing: not a data-only JSON"):
            wire.loads(raw, "rank 3's thing")
    f = tmp_path / "layout.json"
    f.write_bytes(b"[" + b"7" * 5000 + b"]")
    with pytest.raises(wire.WireError, match="is not JSON"):
        wire.load_layout(f)
    good = wire.layout_to_dict(_layouts()[0])
    for where in ((1,), (2, 0), (5, 0)):  # a fragment's rank, offset, local offset
        d = json.loads(json.dumps(good))
        d["columnar"] = True
        frag = d["fragments"][0]
        if len(where) == 1:
            frag[where[0]] = 10**30
        else:
            frag[where[0]][where[1]] = 10**30
        with pytest.raises(wire.WireError, match=r"rank 3's thing<Layout>"):
            wire.loads(json.dumps({"$": "Layout", "v": d}).encode(), "rank 3's thing")


def test_a_members_malformed_request_is_an_error_reply_not_a_dead_connection():
    """The server parses an authenticated request's fields strictly: a malformed integer ("--5": it passed
    the old digit check, then int() raised in the server's thread and killed the member's connection) is an
    error reply to that member, whose connection stays usable."""
    from triton_reshard.comm import auth

    srv = AuthStoreServer("127.0.0.1", 0, SECRET)
    s = AuthStore("127.0.0.1", srv.port, SECRET, timedelta(seconds=5))
    try:
        for fields in ((b"k", b"--5"), (b"k", b"-"), (b"k", b"5-"), (b"k", "\u0663".encode())):
            with pytest.raises(RuntimeError, match="refused op 3: .*malformed integer"):
                s._call(auth.ADD, *fields)
        with pytest.raises(RuntimeError, match="malformed integer"):
            s._call(auth.GET, b"--1000", b"k")
        assert s.add("k", -2) == -2 and s.add("k", 5) == 3  # the same connection, still in sequence
    finally:
        s.close()
        srv.close()


def test_a_world_writable_secret_file_is_refused_and_a_world_readable_one_warned(tmp_path, monkeypatch):
    import warnings

    from triton_reshard.comm.auth import secret_from

    f = tmp_path / "secret"
    f.write_text("q" * 40 + "\n")
    monkeypatch.setenv("TRITON_RESHARD_SECRET_FILE", str(f))
    os.chmod(f, 0o600)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_secret() == b"q" * 40
    os.chmod(f, 0o644)
    with pytest.warns(UserWarning, match=r"readable by every user .*0644"):
        assert resolve_secret() == b"q" * 40
    for mode in (0o666, 0o602):
        os.chmod(f, mode)
        with pytest.raises(ValueError, match=rf"writable by every user of this machine \(mode 0{mode:o}\)") as e:
            resolve_secret()
        assert "q" * 16 not in str(e.value)
        with pytest.raises(ValueError, match="writable by every user"):
            secret_from(None, f)
        with pytest.raises(ValueError, match="writable by every user"):
            init_refit_group("127.0.0.1", 1234, 0, 1)


def test_a_stranger_host_cannot_take_every_handshake_slot(monkeypatch):
    """Idle connections from one stranger address (127.0.0.2 here) hold at most MAX_PENDING_PER_HOST of the
    server's handshake slots, so a member from another address gets in at once instead of waiting out the
    strangers' handshake timeout (here longer than the member's own deadline: it failed before the cap)."""
    from triton_reshard.comm import auth

    monkeypatch.setattr(auth, "MAX_PENDING", 8)
    monkeypatch.setattr(auth, "MAX_PENDING_PER_HOST", 4, raising=False)
    monkeypatch.setattr(auth, "HANDSHAKE_TIMEOUT", 6.0)
    srv = AuthStoreServer("127.0.0.1", 0, SECRET)
    holders = [socket.create_connection(("127.0.0.1", srv.port), source_address=("127.0.0.2", 0))
               for _ in range(12)]
    try:
        time.sleep(0.3)
        assert srv.refused == 8  # 4 admitted, the rest closed at once
        t0 = time.monotonic()
        s = AuthStore("127.0.0.1", srv.port, SECRET, timedelta(seconds=2))
        s.set("k", b"v")
        assert s.get("k") == b"v" and time.monotonic() - t0 < 2
        s.close()
    finally:
        for h in holders:
            h.close()
        srv.close()


def test_a_connection_accepted_while_the_server_closes_is_not_served(monkeypatch):
    """A connection that the accept loop takes just as :meth:`AuthStoreServer.close` runs is closed with the
    rest (it was served by a thread close() never saw: the client completed its handshake with a closed
    server, and the thread lived on)."""
    from triton_reshard.comm import auth

    accepted, closed = threading.Event(), threading.Event()

    class SlowAccept(socket.socket):
        def accept(self):
            conn, addr = super().accept()
            accepted.set()
            closed.wait(5)  # close() runs between accept() and the admission of the connection
            return conn, addr

    monkeypatch.setattr(auth.socket, "socket", SlowAccept)
    srv = AuthStoreServer("127.0.0.1", 0, SECRET)
    monkeypatch.undo()
    out = {}

    def join():
        try:
            out["store"] = AuthStore("127.0.0.1", srv.port, SECRET, timedelta(seconds=2))
        except (AuthError, TimeoutError) as e:
            out["error"] = e

    t = threading.Thread(target=join)
    t.start()
    assert accepted.wait(5)
    srv.close()
    closed.set()
    t.join(10)
    assert "store" not in out and "error" in out, out
    time.sleep(0.3)
    assert not srv._conns


def _gather_records(rank: int, world: int) -> list:
    from triton_reshard.integrations.record import LoadRecord

    rec = None if rank == 1 else LoadRecord(rank=rank, unused=["w" * rank], problems=[f"p{rank}"])
    return [None if r is None else (r.rank, list(r.unused), list(r.problems))
            for r in wire.all_gather_data(rec, None, "load record")]


@pytest.mark.slow
def test_load_records_are_gathered_as_data_over_torch_distributed():
    """layout_from_vllm / layout_from_sglang gather every rank's LoadRecord over the engine's own
    torch.distributed group as wire JSON (torch's all_gather_object would unpickle what a peer sends)."""
    from triton_reshard.testing.launch import run_world

    want = [(0, [""], ["p0"]), None, (2, ["ww"], ["p2"])]
    assert run_world(_gather_records, 3, backend="gloo", timeout=120) == [want] * 3
    assert wire.all_gather_data({"a": (1, 2)}) == [{"a": (1, 2)}]  # no world: just the value
