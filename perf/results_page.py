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
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the page's modules beside it, however it is imported
import results_cluster  # noqa: E402,F401  (registers every section, in page order: results_sections' first)
from results_model import HISTORY, PAGE, PROVENANCE, RESULTS, SUMMARIZERS, Results, Section  # noqa: E402

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
