"""Megatron-Core's own resharding against ours, between the same real GPTModels on this machine (CPU, gloo):

    PYTHONPATH=$PWD /work/main/.venv-engines/bin/python perf/bench_megatron.py [--runs 5] [--layers 4]
        [--shapes demo,small] [--small-layers 8]
        [--refits 10] [--warmup 2] [--json out.json]

Each run is a fresh world of 8 processes (fresh default process group). Every rank builds two real
megatron-core 0.16.1 ``GPTModel`` s (local layer spec, fp32, Llama-shaped ``llama_demo`` with ``--layers``
layers and a 32768-token vocab, so neither side pads the vocab; ``--shapes demo,small`` adds, run by run in the
same command, the small model of :func:`bench_config`: messages of KiB to a few hundred KiB, where the fixed
costs of a call and of a message weigh most):

* the source, TP4 x PP2, from ``parallel_state.initialize_model_parallel`` (as a trainer builds it);
* the destination, TP2 x DP4 (PP1), with its own ``ProcessGroupCollection`` (a ``HyperCommGrid``, as
  Megatron's own ``tests/unit_tests/resharding/test_model_swap.py`` builds its target model).

The source parameters are filled from seeded global (HF-named) tensors through our layout, so every rank
knows the exact destination values: the global tensors sliced by the destination layout. Then, on the same
two models:

* ``megatron``: ``megatron.core.resharding.swap_model_weights(src, dst, "gloo")`` (its first call builds
  the GlooCopyService, i.e. a new gloo group, and the centralized plan, then runs it; later calls reuse both);
* ``ours``: ``triton_reshard.refit`` with ``layout_from_megatron(src_model, cfg)`` for the source and
  ``megatron_layout(cfg, tp=2, dp=4, spec="local")`` for the destination, over a new gloo group (its first
  call: the new group, both layouts, the plan, binding, the run; later calls: the cached Resharder).

**First call**: each side's first call in the run (order alternates across runs: even runs Megatron first),
timed on rank 0 between two barriers, with the phases of each. **Steady**: ``--warmup`` + ``--refits``
rounds, both sides per round (order alternating), the per-refit median and the median of per-round ratios.
Before every call the destination parameters are poisoned (NaN); after it every rank checks them bit for bit
against the sliced global tensors (a mismatch fails the run). Prints a table per shape (and ``--json`` the raw
times), with the wire bytes and the bytes each side copies per refit (ours: packs, unpacks and local copies from
the run's report, what goes on the wire from the tensors themselves not counted; Megatron's: counted from its
plan, :func:`_megatron_copied`). ``--profile``: rank 0's cProfile of each side's first call and steady refits.

**Across emulated nodes** (``--cluster 2xR``, root: ``triton_reshard.testing.cluster``; the code:
``perf/cluster_megatron.py``), each run a fresh cluster of 2 nodes x R ranks behind ``--rate`` links: the
trainer's ``GPTModel`` (TP R) only on node 0, the engine's (TP ``--dst-tp``, default R, x DP R / TP) only on
node 1; every rank passes its own side's model and a parameterless stand-in for the other (what
``swap_model_weights`` reads of it: ``config``, ``pg_collection``), so Megatron's planner sees each side on its own
ranks. Small by default (``--layers 2 --vocab 4096``: 124 MB of
fp32), the same first-call / steady protocol, every call checked bit-exact on the engine's ranks; per call the
bytes each node's interface counted. ``ours`` = ``refit(..., gpus_per_node=R)``. Reports the ratio, the link
limit (the model's bytes over the rate: node 1 must receive every element once), the trainer link's bytes per
refit and each plan's predicted cross-node payload::

    PYTHONPATH=$PWD .venv-engines/bin/python perf/bench_megatron.py --cluster 2x2 --rate 1gbit [--dst-tp 1] \
        --runs 3 --layers 2 --warmup 1 --refits 5 --json perf/results/bench_megatron_cluster.json
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import importlib
import io
import json
import os
import pstats
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # megatron_models, also when imported from tests
from megatron_models import (  # noqa: E402
    DST,
    SHAPES,
    SIDES,
    SRC,
    bench_config,
    check_params,
    dst_pg_collection,
    global_tensors,
    gpt_model,
)


class _Phases:
    """Wall time of named calls (wrapped module attributes), per call, in the order they ran."""

    def __init__(self):
        self.log: list[tuple[str, float]] = []
        self.saved: list[tuple[object, str, object]] = []

    def wrap(self, obj, attr: str, label: str) -> None:
        fn = getattr(obj, attr)
        self.saved.append((obj, attr, fn))

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.log.append((label, time.perf_counter() - t))

        setattr(obj, attr, timed)

    def restore(self) -> None:
        while self.saved:
            obj, attr, fn = self.saved.pop()
            setattr(obj, attr, fn)

    def gc_callback(self):
        """A ``gc.callbacks`` entry logging each pass of the cyclic collector as the phase "gc (collector)": in a
        process holding a Megatron model (~440k tracked objects) a full pass costs tens to hundreds of ms, and it
        lands in whichever call crosses the collector's threshold."""
        started = [0.0]

        def cb(phase: str, _info: dict) -> None:
            if phase == "start":
                started[0] = time.perf_counter()
            else:
                self.log.append(("gc (collector)", time.perf_counter() - started[0]))

        return cb

    def take(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for label, s in self.log:
            out[label] = out.get(label, 0.0) + s
        self.log.clear()
        return out


def _top(pr: cProfile.Profile, n: int = 30) -> str:
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("cumulative").print_stats(n)
    return out.getvalue()


def _megatron_copied(mplan, src_params: dict, dst_params: dict) -> int:
    """Bytes ``swap_model_weights`` copies on this rank per call (megatron-core 0.16.1, gloo, CPU): a send's
    ``contiguous()`` of a strided source slice; per receive, ``empty_like(dst_slice.contiguous())`` (a copy
    when the slice is strided), the GlooCopyService's copy of what arrived (or of the local source) into that
    buffer, and the write-back into the parameter."""
    n = 0
    for op in mplan.send_ops:
        v = src_params[op.param_name][op.my_slice]
        n += 0 if v.is_contiguous() else v.numel() * v.element_size()
    for op in mplan.recv_ops:
        v = dst_params[op.param_name][op.my_slice]
        n += v.numel() * v.element_size() * (2 + (not v.is_contiguous()))
    return n


def world_main(rank: int, world: int, cfg: dict, warmup: int, refits: int, megatron_first: bool,
               profile: bool = False) -> dict:
    """One fresh world: build both models, time each side's first call, then ``warmup`` + ``refits`` rounds;
    every call is checked bit-exact (raises ``AssertionError`` naming the rank and the tensors). ``profile``: rank 0
    runs each side's first call under cProfile (the top functions by cumulative time come back as text)."""
    warnings.filterwarnings("ignore", module="megatron")  # Apex / absl / cuda-graph notices at import
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.resharding import refit as mrefit

    from triton_reshard import refit
    from triton_reshard.execute import resharder as ores
    from triton_reshard.execute import session as osession
    from triton_reshard.integrations import layout_from_megatron
    from triton_reshard.presets import megatron_layout
    from triton_reshard.testing.megatron_cpu import DummyStream as _DummyStream
    from triton_reshard.testing.megatron_cpu import install_cpu_stubs as _install_stubs

    orefit = importlib.import_module("triton_reshard.refit")  # the module (the package's ``refit`` is the function)
    _install_stubs()
    state_phases = None
    torch.cuda.current_stream = lambda *a, **k: _DummyStream()  # GlooCopyService.run waits on it (no CUDA)
    ps.initialize_model_parallel(tensor_model_parallel_size=SRC["tp"], pipeline_model_parallel_size=SRC["pp"],
                                 distributed_timeout_minutes=2)
    try:
        src_model = gpt_model(cfg, **SRC)
        dst_model = gpt_model(cfg, **DST, pg_collection=dst_pg_collection(DST["tp"]))
        src_layout0 = megatron_layout(cfg, tp=SRC["tp"], pp=SRC["pp"], dp=1, spec="local", dtype=torch.float32)
        dst_layout0 = megatron_layout(cfg, tp=DST["tp"], pp=1, dp=world // DST["tp"], spec="local",
                                      dtype=torch.float32)
        hf = global_tensors(cfg)
        src_params, dst_params = dict(src_model.named_parameters()), dict(dst_model.named_parameters())
        check_params(rank, (("source", src_params, src_layout0), ("destination", dst_params, dst_layout0)))
        with torch.no_grad():
            for n, t in src_layout0.shard(hf, rank).items():
                src_params[n].copy_(t)
        expect = dst_layout0.shard(hf, rank)
        del hf
        wire = sum(t.numel() * t.element_size() for t in expect.values())

        phases = state_phases = _Phases()
        gc_cb = phases.gc_callback()
        gc.callbacks.append(gc_cb)
        phases.wrap(mrefit, "get_or_create_service", "service (new gloo group)")
        phases.wrap(mrefit, "build_centralized_reshard_plan", "plan")
        phases.wrap(mrefit, "execute_reshard_plan", "run")
        phases.wrap(osession, "plan_reshard", "plan")  # the refit session plans (this rank's share)
        phases.wrap(ores.Resharder, "__init__", "resharder init")
        phases.wrap(ores.Resharder, "_bind", "bind")
        phases.wrap(ores.Resharder, "_execute", "run")
        state: dict = {}

        def call_megatron() -> None:
            mrefit.swap_model_weights(src_model, dst_model, "gloo")

        def call_ours() -> None:
            if "group" not in state:  # the first call: a fresh group and both layouts, like Megatron's first
                t = time.perf_counter()
                state["group"] = dist.new_group(backend="gloo")
                t1 = time.perf_counter()
                state["src"] = layout_from_megatron(src_model, cfg)
                state["dst"] = megatron_layout(cfg, tp=DST["tp"], pp=1, dp=world // DST["tp"], spec="local",
                                               dtype=torch.float32)
                phases.log += [("new gloo group", t1 - t), ("layouts", time.perf_counter() - t1)]
            state["report"] = refit(src_params, dst_params, state["src"], state["dst"], group=state["group"])

        calls = {"megatron": call_megatron, "ours": call_ours}

        prof = {s: {"first call": cProfile.Profile(), "steady": cProfile.Profile()} for s in SIDES} \
            if profile and rank == 0 else {}

        def timed(side: str, what: str | None = None) -> tuple[float, dict[str, float]]:
            with torch.no_grad():
                for p in dst_params.values():
                    p.fill_(float("nan"))
            phases.take()
            dist.barrier()
            pr = prof[side][what] if prof and what else None
            t = time.perf_counter()
            if pr is not None:
                pr.enable()
            calls[side]()
            if pr is not None:
                pr.disable()
            dist.barrier()
            dt = time.perf_counter() - t
            ph = phases.take()
            bad = [n for n, p in dst_params.items() if not torch.equal(p, expect[n])]
            if bad:
                raise AssertionError(f"rank {rank}: {side}: {len(bad)} destination parameters differ from the "
                                     f"sliced global tensors, e.g. {bad[:3]}")
            return dt, ph

        order = list(SIDES) if megatron_first else list(reversed(SIDES))
        first = {side: timed(side, "first call") for side in order}
        steady: dict[str, list[float]] = {s: [] for s in SIDES}
        for i in range(warmup + refits):
            for side in order if i % 2 == 0 else reversed(order):
                dt, _ = timed(side, "steady" if i >= warmup else None)
                if i >= warmup:
                    steady[side].append(dt)
        src_bytes = sum(p.numel() * p.element_size() for p in src_params.values())
        mplan = dst_model._cached_reshard_plan  # Megatron's plan of this rank (cached by its first call)
        msent = sum(src_params[op.param_name][op.my_slice].numel() * 4 for op in mplan.send_ops
                    if op.peer_rank != rank)
        rep = state["report"]
        sent = {"megatron": msent, "ours": rep.sent_bytes}
        copied = {"megatron": _megatron_copied(mplan, src_params, dst_params),
                  "ours": rep.sent_bytes + rep.recv_bytes - rep.in_place_bytes + rep.local_bytes}
        profiles = {s: {w: _top(p) for w, p in ps_.items()} for s, ps_ in prof.items()}
        return {"sent_bytes": sent, "copied_bytes": copied, "first": {s: first[s][0] for s in SIDES},
                "phases": {s: first[s][1] for s in SIDES}, "profiles": profiles, "steady": steady, "order": order,
                "dst_bytes": wire, "src_bytes": src_bytes}
    finally:
        if state_phases is not None:
            state_phases.restore()
            gc.callbacks[:] = [c for c in gc.callbacks if c is not gc_cb]
        mrefit.clear_service_cache()
        orefit.clear_cache()
        ps.destroy_model_parallel()


def _fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} s [{min(xs):.3f}–{max(xs):.3f}]"


def _parse_args(argv) -> argparse.Namespace:
    """The options, checked before any work (a bad value is one line, exit 2); ``--cluster 2xR`` also checks
    the cluster is available and sets ``--dst-tp`` (default R)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5, help="fresh worlds (first calls per side)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers, even (PP2; 4: 428 MiB of fp32 weights)")
    ap.add_argument("--shapes", default="demo",
                    help="comma list of model shapes, run alternately in one command: demo (llama_demo, --layers), "
                         "small (small_llama's shapes, --small-layers)")
    ap.add_argument("--small-layers", type=int, default=8, help="decoder layers of the small shape, even")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--refits", type=int, default=10, help="timed steady refits per side per run")
    ap.add_argument("--json", default=None, help="write the raw times here")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile each side's first call on rank 0 and print the top functions (slows both)")
    ap.add_argument("--cluster", default=None, metavar="2xR",
                    help="trainer and engine on two emulated nodes of R ranks (triton_reshard.testing.cluster, root)")
    ap.add_argument("--rate", default="1gbit", help="--cluster: each node's link rate")
    ap.add_argument("--dst-tp", type=int, default=None, help="--cluster: the engine's TP (default R; DP = R / TP)")
    ap.add_argument("--vocab", type=int, default=4096, help="--cluster: vocabulary size (small: the link is slow)")
    args = ap.parse_args(argv)
    from triton_reshard.tools.cliutil import UsageError, check_output_file

    try:  # before any work: a bad count or an output path that cannot be written is one line, exit 2
        check_output_file(args.json, "--json")
        for opt, val, low in (("--runs", args.runs, 1), ("--refits", args.refits, 1), ("--warmup", args.warmup, 0),
                              ("--layers", args.layers, 1 if args.cluster else 2), ("--vocab", args.vocab, 1)):
            if val < low:
                raise UsageError(f"{opt} must be >= {low}, got {val}")
        if args.layers % SRC["pp"] and not args.cluster:
            raise UsageError(f"--layers {args.layers}: the source has pp={SRC['pp']} stages; give a multiple of it")
        args.shapes = [x.strip() for x in args.shapes.split(",") if x.strip()]
        bad = [x for x in args.shapes if x not in SHAPES] or len(set(args.shapes)) != len(args.shapes)
        if bad or not args.shapes:
            raise UsageError(f"--shapes: give distinct names of {list(SHAPES)}, got {args.shapes}")
        if args.small_layers < 2 or args.small_layers % SRC["pp"]:
            raise UsageError(f"--small-layers {args.small_layers}: give a multiple of pp={SRC['pp']}")
    except UsageError as e:
        ap.error(str(e))
    if args.cluster:
        try:
            nodes, rpn = (int(x) for x in args.cluster.lower().split("x"))
        except ValueError:
            ap.error(f"--cluster {args.cluster!r}: give NODESxRANKS, e.g. 2x2")
        if nodes != 2 or rpn < 1:
            ap.error(f"--cluster {args.cluster}: only 2 nodes (trainer node -> engine node), >= 1 rank each")
        from triton_reshard.testing.cluster import available

        can, why = available()
        if not can:
            ap.error(f"--cluster: {why}")
        args.dst_tp = args.dst_tp or rpn
        if rpn % args.dst_tp:
            ap.error(f"--dst-tp {args.dst_tp} does not divide the {rpn} ranks per node")
    return args


def _cluster_main(args, argv) -> int:
    """``--cluster``: the two sides on two emulated nodes (``perf/cluster_megatron.py``)."""
    import cluster_megatron

    return cluster_megatron.cluster_main(args, argv)


def _local_runs(args, shape: str, i: int) -> dict:
    """Run ``i`` of ``shape``: one fresh 8-rank world; prints its line (and rank 0's first-call phases)."""
    from triton_reshard.testing.launch import run_world

    t = time.perf_counter()
    layers = args.layers if shape == "demo" else args.small_layers
    res = run_world(world_main, 8, bench_config(layers, shape), args.warmup, args.refits, i % 2 == 0, args.profile,
                    timeout=1800, pg_timeout=300)
    r0 = res[0]
    print(f"{shape} run {i} ({' then '.join(r0['order'])}, {time.perf_counter() - t:.0f} s): first call "
          + ", ".join(f"{s} {r0['first'][s]:.3f} s" for s in SIDES)
          + "; steady median " + ", ".join(f"{s} {statistics.median(r0['steady'][s]):.3f} s" for s in SIDES),
          flush=True)
    for s in SIDES:
        print(f"    {s} first-call phases (rank 0): "
              + ", ".join(f"{k} {v:.3f}" for k, v in r0["phases"][s].items()), flush=True)
        for what, text in r0["profiles"].get(s, {}).items():
            print(f"    {s} {what} (rank 0, cProfile):\n{text}", flush=True)
    return {**r0, "layers": layers, "world": {k: [r[k] for r in res] for k in ("sent_bytes", "copied_bytes",
                                                                              "src_bytes", "dst_bytes")}}


def _table(shape: str, runs: list[dict], n: int) -> dict:
    """Print one shape's table; its summary (medians and ratios) for the JSON."""
    w = runs[-1]["world"]
    sent = {s: [x[s] for x in w["sent_bytes"]] for s in SIDES}
    copied = {s: [x[s] for x in w["copied_bytes"]] for s in SIDES}
    first = {s: [r["first"][s] for r in runs] for s in SIDES}
    first_ratio = [r["first"]["megatron"] / r["first"]["ours"] for r in runs]
    steady = {s: [statistics.median(r["steady"][s]) for r in runs] for s in SIDES}
    steady_ratio = [statistics.median([m / o for m, o in zip(r["steady"]["megatron"], r["steady"]["ours"],
                                                             strict=True)]) for r in runs]
    print(f"\n{shape}: Megatron-Core GPTModel TP4xPP2 -> TP2xDP4, {runs[0]['layers']} layers, fp32: source "
          f"{sum(w['src_bytes']) / 2**20:.0f} MiB (all ranks), destination {sum(w['dst_bytes']) / 2**20:.0f} MiB "
          f"(all ranks); {n} fresh worlds of 8 gloo ranks")
    print("| | Megatron-Core swap_model_weights | ours (refit) | Megatron / ours |")
    print("|---|---|---|---|")
    print(f"| first call: median [min–max] over runs | {_fmt(first['megatron'])} | {_fmt(first['ours'])} | "
          f"{statistics.median(first_ratio):.2f}× [{min(first_ratio):.2f}–{max(first_ratio):.2f}] |")
    print(f"| steady per refit: median of run medians [min–max] | {_fmt(steady['megatron'])} | "
          f"{_fmt(steady['ours'])} | {statistics.median(steady_ratio):.2f}× "
          f"[{min(steady_ratio):.2f}–{max(steady_ratio):.2f}] |")
    for what, b in (("wire bytes", sent), ("bytes copied per refit", copied)):
        print(f"| {what}: all ranks / busiest rank | "
              + " | ".join(f"{sum(b[s]) / 2**20:.1f} / {max(b[s]) / 2**20:.1f} MiB" for s in SIDES) + " | |")
    print(f"ours no slower on the first call in {sum(x >= 1 for x in first_ratio)} of {len(first_ratio)} runs; "
          f"every call checked bit-exact against the sliced global tensors on every rank")
    return {"first_ratio": statistics.median(first_ratio), "steady_ratio": statistics.median(steady_ratio),
            "first_s": {s: statistics.median(first[s]) for s in SIDES},
            "steady_s": {s: statistics.median(steady[s]) for s in SIDES},
            "sent_bytes": {s: sum(sent[s]) for s in SIDES}, "copied_bytes": {s: sum(copied[s]) for s in SIDES}}


def _local_main(args, argv) -> int:
    """Both sides in fresh 8-rank local worlds, ``--runs`` times per shape (the shapes alternate run by run, so
    they share the machine's load); a table per shape, and the JSON with the raw times."""
    by_shape: dict[str, list] = {sh: [] for sh in args.shapes}
    for i in range(args.runs):
        for sh in args.shapes:
            by_shape[sh].append(_local_runs(args, sh, i))
    summary = {sh: _table(sh, runs, args.runs) for sh, runs in by_shape.items()}
    if args.json:
        with open(args.json, "w") as f:
            meta = {"argv": ["perf/bench_megatron.py", *(sys.argv[1:] if argv is None else argv)],
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_average": list(os.getloadavg()),
                    "machine": f"CPU, {os.cpu_count()} cores, 8 gloo ranks"}
            # "runs": the first shape's (the results page reads it), "shapes": every shape's runs and summary
            json.dump({"args": vars(args), "runs": by_shape[args.shapes[0]], "meta": meta,
                       "shapes": {sh: {"runs": by_shape[sh], "summary": summary[sh]} for sh in args.shapes}},
                      f, indent=1)
    return 0


def main(argv=None) -> int:
    args = _parse_args(argv)
    return _cluster_main(args, argv) if args.cluster else _local_main(args, argv)


if __name__ == "__main__":
    sys.exit(main())
