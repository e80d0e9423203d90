"""The model of perf/RESULTS.md (perf/results_page.py): the JSON folder (``Results``), a page section
(``Section``), the summarizer registry (``summarizer``) and the number formats the sections share."""

from __future__ import annotations

import json
import statistics
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

def ratio_span(xs: list[float]) -> str:
    """The range of ratios, e.g. ``1.02–2.09×`` (one ``×`` when they are equal to two decimals)."""
    lo, hi = f"{min(xs):.2f}", f"{max(xs):.2f}"
    return f"{lo}×" if lo == hi else f"{lo}–{hi}×"


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


