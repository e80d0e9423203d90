"""The sections of perf/RESULTS.md (perf/results_page.py), the single-machine benchmarks: each a summarizer
(``results_model.summarizer``) that reads its JSON and returns a ``Section``, registered in page order."""

from __future__ import annotations

import statistics

from results_model import Results, Section, gbps, mib, pct, ratio, ratio_span, secs, span, summarizer

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
        headline=f"{ratio_span(ratios)} faster than Megatron-Core (steady, median)",
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



