"""What the integrity digest of in-place sends costs one rank (issue 46), before and after they were hashed in
the local copies' pass (``integrity.Ledger.local``), in thread CPU seconds (steady on a shared machine).

A rank keeping its shard and sending it (TP2 x DP2 -> TP1 x DP4: its half of each tensor goes to two peers in
place, zero-copy, and into its own destination by a local copy): ``--mb`` MB of fp32 source in 4 tensors,
local copies into equal destinations, in-place sends of 1.75 MiB row blocks covering all of it. Per call:

* ``off``: the local copies (torch ``copy_``, one thread), no digest;
* ``before``: the same copies, then every send hashed from its buffer (one native call: a read pass);
* ``after``: the copies run by ``Ledger.local``, which hashes each send's bytes as it copies them.

The three alternate call by call (which goes first turns round), a 256 MB buffer written before each (the
sources start cold, as after a training step); medians of ``--repeats``. ``before`` and ``after`` give the
same digest values (checked).

    python perf/bench_local_digest.py --mb 128 --repeats 11 --out perf/results/local_digest.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

COLS = 512
SEND_BYTES = 1835008  # 1.75 MiB: the 256 MB Llama-shaped refit's in-place sends


def _setup(mb: float):
    from triton_reshard.execute import integrity as ig

    rows = max(1, int(mb * (1 << 20) / 4 / 4 / COLS))
    g = torch.Generator().manual_seed(0)
    srcs = [torch.randn(rows, COLS, generator=g) for _ in range(4)]
    dsts = [torch.empty(rows, COLS) for _ in range(4)]
    per = max(1, SEND_BYTES // (COLS * 4))
    sends = [(1, s[r : r + per].view(torch.uint8).view(-1)) for s in srcs for r in range(0, rows, per)]
    return ig, list(zip(srcs, dsts, strict=True)), sends


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=128.0, help="the rank's source shard, MB (fp32)")
    p.add_argument("--repeats", type=int, default=11)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    from triton_reshard.ops import digest as nd

    if nd.copy_native() is None:
        raise SystemExit("the native extension is not built (python setup.py build_ext --inplace)")
    torch.set_num_threads(1)
    ig, pairs, sends = _setup(a.mb)
    coef = ig.Coefficients(b"bench-local-digest" * 2)
    work = type("Work", (), {"steps": [(0, None)]})()
    views: dict = {}
    ig.THREAD_MIN_BYTES = 1 << 62  # every send hashed in this thread (its CPU is what is measured)

    def off():
        for s, d in pairs:
            d.copy_(s)

    def before():
        led = ig.Ledger(b"k", coef, 0, "p", work, (), {})
        off()
        led.on_post(0, sends, [])  # no fused pack: each send hashed from its buffer
        led._values()
        return led

    def after():
        led = ig.Ledger(b"k", coef, 0, "p", work, (), views)
        # what a pack that copied none of them leaves: each send one gap (deferred to the local copies)
        led._fused["pack", 0] = (
            np.zeros(len(sends), dtype=np.uint64),
            [nd.buffer_rows(b) for _p, b in sends],
        )
        led.on_post(0, sends, [])
        for s, d in led.local(pairs, [(sends, [])], ("bench", "local"), "torch"):
            d.copy_(s)
        led._values()
        return led

    evict = torch.empty(256 << 20, dtype=torch.uint8)
    ways = [("off", off), ("before", before), ("after", after)]
    secs: dict = {w: [] for w, _f in ways}
    values: dict = {}
    for r in range(a.repeats + 1):  # the first round warms up
        k = r % len(ways)
        for name, fn in ways[k:] + ways[:k]:
            evict.fill_(r & 0xFF)
            t = time.thread_time()
            led = fn()
            dt = time.thread_time() - t
            if r:
                secs[name].append(dt)
            if led is not None:
                values[name] = [e[2] for e in led.sent[1]]
    if values["before"] != values["after"]:
        raise SystemExit("the local copies' digests differ from the sends' own hashes")
    med = {w: statistics.median(v) for w, v in secs.items()}
    out = {
        "mb": a.mb,
        "sends": len(sends),
        "repeats": a.repeats,
        "thread_cpu_s": secs,
        "median_s": med,
        "digest_cost_before_s": med["before"] - med["off"],
        "digest_cost_after_s": med["after"] - med["off"],
        "meta": {
            "argv": ["perf/bench_local_digest.py", *(sys.argv[1:] if argv is None else argv)],
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"cpu, {os.cpu_count()} cores",
            "load_average": os.getloadavg(),
            "torch": torch.__version__,
        },
    }
    print(
        f"{a.mb:g} MB shard, {len(sends)} in-place sends, thread CPU medians of {a.repeats}: local copies alone "
        f"{med['off'] * 1e3:.1f} ms; with the sends' digest before {med['before'] * 1e3:.1f} ms "
        f"(+{out['digest_cost_before_s'] * 1e3:.1f}), after {med['after'] * 1e3:.1f} ms "
        f"(+{out['digest_cost_after_s'] * 1e3:.1f})"
    )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
