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
