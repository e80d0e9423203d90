"""A staged receive unpacked by its same-host lane (``execute/lane_hash.py``, ``trd_copy_digest_span``): each
piece of the message, as it lies in the ring, goes straight into the destination views the step's unpack
writes, hashed as written; the receive buffer is never written. Checked against the message as sent: the
destination views bit for bit (and nothing outside them), the message's digest equal to the sender's hash
of its bytes, pieces cut at any byte (odd offsets, inside a word, inside a row), and a message that did
not come through a lane (gloo) unpacked from its buffer by the step's unpack as before."""

from __future__ import annotations

import pytest
import torch

from triton_reshard.execute import integrity as ig
from triton_reshard.execute import lane_hash
from triton_reshard.ops import digest as nd

POISON = 0xFF


def _native() -> None:
    if nd.copy_native() is None or nd.copy_span_native() is None:
        pytest.skip("the native extension is not built (or built before trd_copy_digest_span)")


class _Lanes:
    """What ``lane_hash`` and the lanes' copy out of the ring share (``comm/lanes.Lanes``)."""

    def __init__(self) -> None:
        self.copy_hash = None
        self.want: set[int] = set()
        self.hashed: dict = {}

    def __bool__(self) -> bool:
        return True

    def copy_out(self, ring: torch.Tensor, buf: torch.Tensor, cuts: list[int]) -> None:
        """``comm/lanes.LaneRecv._copy_out`` of a message held in ``ring``, in pieces ending at ``cuts``."""
        total, key, at = ring.numel(), (buf.data_ptr(), ring.numel()), 0
        for end in [*cuts, total]:
            src, dst = ring[at:end], buf.view(-1)[at:end]
            if self.copy_hash is not None and key[0] in self.want:
                h = self.copy_hash(src, dst, at, total)
                self.hashed[key] = (self.hashed.get(key, 0) + h) & ((1 << 64) - 1)
            else:
                dst.copy_(src)
            at = end


def _step(dtype: torch.dtype, g: torch.Generator):
    """Three staged messages in one receive area: (area, [(offset, bytes)], unpack pairs, destinations, the
    messages as sent). Message 0: a strided block of A, 8 bytes of padding, a slice of B; message 1: a 3-D
    strided view of C; message 2: a strided block of A2 (it will come over gloo)."""
    e = torch.empty((), dtype=dtype).element_size()
    dests = {
        "A": torch.zeros((37, 20), dtype=dtype),
        "B": torch.zeros((50,), dtype=dtype),
        "C": torch.zeros((9, 7, 6), dtype=dtype),
        "A2": torch.zeros((33, 17), dtype=dtype),
    }
    for t in dests.values():
        t.view(torch.uint8).fill_(POISON)
    views = [
        [dests["A"][:, 3:15], None, dests["B"][5:45]],  # None: 8 bytes of padding
        [dests["C"][:, 2:5, 1:4]],
        [dests["A2"][1:30, 2:13]],
    ]
    sizes = [sum(8 if v is None else v.numel() * e for v in m) for m in views]
    offs = [0, sizes[0] + 24, sizes[0] + 24 + sizes[1] + 8]  # the messages' places in the area
    area = torch.full((offs[-1] + sizes[-1] + 16,), POISON, dtype=torch.uint8)
    pairs, sent = [], []
    for m, o in zip(views, offs, strict=True):
        at = o
        for v in m:
            nb = 8 if v is None else v.numel() * e
            if v is not None:
                pairs.append((area[at : at + nb].view(dtype).view(v.shape), v))
            at += nb
        sent.append(torch.randint(0, 256, (at - o,), dtype=torch.uint8, generator=g))
    msgs = [(o, n) for o, n in zip(offs, sizes, strict=True)]
    return area, msgs, pairs, dests, sent


def _unpacked(dests: dict, pairs, area: torch.Tensor, msgs, sent) -> dict:
    """The destinations a plain unpack of the messages as sent writes (poison outside the views)."""
    ref = area.clone()
    for (o, n), s in zip(msgs, sent, strict=True):
        ref[o : o + n] = s
    out = {k: torch.empty_like(t).view(torch.uint8).fill_(POISON).view(t.dtype) for k, t in dests.items()}
    for r, d in pairs:
        name = next(
            k for k, t in dests.items() if t.untyped_storage().data_ptr() == d.untyped_storage().data_ptr()
        )
        at, nb = r.data_ptr() - area.data_ptr(), r.numel() * r.element_size()
        w = out[name].as_strided(d.shape, d.stride(), d.storage_offset())
        w.copy_(ref[at : at + nb].view(r.dtype).view(r.shape))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8], ids=str)
@pytest.mark.parametrize("cuts", [(), (1,), (5, 13, 300), (7, 8, 9, 1001)], ids=lambda c: f"cuts{list(c)}")
def test_a_lane_unpacks_each_piece_from_the_ring_into_the_destination(dtype, cuts):
    _native()
    g = torch.Generator().manual_seed(11)
    area, msgs, pairs, dests, sent = _step(dtype, g)
    coef = ig.Coefficients(b"k" * 32)
    work = type("W", (), {"steps": [(0, None)]})()
    ledger = ig.Ledger(b"k", coef, 0, "p", work, (), {})
    lanes = _Lanes()
    lane_hash.attach(ledger, type("C", (), {"lanes": lanes})())
    bufs = [area[o : o + n] for o, n in msgs]
    recvs = [(q, b) for q, b in enumerate(bufs)]
    lane_hash.want(ledger, recvs, (pairs, "step0"))
    assert len(ledger.lane_unpacks) == 3
    for j in (0, 1):  # through a lane, in pieces cut at ``cuts`` (those inside the message)
        ring = sent[j].clone()
        lanes.copy_out(ring, bufs[j], [c for c in cuts if 0 < c < ring.numel()])
    bufs[2].copy_(sent[2])  # over gloo: into its buffer
    for j in (0, 1):
        assert torch.all(bufs[j] == POISON), j  # the lane wrote the destination, never the receive buffer
        assert lanes.hashed[bufs[j].data_ptr(), msgs[j][1]] == ig.partial(sent[j], coef), j
    got = lane_hash.rest(ledger, [(b, b.numel()) for b in bufs])
    assert got is not None
    values = ledger._finish(got, [(b, b.numel()) for b in bufs])
    assert values == [ig.partial(s, coef) for s in sent]  # every message's digest: the sender's hash of it
    want = _unpacked(dests, pairs, area, msgs, sent)  # bit for bit, and nothing outside the views
    for k, t in dests.items():
        assert torch.equal(t.view(torch.uint8), want[k].view(torch.uint8)), k
    assert lane_hash.take(ledger, [(b, b.numel()) for b in bufs])[:2] == values[:2]
    assert not ledger.lane_unpacks


def test_no_lane_landed_leaves_the_whole_unpack_to_the_step():
    _native()
    g = torch.Generator().manual_seed(5)
    area, msgs, pairs, _dests, sent = _step(torch.float32, g)
    ledger = ig.Ledger(
        b"k", ig.Coefficients(b"k" * 32), 0, "p", type("W", (), {"steps": [(0, None)]})(), (), {}
    )
    lanes = _Lanes()
    lane_hash.attach(ledger, type("C", (), {"lanes": lanes})())
    bufs = [area[o : o + n] for o, n in msgs]
    lane_hash.want(ledger, list(enumerate(bufs)), (pairs, "s"))
    for b, s in zip(bufs, sent, strict=True):
        b.copy_(s)
    assert lane_hash.rest(ledger, [(b, b.numel()) for b in bufs]) is None
    assert not ledger.lane_plans


def test_a_message_whose_first_piece_came_before_it_was_registered_lands_in_its_buffer():
    """A receive pre-posted with the handshake can take its first pieces in the handshake's waits, before the
    step registers its unpack: the lane then copies the whole message into its buffer (not the rest into the
    destination) and the step's unpack copies it from there, bit-exact, its digest the sender's."""
    _native()
    g = torch.Generator().manual_seed(9)
    area, msgs, pairs, dests, sent = _step(torch.float32, g)
    coef = ig.Coefficients(b"k" * 32)
    ledger = ig.Ledger(b"k", coef, 0, "p", type("W", (), {"steps": [(0, None)]})(), (), {})
    lanes = _Lanes()
    lane_hash.attach(ledger, type("C", (), {"lanes": lanes})())
    bufs = [area[o : o + n] for o, n in msgs]
    first = 40
    lanes.copy_out(sent[0][:first].clone(), bufs[0], [])  # (as the first piece of message 0, unregistered)
    lane_hash.want(ledger, list(enumerate(bufs)), (pairs, "s"))
    ring = sent[0].clone()
    total, key = ring.numel(), bufs[0].data_ptr()
    for a, z in ((first, 301), (301, total)):  # its next pieces, once registered
        h = lanes.copy_hash(ring[a:z], bufs[0].view(-1)[a:z], a, total)
        lanes.hashed[key, total] = (lanes.hashed.get((key, total), 0) + h) & ((1 << 64) - 1)
    lanes.copy_out(sent[1].clone(), bufs[1], [17])
    bufs[2].copy_(sent[2])
    assert torch.equal(bufs[0], sent[0])  # all of message 0 in its buffer
    got = lane_hash.rest(ledger, [(b, b.numel()) for b in bufs])
    values = ledger._finish(got, [(b, b.numel()) for b in bufs])
    assert values == [ig.partial(s, coef) for s in sent]
    want = _unpacked(dests, pairs, area, msgs, sent)
    for k, t in dests.items():
        assert torch.equal(t.view(torch.uint8), want[k].view(torch.uint8)), k
