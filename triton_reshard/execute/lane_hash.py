"""The digest of messages that came through a same-host lane (``comm/lanes.py``), hashed in the lane's copy.

A message a lane carries is copied out of the ring by the receiver; a message received in place (straight
into the destination) was then hashed by the digest in a read pass of its own after it landed
(``execute/integrity.py``: ~5-6 % of a dense CPU refit at 256 MB). With the lanes, the receive's copy out of
the ring is the native copy that hashes what it writes (``csrc/digest.c``, ``trd_copy_digest``): the same
value, as :func:`~triton_reshard.execute.integrity.partial` gives over the destination's bytes, with no pass
of its own; a message that came in pieces is hashed piece by piece (the hash is linear in the bytes: each
piece's part at its offset, summed). The ledger registers the receives it will digest when their step is posted
(:func:`want`); the lane hashes those as it copies them; :func:`take` hands the values to the ledger when the
step lands."""

from __future__ import annotations

import numpy as np

from ..ops.digest import copy_native
from ..ops.digest import entries as _entries


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
    coef = ledger.coef

    def copy_hash(src, dst, off: int, total: int) -> int:
        """Copy ``src`` to ``dst`` (bytes at ``off`` of a message of ``total`` bytes): their part of its hash."""
        n = dst.numel()
        desc = np.array([[src.data_ptr(), dst.data_ptr(), 0, off, n, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0]],
                        dtype=np.int64)
        lens = np.array([total], dtype=np.int64)
        out = np.zeros(1, dtype=np.uint64)
        c = coef.numpy(_entries(total))
        fn(1, desc.ctypes.data, lens.ctypes.data, c.ctypes.data, out.ctypes.data)
        return int(out[0])

    lanes.copy_hash = copy_hash
    ledger.lanes = lanes


def want(ledger, recvs) -> None:
    """Step's receives ``recvs`` ((peer, buffer)) posted: the lanes hash them as they copy them in."""
    lanes = ledger.lanes
    if lanes is not None:
        lanes.want.update(buf.data_ptr() for _p, buf in recvs if buf.device.type == "cpu")


def take(ledger, bufs) -> list[int | None]:
    """Per (buffer, bytes) of a step that landed: the lane's hash of those bytes as copied in, or None."""
    lanes = ledger.lanes
    if lanes is None:
        return [None] * len(bufs)
    got = [lanes.hashed.pop((b.data_ptr(), n), None) for b, n in bufs]
    for b, _n in bufs:
        lanes.want.discard(b.data_ptr())
    return got
