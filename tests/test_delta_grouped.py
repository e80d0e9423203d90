"""Fewer, larger delta messages (issue 44 item 2): in a delta refit a step's delta-able messages to one peer go
on the wire as one message (``execute.delta.wire_groups``). Over a spawned gloo world of 3 (rank 0 holds every
tensor, ranks 1-2 receive shards): one payload message per peer per step where the plan has several, counted
at the transport; bit-exact into NaN / 0xFF-poisoned destinations for every element size the delta takes,
through changes that need every width (one ulp, sign flips, NaN payloads, everything changed); sends that
share a snapshot (a replicated tensor: the same box to both receivers) packed alone and joined; and a bit
flipped in a joined message in flight caught by the integrity digest on every rank, naming its tensors, then
repaired by the next refit (dense).

Fails without the grouping: ``GROUP = False`` in ``execute/delta.py`` sends ~one message per plan message
(the count assertion)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.integrity_cases import RecvFault, flip_delta_value
from triton_reshard import Layout, Replicate, Resharder, Shard, plan_reshard
from triton_reshard.execute.delta import DeltaRequest
from triton_reshard.testing.launch import run_world

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool]
SHAPES = {f"t{k}": ((40 + 3 * k, 24) if k % 2 else (33, 20 + k)) for k in range(len(DTYPES))}  # (short names:
# the digest's error names a joined message's tensors in 56 bytes)
DT = dict(zip(SHAPES, DTYPES, strict=True))


def _layouts(replicated: bool):
    names = list(SHAPES)
    place = {n: [Shard(k % 2)] for k, n in enumerate(names)}  # rows (in place) and column blocks (staged)
    if replicated:  # the same box to both receivers: one snapshot, diffed once, joined into both messages
        for n in names[::3]:
            place[n] = [Replicate()]
    src = Layout.from_placements(SHAPES, [0], [Replicate()], DT)
    return src, Layout.from_placements(SHAPES, [1, 2], place, DT)


def _data(version: int) -> dict[str, torch.Tensor]:
    """Version 0 random; each later one changes a few elements of every tensor (one ulp up or down, a sign
    flip, a NaN payload) and, at version 3, every element of the first tensor (sign flips)."""
    g = torch.Generator().manual_seed(44)
    out = {}
    for n, shape in SHAPES.items():
        dt = DT[n]
        if dt == torch.bool:
            t = torch.rand(shape, generator=g) < 0.5
        elif dt.is_floating_point:
            t = torch.randn(shape, generator=g).to(dt)
        else:
            t = torch.randint(0, 100, shape, generator=g).to(dt)
        out[n] = t
    for v in range(1, version + 1):
        g = torch.Generator().manual_seed(100 + v)
        for k, t in enumerate(out.values()):
            flat = t.view(-1)
            pos = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 20)]
            if t.dtype == torch.bool:
                flat[pos] = ~flat[pos]
                continue
            ints = flat.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
            ints[pos[0::3]] += 1  # one ulp (or one) up
            ints[pos[1::3]] -= 1
            if t.dtype.is_floating_point:
                ints[pos[2::3]] ^= -(1 << (8 * t.element_size() - 1))  # sign flips
                if t.element_size() >= 2:
                    ints[pos[:1]] = -1  # an all-ones bit pattern: a NaN with a full payload
            if v == 3 and k == 0:
                ints.neg_()
    return out


class Count:
    """Per post on this process's transport, the payload messages (uint8, >= 16 bytes) per peer, sends and
    receives."""

    def __enter__(self):
        from triton_reshard.comm.group import TorchGroup

        self.real = real = TorchGroup.post
        self.posts = []

        def post(group, sends, recvs):
            def per(side):
                return Counter(p for p, b in side if b.dtype == torch.uint8 and b.numel() >= 16)

            self.posts.append((per(sends), per(recvs)))
            return real(group, sends, recvs)

        TorchGroup.post = post
        return self

    def __exit__(self, *exc):
        from triton_reshard.comm.group import TorchGroup

        TorchGroup.post = self.real
        return False


def _same(dst: dict, want: dict) -> bool:
    return all(torch.equal(dst[n].contiguous().view(torch.uint8), want[n].contiguous().view(torch.uint8)) for n in want)


def _poisoned(layout, rank: int) -> dict:
    out = {}
    for n, spec in layout.local_specs(rank).items():
        t = torch.empty(spec.shape, dtype=spec.dtype)
        t.view(torch.uint8).fill_(0xFF)  # (a NaN for every float width)
        out[n] = t
    return out


def grouped_world(rank: int, world: int, replicated: bool) -> dict:
    import triton_reshard.execute.strategies as xs

    joined, real = [0], xs.join_messages

    def join(msgs):  # counted: the sends sharing a snapshot go this way
        joined[0] += 1
        return real(msgs)

    xs.join_messages = join
    src_l, dst_l = _layouts(replicated)
    r = Resharder(plan_reshard(src_l, dst_l, rank=rank), timeout=60, direct_min_bytes=256)  # several per peer
    per_peer = [max(Counter(p for p, _a, _m in (st.sends or st.recvs)).values()) for _i, st in r.steps]
    src = {n: t.clone() for n, t in _data(0).items()} if rank == 0 else {}
    dst = _poisoned(dst_l, rank) if rank else {}
    out = {"plan_per_peer": per_peer, "rows": [], "exact": []}

    def go(v, held):
        if rank == 0:
            for n, t in _data(v).items():
                src[n].copy_(t)
        with Count() as c:
            rep = r.run(src, dst, delta=DeltaRequest(v, held=held))
        out["rows"].append({"v": v, "mode": rep.mode, "posts": [(dict(s), dict(q)) for s, q in c.posts
                                                                 if s or q]})
        out["exact"].append(_same(dst, dst_l.shard(_data(v), rank)) if rank else True)

    go(0, None)  # dense: the snapshot
    for v in (1, 2, 3):
        go(v, v - 1)
    fault = RecvFault(flip_delta_value) if rank == 1 else None
    try:
        if fault is not None:
            fault.__enter__()
        go(4, 3)
        out["caught"] = None
    except Exception as e:  # the integrity error, on every rank
        out["caught"] = (type(e).__name__, getattr(e, "tensor", None), str(e)[:300])
    finally:
        if fault is not None:
            fault.__exit__()
            out["fired"] = fault.fired
    go(5, None)  # after the failed refit: dense, repairs
    out["joined"] = joined[0]
    return out


@pytest.mark.parametrize("replicated", [False, True], ids=["sharded", "replicated-joined"])
def test_one_delta_message_per_peer_per_step(replicated):
    res = run_world(grouped_world, 3, replicated, backend="gloo", timeout=300)
    for rank, out in enumerate(res):
        assert max(out["plan_per_peer"]) >= 4, out["plan_per_peer"]  # the plan has several messages per peer
        assert all(out["exact"]), (rank, out["exact"])
        rows = out["rows"]
        assert [row["mode"] for row in rows] == ["dense-fallback", "delta", "delta", "delta", "dense-fallback"]
        for row in rows[1:4]:  # deltas: one payload message per peer in each post, as many posts as steps
            assert len(row["posts"]) == len(out["plan_per_peer"]), (rank, row)
            for sends, recvs in row["posts"]:
                assert all(n == 1 for n in list(sends.values()) + list(recvs.values())), (rank, row)
        # the dense runs send the plan's messages (several per peer): what the grouping saves
        assert max(n for s, q in rows[0]["posts"] for n in list(s.values()) + list(q.values())) >= 4
        name, tensor, text = out["caught"]
        assert name == "ReshardIntegrityError", out["caught"]
        assert tensor is not None and len(tensor.split(",")) > 1 and set(tensor.split(",")) <= set(SHAPES), text
    assert res[1]["fired"]
    assert (res[0]["joined"] > 0) == replicated, res[0]["joined"]  # joined where sends share a snapshot, else one pack
