"""Same-host lanes (``comm/lanes.py``): gloo messages between ranks of one host through a shared-memory ring.

Real gloo worlds on this machine, the public ``refit``: every destination poisoned (NaN) before each refit
and compared bit for bit with the global tensors sliced by the destination layout. The lanes are checked to
have carried the messages (their counts), in one piece or in several (a lane too small for some messages, a
ring that wraps and fills: pieces wait for room), for dense and delta refits (a delta's receive buffer is larger than its message),
with one rank that has lanes off, over a RefitGroup, and with the ring's bytes or a header corrupted in
flight: the digest names the first, the receiver names the second; nothing is silent. No segment stays in
``/dev/shm``."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from triton_reshard.comm import lane_ends as E
from triton_reshard.comm import lanes as L
from triton_reshard.testing.launch import run_world

WORLD = 4


def _layouts(mb: float):
    from triton_reshard.tools.parallel import llama_pair

    return llama_pair(mb)


def _global(src, version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    out = {t.name: torch.randn(t.shape, generator=g) for t in src.tensors}
    for v in range(1, version + 1):  # a few elements change per version (what a delta sends)
        g = torch.Generator().manual_seed(100 + v)
        for t in out.values():
            flat = t.view(-1)
            idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 100),), generator=g)
            flat[idx] += 1e-3
    return out


def _lanes_of(group=None):
    from triton_reshard.comm.group import RefitGroup, TorchGroup

    return group.lanes if isinstance(group, RefitGroup) else TorchGroup(group).lanes


def _refits(rank: int, src, dst, versions, delta: bool = False, group=None) -> list[bool]:
    from triton_reshard import refit

    ok, d = [], None
    for v in versions:
        glob = _global(src, v)
        s = src.shard(glob, rank)
        expect = dst.shard(glob, rank)
        if d is None or not delta:  # a delta patches what the last refit wrote: poisoned before the first only
            d = {k: torch.full_like(t, float("nan")) for k, t in expect.items()}
        refit(s, d, src, dst, group=group, **({"delta": True, "version": v} if delta else {}))
        ok.append(all(torch.equal(d[k], expect[k]) for k in expect))
    return ok


def lanes_world(rank: int, world: int, mb: float, lane_mb: str, off_rank: int, delta: bool) -> dict:
    os.environ["TRITON_RESHARD_LANE_MB"] = lane_mb
    if rank == off_rank:
        os.environ["TRITON_RESHARD_LANES"] = "0"
    src, dst = _layouts(mb)
    ok = _refits(rank, src, dst, range(6), delta=delta)
    lanes = _lanes_of()
    token = f"{lanes.token:016x}"
    left = [f for f in os.listdir(E.SHM_DIR) if token in f]  # the names this rank made: none left
    return {"ok": ok, "counts": dict(lanes.counts), "out": sorted(lanes.out), "inn": sorted(lanes.inn),
            "left": left}


@pytest.mark.parametrize("lane_mb,delta", [("64", False), ("3", False), ("64", True)])
def test_lanes_carry_refits_bit_exact(lane_mb, delta):
    """Every message between the four ranks goes through a lane: in the ring, and with a 3 MiB budget (1 MiB
    lanes) the larger ones in pieces, waiting for room, the ring wrapping; dense and delta refits bit-exact."""
    res = run_world(lanes_world, WORLD, 6.0, lane_mb, -1, delta, timeout=300)
    for r, out in enumerate(res):
        assert out["ok"] == [True] * 6, (r, out["ok"])
        assert out["out"] == out["inn"] == [q for q in range(WORLD) if q != r]
        c = out["counts"]
        assert c["ring"] > 0 and c["gloo"] == 0, (r, c)
        assert c["hashed"] > 0, (r, c)  # the digest took in-place receives' hashes from the lane's copy
        if lane_mb == "3":
            assert c["pieces"] > c["ring"] and c["waits"] > 0, (r, c)  # messages in several pieces, room waited for
        assert not out["left"], out["left"]


def test_lanes_off_on_one_rank():
    """A rank with ``TRITON_RESHARD_LANES=0`` has no lanes; the others keep theirs among themselves and talk
    to it over gloo; every refit bit-exact."""
    res = run_world(lanes_world, WORLD, 2.0, "64", 2, False, timeout=300)
    for r, out in enumerate(res):
        assert out["ok"] == [True] * 6, (r, out["ok"])
        want = [] if r == 2 else [q for q in range(WORLD) if q not in (r, 2)]
        assert out["out"] == out["inn"] == want, (r, out)
        if r != 2:
            assert out["counts"]["ring"] > 0 and out["counts"]["gloo"] > 0


def refit_group_world(rank: int, world: int, port: int) -> dict:
    from triton_reshard import init_refit_group

    src, dst = _layouts(2.0)
    g = init_refit_group("127.0.0.1", port, rank, world, backend="gloo", timeout=60)
    try:
        ok = _refits(rank, src, dst, range(5), group=g)
        counts = dict(g.lanes.counts)
        g.barrier()
    finally:
        g.destroy()
    return {"ok": ok, "counts": counts, "closed": not g.lanes}


def test_lanes_on_a_refit_group():
    from triton_reshard.comm.group import free_port

    res = run_world(refit_group_world, WORLD, free_port(), timeout=300)
    for r, out in enumerate(res):
        assert out["ok"] == [True] * 5, (r, out)
        assert out["counts"]["ring"] > 0 and out["counts"]["gloo"] == 0, (r, out)
        assert out["closed"]


def corrupt_world(rank: int, world: int, what: str) -> dict:
    """Three clean refits (the lanes are in use from the fourth), then rank 0 corrupts one message to rank 1 as
    it goes: ``ring``, one byte in the ring before its header is rung; ``header``, the header's sequence number. Then (ring)
    a clean refit, which repairs the destination."""
    from triton_reshard import ReshardError, refit

    src, dst = _layouts(2.0)
    ok = _refits(rank, src, dst, range(3))
    hit = {"n": 0}
    send = L.Lanes.send
    if rank == 0:

        def bad_send(self, pg, peer, gpeer, buf):
            nbytes = buf.numel() * buf.element_size()
            if peer != 1 or hit["n"] or nbytes < 4096 or peer not in self.out:
                return send(self, pg, peer, gpeer, buf)
            hit["n"] += 1
            lane = self.out[peer]
            if what == "header":
                lane.seq += 5  # this message's header carries a sequence number the receiver does not expect
                return send(self, pg, peer, gpeer, buf)
            real_ring = lane.ring

            def ring(hdr):  # the message is in the ring, its header not yet rung: flip its last byte there
                lane.ring = real_ring
                end = lane.head % lane.seg.cap or lane.seg.cap
                lane.seg.data[end - 1] ^= 0x40
                return real_ring(hdr)

            lane.ring = ring
            return send(self, pg, peer, gpeer, buf)

        L.Lanes.send = bad_send
    glob = _global(src, 0)
    s, expect = src.shard(glob, rank), dst.shard(glob, rank)
    d = {k: torch.full_like(t, float("nan")) for k, t in expect.items()}
    err = None
    try:
        refit(s, d, src, dst, timeout=20)
    except ReshardError as e:
        err = f"{type(e).__name__}: {e}"
    L.Lanes.send = send
    if what == "ring":
        ok += _refits(rank, src, dst, range(1))
    return {"err": err, "hit": hit["n"], "ok": ok}


def test_lanes_ring_corruption_is_named_by_the_digest():
    res = run_world(corrupt_world, WORLD, "ring", timeout=300, allow_errors=True)
    assert res[0]["hit"] == 1
    for r, out in enumerate(res):
        assert isinstance(out, dict), (r, out)
        assert out["err"] and "ReshardIntegrityError" in out["err"], (r, out)
        assert "from rank 0 to rank 1" in out["err"], (r, out)
        assert out["ok"] == [True] * 4, (r, out)  # and the next refit repairs it


def test_lanes_bad_header_is_named_not_silent():
    res = run_world(corrupt_world, WORLD, "header", timeout=300, allow_errors=True)
    text = res[1]["err"] if isinstance(res[1], dict) else str(res[1])
    assert text and "same-host lane from rank 0" in text and "does not match" in text, text
    for r, out in enumerate(res):  # every rank returns or raises within the timeout: none hangs, none is silent
        assert not isinstance(out, dict) or out["err"], (r, out)


def test_segment_create_refuses_a_taken_name_and_open_checks_owner_mode_size(tmp_path, monkeypatch):
    monkeypatch.setattr(E, "SHM_DIR", str(tmp_path))
    seg = E.create(123, 0, 1, 1 << 16)
    assert seg is not None and stat.S_IMODE(os.stat(seg.path).st_mode) == 0o600
    assert E.create(123, 0, 1, 1 << 16) is None  # O_EXCL: a name someone holds is never used
    assert E.open_peer(123, 0, 1, 1 << 15) is None  # not the announced size
    os.chmod(seg.path, 0o644)
    assert E.open_peer(123, 0, 1, 1 << 16) is None  # readable by others: refused
    os.chmod(seg.path, 0o600)
    other = tmp_path / "triton_reshard-000000000000007b-2-3"
    other.symlink_to(seg.path)
    assert E.open_peer(123, 2, 3, 1 << 16) is None  # a link: refused (O_NOFOLLOW)
    peer = E.open_peer(123, 0, 1, 1 << 16)
    assert peer is not None and peer.cap == (1 << 16) - E.CTRL_BYTES
    assert not os.path.exists(seg.path)  # the second end unlinks the name once it holds the segment
    seg.data[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert peer.data[:4].tolist() == [1, 2, 3, 4]  # one memory
    fd = E.make_fifo(5, 1, 0)
    assert fd is not None and E.make_fifo(5, 1, 0) is None  # mkfifo: a taken name is not used
    wfd = E.open_fifo(5, 1, 0)
    assert wfd is not None and not os.path.exists(E._name(5, 1, 0) + ".fifo")
    for f in (fd, wfd):
        os.close(f)
    seg.close()
    peer.close()


def test_budget_env_is_checked(monkeypatch):
    monkeypatch.setenv("TRITON_RESHARD_LANE_MB", "lots")
    with pytest.raises(ValueError, match="TRITON_RESHARD_LANE_MB"):
        E.budget_bytes()
    monkeypatch.setenv("TRITON_RESHARD_LANE_MB", "0.5")
    assert E.budget_bytes() == 1 << 19
