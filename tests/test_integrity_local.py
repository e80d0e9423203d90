"""Issue 46: an in-place send's digest taken in the local copies' pass. A send that goes on the wire in place
(its bytes are the source tensor's) has no pack copy to hash it; when the rank's local copies read the same
source bytes (a rank keeping its shard and sending it to others), they hash them as they copy, so the send
needs no read pass of its own. The values are the plain hash of each send; the copies write what torch
writes; bytes no local copy reads are still hashed, and a local copy cut off a row boundary is left whole."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from triton_reshard.execute import integrity as ig
from triton_reshard.ops import digest as nd


def _coef() -> ig.Coefficients:
    return ig.Coefficients(ig.digest_key(type("G", (), {"digest_key": b"l" * 32})()))


def _native() -> None:
    if nd.native() is None or nd.copy_native() is None:
        pytest.skip("the native extension is not built")


def _flat(t: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
    """Rows ``[r0, r1)`` of the contiguous 2-D ``t`` as the flat uint8 buffer an in-place send posts."""
    return t[r0:r1].view(torch.uint8).view(-1)


def _whole(bufs) -> tuple:
    """What a fused pack that copied none of ``bufs`` returns: no hash, every message one gap."""
    gaps = [nd.buffer_rows(b) for b in bufs]
    return np.zeros(len(bufs), dtype=np.uint64), gaps


def _ledger(steps: int) -> ig.Ledger:
    work = type("W", (), {"steps": [(i, None) for i in range(steps)]})()
    return ig.Ledger(b"k", _coef(), 0, "p", work, (), {})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_cut_pairs_cover_the_copies_exactly_and_pieces_lie_inside_one_span(dtype):
    g = torch.Generator().manual_seed(3)
    src = torch.randint(0, 100, (101, 12), generator=g).to(dtype)
    dst_full = torch.full((101, 20), 77, dtype=dtype)
    dst = dst_full[:, 5:17]  # strided destination
    other = torch.randint(0, 100, (33,), generator=g).to(dtype)
    other_dst = torch.full((33,), 55, dtype=dtype)
    spans = [
        (_flat(src, 10, 30).data_ptr(), _flat(src, 10, 30).numel()),
        (_flat(src, 50, 101).data_ptr(), _flat(src, 50, 101).numel()),
    ]
    inside, rest = nd.cut_pairs([(src, dst), (other, other_dst)], spans)
    starts = sorted(spans)
    for s, _d in inside:
        a, n = [sp for sp in starts if sp[0] <= s.data_ptr()][-1]
        assert s.data_ptr() + s.numel() * s.element_size() <= a + n
    assert sum(s.numel() for s, _d in inside) == 20 * 12 + 51 * 12
    for s, d in inside + rest:
        d.copy_(s)
    assert torch.equal(dst, src) and torch.equal(other_dst, other)
    assert torch.equal(dst_full[:, :5], torch.full((101, 5), 77, dtype=dtype))  # nothing outside the views


def test_a_span_edge_off_a_row_boundary_leaves_the_copy_whole():
    src = torch.arange(40 * 4, dtype=torch.float32).view(40, 4)
    buf = src.view(torch.uint8).view(-1)[24:200]  # starts inside row 1
    inside, rest = nd.cut_pairs([(src, torch.empty_like(src))], [(buf.data_ptr(), buf.numel())])
    assert inside == [] and len(rest) == 1 and rest[0][0] is src


def test_in_place_sends_take_their_digest_from_the_local_copies():
    """Step 0's in-place sends are posted before the local copies run (deferred), step 1's after (taken at
    once); a send no local copy reads is hashed whole. Every value is the plain hash of the send; the
    destinations hold the sources bit for bit."""
    _native()
    g = torch.Generator().manual_seed(11)
    a = torch.randn(300, 70, generator=g)  # 280 B rows: spans cross the hash's 1 KiB rows anywhere
    b = torch.randn(64, 9, generator=g)
    c = torch.randn(5000, generator=g)  # sent, never copied locally
    da = torch.full((300, 90), float("nan"))[:, 10:80]
    db = torch.full((64, 9), float("nan"))
    sends0 = [(1, _flat(a, 0, 117)), (2, c.view(torch.uint8)), (3, _flat(b, 8, 64))]
    sends1 = [(1, _flat(a, 117, 300)), (2, _flat(a, 0, 117))]  # the same bytes again, to another peer
    wire = [(sends0, []), (sends1, [])]
    led = _ledger(2)
    led._fused["pack", 0] = _whole([buf for _p, buf in sends0])  # (what Ledger.pack leaves: nothing copied)
    led.on_post(0, sends0, [])
    assert set(led._later[0]) == {0, 1, 2}  # deferred: the local copies have not run
    rest = led.local([(a, da), (b, db)], wire, ("k", "local"), "torch")
    for s, d in rest:
        d.copy_(s)
    assert torch.equal(da, a) and torch.equal(db, b)
    assert len(led._local) == 3 and not led._later.get(0)
    led._fused["pack", 1] = _whole([buf for _p, buf in sends1])
    led.on_post(1, sends1, [])
    assert not led._later.get(1)
    coef = led.coef
    want = {
        1: [ig.partial(sends0[0][1], coef), ig.partial(sends1[0][1], coef)],
        2: [ig.partial(sends0[1][1], coef), ig.partial(sends1[1][1], coef)],
        3: [ig.partial(sends0[2][1], coef)],
    }
    led._values()
    assert {p: [e[2] for e in es] for p, es in led.sent.items()} == want


def test_a_send_the_local_copies_read_in_part_adds_the_hash_of_the_rest():
    _native()
    g = torch.Generator().manual_seed(12)
    a = torch.randn(64, 33, generator=g)
    whole = torch.empty(100 * 33)
    whole[: 64 * 33] = a.view(-1)
    whole[64 * 33 :] = torch.randn(36 * 33, generator=g)
    src = whole[: 64 * 33].view(64, 33)  # the local copy reads the first 64 rows of the send only
    dst = torch.full((64, 33), float("nan"))
    send = whole.view(torch.uint8)
    led = _ledger(1)
    rest = led.local([(src, dst)], [([(1, send)], [])], ("k", "local"), "torch")
    for s, d in rest:
        d.copy_(s)
    led._fused["pack", 0] = _whole([send])
    led.on_post(0, [(1, send)], [])
    led._values()
    assert torch.equal(dst, src) and led.sent[1][0][2] == ig.partial(send, led.coef)
    h, gaps = led._local[send.data_ptr(), send.numel()]
    assert int(gaps[:, 2].sum()) == 36 * 33 * 4


def test_a_flipped_source_byte_changes_the_sends_digest():
    """The digest the local copies take is of the bytes they read: a source byte changed before the copy
    (what the wire then carries) changes the send's value."""
    _native()
    a = torch.randn(50, 16, generator=torch.Generator().manual_seed(13))
    send = _flat(a, 0, 50)
    clean = ig.partial(send.clone(), _coef())
    send[1234] ^= 0x08
    led = _ledger(1)
    led._fused["pack", 0] = _whole([send])
    led.on_post(0, [(1, send)], [])
    for s, d in led.local([(a, torch.empty_like(a))], [([(1, send)], [])], ("k", "local"), "torch"):
        d.copy_(s)
    led._values()
    assert led.sent[1][0][2] == ig.partial(send, led.coef) != clean
