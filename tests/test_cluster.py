"""Refits across an emulated cluster (``triton_reshard.testing.cluster``): 2 nodes x 2 ranks as network
namespaces behind 1 Gbit/s ``tbf`` links. Dense, delta and relayed refits land bit for bit in poisoned
destinations, and the bytes that crossed each node's link (its interface counters) equal the plan's predicted
cross-node bytes plus the protocol overhead, bounded here and measured in docs/cluster.md. A rank that dies
inside a node is reported by node and rank and the namespaces are still removed; a lossy link (1 %) completes
exactly or fails named. Bad sizes and rates fail in one line without root.

Needs root and iproute2: elsewhere these tests skip with the harness's one-line reason, except under
``CI=true``, where that is a failure (CI runs as root).
"""

from __future__ import annotations

import math
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.cluster_cases import RANKS_PER_NODE, SHAPES, layouts
from triton_reshard import plan_reshard
from triton_reshard.testing import cluster as C
from triton_reshard.tools.topology import node_link_bytes, plan_pair_bytes

ROOT = str(Path(__file__).resolve().parents[1])
ENV = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
# protocol overhead allowed per packet the interface counted: Ethernet 14 + IPv4 20 + TCP 32 (timestamps) =
# 66 bytes of headers per (GSO) packet, plus gloo's message headers and the plan's 16-byte chunk alignment
PER_PACKET = 80
ALIGN_SLACK = 16 * 64  # the plan's chunks start at multiples of 16 bytes: at most 15 bytes per chunk


@pytest.fixture(scope="module")
def need_cluster():
    ok, why = C.available()
    if not ok:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but the cluster harness cannot run: {why}")
        pytest.skip(why)


def _ours() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"{C.PREFIX}{os.getpid()}-")]


# ---------------------------------------------------------------------------------------------------------
# bad input: no root needed


@pytest.mark.parametrize("kwargs, match", [
    ({"nodes": 0}, "nodes=0"),
    ({"nodes": 2, "ranks_per_node": 0}, "ranks_per_node=0"),
    ({"nodes": 1000}, "nodes=1000"),
    ({"nodes": 2, "rate": "fast"}, "link rate 'fast'"),
    ({"nodes": 2, "rate": "0gbit"}, "link rate '0gbit'"),
    ({"nodes": 2, "rate": ["1gbit"]}, "1 link rates given for 2 nodes"),
    ({"nodes": 2, "latency": "soon"}, "link latency 'soon'"),
    ({"nodes": 2, "loss": 2.0}, "link loss 2.0"),
    ({"nodes": 2, "mtu": 10}, "mtu=10"),
])
def test_bad_cluster_is_one_line(kwargs, match):
    with pytest.raises(ValueError, match=match) as e:
        C.Cluster(**kwargs)
    assert "\n" not in str(e.value)


def test_rates_parse():
    assert C.parse_rate("1gbit") == 1e9 and C.parse_rate("500mbit") == 5e8 and C.parse_rate(2.5e9) == 2.5e9
    assert C.parse_rate("1gbps") == 8e9 and C.parse_rate(None) is None
    assert C.parse_seconds("50us") == pytest.approx(50e-6) and C.parse_seconds("1ms") == pytest.approx(1e-3)


def test_node_link_bytes_counts_only_cross_node_pairs():
    pairs = {(0, 1): 5, (0, 2): 7, (1, 3): 11, (3, 2): 13, (2, 0): 17, (1, 1): 19}
    assert node_link_bytes(pairs, 2) == [(18, 17), (17, 18)]


# ---------------------------------------------------------------------------------------------------------
# 2 nodes x 2 ranks


def _node_link(results, phase: str) -> list[dict]:
    """Per node, the counters its lowest rank measured around ``phase`` (every rank of a node reads the same)."""
    return [results[n * RANKS_PER_NODE][phase]["link"] for n in range(2)]


def _check_bytes(results, phase: str, predicted: list[tuple[int, int]]) -> dict:
    links = _node_link(results, phase)
    idle = max(r["idle"]["tx"] + r["idle"]["rx"] for r in results)  # a barrier's bytes, both ways
    report = {}
    for node, (link, (tx, rx)) in enumerate(zip(links, predicted, strict=True)):
        for way, want, got, pk in (("tx", tx, link["tx"], link["tx_packets"]),
                                   ("rx", rx, link["rx"], link["rx_packets"])):
            slack = PER_PACKET * pk + 2 * idle + ALIGN_SLACK
            assert want <= got <= want + slack, (
                f"{phase}: node {node} {way}: measured {got} bytes on the link, predicted {want} "
                f"(+ at most {slack} of protocol overhead)")
            report[f"node{node}_{way}"] = (want, got)
    return report


def test_refits_across_two_nodes_are_exact_and_cross_the_predicted_bytes(need_cluster):
    with C.Cluster(2, RANKS_PER_NODE, rate="1gbit") as c:
        names = _ours()
        assert len(names) == 3  # two nodes and the switch
        run = c.run("tests.cluster_cases:refits", SHAPES, 1e-6, 0, timeout=170, env=ENV)
    assert not [n for n in _ours() if n in names]  # torn down
    res = run.results
    for r in res:
        for phase in ("dense", "delta", "relay_on", "relay_off"):
            assert r[phase]["bad"] == [], r[phase]["bad"]
    assert {r["dense"]["mode"] for r in res} == {"dense-fallback"}  # the first delta=True refit is dense
    assert {r["delta"]["mode"] for r in res} == {"delta"}

    src, dst, rep = layouts(SHAPES)
    dense = node_link_bytes(plan_pair_bytes(plan_reshard(src, dst)), RANKS_PER_NODE, 2)
    total = sum(2 * math.prod(s) for s in SHAPES.values())  # bf16
    assert dense == [(total, 0), (0, total)]  # disaggregated: every element crosses once
    _check_bytes(res, "dense", dense)

    # delta: the encoded messages (the bytes each trainer rank reports sending) are what crosses
    sent = sum(r["delta"]["sent"] for r in res[:2])
    assert 0 < sent < total / 2
    _check_bytes(res, "delta", [(sent, 0), (0, sent)])

    # relayed: one copy crosses, the engine node fans it out over loopback; without relays every engine rank
    # pulls its own copy over the link
    on = node_link_bytes(plan_pair_bytes(plan_reshard(src, rep, gpus_per_node=2, relay=True)), 2, 2)
    off = node_link_bytes(plan_pair_bytes(plan_reshard(src, rep, gpus_per_node=2, relay=False)), 2, 2)
    assert on == [(total, 0), (0, total)] and off == [(2 * total, 0), (0, 2 * total)]
    _check_bytes(res, "relay_on", on)
    _check_bytes(res, "relay_off", off)


def test_a_rank_dying_inside_a_node_is_named_and_the_namespaces_go(need_cluster):
    t0 = time.monotonic()
    with C.Cluster(2, RANKS_PER_NODE, rate="1gbit") as c:
        names = _ours()
        with pytest.raises(C.ClusterRankError) as e:
            c.run("tests.cluster_cases:dies", 3, timeout=120, pg_timeout=20, env=ENV)
    assert not [n for n in _ours() if n in names]
    errs = e.value.errors
    assert errs[3][0] == 1 and "exited with code 7" in errs[3][1]
    assert "node 1 rank 3" in str(e.value)
    # the survivors raise what they raise today (a named refit error), they do not hang
    assert any("Error" in text for r, (_, text) in errs.items() if r != 3)
    assert time.monotonic() - t0 < 120


def test_stale_namespaces_of_a_dead_run_are_removed(need_cluster):
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{C.PREFIX}{dead.pid}-1-n0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        assert stale in C.remove_stale()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)
    assert stale not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_node_env_reaches_only_its_nodes_ranks(need_cluster):
    names = ["TR_TEST_ALL", "TR_TEST_NODE"]
    with C.Cluster(2, RANKS_PER_NODE, rate="1gbit") as c:
        with pytest.raises(ValueError, match=r"node_env names nodes \[2\]"):
            c.run("tests.cluster_cases:env_of", names, env=ENV, node_env={2: {"X": "1"}})
        run = c.run("tests.cluster_cases:env_of", names, timeout=120,
                    env={**ENV, "TR_TEST_ALL": "a", "TR_TEST_NODE": "base"}, node_env={0: {"TR_TEST_NODE": "n0"}})
    for rank, got in enumerate(run.results):
        assert got == {"node": c.node_of(rank), "TR_TEST_ALL": "a", "TR_TEST_NODE": "n0" if got["node"] == 0 else "base"}


def test_lossy_link_completes_exactly_or_fails_named(need_cluster):
    caps = C.capabilities()
    if not (caps["netem"] or caps["nft"]):
        pytest.skip("no way to drop packets here: neither tc netem nor nftables' nft")
    t0 = time.monotonic()
    with C.Cluster(2, RANKS_PER_NODE, rate="1gbit", loss=0.01) as c:
        run = c.run("tests.cluster_cases:lossy", 6, timeout=170, env=ENV, allow_errors=True)
    # the loss happened: counted where the packets die (netem on the sender's egress, whose eth0 counters never
    # see them, or the nftables rule at the switch port); ~680 packets each way (GSO: one per ~25 KB), so
    # P(no drop on one link) ~ 0.1 %, P(none on either) ~ 1e-6
    assert sum(run.dropped) > 0, (run.dropped, run.link_bytes)
    for r, (node, text) in run.errors.items():  # failing is allowed, but named
        assert "Error" in text.splitlines()[0], (node, r, text)
    for r in run.results:
        if r is not None:
            assert all(row["bad"] == [] for row in r["rows"])
    assert time.monotonic() - t0 < 180


def test_bench_call_cluster_smoke(need_cluster, tmp_path):
    """perf/bench_call.py across the emulated nodes (its loopback mode runs in the main tier's smoke): the
    cached 64-byte refit, with and without the first step's receives posted with the handshake, exact."""
    import json
    import sys

    out = tmp_path / "call.json"
    p = subprocess.run([sys.executable, str(Path(ROOT) / "perf" / "bench_call.py"), "--where", "cluster",
                        "--nodes", "2", "--calls", "4", "--ab", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["exact"] is True and res["where"] == "cluster" and res["ranks"] == 4
    assert {"prepost", "no_prepost"} <= set(res["ab"]) and res["rtt_s"] > 0


def test_bench_cluster_smoke(need_cluster, tmp_path):
    """perf/bench_cluster.py --smoke (what CI runs of it): 2 nodes, 1 Gbit/s, small_llama; every method and the
    delta refit bit-exact (its exit code), the JSON has every method."""
    import json
    import sys

    out = tmp_path / "bench.json"
    p = subprocess.run([sys.executable, str(Path(ROOT) / "perf" / "bench_cluster.py"), "--smoke", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    row = res["settings"][0]["models"]["small_llama"]
    assert set(row["methods"]) == {"ours", "allgather", "gather-bcast"}
    assert row["methods"]["ours"]["node_tx"][0] >= row["link_limit_bytes"]
    assert all(d["modes"] == ["delta"] for d in row["delta"]["rows"])
    # the calibration's probes (session 41): the links as a refit uses them, at least what a 16 MiB refit
    # showed they carried; the host term only adds
    probe = res["settings"][0]["probe"]
    assert probe["link_calibrated"] >= probe["link"] > 0 and probe["link_one_stream"] > 0
    assert probe["bulk_bytes"] == 16 << 20 and probe["host_cores"] >= 1 and probe["refit_step_s"] > 0
    assert row["predicted_calibrated_s"] >= row["predicted_calibrated_wire_s"] > 0
