"""What the same-host lanes (``comm/lanes.py``) save: the same dense refits with lanes on and off, side by side.

A gloo world of ``--world`` ranks on this machine refits a Llama-shaped model of ``--mb`` MB (fp32,
Megatron-style TP2 x DP2 -> TP1 x DP4 at 4 ranks: every rank sends and receives) through the public ``refit``,
the digest on (the default). Per setting a fresh world (``TRITON_RESHARD_LANES=1`` / ``0``), settings
alternating ``--rounds`` times (which goes first alternates too); in each world ``--warmup`` refits (at least 3:
the lanes are set up over a group's first handshakes and in use from its fourth refit), then
``--refits`` timed ones, each from a barrier to the slowest rank's return (max over ranks), and the CPU every
rank's process spent (all threads, summed: on a shared machine the steadier of the two). Every refit is
checked bit-exact against the sliced global tensors (poisoned destinations). Prints per size the medians and
the ratios off / on, and the lanes' counts (messages through a lane, their bytes and pieces, pushes that waited
for room, messages without a lane)::

    python perf/bench_lanes.py --mb 2,16,64,256 --rounds 2 --out perf/results/bench_lanes.json

``--messages``: the transport alone, one message of each ``--sizes`` KiB from rank 0 to rank 1 and back
(ping-pong, ``--repeats`` times), through a lane and over gloo's loopback TCP.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _cpu() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def refit_world(rank: int, world: int, mb: float, warmup: int, refits: int) -> dict:
    import torch.distributed as dist

    from triton_reshard import refit
    from triton_reshard.comm.group import TorchGroup
    from triton_reshard.tools.parallel import llama_pair

    src, dst = llama_pair(mb)
    g = torch.Generator().manual_seed(11)
    glob = {t.name: torch.randn(t.shape, generator=g) for t in src.tensors}
    s, expect = src.shard(glob, rank), dst.shard(glob, rank)
    del glob
    d = {k: torch.empty_like(t) for k, t in expect.items()}
    wall, cpu = [], []
    for i in range(warmup + refits):
        for t in d.values():
            t.fill_(float("nan"))
        dist.barrier()
        t0, c0 = time.perf_counter(), _cpu()
        refit(s, d, src, dst)
        c1 = _cpu()
        dist.barrier()
        t1 = time.perf_counter()
        if i >= warmup:
            wall.append(t1 - t0)
            cpu.append(c1 - c0)
        bad = [k for k in expect if not torch.equal(d[k], expect[k])]
        if bad:
            raise AssertionError(f"rank {rank}: refit {i} wrote {bad[:3]} wrong")
    return {"wall": wall, "cpu": cpu, "counts": dict(TorchGroup(None).lanes.counts)}


def message_world(rank: int, world: int, sizes: list[int], repeats: int) -> dict:
    import torch.distributed as dist

    from triton_reshard.comm.group import TorchGroup

    comm = TorchGroup(None)
    from datetime import timedelta

    setup = comm.lane_setup(timedelta(seconds=60))
    for _ in range(4):  # the setup's four steps (a refit's handshakes take them)
        setup.take()
        setup.post()
    out = {}
    for kib in sizes:
        buf = torch.full((kib << 10,), rank, dtype=torch.uint8)
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                for w in comm.post([(1, buf)], []):
                    w.wait()
                for w in comm.post([], [(1, buf)]):
                    w.wait()
            elif rank == 1:
                for w in comm.post([], [(0, buf)]):
                    w.wait()
                for w in comm.post([(0, buf)], []):
                    w.wait()
            times.append(time.perf_counter() - t0)
        out[kib] = min(times) / 2
    return out


def _run(fn, world: int, on: bool, *args) -> list:
    from triton_reshard.testing.launch import run_world

    return run_world(fn, world, *args, timeout=1800, env={"TRITON_RESHARD_LANES": "1" if on else "0"})


def bench_refits(args) -> dict:
    out = {}
    for mb in [float(x) for x in args.mb.split(",")]:
        got: dict[str, dict] = {"on": {"wall": [], "cpu": []}, "off": {"wall": [], "cpu": []}}
        counts = None
        for r in range(args.rounds):
            order = ("on", "off") if r % 2 == 0 else ("off", "on")
            for setting in order:
                res = _run(refit_world, args.world, setting == "on", mb, args.warmup, args.refits)
                got[setting]["wall"] += [max(x["wall"][i] for x in res) for i in range(args.refits)]
                got[setting]["cpu"] += [sum(x["cpu"][i] for x in res) for i in range(args.refits)]
                if setting == "on":
                    counts = res[0]["counts"]
        med = {s: {k: statistics.median(v) for k, v in got[s].items()} for s in got}
        row = {"median": med, "raw": got, "counts_rank0": counts,
               "off_over_on": {k: med["off"][k] / med["on"][k] for k in ("wall", "cpu")}}
        out[str(mb)] = row
        print(f"{mb:g} MB: wall off {med['off']['wall'] * 1e3:.1f} ms, on {med['on']['wall'] * 1e3:.1f} ms "
              f"({row['off_over_on']['wall']:.2f}x); CPU off {med['off']['cpu'] * 1e3:.0f} ms, on "
              f"{med['on']['cpu'] * 1e3:.0f} ms ({row['off_over_on']['cpu']:.2f}x); rank 0's lanes {counts}",
              flush=True)
    return out


def bench_messages(args) -> dict:
    sizes = [int(x) for x in args.sizes.split(",")]
    on = _run(message_world, 2, True, sizes, args.repeats)[0]
    off = _run(message_world, 2, False, sizes, args.repeats)[0]
    for kib in sizes:
        print(f"{kib} KiB one way: lane {on[kib] * 1e6:.0f} us, gloo {off[kib] * 1e6:.0f} us "
              f"({off[kib] / on[kib]:.1f}x)", flush=True)
    return {"lane": on, "gloo": off}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", default="2,16,64,256")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)  # lanes are in use from the fourth refit
    ap.add_argument("--refits", type=int, default=5)
    ap.add_argument("--messages", action="store_true")
    ap.add_argument("--sizes", default="16,256,4096")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result = {"args": vars(args), "load": list(__import__("os").getloadavg())}
    if args.messages:
        result["messages"] = bench_messages(args)
    else:
        result["refits"] = bench_refits(args)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
