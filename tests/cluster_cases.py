"""Rank side of ``test_cluster.py``: refits across the emulated nodes of ``triton_reshard.testing.cluster``.

2 nodes x 2 ranks: the trainer (TP2, rows) on node 0 = ranks 0-1, the engine on node 1 = ranks 2-3 (TP2 by
columns, or every rank a full replica for the relayed refit). Each refit is bracketed by barriers and the
node's interface counters (``link_counters``), so the bytes it put on each link are measured; destinations are
poisoned (all bits set) before the first refit into them and checked bit for bit against slicing the global
tensors. Everything returned is JSON (the harness reads it from a file).
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from triton_reshard import Layout, Replicate, Shard, refit
from triton_reshard.testing.cluster import link_counters

SHAPES = {"w0": (512, 1024), "w1": (384, 1024), "w2": (1024, 512), "b": (1024,)}
RANKS_PER_NODE = 2
TIMEOUT = 60.0


def layouts(shapes=SHAPES):
    shapes = {n: tuple(s) for n, s in shapes.items()}
    src = Layout.from_placements(shapes, [0, 1], [Shard(0)], torch.bfloat16)
    dst = Layout.from_placements(shapes, [2, 3], {n: [Shard(len(s) - 1)] for n, s in shapes.items()}, torch.bfloat16)
    rep = Layout.from_placements(shapes, [2, 3], [Replicate()], torch.bfloat16)
    return src, dst, rep


def measured(fn):
    """``fn()`` between two barriers, with this node's link counters read around it: (result, bytes dict)."""
    dist.barrier()
    c0 = link_counters()
    t0 = time.perf_counter()
    out = fn()
    dist.barrier()
    secs = time.perf_counter() - t0
    c1 = link_counters()
    return out, {**(c1 - c0).as_dict(), "seconds": secs}


def _mismatches(dst: dict, want: dict, what: str) -> list[str]:
    bad = []
    for n, t in want.items():
        a, b = dst[n].view(torch.int16), t.view(torch.int16)
        if not torch.equal(a, b):
            k = int((a != b).sum())
            bad.append(f"{what}: {n!r}: {k} of {a.numel()} elements differ from the global tensor's slice")
    return bad


def _poisoned(layout: Layout, rank: int) -> dict:
    out = layout.allocate(rank)
    for t in out.values():
        t.view(torch.int16).fill_(-1)  # all bits set: a NaN nobody wrote
    return out


def refits(rank: int, world: int, shapes: dict, lr: float, seed: int) -> dict:
    """Dense, delta (after an AdamW step) and relayed refits (relay on and off) across the two nodes."""
    from tests.delta_cases import Trainer

    src_l, dst_l, rep_l = layouts(shapes)
    specs = {n: (tuple(s), torch.bfloat16) for n, s in shapes.items()}
    tr = Trainer(specs, seed=seed)
    tr.opt.param_groups[0]["lr"] = lr
    pub = tr.published()
    src = src_l.shard(pub, rank) if rank < 2 else {}
    out: dict = {"node": rank // RANKS_PER_NODE}
    _, out["idle"] = measured(lambda: None)

    # dense, with delta=True so that its snapshot is captured for the next one
    dst = _poisoned(dst_l, rank) if rank >= 2 else {}
    rep, link = measured(lambda: refit(src, dst, src_l, dst_l, version=0, delta=True, timeout=TIMEOUT))
    out["dense"] = {"link": link, "sent": rep.sent_bytes, "mode": rep.mode, "seconds": rep.seconds,
                    "bad": _mismatches(dst, dst_l.shard(pub, rank), "dense") if rank >= 2 else []}

    # one AdamW step: the delta refit sends only the elements whose bf16 bits changed
    tr.step("adam")
    pub2 = tr.published()
    changed = sum(int((pub2[n].view(torch.int16) != pub[n].view(torch.int16)).sum()) for n in pub)
    total = sum(t.numel() for t in pub.values())
    if rank < 2:
        for n, t in src_l.shard(pub2, rank).items():
            src[n].copy_(t)
    rep, link = measured(lambda: refit(src, dst, src_l, dst_l, version=1, delta=True, timeout=TIMEOUT))
    out["delta"] = {"link": link, "sent": rep.sent_bytes, "dense_sent": rep.dense_sent_bytes, "mode": rep.mode,
                    "seconds": rep.seconds, "changed_fraction": changed / total,
                    "bad": _mismatches(dst, dst_l.shard(pub2, rank), "delta") if rank >= 2 else []}

    # replicated engine ranks on one node: relayed (each piece crosses once) and not (once per engine rank)
    for name, relay in (("relay_on", True), ("relay_off", False)):
        d = _poisoned(rep_l, rank) if rank >= 2 else {}
        rep, link = measured(lambda d=d, relay=relay: refit(src, d, src_l, rep_l, gpus_per_node=RANKS_PER_NODE,
                                                            relay=relay, timeout=TIMEOUT))
        out[name] = {"link": link, "sent": rep.sent_bytes, "seconds": rep.seconds,
                     "bad": _mismatches(d, rep_l.shard(pub2, rank), name) if rank >= 2 else []}
    return out


def dies(rank: int, world: int, victim: int) -> dict:
    """Rank ``victim`` exits hard after the rendezvous; the others start a dense refit and must fail named."""
    src_l, dst_l, _ = layouts()
    if rank == victim:
        os._exit(7)
    from triton_reshard.testing import synthetic_global

    pub = {n: synthetic_global(n, s, torch.bfloat16) for n, s in SHAPES.items()}
    src = src_l.shard(pub, rank) if rank < 2 else {}
    dst = _poisoned(dst_l, rank) if rank >= 2 else {}
    refit(src, dst, src_l, dst_l, timeout=10.0)
    return {"unexpected": "refit completed without the victim"}


def lossy(rank: int, world: int, repeats: int) -> dict:
    """Dense refits over a lossy link: each completes bit-exact or raises (the caller times the whole run)."""
    src_l, dst_l, _ = layouts()
    from triton_reshard.testing import synthetic_global

    pub = {n: synthetic_global(n, s, torch.bfloat16) for n, s in SHAPES.items()}
    src = src_l.shard(pub, rank) if rank < 2 else {}
    rows = []
    for _ in range(repeats):
        dst = _poisoned(dst_l, rank) if rank >= 2 else {}
        rep, link = measured(lambda dst=dst: refit(src, dst, src_l, dst_l, timeout=TIMEOUT))
        rows.append({"seconds": rep.seconds, "link": link,
                     "bad": _mismatches(dst, dst_l.shard(pub, rank), "lossy") if rank >= 2 else []})
    return {"rows": rows}


def rtts(rank: int, world: int, n: int) -> dict:
    """Round trips of a 4-byte message between every pair of ranks (one rank per node): ``n`` ping-pongs per
    pair, timed on the lower rank; every rank returns {"a-b": [seconds, ...]} for the pairs it timed."""
    small = torch.zeros(1)
    out: dict = {}
    for a in range(world):
        for b in range(a + 1, world):
            dist.barrier()
            if rank not in (a, b):
                continue
            times = []
            for _ in range(n + 2):  # the first two: connection set-up
                t0 = time.perf_counter()
                if rank == a:
                    dist.send(small, b)
                    dist.recv(small, b)
                else:
                    dist.recv(small, a)
                    dist.send(small, a)
                times.append(time.perf_counter() - t0)
            if rank == a:
                out[f"{a}-{b}"] = times[2:]
    dist.barrier()
    return out


def env_of(rank: int, world: int, names: list[str]) -> dict:
    """This rank's node and the values of ``names`` in its environment (None where unset); after a barrier (a
    rank that leaves before its peers have connected fails their rendezvous)."""
    dist.barrier()
    return {"node": int(os.environ["TRITON_RESHARD_CLUSTER_NODE"]), **{n: os.environ.get(n) for n in names}}
