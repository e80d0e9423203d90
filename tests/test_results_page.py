"""perf/RESULTS.md is generated from perf/results/*.json (perf/results_page.py): the page in the tree must be what
the JSON gives, section by section, and a change to a number in the JSON must show up as a named stale section.
Reads files only; nothing is spawned."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

PERF = Path(__file__).resolve().parents[1] / "perf"
sys.path.insert(0, str(PERF))
import results_page  # noqa: E402


def test_results_page_matches_the_json():
    bad = results_page.check()
    assert bad == [], ("perf/RESULTS.md differs from what perf/results/*.json generates "
                       f"(run python perf/results_page.py): {bad}")


@pytest.fixture
def copy(tmp_path):
    """A copy of perf/results/, HISTORY.md and the generated page, to change one thing in."""
    shutil.copytree(PERF / "results", tmp_path / "results", ignore=shutil.ignore_patterns("*.png", "*.txt"))
    shutil.copy(PERF / "HISTORY.md", tmp_path / "HISTORY.md")
    page = tmp_path / "RESULTS.md"
    page.write_text(results_page.render(tmp_path / "results", tmp_path / "HISTORY.md"))
    return tmp_path


def _check(root: Path) -> list[str]:
    return results_page.check(root / "RESULTS.md", root / "results", root / "HISTORY.md")


def test_a_changed_number_names_its_section(copy):
    assert _check(copy) == []
    f = copy / "results" / "bench_refit.json"
    d = json.loads(f.read_text())
    d["results"][0]["methods"]["reshard"]["speedup_vs_allgather"] = 1.5
    f.write_text(json.dumps(d))
    bad = _check(copy)
    assert any(b.startswith("End-to-end refit") and b.endswith("differs") for b in bad), bad
    assert any(b.startswith("Summary") for b in bad), bad  # the headline ratio moved too
    assert not any(b.startswith("Megatron") for b in bad), bad


def test_a_hand_edit_of_the_page_is_named(copy):
    page = copy / "RESULTS.md"
    text = page.read_text()
    page.write_text(text.replace("4.95×", "5.95×", 1) + "\n## My own numbers\n\n| a | b |\n")
    bad = _check(copy)
    assert "My own numbers: on RESULTS.md but not generated from the JSON" in bad, bad
    assert any(b.startswith("Summary") or b.startswith("Megatron") for b in bad), bad


def test_a_new_json_file_shows_up_until_summarized_or_listed(copy):
    (copy / "results" / "bench_new.json").write_text(json.dumps({"meta": {"date": "today"}, "rows": []}))
    assert _check(copy) == ["Other raw data: differs"]


def test_a_result_without_provenance_names_the_file(copy):
    f = copy / "results" / "bench_megatron_quiet.json"
    d = json.loads(f.read_text())
    d["meta"] = {"date": "2099-01-01"}  # provenance.json's entry is for another run now: no command, machine
    f.write_text(json.dumps(d))
    with pytest.raises(RuntimeError, match=r"bench_megatron.*bench_megatron_quiet\.json: no command, machine"):
        results_page.render(copy / "results", copy / "HISTORY.md")


def test_a_history_heading_that_moved_is_an_error(copy):
    h = copy / "HISTORY.md"
    h.write_text(h.read_text().replace("## Topology-aware routing", "## Routing by topology"))
    with pytest.raises(KeyError, match="Topology-aware routing"):
        results_page.render(copy / "results", copy / "HISTORY.md")


def test_check_mode_exits_1_naming_the_section(copy, capsys):
    page = copy / "RESULTS.md"
    shutil.copy(PERF / "RESULTS.md", page)
    assert results_page.main(["--check", "--page", str(page)]) == 0
    page.write_text(page.read_text().replace("## Delta refit", "## Delta refit (edited)"))
    assert results_page.main(["--check", "--page", str(page)]) == 1
    out = capsys.readouterr().out
    assert "Delta refit (`perf/bench_delta.py --part refit`): missing from RESULTS.md" in out, out


def test_every_number_on_the_page_comes_from_a_summarizer():
    """The page's fixed prose (intro, notes, the historical list) has no digits but in names and commands."""
    import re

    prose = [results_page.INTRO, *(what for what, _h, _j in results_page.HISTORICAL)]
    for text in prose:
        text = re.sub(r"`[^`]*`|\b[A-Za-z]+\d+\b", "", text)  # commands and names (FP8, BF16)
        assert not re.search(r"\d", text), text


def test_the_cluster_goals_follow_the_json(copy):
    """Issue 32's goals table (perf/bench_cluster.py): each row's met / missed follows the number in the file
    the row names, on either side of the goal."""
    path = copy / "results" / "bench_cluster_moe_adamw.json"
    d = json.loads(path.read_text())
    row = d["settings"][0]["models"]["small_qwen3_moe"]

    def goal(text: str) -> list[str]:
        sec = next(s for s in results_page.sections(results_page.Results(copy / "results"))
                   if s.title.startswith("Issue 32"))
        return [r[2:] for r in sec.table if r[0].startswith(text) and "bench_cluster_moe_adamw.json" in r[1]
                and r[1].startswith("2 nodes")]  # the file's first setting (it also has 4 nodes)

    for speedup, over, want in ((5.2, 1.1, "met"), (4.9, 1.2, "**missed**")):
        row["delta"]["by_fraction"]["0.02"]["speedup"] = speedup
        row["methods"]["ours"]["over_link_limit"] = over
        path.write_text(json.dumps(d))
        assert goal("delta at 2 % ≥ 5× faster than dense at 1 Gbit/s (AdamW") == [[f"{speedup:.2f}×", want]]
        assert goal("dense ≤ 1.15× the link limit") == [[f"{over:.2f}×", want]]
