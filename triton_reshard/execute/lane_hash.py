"""The digest of messages that came through a same-host lane (``comm/lanes.py``), hashed in the lane's copy.

A message a lane carries is copied out of the ring by the receiver; a message received in place (straight
into the destination) was then hashed by the digest in a read pass of its own after it landed
(``execute/integrity.py``: ~5-6 % of a dense CPU refit at 256 MB). With the lanes, the receive's copy out of
the ring is the native copy that hashes what it writes (``csrc/digest.c``, ``trd_copy_digest``): the same
value, as :func:`~triton_reshard.execute.integrity.partial` gives over the destination's bytes, with no pass
of its own; a message that came in pieces is hashed piece by piece (the hash is linear in the bytes: each
piece's part at its offset, summed). The ledger registers the receives it will digest when their step is posted
(:func:`want`); the lane hashes those as it copies them; :func:`take` hands the values to the ledger when the
step lands.

A staged receive of a dense step is unpacked by the lane itself (:class:`LaneUnpack`): each piece's copy out
of the ring writes its bytes straight into the destination views the step's unpack would write (the unpack's
own fused copy, clipped to the piece and reading from the ring: ``trd_copy_digest_span``), hashing them as
written, so the message never passes through its staging buffer: one copy of its bytes where there were two.
The step's unpack then copies only the messages no lane landed (:func:`rest`)."""

from __future__ import annotations

import numpy as np

from ..ops.digest import (
    COPY_WIDTH,
    WIDTH,
    copy_digest,
    copy_native,
    copy_span_native,
    digest_many,
    fused_plan,
)
from ..ops.digest import entries as _entries

_NO_GAPS = np.zeros((0, WIDTH), dtype=np.int64)


class LaneUnpack:
    """Message ``j`` of a step's fused unpack (``ops.digest.fused_plan``) as its lane lands it, piece by piece,
    from the ring (:meth:`land`): its copies (message ``j`` renumbered 0) and the byte ranges no copy takes
    (padding: hashed as they arrived). ``got``: its bytes landed so far, ``hash``: their hash. A message whose
    first pieces came before it was registered (a receive pre-posted with the handshake lands as the waits
    make progress) goes on into its buffer, all of it: the step's unpack copies it as before."""

    __slots__ = ("nbytes", "desc", "gaps", "lens", "need", "got", "hash", "out", "at")

    def __init__(self, desc: np.ndarray, gaps: np.ndarray, nbytes: int) -> None:
        self.nbytes = nbytes
        self.desc = np.ascontiguousarray(desc)
        self.desc[:, 2] = 0
        self.gaps = [(int(o), int(n)) for o, n in gaps[:, 1:3]]
        self.lens = np.array([nbytes], dtype=np.int64)
        self.need = _entries(nbytes)
        self.got = self.hash = 0
        self.out = np.zeros(1, dtype=np.uint64)
        self.at = (len(self.desc), self.desc.ctypes.data, self.lens.ctypes.data, self.out.ctypes.data)

    def land(self, fn, piece: int, off: int, n: int, coef) -> int:
        """Copy the message's bytes ``[off, off + n)``, which lie at address ``piece``, into the destination
        views (and hash the padding among them as it lies there); their part of the message's hash."""
        c = coef.numpy(self.need)
        nd, desc, lens, out = self.at
        self.out[0] = 0
        fn(nd, desc, lens, c.ctypes.data, out, off, off + n, piece)
        h = int(self.out[0])
        rows = [
            [piece + a - off, a, z - a, 0, 1, 1, 1, 1, 0, 0, 0, 0]
            for a, z in ((max(o, off), min(o + k, off + n)) for o, k in self.gaps)
            if a < z
        ]
        if rows:
            h += digest_many([np.array(rows, dtype=np.int64)], [self.nbytes], c)[0]
        self.got += n
        self.hash = (self.hash + h) & ((1 << 64) - 1)
        return h & ((1 << 64) - 1)


def attach(ledger, comm) -> None:
    """At the start of a run: the run's ``ledger`` (None: digest off) hashes through ``comm``'s lanes, if it has
    any and the native copy is built; the lanes forget what an earlier run left."""
    lanes = getattr(comm, "lanes", None)
    if not lanes:
        return
    lanes.want.clear()
    lanes.hashed.clear()
    fn = copy_native() if ledger is not None else None
    if fn is None:
        lanes.copy_hash = None
        return
    coef, into, span = ledger.coef, ledger.lane_unpacks, copy_span_native()
    # one whole-message copy, made in place (this thread alone calls the hook): its addresses and length set per call
    one = np.zeros((1, COPY_WIDTH), dtype=np.int64)
    one[0, 6:10] = 1
    lens, out = np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.uint64)
    at = (one.ctypes.data, lens.ctypes.data, out.ctypes.data)

    def copy_hash(src, dst, off: int, total: int) -> int:
        """Copy ``src`` to ``dst`` (bytes at ``off`` of a message of ``total`` bytes): their part of its hash. The
        pieces of a message whose step's unpack was registered for its buffer (:func:`want`) go straight into
        the destination views instead."""
        n = dst.numel()
        plan = into.get(dst.data_ptr() - off) if span is not None else None
        if plan is not None and plan.nbytes == total and plan.got == off:  # (every piece before it landed so)
            return plan.land(span, src.data_ptr(), off, n, coef)
        one[0, 0], one[0, 1], one[0, 3], one[0, 4] = src.data_ptr(), dst.data_ptr(), off, n
        lens[0], out[0] = total, 0
        fn(1, at[0], at[1], coef.numpy(_entries(total)).ctypes.data, at[2])
        return int(out[0])

    lanes.copy_hash = copy_hash
    ledger.lanes = lanes


def want(ledger, recvs, unpack=None) -> None:
    """Step's receives ``recvs`` ((peer, buffer)) posted: the lanes hash them as they copy them in. ``unpack``:
    the step's unpack ``(pairs, key)`` the lanes may make themselves (``Dense.lane_unpack``), or None."""
    lanes = ledger.lanes
    if lanes is None:
        return
    lanes.want.update(buf.data_ptr() for _p, buf in recvs if buf.device.type == "cpu")
    if unpack is None or not recvs or copy_span_native() is None:
        return
    bufs = [(buf, buf.numel()) for _p, buf in recvs]
    plan = fused_plan(ledger.views, unpack[0], bufs, 0, unpack[1])
    if plan is None:
        return
    split = ledger.views.get(("lane", id(plan)))
    if (
        split is None or split[0] is not plan
    ):  # per message with copies: its copies and gaps (cached with the plan)
        desc, gaps = plan[0], plan[1]
        split = (
            plan,
            [
                (j, LaneUnpack(desc[desc[:, 2] == j], gaps[j], n))
                for j, (_b, n) in enumerate(bufs)
                if n and (desc[:, 2] == j).any()
            ],
        )
        ledger.views["lane", id(plan)] = split
    for j, u in split[1]:
        u.got = u.hash = 0
        ledger.lane_unpacks[bufs[j][0].data_ptr()] = u
    ledger.lane_plans[recvs[0][1].data_ptr()] = plan


def rest(ledger, bufs) -> tuple | None:
    """The step's unpack of the messages ``bufs`` ((buffer, bytes)) no lane landed (:class:`LaneUnpack`), made
    now: ``(hashes, gaps)`` per message as ``ops.digest.fused_copy`` gives them, with the lanes' hashes of the
    messages they landed (and no gaps: all their bytes are hashed); None where no lane landed one (the caller
    makes the whole unpack)."""
    plan = ledger.lane_plans.pop(bufs[0][0].data_ptr(), None) if bufs else None
    if plan is None:
        return None
    done = {}
    for j, (b, _n) in enumerate(bufs):
        u = ledger.lane_unpacks.get(b.data_ptr())
        if u is not None and u.got == u.nbytes:  # every piece came once it was registered (not: a pre-posted
            done[j] = u.hash  # receive's first pieces came in the handshake's waits, into its buffer)
    if not done:
        return None
    desc, gaps, lens, need = plan
    left = desc[~np.isin(desc[:, 2], list(done))]
    hashes = copy_digest(copy_native(), left, lens, ledger.coef.numpy(need))
    gaps = list(gaps)
    for j, h in done.items():
        hashes[j] = h
        gaps[j] = _NO_GAPS
    return hashes, gaps


def take(ledger, bufs) -> list[int | None]:
    """Per (buffer, bytes) of a step that landed: the lane's hash of those bytes as copied in, or None."""
    lanes = ledger.lanes
    if lanes is None:
        return [None] * len(bufs)
    got = [lanes.hashed.pop((b.data_ptr(), n), None) for b, n in bufs]
    for b, _n in bufs:
        lanes.want.discard(b.data_ptr())
        ledger.lane_unpacks.pop(b.data_ptr(), None)
    return got
