"""The command line as a newcomer meets it: every mistake is one line on stderr naming the bad value, exit 2,
and no traceback; every option's help says its default; dtype names take torch's and the short spellings.
All in-process (``cli.main([...])``): nothing here spawns a rank."""

from __future__ import annotations

import pytest
import torch

from triton_reshard.tools import cli
from triton_reshard.tools.cliutil import UsageError, parse_dtype, parse_sizes

DEMO_TINY = ["--size-gb", "0.01", "--no-baseline"]

# (argv, words the one stderr line must contain): the mistakes of issue 14, exactly as quoted, and their kin
MISTAKES = [
    (["demo", "--dtype", "bfloat17"], ["--dtype 'bfloat17'", "bf16"]),
    (["demo", "--src", "tp4,pp2"], ["'tp4'", "no '='"]),
    (["demo", "--src", "tp=4,pq=2"], ["unknown key 'pq'"]),
    (["demo", "--src", "tp=4 pp=2"], ["commas", "no spaces"]),
    (["demo", "--src", "tp=x"], ["tp='x'", "whole number"]),
    (["demo", "--src", "tp=0"], ["tp must be >= 1"]),
    (["demo", "--world", "3", "--src", "tp=3"], ["--world 3", "need 8 ranks"]),
    (["demo", "--world", "12"], ["--world 12", "ranks 8..11 would idle"]),
    (["demo", "--world", "6", "--src", "tp=3,pp=2", "--dst", "tp=2,dp=3"], ["tp=3 does not divide"]),
    (["demo", "--dst", "tp=2,pp=2,dp=2"], ["no pipeline stages"]),
    (["demo", "--bucket-mb", "0"], ["--bucket-mb 0"]),
    (["demo", "--world", "x"], ["--world", "'x'"]),
    (["demo", "--layouts", "megatron"], ["--layouts", "'megatron'"]),
    (["demo", "--frob"], ["unrecognized arguments: --frob"]),
    (["frobnicate"], ["invalid choice: 'frobnicate'"]),
    (["plan", "--model", "llama-3-8b", "--src", "tp=8,pp=64", "--dst", "tp=8"], ["pp=64", "32 decoder layers"]),
    (["plan", "--model", "llama-3-8b", "--src", "tp=8,pp=3", "--dst", "tp=8"],
     ["do not split evenly over pp=3", "--src-layers-per-stage"]),
    (["plan", "--model", "nope", "--src", "tp=1", "--dst", "tp=1"], ["--model 'nope'", "tiny_qwen3_moe"]),
    (["plan", "--model", "tiny_llama", "--src", "tp=1", "--dst", "tp=1", "--dtype", "bf17"], ["--dtype 'bf17'"]),
    (["plan", "--model", "tiny_llama", "--src", "tp=1,pp=1,zz=2", "--dst", "tp=1"], ["unknown key 'zz'"]),
    (["plan", "--model", "tiny_llama", "--src", "tp=1", "--dst", "tp=1,pp=2"], ["unknown key 'pp'"]),
    (["plan", "--model", "tiny_llama", "--src", "tp=1"], ["--dst"]),
    (["plan", "--model", "tiny_llama", "--src", "tp=2", "--dst", "tp=2", "--rank", "2"], ["--rank 2", "ranks 0..1"]),
    (["plan", "--model", "tiny_llama", "--src", "tp=2", "--dst", "tp=2", "--rank", "-1"], ["--rank -1", ">= 0"]),
    (["plan", "--model", "tiny_llama", "--src", "tp=2", "--dst", "tp=2", "--bucket-mb", "0.0001"],
     ["--bucket-mb 0.0001", "bucket_bytes=104 is too small: at least 256 B"]),
    (["bench", "--cases", "foo"], ["unknown case 'foo'"]),
    (["bench", "--sizes-gb", "1,x"], ["--sizes-gb '1,x'"]),
    (["bench", "--dtype", "bf17"], ["--dtype 'bf17'"]),
]


@pytest.mark.parametrize(("argv", "words"), MISTAKES, ids=[" ".join(a) for a, _ in MISTAKES])
def test_a_mistake_is_one_line_and_exit_2(argv, words, capsys):
    assert cli.main(argv) == 2
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1, cap.err
    assert lines[0].startswith("triton-reshard"), lines[0]
    assert "error:" in lines[0] and "Traceback" not in cap.err + cap.out
    for w in words:
        assert w in lines[0], (w, lines[0])


def test_dtype_spellings():
    for text in ("bf16", "bfloat16", "torch.bfloat16", "BF16"):
        assert parse_dtype(text) is torch.bfloat16
    for text in ("fp16", "half", "float16"):
        assert parse_dtype(text) is torch.float16
    for text in ("fp32", "float", "float32", "f32"):
        assert parse_dtype(text) is torch.float32
    assert parse_dtype("fp8") is torch.float8_e4m3fn
    with pytest.raises(UsageError, match="is not a dtype"):
        parse_dtype("Size")  # an attribute of torch that is no dtype


def test_demo_accepts_short_dtypes_before_spawning(monkeypatch, capsys):
    """``demo --dtype bf16`` gets past validation and planning (the world itself is stubbed out here)."""
    from triton_reshard.tools import demo

    def no_world(*a, **k):
        raise SystemExit("stop before spawning")

    monkeypatch.setattr(demo, "run_world", no_world)
    with pytest.raises(SystemExit, match="stop before spawning"):
        cli.main(["demo", "--dtype", "bf16", *DEMO_TINY])
    out = capsys.readouterr().out
    assert "bfloat16 weights" in out and "spawning 8 ranks" in out and "planned in" in out


def test_parse_sizes_names_the_part():
    assert parse_sizes("tp=4,pp=2", ("tp", "pp"), "--src", "tp=4") == {"tp": 4, "pp": 2}
    assert parse_sizes(" tp=4 , pp=2 ,", ("tp", "pp"), "--src", "tp=4") == {"tp": 4, "pp": 2}
    with pytest.raises(UsageError, match="tp is given twice"):
        parse_sizes("tp=4,tp=2", ("tp",), "--src", "tp=4")
    with pytest.raises(UsageError, match="is empty"):
        parse_sizes("", ("tp",), "--src", "tp=4")


def _all_parsers(parser):
    import argparse

    yield parser
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for p in a.choices.values():
                yield from _all_parsers(p)


def test_every_option_has_help_and_its_default():
    import argparse

    for p in _all_parsers(cli.build_parser()):
        text = p.format_help()
        assert "``" not in text and "(and more" not in text, p.prog
        for a in p._actions:
            if not a.option_strings or isinstance(a, argparse._HelpAction | argparse._VersionAction):
                continue
            assert a.help and a.help.strip(), (p.prog, a.option_strings)
            assert not a.help.rstrip().endswith(("without", "the", "and", "or")), (p.prog, a.option_strings, a.help)
            if a.default not in (None, False) and not a.required:
                helped = p._get_formatter()._get_help_string(a) % {"default": a.default}
                assert "default" in helped, (p.prog, a.option_strings, a.help)


def test_help_lists_values(capsys):
    assert cli.main(["plan", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # help wraps lines
    assert "tiny_qwen3_moe" in out and "bf16" in out and "without relays beside it" in out
    assert "default 1024" in out
    assert cli.main(["demo", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "bf16" in out and "default 120" in out and "--plot" in out
    assert cli.main(["bench", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for opt in ("--dtype", "--bucket-mb", "--repeats", "--timeout"):
        assert opt in out
    assert "default 64" in out and "default 3" in out


def test_version(capsys):
    from triton_reshard import __version__

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"triton-reshard {__version__}"


def test_plan_plot_writes_a_heatmap(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from triton_reshard.tools.plot import traffic_matrix

    png = tmp_path / "traffic.png"
    argv = ["plan", "--model", "tiny_qwen3_moe", "--src", "tp=2,pp=2", "--dst", "tp=2,dp=2", "--bucket-mb", "1",
            "--plot", str(png)]
    assert cli.main(argv) == 0
    assert f"traffic heatmap written to {png}" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from triton_reshard.plan import plan_reshard
    from triton_reshard.presets import get_config, megatron_layout, vllm_layout

    cfg = get_config("tiny_qwen3_moe")
    plan = plan_reshard(megatron_layout(cfg, tp=2, pp=2, ranks=0), vllm_layout(cfg, tp=2, dp=2, ranks=0))
    ranks, m = traffic_matrix(plan)
    st = plan.stats()
    assert ranks == [0, 1, 2, 3]
    assert m.sum() - m.trace() == st.wire_bytes and m.trace() == st.local_bytes


def test_plan_rank_prints_that_ranks_share(tmp_path, capsys):
    """``plan --rank R``: rank R's share alone, its transfers = the whole plan's transfers of rank R."""
    import inspect
    import json

    from triton_reshard.plan import plan_reshard
    from triton_reshard.presets import get_config, megatron_layout, vllm_layout

    if "rank" not in inspect.signature(plan_reshard.__wrapped__).parameters:
        pytest.skip("plan_reshard(..., rank=) (rank plans, issue 13) is not in this tree yet")
    out_json = tmp_path / "r.json"
    argv = ["plan", "--model", "tiny_qwen3_moe", "--src", "tp=2,pp=2", "--dst", "tp=2,dp=2,ep=4", "--instances", "2",
            "--bucket-mb", "1", "--rank", "5", "--json", str(out_json)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "rank 5 of 8" in out and "rank share time:" in out and "rank plan" in out and "peak memory" in out
    r = json.loads(out_json.read_text())
    cfg = get_config("tiny_qwen3_moe")
    one = vllm_layout(cfg, tp=2, dp=2, enable_expert_parallel=True, ranks=0)
    whole = plan_reshard(megatron_layout(cfg, tp=2, pp=2, ranks=0), one.instances(2), False, None, None,
                         one.instance_groups(2))
    mine = [t for t in whole.transfers if 5 in (t.src_rank, t.dst_rank)]
    assert r["num_transfers"] == len(mine)
    assert r["sent_bytes"] == sum(t.nbytes for t in mine if t.src_rank == 5)
    assert r["recv_bytes"] == sum(t.nbytes for t in mine if t.dst_rank == 5)
    assert r["num_local_copies"] == sum(1 for t in whole.local_copies if t.dst_rank == 5)


@pytest.mark.slow
def test_demo_end_to_end_explains_itself(tmp_path, capfd):
    """A tiny demo on 2 spawned ranks: phase lines, the legend, the lower bound, the speed-up's source, the
    time breakdown and the one-line verdict, plus the heatmap."""
    pytest.importorskip("matplotlib")
    png = tmp_path / "demo.png"
    argv = ["demo", "--src", "tp=2", "--dst", "tp=1,dp=2", "--size-gb", "0.02", "--repeats", "1", "--dtype", "bf16",
            "--plot", str(png)]
    assert cli.main(argv) == 0
    out = capfd.readouterr().out  # rank 0's phase lines come from its own process
    for words in ("spawning 2 ranks", "reshard run 1/1", "all-gather baseline run 1/1", "busiest recv",
                  "staging/rank  extra buffers", "lower bound on the wire", "DP2: each replica", "speed-up over the all-gather",
                  "from batching", "first run:", "demo time", "OK: every destination element"):
        assert words in out, (words, out)
    assert out.rstrip().splitlines()[-1].startswith("OK: ") and png.stat().st_size > 0


def _no_world(*a, **k):
    raise AssertionError("spawned a world although the command line was wrong")


MISSING = "/nonexistent-triton-reshard-folder/out"
OUTPUT_MISTAKES = [
    (["demo", *DEMO_TINY, "--json", MISSING + ".json"], ["--json", "does not exist"]),
    (["demo", *DEMO_TINY, "--plot", MISSING + ".png"], ["--plot", "does not exist"]),
    (["plan", "--model", "tiny_llama", "--src", "tp=1", "--dst", "tp=1", "--json", MISSING + ".json"],
     ["--json", "does not exist"]),
    (["plan", "--model", "tiny_llama", "--src", "tp=1", "--dst", "tp=1", "--plot", MISSING + ".png"],
     ["--plot", "does not exist"]),
    (["plan", "--model", "tiny_llama", "--src", "tp=1", "--dst", "tp=1", "--json", "/"], ["--json /", "is a folder"]),
]


@pytest.mark.parametrize(("argv", "words"), OUTPUT_MISTAKES, ids=[" ".join(a[:1] + a[-2:]) for a, _ in OUTPUT_MISTAKES])
def test_an_output_path_that_cannot_be_written_is_refused_before_any_work(argv, words, monkeypatch, capsys):
    """Issue 22: ``--plot``/``--json`` into a missing folder was a traceback after the work was done."""
    from triton_reshard.tools import demo

    monkeypatch.setattr(demo, "run_world", _no_world)
    assert cli.main(argv) == 2
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in cap.err, cap.err
    assert MISSING in lines[0] or argv[-1] in lines[0], lines[0]
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert "planned in" not in cap.out and "plan " not in cap.out, cap.out  # refused before planning


def test_bench_out_that_is_a_file_is_refused_before_spawning(tmp_path, monkeypatch, capsys):
    import triton_reshard.tools.bench as bench

    monkeypatch.setattr(bench, "run_world", _no_world)
    f = tmp_path / "results"
    f.write_text("")
    assert cli.main(["bench", "--out", str(f)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--out {f}: is a file, not a folder" in err[0], err
    assert cli.main(["bench", "--out", str(f / "sub")]) == 2
    assert "cannot create it" in capsys.readouterr().err


def test_output_checks_accept_what_can_be_written(tmp_path):
    from triton_reshard.tools.cliutil import check_output_file, check_output_folder

    check_output_file(str(tmp_path / "a.json"), "--json")
    check_output_file(None, "--json")
    check_output_folder(str(tmp_path / "new" / "deeper"), "--out")  # created later by the bench
    check_output_folder(str(tmp_path), "--out")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_backend_triton_on_cpu_is_refused_before_spawning_unless_interpreted(monkeypatch, capsys):
    pytest.importorskip("triton")
    from triton_reshard.tools import demo

    monkeypatch.setattr(demo, "run_world", _no_world)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert cli.main(["demo", *DEMO_TINY, "--backend", "triton"]) == 2
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and "--backend triton" in lines[0] and "TRITON_INTERPRET=1" in lines[0], cap.err
    assert "spawning" not in cap.out
    # under Triton's interpreter the Triton copy runs on CPU tensors: valid, it gets to spawning
    monkeypatch.setenv("TRITON_INTERPRET", "1")

    def stop(*a, **k):
        raise SystemExit("stop before spawning")

    monkeypatch.setattr(demo, "run_world", stop)
    with pytest.raises(SystemExit, match="stop before spawning"):
        cli.main(["demo", *DEMO_TINY, "--backend", "triton"])
    assert "spawning 8 ranks" in capsys.readouterr().out


def _one_rank_world(fn, world, *args, **kwargs):
    """``run_world`` for a world of one, in this process (a real gloo group of size 1)."""
    import torch.distributed as dist

    assert world == 1
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return [fn(0, 1, *args)]
    finally:
        dist.destroy_process_group()


def test_fp8_demo_says_each_phase_and_counts_it_in_the_breakdown(monkeypatch, capsys):
    """Issue 22: the FP8 demo was silent while the ranks built the FP8 plan and its reference quantization, and
    the time breakdown counted that (and the FP8 runs) as spawning; its table mixed GiB, MiB and KiB."""
    import re

    from triton_reshard.tools import demo

    monkeypatch.setattr(demo, "run_world", _one_rank_world)
    argv = ["demo", "--layouts", "simple", "--src", "tp=1", "--dst", "tp=1", "--size-gb", "0.005", "--dtype", "bf16",
            "--dst-dtype", "fp8-block", "--quant-block", "32", "--repeats", "1"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()

    def at(words):
        hits = [i for i, x in enumerate(lines) if words in x]
        assert hits, (words, out)
        return hits[0]

    assert at("reshard run 1/1") < at("block-FP8 destination: each rank plans it") < at("block-FP8 set up in") \
        < at("block-FP8 run 1/1") < at("all-gather baseline run 1/1")
    # the table: one unit (MiB, said in the header), numbers only in its cells
    head = at("method ")
    assert lines[head].split()[-1] == "wrong" and lines[head].count("(MiB)") == 4, lines[head - 1:head + 1]
    rows = lines[head + 1:head + 4]
    assert [r.split()[0] for r in rows] == ["reshard", "ours", "all-gather"], rows
    for r in rows:
        assert not re.search(r"[KMG]iB|\d+ B\b|K\b", r), r
    # the breakdown: every phase named, and they add up to the world's time
    bd = lines[at("demo time ")]
    m = re.search(r"the world ([\d.]+) s = spawn and per-rank setup (-?[\d.]+) s, reshard runs ([\d.]+) s, "
                  r"block-FP8 setup \(its plan and reference quantization\) ([\d.]+) s, block-FP8 runs ([\d.]+) s, "
                  r"all-gather runs ([\d.]+) s", bd)
    assert m, bd
    world, *parts = (float(x) for x in m.groups())
    assert parts[0] >= 0 and abs(sum(parts) - world) <= 0.15, bd
    assert lines[-1].startswith("OK: every destination element equals the global tensor"), lines[-1]


@pytest.mark.parametrize(("fmt", "label"), [("mxfp8", "MXFP8"), ("nvfp4", "NVFP4")])
def test_demo_refits_into_mxfp8_and_nvfp4(monkeypatch, capsys, fmt, label):
    """``--dst-dtype mxfp8 | nvfp4``: the demo's refit into those weights, every value byte, scale and (NVFP4) global
    scale checked against the format's reference of the whole tensor (poisoned destinations)."""
    from triton_reshard.tools import demo

    monkeypatch.setattr(demo, "run_world", _one_rank_world)
    argv = ["demo", "--layouts", "simple", "--src", "tp=1", "--dst", "tp=1", "--size-gb", "0.005", "--dtype", "bf16",
            "--dst-dtype", fmt, "--repeats", "1", "--no-baseline"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert f"{label} run 1/1" in out and "0 wrong bytes or scales on rank 0" in out, out
    assert any(line.split()[:3] == ["ours", "->", fmt] and line.split()[-1] == "0" for line in out.splitlines()), out
    assert out.splitlines()[-1].startswith("OK: every destination element equals the global tensor")


PERF_OUTPUTS = [  # (script, its output option, whether the script creates the missing folder itself)
    ("bench_planner", "--out", True), ("bench_planner", "--plot", False), ("bench_routing", "--out", True),
    ("bench_kernels", "--out", True), ("autotune", "--out", True), ("bench_quant", "--out", False),
    ("bench_record", "--out", True), ("bench_megatron", "--json", False),
]


@pytest.mark.parametrize(("script", "option", "makes_folder"), PERF_OUTPUTS, ids=[f"{s} {o}" for s, o, _ in PERF_OUTPUTS])
def test_perf_scripts_refuse_an_unwritable_output_before_any_work(script, option, makes_folder, tmp_path, monkeypatch,
                                                                  capsys):
    import importlib
    import os
    import sys

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(__file__)), "perf"))
    mod = importlib.import_module(script)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    # a folder the script cannot create (its parent is a file); one it need not create when it makes folders
    bad = str(blocker / "sub" / "out.json") if makes_folder else str(tmp_path / "missing" / "out.json")
    argv = [option, bad]
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv])
    with pytest.raises(SystemExit) as e:
        mod.main() if script == "bench_record" else mod.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"{script}.py: error: {option} {bad}: "), err
    assert ("cannot create its folder" if makes_folder else "does not exist") in err[-1], err


def test_traffic_plot_labels_every_cell_in_mib(tmp_path, monkeypatch):
    """Issue 22: one unit per picture: the cells below 0.1 MiB were labelled in KiB ("51K")."""
    pytest.importorskip("matplotlib")
    import re

    import matplotlib.pyplot as plt

    from triton_reshard.plan import plan_reshard
    from triton_reshard.presets import get_config, megatron_layout, vllm_layout
    from triton_reshard.tools.plot import plot_traffic, traffic_matrix

    figs = []
    monkeypatch.setattr(plt, "close", figs.append)
    cfg = get_config("tiny_qwen3_moe")
    plan = plan_reshard(megatron_layout(cfg, tp=2, pp=2, ranks=0), vllm_layout(cfg, tp=2, dp=2, ranks=0))
    _ranks, m = traffic_matrix(plan)
    assert 0 < m[m > 0].min() < 0.1 * (1 << 20)  # cells that were labelled in KiB
    plot_traffic(plan, str(tmp_path / "t.png"))
    texts = [t.get_text() for ax in figs[0].axes for t in ax.texts]
    assert len(texts) == int((m > 0).sum()) and all(re.fullmatch(r"[\d.]+(e-\d+)?", t) for t in texts), texts
    assert all("KiB" not in ax.get_ylabel() for ax in figs[0].axes)
