"""The demo's report: the table of methods with its legend, where the bytes and the speed-up come from, the
time breakdown and the verdict, from the ranks' results (``demo_worker``'s dicts) and the plan's stats."""

from __future__ import annotations

import statistics

from ..layout import Layout, quant_format
from .cliutil import fmt_mib


def quant_name(dst_dtype: str, block: int) -> str:
    """A quantized destination's short name: the format's, with ``block`` when the format takes it from the
    caller (``--quant-block``: block FP8)."""
    f = quant_format(dst_dtype)
    return f.name if f.block is not None else f"{f.name}{block}"


LEGEND = """
  time          one refit, wall time of the slowest rank, {runs}
  on the wire   bytes sent between ranks, all ranks together (a rank's copies into itself are not counted)
  busiest recv  bytes received by the rank that receives the most
  staging/rank  extra buffers a rank holds while it runs: ours, the send + receive buckets (--bucket-mb);
                the all-gather, its largest full-size tensor plus one box (it builds every tensor whole)
  RSS growth    peak resident memory above the rank's start of the run (as Linux counts it; noisy)
  wrong         destination elements that differ from the global tensor, bit for bit, over all ranks"""


def _median_of_slowest(res: list[dict], key: str, n_rep: int) -> float:
    """Per repeat the slowest rank's time, then the median over the repeats."""
    return statistics.median(max(r[key][i] for r in res) for i in range(n_rep))


def result_rows(res: list[dict], args, st, qst) -> list[tuple]:
    """Per method (ours, ours into the quantized destination, the all-gather): (name, seconds, wire bytes,
    busiest receive, staging per rank, RSS growth, wrong elements)."""
    n_rep = args.repeats
    ours = _median_of_slowest(res, "ours_seconds", n_rep) if n_rep else max(r["ours_first_seconds"] for r in res)
    rows = [
        ("reshard (ours)", ours, st.wire_bytes, st.max_recv_bytes,
         max(r["ours_staging_bytes"] for r in res), max(r["ours_peak_extra_rss"] for r in res),
         sum(r["ours_bad"] for r in res)),
    ]
    if qst is not None:
        qd = args.dst_dtype
        q_time = _median_of_slowest(res, "fp8_seconds", n_rep) if n_rep else max(r["fp8_first_seconds"] for r in res)
        rows.append((f"ours -> {quant_name(qd, args.quant_block)}", q_time, qst.wire_bytes,
                     qst.max_recv_bytes,
                     max(r["fp8_staging_bytes"] for r in res), max(r["fp8_peak_extra_rss"] for r in res),
                     sum(r["fp8_bad"] for r in res)))
    if not args.no_baseline:
        base = _median_of_slowest(res, "base_seconds", max(1, n_rep))
        rows.append(("all-gather baseline", base, sum(r["base_recv_bytes"] for r in res),
                     max(r["base_recv_bytes"] for r in res), max(r["base_peak_extra_bytes"] for r in res),
                     max(r["base_peak_extra_rss"] for r in res), sum(r["base_bad"] for r in res)))
    return rows


def print_table(rows: list[tuple], n_rep: int) -> None:
    print()
    print(f"{'':20s} {'':>9s} {'on the wire':>12s} {'busiest recv':>13s} {'staging/rank':>13s} {'RSS growth':>11s}")
    print(f"{'method':20s} {'time (s)':>9s} {'(MiB)':>12s} {'(MiB)':>13s} {'(MiB)':>13s} {'(MiB)':>11s} {'wrong':>7s}")
    for name, secs, wire, mrecv, staging, rss, bad in rows:
        print(f"{name:20s} {secs:9.3f} {fmt_mib(wire):>12s} {fmt_mib(mrecv):>13s} {fmt_mib(staging):>13s} "
              f"{fmt_mib(rss):>11s} {bad:>7d}")
    print(LEGEND.format(runs=f"median of {n_rep} runs after a first one" if n_rep else "the first run"))
    print()


def quant_line(args, st, qst, rows: list[tuple], dtype_name: str) -> str:
    """The quantized destination's bytes against the plain one's."""
    f = quant_format(args.dst_dtype)
    return (f"{f.label} destination ({f.summary.format(block=args.quant_block)}, every Linear "
            f"weight): {fmt_bytes(qst.wire_bytes)} on the wire vs {fmt_bytes(st.wire_bytes)} for "
            f"{dtype_name} ({qst.wire_bytes / max(1, st.wire_bytes):.2f}x); {fmt_bytes(qst.quant_src_bytes)} "
            f"of it quantized by the senders (values + scales), {fmt_bytes(qst.quant_dst_bytes)} sent in "
            f"{dtype_name} for the receivers to quantize (blocks split between training shards); lower "
            f"bound {fmt_bytes(qst.lower_bound_bytes)} ({qst.wire_bytes / max(1, qst.lower_bound_bytes):.3f}x); "
            f"time {rows[1][1]:.3f} s vs {rows[0][1]:.3f} s")


def lower_bound_line(st, model_bytes: int, dst_bytes: int, dst_dp: int) -> str:
    """Where the lower bound on the wire comes from."""
    if not st.lower_bound_bytes:
        return "lower bound on the wire 0 B: every rank already holds what it needs (local copies only)"
    need = st.lower_bound_bytes + st.local_bytes
    return (f"lower bound on the wire {fmt_bytes(st.lower_bound_bytes)}: the inference ranks hold "
            f"{dst_bytes / max(1, model_bytes):.2f} copies of the {fmt_bytes(model_bytes)} model"
            f"{f' (DP{dst_dp}: each replica needs all of its shards)' if dst_dp > 1 else ''}, {fmt_bytes(need)} "
            f"in all; {fmt_bytes(st.local_bytes)} of it a rank already holds itself (copied locally), the rest "
            f"must cross the wire. Ours sends {st.wire_bytes / st.lower_bound_bytes:.3f}x that.")


def speedup_against_allgather(args, st, rows: list[tuple], steps: int, src: Layout) -> tuple[str, str]:
    """(the line on where the speed-up over the all-gather comes from, the verdict's words on it)."""
    bw = rows[-1][2]
    speed = rows[-1][1] / max(rows[0][1], 1e-9)
    byte_ratio = bw / max(1, st.wire_bytes)
    batching = (f"{steps} steps of batched point-to-point messages (one packed buffer per peer) "
                f"instead of {baseline_broadcasts(src)} broadcasts, one box at a time to all {args.world} ranks, "
                f"each assembled into a full tensor and sliced")
    if byte_ratio > 1.05:
        line = (f"speed-up over the all-gather: {speed:.2f}x, from {byte_ratio:.2f}x fewer bytes (the all-gather "
                f"sends every box to every rank, needed or not) and from batching: {batching}.")
        fewer = f"{byte_ratio:.2f}x fewer wire bytes"
    else:
        line = (f"speed-up over the all-gather: {speed:.2f}x with about the same bytes (here every rank needs "
                f"nearly everything), so all of it comes from batching: {batching}.")
        fewer = "the same wire bytes"
    return line, (f", {speed:.2f}x faster than the all-gather with {fewer}, "
                  f"{fmt_bytes(rows[0][4])} vs {fmt_bytes(rows[-1][4])} staging per rank")


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def time_breakdown(r0: dict, total: float, prep_s: float, world_s: float, label: str = "block-FP8") -> str:
    """The demo's time in its phases, from rank 0's timers (``r0``): the parent's layouts and plan, then the
    world: spawn and per-rank setup (the rest), our runs, the block-FP8 setup and runs, the all-gather's runs."""
    fp8 = r0.get("fp8_total_seconds")
    parts = [("reshard runs", r0["ours_total_seconds"])]
    if fp8 is not None:
        setup = r0["fp8_setup_seconds"]
        parts += [(f"{label} setup (its plan and reference quantization)", setup), (f"{label} runs", fp8 - setup)]
    if "base_total_seconds" in r0:
        parts.append(("all-gather runs", r0["base_total_seconds"]))
    rest = world_s - sum(v for _k, v in parts)
    return (f"demo time {total:.1f} s: layouts and plan {prep_s:.1f} s; the world {world_s:.1f} s = spawn and "
            f"per-rank setup {rest:.1f} s, " + ", ".join(f"{k} {v:.1f} s" for k, v in parts)
            + f" (checking every element: {r0['check_seconds']:.1f} s of these, rank 0)")


def baseline_broadcasts(src: Layout) -> int:
    """How many broadcasts the all-gather baseline makes: one per distinct source box of each tensor."""
    return sum(len({(f.offsets, f.sizes) for f in fr if f.numel}) for fr in src.fragments_by_tensor.values())
