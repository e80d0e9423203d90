"""What the receiver's digest of in-place messages costs (issue 46), and whether landing them differently would
cost less: two ranks, rank 1 sends ``--mb`` MB, rank 0 receives it into a destination and digests it. Per call,
the receiving process's CPU (every thread: gloo's receives too), in turn:

* ``off``: the messages (``--msg`` bytes each, the 256 MB refit's in-place size) received in place, no digest;
* ``cold``: the same, then every message hashed from the destination after the step (today's path:
  ``integrity.Ledger.on_land``, one native call);
* ``landed``: the same, each message hashed right after its receive completed (in the wait loop, the same
  thread): while it may still be in cache;
* ``staged@P``: the data sent in pieces of ``P`` KiB (``--pieces``), received through a ring of two staging
  buffers and unpacked into the destination by the fused copy that hashes what it writes (``ops.digest``):
  the transport writes a small cache-sized buffer, the copy reads it from there.

While the messages are on the wire the receiver makes ``--local-mb`` MB of local copies (a refit's rank does).
Also: the native hash's speed on the same bytes cold (a 256 MB buffer) and hot (again right away). Medians of
``--repeats`` calls; the modes alternate call by call (which goes first turns round). All digests of one call
agree (checked).

    python perf/bench_recv_digest.py --mb 96 --pieces 256,1024,4096 --repeats 15 --out perf/results/recv_digest.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch


def _ring(dist, dst, stage, piece: int, fn, desc, lens, cn) -> int:
    """Receive ``dst`` in pieces through the two ``stage`` buffers, each unpacked by the fused copy+hash."""
    n = -(-dst.numel() // piece)
    size = [min(piece, dst.numel() - k * piece) for k in range(n)]
    works = [dist.irecv(stage[k][: size[k]], 1) for k in range(min(2, n))]
    out = np.zeros(1, dtype=np.uint64)
    for k in range(n):
        works[k].wait()
        fn(1, desc[k].ctypes.data, lens.ctypes.data, cn.ctypes.data, out.ctypes.data)
        if k + 2 < n:
            works.append(dist.irecv(stage[k % 2][: size[k + 2]], 1))
    return int(out[0])


def _staged_plan(dst, stage, piece: int):
    """Per piece, the fused copy's descriptor (staging slot -> its place in the destination, one message)."""
    from triton_reshard.ops import digest as nd

    out = []
    for k, a in enumerate(range(0, dst.numel(), piece)):
        z = min(a + piece, dst.numel())
        row = nd.copy_row(stage[k % 2][: z - a], dst[a:z], 0, a)
        out.append(np.ascontiguousarray([row], dtype=np.int64))
    return out


def worker(rank: int, world: int, spec: dict) -> dict:
    import torch.distributed as dist

    from triton_reshard.execute import integrity as ig
    from triton_reshard.ops import digest as nd

    torch.set_num_threads(1)
    total, msg = spec["bytes"], spec["msg"]
    sizes = [min(msg, total - a) for a in range(0, total, msg)]
    coef = ig.Coefficients(b"bench-recv-digest" * 2)
    cn = coef.numpy(nd.entries(total) + 8)
    fn, copy_fn = nd.native(), nd.copy_native()
    loc_src = torch.randn(max(1, spec["local_mb"] << 18))
    loc_dst = torch.empty_like(loc_src)
    src = torch.randint(0, 256, (total,), dtype=torch.uint8) if rank == 1 else None
    dst = torch.zeros(total, dtype=torch.uint8)
    views = list(torch.split(dst, sizes))
    stage = [torch.empty(max(spec["pieces"]) << 10, dtype=torch.uint8) for _ in range(2)]
    plans = {p: _staged_plan(dst, stage, p << 10) for p in spec["pieces"]}
    lens = np.array([total], dtype=np.int64)
    modes = ["off", "cold", "landed"] + [f"staged@{p}" for p in spec["pieces"]]
    res: dict = {m: [] for m in modes}
    digests: dict = {m: [] for m in modes}

    def call(mode: str):
        piece = int(mode.split("@")[1]) << 10 if "@" in mode else msg
        dist.barrier()
        if rank == 1:  # the sender: every message (or piece) posted at once, zero-copy from the source
            works = [dist.isend(src[a : a + piece], 0) for a in range(0, total, piece)]
            loc_dst.copy_(loc_src)
            for w in works:
                w.wait()
            return None, None, None
        t, c = time.perf_counter(), time.process_time()
        if "@" in mode:
            h = _ring(dist, dst, stage, piece, copy_fn, plans[piece >> 10], lens, cn)  # (local copies: after)
            loc_dst.copy_(loc_src)
        else:
            works = [dist.irecv(v, 1) for v in views]
            loc_dst.copy_(loc_src)  # the rank's local copies while the step is on the wire
            h = 0
            for a, (w, v) in zip(range(0, total, msg), zip(works, views, strict=True), strict=True):
                w.wait()
                if mode == "landed":  # one message of a longer one: the hash over its offsets [a, a + n)
                    rows = np.array([[v.data_ptr(), a, v.numel(), 0, 1, 1, 1, 1, 0, 0, 0, 0]], dtype=np.int64)
                    h += nd.digest_rows(fn, rows, total, cn)
            if mode == "cold":
                h = nd.digest_buffer(fn, dst, cn)
        return time.process_time() - c, time.perf_counter() - t, h & ((1 << 64) - 1)

    for k in range(spec["warmup"] + spec["repeats"]):
        for mode in modes[k % len(modes) :] + modes[: k % len(modes)]:
            cpu, wall, h = call(mode)
            if rank == 0 and k >= spec["warmup"]:
                res[mode].append((cpu, wall))
                digests[mode].append(h)
    if rank == 1:
        return {}
    want = digests["cold"][-1]
    bad = [m for m in modes if m != "off" and any(d != want for d in digests[m])]
    if bad:
        raise AssertionError(f"the digests of {bad} differ from the cold one")
    return {"res": res, "speed": _speeds(fn, cn, views)}


def _speeds(fn, cn, views) -> dict:
    """The native hash's GB/s over the messages cold (after 256 MB of other writes) and hot (right again)."""
    from triton_reshard.ops import digest as nd

    junk = torch.empty(256 << 20, dtype=torch.uint8)
    cold, hot = [], []
    for _ in range(5):
        junk.fill_(1)
        t = time.thread_time()
        for v in views:
            nd.digest_buffer(fn, v, cn)
        cold.append(time.thread_time() - t)
        t = time.thread_time()
        for v in views[-2:]:
            nd.digest_buffer(fn, v, cn)
        hot.append((time.thread_time() - t) * len(views) / 2)
    n = sum(v.numel() for v in views)
    return {"cold_gbs": n / statistics.median(cold) / 1e9, "hot_gbs": n / statistics.median(hot) / 1e9}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=96.0, help="bytes received per call, MB")
    p.add_argument("--msg", type=int, default=1835008, help="in-place message bytes (the 256 MB refit's)")
    p.add_argument("--pieces", default="256,1024,4096", help="staged piece sizes, KiB")
    p.add_argument("--local-mb", type=int, default=32, help="local copies made while the messages arrive, MB")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    from triton_reshard.ops import digest as nd
    from triton_reshard.testing.launch import run_world

    if nd.copy_native() is None:
        raise SystemExit("the native extension is not built (python setup.py build_ext --inplace)")
    spec = {
        "bytes": int(a.mb * (1 << 20)) // 8 * 8,
        "msg": a.msg,
        "pieces": [int(x) for x in a.pieces.split(",")],
        "local_mb": a.local_mb,
        "repeats": a.repeats,
        "warmup": a.warmup,
    }
    got = run_world(worker, 2, spec, timeout=1800)[0]
    res = got["res"]
    off = statistics.median(c for c, _w in res["off"])
    out: dict = {"spec": spec, "load": list(os.getloadavg()), **got["speed"], "modes": {}}
    for mode, rows in res.items():
        cpu, wall = statistics.median(c for c, _w in rows), statistics.median(w for _c, w in rows)
        out["modes"][mode] = {"cpu_ms": cpu * 1e3, "extra_cpu_ms": (cpu - off) * 1e3, "wall_ms": wall * 1e3}
        print(
            f"{mode:>12}: receiver CPU {cpu * 1e3:7.2f} ms (digest +{(cpu - off) * 1e3:6.2f}), wall {wall * 1e3:7.2f} ms"
        )
    print(f"native hash over the messages: cold {out['cold_gbs']:.1f} GB/s, hot {out['hot_gbs']:.1f} GB/s")
    if a.out:  # (the load average at the end: a shared machine's)
        Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
