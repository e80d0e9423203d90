"""Every refit proves what it wrote (issue 46): a digest per message on both ends, compared at the end.

The sender digests each message it sends, over the bytes it hands the transport (a dense message, a delta
message, fp8 values and scales, a relayed destination), right after posting it: the hash reads the buffer
while the transport does, hot in cache. The receiver digests each message after landing it: an in-place
receive is the destination itself; a staged one is first rebuilt from the destination views the unpack
wrote (the unpack reversed, where it did not cast), so the digest covers what the destination holds, not
only what arrived; a delta message is digested as it arrived. On CPU with the native extension and torch's
copy backend, a dense step's pack and unpack are one C pass each that copies and hashes what it wrote
(:func:`fused_copy`; ``csrc/digest.c``): the hash takes no read pass of its own; a message sent in place whose
bytes the rank's local copies also read is hashed in their pass (:meth:`Ledger.local`); only bytes no copy takes
(other in-place messages, padding, quantized pieces) are read again. At the end of the refit the
ranks exchange one keyed value per (sender, receiver) pair in one row exchange (rooted on gloo:
:func:`post_gather`; in a delta refit posted before the last step's apply, which it then overlaps:
``StepLoop.apply``); a mismatch makes a second exchange that names the first differing message, and every rank raises
:class:`ReshardIntegrityError` (tensor, step, sender, receiver). The Resharder marks the destination torn, as
for any failed refit, drops the delta snapshot (the next refit is dense) and stays usable (the group is
fine: the exchange itself completed).

The fused hash (:func:`partial`): the message's bytes as int64 words (the tail bytes one word each), summed
per row of :data:`ROW_WORDS` words (one read pass, the only full pass; AVX2 where the machine has it), then
the row sums multiplied by odd 64-bit coefficients per row position and summed, everything mod 2**64. The coefficients
come from the job's secret (SHAKE-256 of a key derived from it). The keyed combine is HMAC-SHA256 over the
per-message partials with that key, truncated to 63 bits. What it guarantees is in ``docs/integrity.md``.
"""

from __future__ import annotations

import bisect
import hashlib
import hmac
import os
import struct

import numpy as np
import torch

from ..comm.secret import NO_SECRET_KEY, resolve_secret
from ..ops.digest import (
    ROW_WORDS,  # int64 words per first-level row (1 KiB): one sum each, then keyed weights
    buffer_rows,
    copy_native,
    cut_pairs,
    digest_buffer,
    digest_many,
    fused_copy,
    message_rows,
    span_torch,
)
from ..ops.digest import entries as _entries
from ..ops.digest import native as digest_native
from ..ops.quant_digest import add_hashed
from . import lane_hash
from .errors import ReshardIntegrityError, integrity_error
from .transport import PostedRows
from .transport import post_gather as transport_post_gather

LABEL = b"triton_reshard/v1/digest/"
NAME_WORDS = 8  # a tensor name in the localizing exchange: 8 int64 of 7 bytes each (56 bytes, then cut)
MAX_PAIRS = 4  # mismatched (sender, receiver) pairs localized to a message (the others are counted)
MAX_MSGS = 32  # messages per pair compared one by one in the localizing exchange (the rest as a count)
MASK63 = (1 << 63) - 1
ROOTED_MIN_RANKS = 3  # gloo groups from this size exchange the digest rows rooted (:func:`post_gather`)
# in-place sends from this size are hashed in the digest's thread: handing a hash to the thread and taking its
# value costs ~20-40 us, what the native hash takes for 1-4 MiB; smaller sends are hashed at once, in one call
THREAD_MIN_BYTES = 8 << 20
_POOL: list = []


def _pool():
    """The digest's one hashing thread (made on first use, kept for the process)."""
    if not _POOL:
        from concurrent.futures import ThreadPoolExecutor

        _POOL.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="trd-digest"))
    return _POOL[0]


ENV_VAR = "TRITON_RESHARD_DIGEST"  # "off" / "0": no digest whatever ``digest=`` says (set it on every rank)


def enabled() -> bool:
    """False where ``TRITON_RESHARD_DIGEST`` turns the digest off (``off``, ``0``, ``false``, ``no``): one
    switch for every refit of a process and the processes it starts (an engine's workers: the RL loop's
    ``--digest off``). Every rank of a refit must agree (the end-of-refit exchange is collective)."""
    return os.environ.get(ENV_VAR, "on").strip().lower() not in ("off", "0", "false", "no")


def digest_key(comm) -> bytes:
    """The key of the digests: derived from the refit group's secret (a RefitGroup keeps it), else from the
    environment's secret (``TRITON_RESHARD_SECRET`` / ``_FILE``) for a torch.distributed group, else the
    public no-secret key (the digests then catch corruption, not a forger)."""
    key = getattr(comm, "digest_key", None)
    if not key:
        try:
            key = resolve_secret(None, where="the integrity digest") or NO_SECRET_KEY
        except (OSError, TypeError, ValueError):  # an unreadable or short secret is refused where groups are made
            key = NO_SECRET_KEY
    return hmac.new(key, LABEL + b"key", hashlib.sha256).digest()


class Coefficients:
    """The keyed odd coefficients of the second level, per device, grown on demand (SHAKE-256 is an XOF:
    a longer output starts with the shorter one, so a coefficient never changes with the length)."""

    def __init__(self, key: bytes) -> None:
        self.seed = hmac.new(key, LABEL + b"coefficients", hashlib.sha256).digest()
        self._by_device: dict[torch.device, torch.Tensor] = {}
        self._np: np.ndarray | None = None  # the CPU coefficients as uint64 (the native hash's), all made so far

    def get(self, n: int, device: torch.device) -> torch.Tensor:
        have = self._by_device.get(device)
        if have is None or have.numel() < n:
            m = max(n, 2 * (have.numel() if have is not None else 0), 1024)
            raw = bytearray(hashlib.shake_256(self.seed).digest(8 * m))
            c = torch.frombuffer(raw, dtype=torch.int64) | 1
            have = self._by_device[device] = c.to(device)
        return have[:n]

    def numpy(self, n: int) -> np.ndarray:
        """The first ``n`` coefficients as uint64 (the same bits), for the CPU hash."""
        have = self._np
        if have is None or have.size < n:
            self.get(n, torch.device("cpu"))
            have = self._np = self._by_device[torch.device("cpu")].numpy().view(np.uint64)
        return have[:n]


def partial(buf: torch.Tensor, coef: Coefficients) -> torch.Tensor | int:
    """The fused hash of the flat uint8 ``buf``: an int (CPU: the native one-pass hash, ``ops/digest.py``,
    else numpy, one thread, no torch dispatch; torch's threaded reduction waits ~25 ms on a pool of busy cores
    for a 1 MiB message) or a 0-dim int64 tensor on its device (no sync). All are the same arithmetic mod
    2**64, so the same value for the same bytes."""
    if buf.device.type == "cpu":
        fn = digest_native()
        if fn is not None and buf.is_contiguous():
            return digest_buffer(fn, buf, coef.numpy(_entries(buf.numel())))
        return _partial_np(buf.detach().numpy(), coef)  # a view of a Parameter requires grad
    return _partial_torch(buf, coef)


def _partial_torch(buf: torch.Tensor, coef: Coefficients) -> torch.Tensor | int:
    n = buf.numel()
    nw = n // 8
    parts = []
    if nw:
        head = buf[: nw * 8]
        if head.data_ptr() % 8:  # an unaligned in-place buffer: one aligned copy
            head = head.clone()
        w = head.view(torch.int64)
        rows = nw // ROW_WORDS
        if rows:
            parts.append(w[: rows * ROW_WORDS].view(rows, ROW_WORDS).sum(1))
        if nw % ROW_WORDS:
            parts.append(w[rows * ROW_WORDS :].sum().view(1))
    if n % 8:
        parts.append(buf[nw * 8 :].to(torch.int64))
    if not parts:
        return 0
    v = torch.cat(parts) if len(parts) > 1 else parts[0]
    return (v * coef.get(v.numel(), v.device)).sum()


def _partial_np(a: np.ndarray, coef: Coefficients) -> int:
    n = a.size
    nw = n // 8
    parts = []
    if nw:
        w = a[: nw * 8].view(np.uint64)
        rows = nw // ROW_WORDS
        if rows:
            parts.append(np.add.reduce(w[: rows * ROW_WORDS].reshape(rows, ROW_WORDS), axis=1))
        if nw % ROW_WORDS:
            parts.append(np.add.reduce(w[rows * ROW_WORDS :], keepdims=True))
    if n % 8:
        parts.append(a[nw * 8 :].astype(np.uint64))
    if not parts:
        return 0
    v = np.concatenate(parts) if len(parts) > 1 else parts[0]
    return int(np.dot(v, coef.numpy(v.size)))


def _mac63(key: bytes, *parts: bytes) -> int:
    return int.from_bytes(hmac.new(key, b"".join(parts), hashlib.sha256).digest()[:8], "little") & MASK63


def _name_words(name: str) -> list[int]:
    raw = name.encode("utf-8")[: 7 * NAME_WORDS].ljust(7 * NAME_WORDS, b"\0")
    return [int.from_bytes(raw[7 * k : 7 * k + 7], "little") for k in range(NAME_WORDS)]


def _name_of(words: list[int]) -> str:
    return b"".join(int(w).to_bytes(7, "little") for w in words).rstrip(b"\0").decode("utf-8", "replace")


class Ledger:
    """One run's digests on this rank: per peer, the messages sent to it and received from it, in order
    (gloo and NCCL deliver a pair's messages in posting order: the k-th sent is the k-th received)."""

    def __init__(self, key: bytes, coef: Coefficients, rank: int, plan_digest: str, work, transfers, views=None,
                 owner=None) -> None:
        self.key, self.coef, self.rank = key, coef, rank
        self.views = {} if views is None else views  # the native hash's view descriptors (Digests keeps them)
        self.owner = owner  # the Digests it came from (step 0's fused pack made during the handshake)
        self._fused: dict[tuple[str, int], tuple] = {}  # (pack|unpack, pos) -> (hashes, gaps) of a fused copy
        self.plan = plan_digest.encode()
        self.work, self.transfers = work, transfers
        self.sent: dict[int, list] = {}  # peer -> [(step, nbytes, partial)]
        self.recvd: dict[int, list] = {}  # peer -> [(step, nbytes, partial, (pos, j))]
        self._posted: dict[int, list] = {}  # step position -> the receives posted for it
        self._hashing: dict[int, list] = {}  # step position -> (peer, index in sent[peer]) hashed in the thread
        self._round: tuple | None = None  # (messages digested, the posted row exchange): post_round
        # step position -> in-place send index -> (peer, index in sent[peer], buffer): hashed later (_resolve)
        self._later: dict[int, dict] = {}
        # (address, bytes) of an in-place send -> (the local copies' hash of it, the views they did not read)
        self._local: dict | None = None  # (None: the local copies have not run yet)
        self.lanes = None  # the group's same-host lanes, which hash what they copy in (execute/lane_hash.py)
        self.lane_unpacks: dict = {}  # receive buffer address -> its lane_hash.LaneUnpack (landed by its lane)
        self.lane_plans: dict = {}  # a step's first receive buffer address -> its fused unpack (lane_hash.rest)

    def on_post(self, pos: int, sends, recvs, unpack=None) -> None:
        """Step ``pos`` was posted: digest its sends now (the transport reads them too). A send no fused copy
        hashed (in place, zero-copy) of at least :data:`THREAD_MIN_BYTES` on CPU is hashed in the digest's
        thread (the native hash releases the GIL) while this thread goes on (the next step's pack, the last
        step's unpack); :meth:`on_land` of the same step takes its value (the buffer is not reused before).
        ``unpack``: the step's unpack ``(pairs, key)`` its same-host lanes may make (``lane_hash.want``)."""
        i = self.work.steps[pos][0]
        fused = self._fused.pop(("pack", pos), None)
        bufs = [(b, b.numel()) for _p, b in sends]
        later = self._deferred(fused, bufs)
        values = self._finish(fused, bufs, later) if fused is not None else None
        if values is None:
            values = self._sends([b for _p, b in sends])
        for j, ((peer, buf), v) in enumerate(zip(sends, values, strict=True)):
            if not isinstance(v, (int, torch.Tensor)):  # a future of the digest's thread
                self._hashing.setdefault(pos, []).append((peer, len(self.sent.get(peer, ()))))
            if j in later:
                self._later.setdefault(pos, {})[j] = (peer, len(self.sent.get(peer, ())), buf)
            self.sent.setdefault(peer, []).append((i, buf.numel(), v))
        self._posted[pos] = list(recvs)
        lane_hash.want(self, recvs, unpack)
        if self._local is not None:
            self._resolve(pos)

    def _deferred(self, fused, bufs) -> set[int]:
        """The sends a fused pack did not touch (in place, read from the sources) whose hash waits for the local
        copies (:meth:`local`: they read the same source bytes, and hash them in their pass), or takes it."""
        if fused is None or isinstance(fused[0], torch.Tensor) or self._local == {}:
            return set()
        whole = {j for j, g in enumerate(fused[1]) if len(g) == 1 and g[0, 2] == bufs[j][1]}
        if self._local is None:
            return whole
        return {j for j in whole if (bufs[j][0].data_ptr(), bufs[j][1]) in self._local}

    def local(self, pairs, wire, key, backend: str) -> list:
        """Run the rank's local copies ``pairs`` that read the bytes of in-place sends (``wire``: every step's
        (sends, receives)) natively, hashing those bytes per send in the same pass (what a send's digest needs:
        no read pass of its own); returns the pairs left for the caller to copy. Takes the deferred sends."""
        rest, self._local = pairs, {}
        if backend == "torch" and pairs and copy_native() is not None:
            sends = {(b.data_ptr(), b.numel()): b for ss, _r in wire for _p, b in ss if not b.is_cuda}
            sig = ("local", key, tuple(sends), len(pairs))
            cut = self.views.get(sig)
            if cut is None:
                cut = self.views[sig] = cut_pairs(pairs, list(sends))
            starts = sorted(sends)
            hit = {starts[bisect.bisect_right(starts, (s.data_ptr(), 1 << 62)) - 1] for s, _d in cut[0]}
            bufs = [(sends[h], h[1]) for h in sorted(hit)]
            got = fused_copy(self.views, self.coef, cut[0], bufs, 0, key) if bufs else None
            if got is not None:
                rest = cut[1]
                for (b, n), h, g in zip(bufs, got[0].tolist(), got[1], strict=True):
                    self._local[b.data_ptr(), n] = (h, g)
        self._resolve()
        return rest

    def _resolve(self, pos: int | None = None) -> None:
        """The deferred sends of step ``pos`` (every step's: None): the local copies' hash of their bytes plus the
        bytes those did not read, or the whole buffer, in one native call."""
        steps = [pos] if pos is not None else list(self._later)
        todo = [(p, j) for p in steps for j in self._later.get(p, ())]
        if not todo:
            return
        got, rows, lens = [], [], []
        for p, j in todo:
            peer, k, buf = self._later[p].pop(j)
            h, g = (self._local or {}).get((buf.data_ptr(), buf.numel()), (0, buffer_rows(buf)))
            got.append((peer, k, h))
            rows.append(g)
            lens.append(buf.numel())
        some = [m for m, g in enumerate(rows) if len(g)]
        hashed = self._many([rows[m] for m in some], [lens[m] for m in some]) if some else []
        extra = dict(zip(some, hashed, strict=True))
        for m, (peer, k, h) in enumerate(got):
            e = self.sent[peer][k]
            self.sent[peer][k] = (e[0], e[1], (e[2] + h + extra.get(m, 0)) & ((1 << 64) - 1))

    def _sends(self, bufs: list[torch.Tensor]) -> list:
        """The hashes of sends no fused copy hashed (delta messages, in-place sends): on CPU with the native
        hash those of :data:`THREAD_MIN_BYTES` or more as futures of the digest's thread, the rest in one native
        call; else one by one (:func:`partial`)."""
        fn = digest_native()
        values: list = [None] * len(bufs)
        batch = []
        for j, buf in enumerate(bufs):
            if fn is None or buf.device.type != "cpu" or not buf.is_contiguous():
                values[j] = partial(buf, self.coef)
            elif buf.numel() >= THREAD_MIN_BYTES:
                values[j] = _pool().submit(digest_buffer, fn, buf, self.coef.numpy(_entries(buf.numel())))
            else:
                batch.append(j)
        if batch:
            got = self._many([buffer_rows(bufs[j]) for j in batch], [bufs[j].numel() for j in batch])
            for j, v in zip(batch, got, strict=True):
                values[j] = v
        return values

    def _many(self, rows: list[np.ndarray], lens: list[int]) -> list[int]:
        """The native hashes of messages ``rows`` (:func:`message_rows`) of ``lens`` bytes, in one call."""
        return digest_many(rows, lens, self.coef.numpy(max(_entries(n) for n in lens)))

    def _joined(self, pos: int | None = None) -> None:
        """The threaded and the deferred hashes of step ``pos``'s sends (every step's: None) as values."""
        self._resolve(pos)
        for p in [pos] if pos is not None else list(self._hashing):
            for peer, k in self._hashing.pop(p, ()):
                e = self.sent[peer][k]
                self.sent[peer][k] = (e[0], e[1], e[2].result())

    # -- the fused copies: the hash in the pack's and the unpack's own pass (csrc/digest.c) ---------------------

    def pack(self, pos: int, pairs, sends, key, backend: str = "torch") -> bool:
        """Make step ``pos``'s pack copies (source views into its send buffers ``sends``) natively (``backend``
        torch) or with the Triton kernel (triton), hashing each message's bytes as they are written; False
        (nothing copied) where the fused copy cannot: the caller copies and :meth:`on_post` hashes the buffers
        afterwards."""
        got = fused_copy(self.views, self.coef, pairs, [(b, b.numel()) for _p, b in sends], 1, key, backend)
        if got is None:
            return False
        self._fused["pack", pos] = got
        return True

    def add_hashed(self, pos: int, lengths: list[int], sums, covered: list) -> None:
        """Step ``pos``'s sends partly hashed by the kernels that wrote them (``ops.quant_digest.add_hashed``)."""
        self._fused["pack", pos] = add_hashed(self._fused.get(("pack", pos)), lengths, sums, covered)

    def prepacked(self, pos: int, key) -> None:
        """Step ``pos`` was packed during the handshake (``steps.prepack``): take that fused pack's hashes if
        it made one for these buffers (else :meth:`on_post` hashes them)."""
        ahead = self.owner.take_ahead(key) if self.owner is not None else None
        if ahead is not None:
            self._fused["pack", pos] = ahead

    def unpack(self, pos: int, pairs, key, backend: str = "torch") -> bool:
        """Make step ``pos``'s unpack copies (received views into the destination) natively, hashing what
        each writes into the destination, read back right after it was written; False (nothing copied) where
        the native copy cannot: the caller copies and :meth:`on_land` hashes as before."""
        posted = self._posted.get(pos)
        if not posted:
            return False
        bufs = [(b, b.numel()) for _p, b in posted]
        got = lane_hash.rest(self, bufs)  # the messages the lanes did not land straight from their ring
        if got is None:
            got = fused_copy(self.views, self.coef, pairs, bufs, 0, key, backend)
        if got is None:
            return False
        self._fused["unpack", pos] = got
        return True

    def _finish(self, fused, bufs, later=(), laned=()) -> list:
        """A fused copy's per-message hashes plus the hash of the bytes it did not copy (read now; messages
        ``later``: left out, :meth:`_resolve` adds it; ``laned``: per message a lane's hash of all of it, or None)."""
        hashes, gaps = fused
        if isinstance(hashes, torch.Tensor):  # the Triton kernels' sums (on the device, no sync)
            return [self._gaps_torch(hashes[j], g, b, n) for j, (g, (b, n)) in enumerate(zip(gaps, bufs, strict=True))]
        out = hashes.tolist()
        done = set(later)
        for j, h in enumerate(laned):  # a message no pair copied (received in place), hashed by its lane
            if h is not None and len(gaps[j]) == 1 and gaps[j][0, 2] == bufs[j][1] and not out[j]:
                out[j] = h
                done.add(j)
        gapped = [j for j, g in enumerate(gaps) if len(g) and j not in done]
        if gapped:  # the bytes no copy took (in-place messages, padding), one native call for all
            for j, h in zip(gapped, self._many([gaps[j] for j in gapped], [bufs[j][1] for j in gapped]), strict=True):
                out[j] = (out[j] + h) & ((1 << 64) - 1)
        return out

    def _gaps_torch(self, h, gaps, buf, n: int):
        """``h`` plus the hash of the byte ranges ``gaps`` of the ``n``-byte message in ``buf``."""
        for a, z in gaps:
            if a == 0 and z == n:  # a message no pair copied (sent or received in place): one word pass
                h = h + partial(buf[:n] if n != buf.numel() else buf, self.coef)
            else:
                h = h + span_torch(buf, a, z, n, self.coef.get(_entries(n), buf.device))
        return h

    def on_land(
        self, pos: int, rebuild=(), backend: str = "torch", lengths: dict | None = None, key=None, wire=None
    ) -> None:
        """Step ``pos`` landed: digest every receive over what the destination now holds (``rebuild``: the
        unpack's (receive view, destination view) pairs; those that cast are digested as they arrived;
        ``lengths``: receive index -> the bytes a message received into a larger buffer holds). On CPU with the
        native hash the destination views are read in place (descriptors cached under ``key``); else the staged
        messages are rebuilt from the destination, then hashed. ``wire``: per receive, its plan receive indices."""
        self._joined(pos)
        posted = self._posted.pop(pos, ())
        bufs = [
            (buf, lengths[j] if lengths and j in lengths else buf.numel())
            for j, (_p, buf) in enumerate(posted)
        ]
        fused = self._fused.pop(("unpack", pos), None)
        laned = lane_hash.take(self, bufs)  # hashed in the lane's copy: no read pass (None: not by a lane)
        if fused is not None:
            values = self._finish(fused, bufs, laned=laned)
        elif not rebuild and bufs and None not in laned:
            values = laned
        elif bufs and bufs[0][0].device.type == "cpu":
            values = self._in_place(bufs, rebuild, key)
        else:
            values = None
        if values is None:
            values = self._rebuilt(bufs, rebuild, backend)
        i = self.work.steps[pos][0]
        for j, ((peer, _buf), (_b, n), v) in enumerate(zip(posted, bufs, values, strict=True)):
            self.recvd.setdefault(peer, []).append((i, n, v, (pos, wire[j] if wire else j)))

    def _in_place(self, bufs, rebuild, key) -> list[int] | None:
        fn = digest_native()
        if fn is None:
            return None
        sig = (key, tuple((b.data_ptr(), n) for b, n in bufs), len(rebuild))
        rows = self.views.get(sig) if key is not None else None
        if rows is None:
            rows = message_rows(bufs, rebuild)
            if rows is None:
                return None
            if key is not None:
                if len(self.views) >= 512:
                    self.views.clear()
                self.views[sig] = rows
        return self._many(rows, [n for _b, n in bufs])

    def _rebuilt(self, bufs, rebuild, backend: str) -> list:
        from .. import ops

        back = [(d, r) for r, d in rebuild if r.dtype == d.dtype and r.numel()]
        if back:
            ops.copy_views(back, backend)
        return [partial(b[:n] if n != b.numel() else b, self.coef) for b, n in bufs]

    # -- the end-of-refit exchange ------------------------------------------------------------------

    def _values(self) -> None:
        """The partials as ints (one device sync for all of them)."""
        self._joined()
        items = [e[2] for d in (self.sent, self.recvd) for es in d.values() for e in es if isinstance(e[2], torch.Tensor)]
        vals = iter(torch.stack(items).tolist() if items else ())
        for d in (self.sent, self.recvd):
            for peer, es in d.items():
                d[peer] = [(e[0], e[1], (next(vals) if isinstance(e[2], torch.Tensor) else e[2]) & ((1 << 64) - 1),
                            *e[3:]) for e in es]

    def _msg(self, s: int, q: int, k: int, e) -> int:
        return _mac63(self.key, LABEL, b"msg", self.plan, struct.pack("<IIIQQ", s, q, k, e[1], e[2]))

    def _pair(self, s: int, q: int, es: list) -> int:
        # the k-th message between a pair is the k-th on both ends (posting order); the step index is only for
        # naming: a rank's share numbers steps by what it takes part in, so it is not in the digest
        body = b"".join(struct.pack("<QQ", e[1], e[2]) for e in es)
        return _mac63(self.key, LABEL, b"pair", self.plan, struct.pack("<III", s, q, len(es)), body)

    def _row_tag(self, rank: int, row: list[int]) -> int:
        """A rank's digest row, keyed: without the secret no one can change a row in flight (e.g. copy the
        sender's digest over the receiver's so that they agree)."""
        return _mac63(self.key, LABEL, b"row", self.plan, struct.pack(f"<I{len(row)}q", rank, *row))

    def post_round(self, link) -> bool:
        """Post this rank's digest row now (every message of the run digested), :meth:`settle` waits and
        compares: the round runs while this rank still works (a delta's apply, ``StepLoop.apply``). Gloo only
        (True: posted): on NCCL the partials' device sync would stall the apply's launch."""
        if self._round is None and link.wire and not link.is_nccl:
            self._round = self._post(link)
        return self._round is not None

    def _post(self, link) -> tuple:
        self._values()
        me, row = self.rank, []
        for r in link.ranks:
            row += [self._pair(me, r, self.sent.get(r, [])), self._pair(r, me, self.recvd.get(r, []))]
        return self._count(), post_gather(link, row + [self._row_tag(me, row)], "the integrity digest exchange")

    def _count(self) -> int:
        return sum(len(es) for d in (self.sent, self.recvd) for es in d.values())

    def settle(self, link) -> None:
        """Exchange (posted by :meth:`post_round`, else now) and compare every pair's keyed digest; raise
        :class:`ReshardIntegrityError` on every rank (the same verdict everywhere: every rank sees every row)
        if any pair differs."""
        if not link.wire:
            return
        (count, posted), self._round = self._round or self._post(link), None
        rows = posted.rows()
        if count != self._count():  # a message digested after the row went would be compared by no one
            raise RuntimeError(f"rank {self.rank}: a message was digested after the digest row was posted")
        me, ranks = self.rank, link.ranks
        forged = [r for r, got in zip(ranks, rows, strict=True) if got[-1] != self._row_tag(r, got[:-1])]
        if forged:  # the rows travel on the data plane: one changed in flight (a copied digest, say) is refused
            raise ReshardIntegrityError(
                f"rank {me}: integrity check failed: the digest row of rank(s) {forged} fails its keyed tag (changed "
                f"on the wire); the destination is not proven (it is torn until a refit succeeds)",
                tensor=None, step=None, sender=forged[0], receiver=me, pairs=())
        bad = [(s, q) for a, s in enumerate(ranks) for b, q in enumerate(ranks) if rows[a][2 * b] != rows[b][2 * a + 1]]
        if bad:
            self._localize(link, bad)

    def _localize(self, link, bad: list[tuple[int, int]]) -> None:
        """The rare path: per mismatched pair (up to :data:`MAX_PAIRS`), the sender's and the receiver's
        per-message keyed digests (up to :data:`MAX_MSGS`) and the receiver's tensor names, in one more
        exchange; then the named error, on every rank alike."""
        me, ranks = self.rank, link.ranks
        width = 2 + MAX_MSGS * (3 + NAME_WORDS)
        row = [0] * (width * min(len(bad), MAX_PAIRS))
        for p, (s, q) in enumerate(bad[:MAX_PAIRS]):
            at = p * width
            if me == s:
                es = self.sent.get(q, [])
                row[at] = len(es)
                for k, e in enumerate(es[:MAX_MSGS]):
                    row[at + 2 + k] = self._msg(s, q, k, e)
            if me == q:
                es = self.recvd.get(s, [])
                row[at + 1] = len(es)
                for k, e in enumerate(es[:MAX_MSGS]):
                    base = at + 2 + MAX_MSGS + k * (2 + NAME_WORDS)
                    row[base] = self._msg(s, q, k, e)
                    row[base + 1] = e[0]
                    row[base + 2 : base + 2 + NAME_WORDS] = _name_words(self._tensors(*e[3]))
        rows = post_gather(link, row, "the integrity digest exchange (localizing)").rows()
        found = []
        for p, (s, q) in enumerate(bad[:MAX_PAIRS]):
            at = p * width
            rs, rq = rows[ranks.index(s)], rows[ranks.index(q)]
            n_s, n_q = rs[at], rq[at + 1]
            first = None
            for k in range(min(n_s, n_q, MAX_MSGS)):
                base = at + 2 + MAX_MSGS + k * (2 + NAME_WORDS)
                if rs[at + 2 + k] != rq[base]:
                    first = (k, rq[base + 1], _name_of(rq[base + 2 : base + 2 + NAME_WORDS]))
                    break
            found.append((s, q, n_s, n_q, first))
        raise integrity_error(me, bad, found, MAX_MSGS)

    def _tensors(self, pos: int, j: int | tuple[int, ...]) -> str:
        """The destination tensor(s) of receive ``j`` (or receives, joined in one message) of step ``pos``."""
        step = self.work.steps[pos][1]
        js = j if isinstance(j, tuple) else (j,)
        names = dict.fromkeys(self.transfers[c.transfer].tensor for k in js for c in step.recvs[k][2].chunks)
        return ",".join(names)


def post_gather(link, row: list[int], what: str) -> PostedRows:
    """Post the exchange of every rank's digest row (``transport.post_gather``; ``.rows()`` waits). On gloo from
    :data:`ROOTED_MIN_RANKS` ranks, rooted (``transport.RootedRows``: each row to the group's first rank, the
    table back): ``2 (n - 1)`` messages where "direct" rows take ``n (n - 1)``, each waking a gloo thread at
    both ends, most of the round's CPU on a shared host (``perf/bench_integrity.py --rounds``); one more hop.
    The root forwards, it cannot forge: every rank checks every row's keyed tag itself."""
    return transport_post_gather(link, row, what, ROOTED_MIN_RANKS)


class Digests:
    """A Resharder's digest state across runs: the key and coefficients, made once."""

    def __init__(self, comm) -> None:
        self.key = digest_key(comm)
        self.coef = Coefficients(self.key)
        self.views: dict = {}  # per binding and step: the native hash's view descriptors of each message
        self._ahead: tuple | None = None  # (key, fused hashes) of step 0's pack made during the handshake

    def ledger(self, rank: int, plan, work) -> Ledger:
        return Ledger(self.key, self.coef, rank, plan.digest, work, plan.transfers, self.views, self)

    def pack_ahead(self, pairs, sends, key, backend: str = "torch") -> bool:
        """Step 0's pack made during the handshake (``steps.prepack``), natively with its hashes (kept for the
        run's ledger: :meth:`take_ahead`); False (nothing copied) where the native copy cannot."""
        self._ahead = None
        got = fused_copy(self.views, self.coef, pairs, [(b, b.numel()) for _p, b in sends], 1, key, backend)
        if got is None:
            return False
        self._ahead = (key, got)
        return True

    def take_ahead(self, key):
        """The hashes :meth:`pack_ahead` made under ``key`` (once), else None."""
        ahead, self._ahead = self._ahead, None
        return ahead[1] if ahead is not None and ahead[0] == key else None
