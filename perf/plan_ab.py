"""A/B of plans and schedules between two versions of the planner: same digests, same transfers, same steps.

Run it once per version (each from its own tree, ``PYTHONPATH`` at that tree) and compare the two JSONs:

    python perf/plan_ab.py --out /tmp/old.json             # in the old tree
    python perf/plan_ab.py --out /tmp/new.json --check /tmp/old.json

For each case (``bench_planner``'s models and worlds, its ``t128`` pair, and variants on the small worlds: with
``gpus_per_node`` (relays on and off), two engine instances with relay groups, block-FP8 destinations), it
records the whole plan's digest, its wire and local tables' ``keys_digest``, the stats, a hash of every step's
``repr`` of its schedule (two buckets) and of ``for_rank`` of three ranks, and for two ranks their rank plan's
transfers, local copies and ``for_rank``. ``--check``: exit 1 naming every field that differs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_planner import MODELS, WORLDS, _layouts, case_kwargs  # noqa: E402

from triton_reshard import block_quant_layout  # noqa: E402
from triton_reshard.plan import plan_reshard  # noqa: E402
from triton_reshard.presets import get_config, megatron_layout, vllm_layout  # noqa: E402

BUCKETS = (64 << 20, 1 << 30)


def _h(items) -> str:
    h = hashlib.sha256()
    for x in items:
        h.update(repr(x).encode())
        h.update(b"\n")
    return h.hexdigest()[:16]


def _objects_hash(table) -> str:
    return _h(sorted(map(repr, table)))


def record(src, dst, kw: dict, ranks_whole=True) -> dict:
    plan_reshard.cache_clear()
    p = plan_reshard(src, dst, **kw)
    st = p.stats()
    out = {"digest": p.digest, "wire": p.transfers.keys_digest()[:16], "local": p.local_copies.keys_digest()[:16],
           "n": [len(p.transfers), len(p.local_copies)], "wire_bytes": st.wire_bytes,
           "lower_bound": st.lower_bound_bytes, "relay_bytes": st.relay_bytes}
    ranks = p.ranks
    pick = sorted({ranks[0], ranks[len(ranks) // 2], ranks[-1]})
    for b in BUCKETS:
        s = p.schedule(b)
        out[f"steps_{b}"] = _h(repr(x) for x in s.steps)
        out[f"for_rank_{b}"] = _h(repr(s.for_rank(r)) for r in pick)
    for r in (ranks[0], ranks[-1]):
        rp = plan_reshard(src, dst, rank=r, **kw)
        out[f"rank{r}"] = [_objects_hash(rp.transfers), _objects_hash(rp.local_copies),
                           _h([repr(rp.schedule(BUCKETS[0]).for_rank(r))])]
    return out


def cases(only: list[str] | None = None):
    """``(name, src, dst, plan_reshard keywords)`` of every case (``only``: the names starting with one of
    these; the layouts of the others are not built)."""
    def wanted(name: str) -> bool:
        return not only or any(name.startswith(p) or p.startswith(name + "/") for p in only)

    for model in MODELS:
        for world in WORLDS:
            kw = case_kwargs(model, world)
            if kw is None or not wanted(f"{model}/{world}"):
                continue
            cfg = get_config(model)
            src = megatron_layout(cfg, **kw[0], ranks=range(world), dtype=torch.bfloat16)
            dst = vllm_layout(cfg, **kw[1], ranks=range(world), dtype=torch.bfloat16)
            yield f"{model}/{world}", src, dst, {}
            if world <= 32:
                yield f"{model}/{world}/gpn8", src, dst, {"gpus_per_node": 8}
                yield f"{model}/{world}/gpn8-norelay", src, dst, {"gpus_per_node": 8, "relay": False}
                two = dst.instances(2)
                yield f"{model}/{world}/instances2", src, two, {"relay_groups": dst.instance_groups(2)}
                yield f"{model}/{world}/instances2-gpn4", src, two, {"gpus_per_node": 4,
                                                                      "relay_groups": dst.instance_groups(2)}
            if world == 8:
                try:
                    q = block_quant_layout(dst, lambda t: ".layers." in t.name and len(t.shape) == 2)
                except ValueError:  # a shard not block-aligned
                    q = None
                if q is not None:
                    yield f"{model}/{world}/fp8", src, q, {}
    if wanted("t128"):
        src, dst = _layouts("t128")
        yield "t128", src, dst, {}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--check", default=None, help="a JSON of the other version: exit 1 if any field differs")
    ap.add_argument("--only", default=None, help="comma list of case-name prefixes")
    args = ap.parse_args(argv)
    got = {}
    only = args.only.split(",") if args.only else None
    for name, src, dst, kw in cases(only):
        if args.only and not any(name.startswith(x) for x in args.only.split(",")):
            continue
        t = time.process_time()
        got[name] = record(src, dst, kw)
        print(f"{name}: {got[name]['digest']} ({time.process_time() - t:.1f} s CPU)", flush=True)
        with open(args.out, "w") as f:  # after every case: a partial run still compares
            json.dump(got, f, indent=1, sort_keys=True)
    if args.check:
        with open(args.check) as f:
            old = json.load(f)
        bad = [(c, k) for c in got for k in got[c] if c in old and old[c].get(k) != got[c][k]]
        missing = [c for c in got if c not in old]
        for c, k in bad:
            print(f"DIFFERS {c} {k}: {old[c].get(k)} -> {got[c][k]}")
        print(f"{len(got) - len(missing)} cases compared, {len(bad)} fields differ, {len(missing)} not in --check")
        return 1 if bad or missing else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
