"""An authenticated key-value store: the rendezvous of a refit group and of the control plane.

Why not torch's ``TCPStore``: it authenticates nobody, so any process that reaches its port can read and
write every key (claim a rank, read the layouts, plant bytes the members then parse). Here rank 0 runs a
small store server (:class:`AuthStoreServer`, threads, our own framing) and every member, rank 0 included, is
a client of it through :class:`AuthStore`, a ``torch.distributed.Store`` subclass, so gloo's and NCCL's own
rendezvous, the rank claims and ``RefitGroup.all_gather_object`` all ride the authenticated channel.

The handshake (the secret never crosses the wire; both sides prove it):

1. client → server, 48 bytes: ``MAGIC``, a 32-byte random nonce, the client's rank and world size (u32 each).
2. server → client, 88 bytes: ``MAGIC``, its own 32-byte nonce, the group's 16-byte nonce (random per
   server), and ``HMAC-SHA256(secret, "server-proof" | transcript)``. The client checks it with
   ``hmac.compare_digest``: a process without the secret cannot make it, so a member never joins a stranger.
3. client → server, 32 bytes: ``HMAC-SHA256(secret, "client-proof" | transcript)``; the server checks it, or
   closes the connection (the stranger took nothing: it never got to send a request).

``transcript`` is both hellos (both nonces, the group nonce, the rank and world size); the labels differ per
direction, so a proof cannot be reflected. After the handshake every frame in each direction is
``u32 length | body | HMAC-SHA256(key_dir, u64 seq | u32 length | body)`` with a per-connection key per
direction (``HMAC(secret, "key-c2s"/"key-s2c" | transcript)``) and an implicit sequence number: a forged,
replayed, reordered or reflected frame fails its MAC and closes the connection, and no body is parsed before
its MAC is checked. Bodies are a fixed binary schema (an op code and length-prefixed byte strings), never
pickle. Every read has a timeout; a length over :data:`MAX_FRAME` is refused before anything is allocated.

What this does not do: encrypt (the store carries layouts and control messages, not weights; a listener on
the network path can read them), or protect the tensors of the gloo/NCCL data plane. See ``docs/security.md``.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import secrets
import socket
import struct
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from .secret import (  # noqa: F401  (re-exported: the secret belonged here before comm/secret.py)
    INSECURE_ENV,
    MIN_SECRET_BYTES,
    NO_SECRET_KEY,
    SECRET_ENV,
    SECRET_FILE_ENV,
    ResolvedSecret,
    group_key,
    insecure_opt_in,
    is_loopback,
    read_secret_file,
    resolve_secret,
    secret_from,
)

MAX_FRAME = 1 << 30  # bytes of one frame body (a layout of ~10^6 fragments is ~100 MB of JSON)
HANDSHAKE_TIMEOUT = 10.0  # seconds a connecting process has to complete the handshake
MAX_PENDING = 64  # connections in their handshake at once (more are closed at once)
MAX_PENDING_PER_HOST = 8  # of those, from one address (a stranger's host cannot take every slot)

MAGIC = b"TRSHv1\x00\x00"
_HELLO = struct.Struct(">8s32sII")  # magic, client nonce, rank, world size
_SHELLO = struct.Struct(">8s32s16s32s")  # magic, server nonce, group nonce, server proof
_LABEL = b"triton_reshard/v1/"
NO_RANK = 0xFFFFFFFF  # a client that is no rank of a group (the control plane)

# ops and statuses of the store protocol
SET, GET, ADD, CHECK, WAIT, CAS, DELETE, NUM_KEYS, APPEND, MULTI_GET, MULTI_SET = range(1, 12)
OK, TIMEOUT, ERROR = 0, 1, 2


class AuthError(ConnectionError):
    """The other side of a store connection did not prove the secret (or broke the protocol)."""


class _ClosedEarly(AuthError):
    """The server closed the connection before it said anything (full, or going down)."""


class StoreTimeout(TimeoutError):
    """A store wait or get ran past its timeout."""


# ---------------------------------------------------------------------------------------------------------
# the handshake and the framed channel
# ---------------------------------------------------------------------------------------------------------

def _mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, _LABEL + label + b"\x00" + b"".join(parts), hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("timed out reading from the peer")
            sock.settimeout(left)
        else:
            sock.settimeout(None)
        try:
            chunk = sock.recv(min(n - len(buf), 1 << 20))
        except TimeoutError:
            raise TimeoutError("timed out reading from the peer") from None
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        buf += chunk
    return bytes(buf)


class _Channel:
    """One authenticated connection: MAC'd frames with per-direction keys and sequence numbers."""

    def __init__(self, sock: socket.socket, send_key: bytes, recv_key: bytes):
        self.sock, self.send_key, self.recv_key = sock, send_key, recv_key
        self.send_seq = self.recv_seq = 0

    def send(self, body: bytes) -> None:
        head = struct.pack(">I", len(body))
        tag = hmac.new(self.send_key, struct.pack(">Q", self.send_seq) + head + body, hashlib.sha256).digest()
        self.send_seq += 1
        self.sock.sendall(head + body + tag)

    def recv(self, deadline: float | None) -> bytes:
        (n,) = struct.unpack(">I", _recv_exact(self.sock, 4, deadline))
        if n > MAX_FRAME:
            raise AuthError(f"a frame of {n} bytes (over the {MAX_FRAME}-byte limit)")
        body = _recv_exact(self.sock, n, deadline)
        tag = _recv_exact(self.sock, 32, deadline)
        want = hmac.new(self.recv_key, struct.pack(">Q", self.recv_seq) + struct.pack(">I", n) + body,
                        hashlib.sha256).digest()
        if not hmac.compare_digest(tag, want):
            raise AuthError("a frame failed its authentication (forged, replayed or reordered)")
        self.recv_seq += 1
        return body

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()


def _keys(key: bytes, transcript: bytes) -> tuple[bytes, bytes]:
    return _mac(key, b"key-c2s", transcript), _mac(key, b"key-s2c", transcript)


def _pack(*fields: bytes) -> bytes:
    return b"".join(struct.pack(">I", len(f)) + f for f in fields)


def _unpack(body: bytes, start: int = 0) -> list[bytes]:
    out, i = [], start
    while i < len(body):
        if i + 4 > len(body):
            raise AuthError("a truncated field")
        (n,) = struct.unpack_from(">I", body, i)
        i += 4
        if i + n > len(body):
            raise AuthError("a truncated field")
        out.append(body[i:i + n])
        i += n
    return out


def _int(b: bytes) -> int:
    if not 0 < len(b) <= 24 or not b.removeprefix(b"-").isdigit():  # one sign at most ("--5" is no int)
        raise AuthError(f"a malformed integer field {b[:24]!r}")
    return int(b)


# ---------------------------------------------------------------------------------------------------------
# the server (rank 0)
# ---------------------------------------------------------------------------------------------------------

class AuthStoreServer:
    """A key-value store served on ``host:port`` to clients that prove ``key`` (threads; :meth:`close`
    stops it). ``refused`` counts the connections that failed the handshake."""

    def __init__(self, host: str, port: int, key: bytes, world_size: int = 0):
        self.key, self.world_size = key, world_size
        self.group_nonce = secrets.token_bytes(16)
        self.data: dict[str, bytes] = {}
        self.cv = threading.Condition()
        self.refused = 0
        self.closed = False
        self._pending = threading.BoundedSemaphore(MAX_PENDING)
        self._per_host: dict[str, int] = {}  # handshakes in progress by peer address (under self.cv)
        self._conns: set[socket.socket] = set()
        self._rank_of: dict[socket.socket, int] = {}  # authenticated connections: the rank each member claimed
        self._left: dict[int, float] = {}  # rank -> when (monotonic) its last connection closed
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind((host.strip("[]"), port))
            self.sock.listen(128)
        except OSError:
            self.sock.close()
            raise
        self.port = self.sock.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, name="triton_reshard-store", daemon=True)
        self._thread.start()

    def members(self) -> int:
        """Connections open now (members and handshakes in progress)."""
        with self.cv:
            return len(self._conns)

    def member_ranks(self) -> set[int]:
        """The group ranks with an authenticated connection open now (a member's process that died or left has
        none: the kernel closes its socket)."""
        with self.cv:
            return {r for r in self._rank_of.values() if r != NO_RANK}

    def left_at(self) -> dict[int, float]:
        """``{rank: time.monotonic() when its last connection closed}`` for the ranks connected before and not
        now (who left first is who failed first: a dead member's peers often follow it down)."""
        with self.cv:
            alive = set(self._rank_of.values())
            return {r: t for r, t in self._left.items() if r not in alive}

    def close(self, linger: float = 0.0) -> None:
        """Stop serving. ``linger``: first wait up to that many seconds for the connected members to hang up
        (a member that read the last exchange's reply but has not processed it yet then does not see its
        connection cut under it)."""
        end = time.monotonic() + linger
        with self.cv:
            while self._conns and not self.closed and time.monotonic() < end:
                self.cv.wait(min(0.05, max(0.0, end - time.monotonic())))
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()
        with self.cv:
            conns = list(self._conns)
            self.cv.notify_all()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                c.close()

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, addr = self.sock.accept()
            except OSError:
                return
            host = addr[0]
            with self.cv:  # closing, or a flood of handshakes (from anywhere, or from one host): refuse it
                admit = (not self.closed and self._per_host.get(host, 0) < MAX_PENDING_PER_HOST
                         and self._pending.acquire(blocking=False))
                if admit:
                    self._per_host[host] = self._per_host.get(host, 0) + 1
                    self._conns.add(conn)
            if not admit:
                self.refused += 1
                conn.close()
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn, host), daemon=True).start()

    def _handshake(self, conn: socket.socket, host: str) -> _Channel | None:
        try:
            deadline = time.monotonic() + HANDSHAKE_TIMEOUT
            hello = _recv_exact(conn, _HELLO.size, deadline)
            magic, _nonce, rank, _ws = _HELLO.unpack(hello)
            if magic != MAGIC:
                return None
            head = MAGIC + secrets.token_bytes(32) + self.group_nonce
            transcript = hello + head
            conn.sendall(head + _mac(self.key, b"server-proof", transcript))
            proof = _recv_exact(conn, 32, deadline)
            if not hmac.compare_digest(proof, _mac(self.key, b"client-proof", transcript)):
                return None
            c2s, s2c = _keys(self.key, transcript)
            with self.cv:
                self._rank_of[conn] = rank
            return _Channel(conn, s2c, c2s)
        except (OSError, ConnectionError, TimeoutError, struct.error):
            return None
        finally:
            with self.cv:
                self._per_host[host] -= 1
                if not self._per_host[host]:
                    del self._per_host[host]
            self._pending.release()

    def _serve(self, conn: socket.socket, host: str) -> None:
        ch = self._handshake(conn, host)
        try:
            if ch is None:
                self.refused += 1
                return
            ch.send(bytes([OK]))  # authenticated: the client knows it was accepted
            while not self.closed:
                try:
                    body = ch.recv(None)
                except (OSError, ConnectionError, TimeoutError):
                    return
                if not body:
                    return
                try:
                    reply = self._op(body[0], _unpack(body, 1))
                except (AuthError, KeyError) as e:  # a member's malformed request (or a key deleted meanwhile)
                    reply = bytes([ERROR]) + _pack(f"{type(e).__name__}: {e}".encode())
                ch.send(reply)
        except OSError:
            return
        finally:
            with self.cv:
                self._conns.discard(conn)
                rank = self._rank_of.pop(conn, None)
                if rank is not None and rank != NO_RANK:
                    self._left[rank] = time.monotonic()
                self.cv.notify_all()
            with contextlib.suppress(OSError):
                conn.close()

    def _wait_for(self, keys: list[str], timeout_ms: int) -> bool:
        deadline = time.monotonic() + timeout_ms / 1000
        with self.cv:
            while not all(k in self.data for k in keys):
                left = deadline - time.monotonic()
                if left <= 0 or self.closed:
                    return False
                self.cv.wait(min(left, 1.0))
            return True

    def _op(self, op: int, f: list[bytes]) -> bytes:
        def need(n):
            if len(f) != n:
                raise AuthError(f"op {op}: {len(f)} fields, expected {n}")

        def key(b):
            try:
                return b.decode()
            except UnicodeDecodeError:
                raise AuthError("a key that is not utf-8") from None

        if op == SET:
            need(2)
            with self.cv:
                self.data[key(f[0])] = f[1]
                self.cv.notify_all()
            return bytes([OK])
        if op == MULTI_SET:
            if len(f) % 2:
                raise AuthError("multi_set: an odd number of fields")
            with self.cv:
                for i in range(0, len(f), 2):
                    self.data[key(f[i])] = f[i + 1]
                self.cv.notify_all()
            return bytes([OK])
        if op in (GET, MULTI_GET, WAIT):
            if not f:
                raise AuthError(f"op {op}: no timeout field")
            keys = [key(k) for k in f[1:]]
            if not self._wait_for(keys, _int(f[0])):
                with self.cv:
                    missing = [k for k in keys if k not in self.data]
                return bytes([TIMEOUT]) + _pack(*(k.encode() for k in missing))
            if op == WAIT:
                return bytes([OK])
            with self.cv:
                return bytes([OK]) + _pack(*(self.data[k] for k in keys))
        if op == ADD:
            need(2)
            k = key(f[0])
            with self.cv:
                v = _int(self.data[k]) if k in self.data else 0
                v += _int(f[1])
                self.data[k] = str(v).encode()
                self.cv.notify_all()
            return bytes([OK]) + _pack(str(v).encode())
        if op == APPEND:
            need(2)
            with self.cv:
                self.data[key(f[0])] = self.data.get(key(f[0]), b"") + f[1]
                self.cv.notify_all()
            return bytes([OK])
        if op == CHECK:
            with self.cv:
                return bytes([OK]) + _pack(b"1" if all(key(k) in self.data for k in f) else b"0")
        if op == CAS:
            need(3)
            k = key(f[0])
            with self.cv:
                cur = self.data.get(k)
                if (cur is None and not f[1]) or cur == f[1]:
                    self.data[k] = cur = f[2]
                    self.cv.notify_all()
                return bytes([OK]) + _pack(cur if cur is not None else f[1])
        if op == DELETE:
            need(1)
            with self.cv:
                return bytes([OK]) + _pack(b"1" if self.data.pop(key(f[0]), None) is not None else b"0")
        if op == NUM_KEYS:
            with self.cv:
                return bytes([OK]) + _pack(str(len(self.data)).encode())
        raise AuthError(f"unknown op {op}")


# ---------------------------------------------------------------------------------------------------------
# the client: a torch.distributed.Store
# ---------------------------------------------------------------------------------------------------------

def _as_bytes(v) -> bytes:
    if isinstance(v, bytes):
        return v
    if isinstance(v, str):
        return v.encode()
    if isinstance(v, (bytearray, memoryview)):
        return bytes(v)
    if isinstance(v, list):  # torch passes std::vector<uint8_t> as a list of ints
        return bytes(v)
    raise TypeError(f"store value must be bytes or str, got {type(v).__name__}")


def _ms(timeout: timedelta) -> int:
    return max(0, int(timeout.total_seconds() * 1000))


class AuthStore(dist.Store):
    """A client of an :class:`AuthStoreServer`: connects (retrying until ``deadline``), runs the handshake,
    then serves torch's Store interface (gloo's and NCCL's rendezvous accept it). Raises
    :class:`AuthError` if the server does not prove the key, ``TimeoutError`` if it cannot be reached."""

    def __init__(self, host: str, port: int, key: bytes, timeout: timedelta, *, rank: int = NO_RANK,
                 world_size: int = 0, connect_deadline: float | None = None):
        super().__init__()
        self.host, self.port, self._timeout = host, port, timeout
        self._lock = threading.Lock()
        deadline = connect_deadline if connect_deadline is not None else time.monotonic() + timeout.total_seconds()
        while True:
            sock = self._connect(host, port, deadline)
            try:
                self._ch = self._handshake(sock, key, rank, world_size, max(deadline, time.monotonic() + 1.0))
                return
            except _ClosedEarly as e:  # a full server (a flood of handshakes) or one going down: try again
                with contextlib.suppress(OSError):
                    sock.close()
                if time.monotonic() + 0.1 >= deadline:
                    raise AuthError(str(e)) from None
                time.sleep(0.1)
            except BaseException:
                with contextlib.suppress(OSError):
                    sock.close()
                raise

    @staticmethod
    def _connect(host: str, port: int, deadline: float) -> socket.socket:
        while True:
            try:
                sock = socket.create_connection((host.strip("[]"), port),
                                                timeout=max(0.05, min(5.0, deadline - time.monotonic())))
                if sock.getsockname() == sock.getpeername():  # TCP self-connect: retrying a loopback port in
                    sock.close()  # the ephemeral range while nobody listens can connect the socket to itself
                    raise ConnectionRefusedError(111, "connected to itself (nobody listens yet)")
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return sock
            except OSError as e:
                if time.monotonic() + 0.05 >= deadline:
                    raise TimeoutError(f"{host}:{port} refused or did not answer: {e.strerror or e}") from None
                time.sleep(0.05)

    @staticmethod
    def _handshake(sock, key, rank, world_size, deadline) -> _Channel:
        deadline = min(deadline, time.monotonic() + HANDSHAKE_TIMEOUT)
        hello = _HELLO.pack(MAGIC, secrets.token_bytes(32), rank, world_size)
        try:
            sock.sendall(hello)
            head = _recv_exact(sock, 1, deadline)
        except (ConnectionError, BrokenPipeError) as e:  # closed before answering (TimeoutError is not one)
            raise _ClosedEarly(f"the server closed the connection before its handshake ({e}): not a "
                               f"triton_reshard store, or it refused this process") from None
        except (OSError, TimeoutError) as e:
            raise AuthError(f"the server did not complete the handshake ({e}): not a triton_reshard store, "
                            f"or it refused this process") from None
        try:
            head += _recv_exact(sock, _SHELLO.size - 1, deadline)
        except (OSError, ConnectionError, TimeoutError) as e:
            raise AuthError(f"the server did not complete the handshake ({e}): not a triton_reshard store, "
                            f"or it refused this process") from None
        magic, _snonce, _gnonce, proof = _SHELLO.unpack(head)
        transcript = hello + head[:_SHELLO.size - 32]
        if magic != MAGIC or not hmac.compare_digest(proof, _mac(key, b"server-proof", transcript)):
            raise AuthError("the server did not prove the group's secret: it is not this group's rank 0, or the "
                            "secrets differ (nothing was sent to it)")
        sock.sendall(_mac(key, b"client-proof", transcript))
        c2s, s2c = _keys(key, transcript)
        ch = _Channel(sock, c2s, s2c)
        try:
            ok = ch.recv(deadline)
        except (OSError, ConnectionError, TimeoutError, AuthError) as e:
            raise AuthError(f"the server refused this process's proof of the secret ({e})") from None
        if ok != bytes([OK]):
            raise AuthError("the server's acceptance was malformed")
        return ch

    # -- the protocol ------------------------------------------------------------------------------------

    def _call(self, op: int, *fields: bytes, wait: timedelta | None = None) -> list[bytes]:
        deadline = time.monotonic() + (wait.total_seconds() if wait is not None else 0) + 30.0
        with self._lock:
            if self._ch is None:
                raise ConnectionError(f"the store connection to {self.host}:{self.port} is closed")
            try:
                self._ch.send(bytes([op]) + _pack(*fields))
                body = self._ch.recv(deadline)
            except (OSError, ConnectionError, TimeoutError) as e:
                self._drop()
                raise ConnectionError(f"lost the store at {self.host}:{self.port}: {e}") from None
        if not body:
            raise AuthError("an empty reply")
        status, out = body[0], _unpack(body, 1)
        if status == TIMEOUT:
            missing = [k.decode(errors="replace") for k in out]
            raise StoreTimeout(f"timed out after {wait.total_seconds() if wait else 0:g}s waiting for keys "
                               f"{missing[:8]} of the store at {self.host}:{self.port}")
        if status != OK:
            raise RuntimeError(f"the store at {self.host}:{self.port} refused op {op}: "
                               f"{out[0].decode(errors='replace') if out else ''}")
        return out

    def _drop(self) -> None:
        ch, self._ch = self._ch, None
        if ch is not None:
            ch.close()

    def close(self) -> None:
        with self._lock:
            self._drop()

    # -- torch.distributed.Store -------------------------------------------------------------------------

    def set(self, key: str, value) -> None:
        self._call(SET, key.encode(), _as_bytes(value))

    def get(self, key: str) -> bytes:
        return self._call(GET, str(_ms(self._timeout)).encode(), key.encode(), wait=self._timeout)[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call(MULTI_GET, str(_ms(self._timeout)).encode(), *(k.encode() for k in keys),
                          wait=self._timeout)

    def multi_set(self, keys: list[str], values: list) -> None:
        fields = []
        for k, v in zip(keys, values, strict=True):
            fields += [k.encode(), _as_bytes(v)]
        self._call(MULTI_SET, *fields)

    def add(self, key: str, value: int) -> int:
        return _int(self._call(ADD, key.encode(), str(int(value)).encode())[0])

    def append(self, key: str, value) -> None:
        self._call(APPEND, key.encode(), _as_bytes(value))

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._call(CAS, key.encode(), _as_bytes(expected), _as_bytes(desired))[0]

    def check(self, keys: list[str]) -> bool:
        return self._call(CHECK, *(k.encode() for k in keys))[0] == b"1"

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        t = timeout if timeout is not None else self._timeout
        self._call(WAIT, str(_ms(t)).encode(), *(k.encode() for k in keys), wait=t)

    def delete_key(self, key: str) -> bool:
        return self._call(DELETE, key.encode())[0] == b"1"

    def num_keys(self) -> int:
        return _int(self._call(NUM_KEYS)[0])

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    @property
    def timeout(self) -> timedelta:
        return self._timeout
