"""SGLang's own refit path against ours, into the same SGLang ranks, on this machine (CPU, gloo):

    .venv-sglang/bin/python perf/bench_sglang.py [--tp 4] [--repeats 3] [--layers 8] [--hidden 1024]

Two jobs, as an RL stack runs them: an engine job (``tp`` processes: SGLang's model classes built and loaded by
its own ``get_model``, its own ``WeightUpdater``) and a trainer job (one process holding the full model, the
source both paths start from). Each repeat runs, interleaved, on the same engine ranks:

* ``sglang``: SGLang's ``update_weights_from_distributed`` as its scheduler runs it: the trainer broadcasts
  every full checkpoint tensor over SGLang's weight-update group (``init_weights_update_group``); each rank
  ``receive_weights_from_distributed`` + ``begin_weight_update`` + ``load_weights_from_distributed`` (its
  ``load_weights`` slices the tensor) + ``end_weight_update``;
* ``sglang-bucket``: the same with ``load_format="flattened_bucket"`` (one flattened broadcast);
* ``ours``: our plug-in (``SGLangTrainer.send_weights``: SGLang's ``update_weights_from_tensor`` with our
  custom weight loader; each rank receives exactly its own boxes, in place).

Time: the trainer's wall time per refit, control round trips included; wire bytes: what the engine ranks
receive (SGLang's path: every full tensor on every rank; ours: each rank's own boxes, the lower bound).
Prints a table with medians and the ratio to SGLang's faster mode; ``--out FILE`` also writes them as JSON (every
repeat's times, the wire bytes, and a ``meta`` with the command, date, versions and machine), which
``perf/results_page.py`` turns into the SGLang section of perf/RESULTS.md:

    .venv-sglang/bin/python perf/bench_sglang.py --tp 4 --repeats 5 --out perf/results/bench_sglang.json

``--cluster 2xR --rate 1gbit`` (root): the same across two emulated nodes (``triton_reshard.testing.cluster``):
the trainer job (hosting the control store) on node 0, the SGLang TP R engine job on node 1 (its own default
group over that node), the control store and the groups keyed by a fresh secret (off loopback); the JSON adds the
trainer link's bytes per refit and the link rate::

    PYTHONPATH=$PWD .venv-sglang/bin/python perf/bench_sglang.py --cluster 2x2 --rate 1gbit --repeats 5 \
        --layers 4 --hidden 1024 --out perf/results/bench_sglang_cluster.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODES = ("sglang", "sglang-bucket", "ours")


def _config(args) -> dict:
    return {"model_type": "qwen3", "hidden_size": args.hidden, "num_attention_heads": 16, "num_key_value_heads": 4,
            "head_dim": args.hidden // 16, "intermediate_size": args.hidden * 11 // 4, "num_hidden_layers": args.layers,
            "vocab_size": 32000, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def engine_job(rank: int, world: int, ckpt: str, ctl_port: int, upd_port: int, host: str = "127.0.0.1") -> dict:
    import logging

    logging.disable(logging.WARNING)
    from triton_reshard.integrations import sglang as ts
    from triton_reshard.integrations.control import serve, sglang_update_kwargs

    model, mc, _ = ts.load_sglang_model(ckpt, tp=world, dtype="bfloat16")
    updater = ts.sglang_weight_updater(model, mc)
    updater.init_weights_update_group(host, upd_port, 1, world + 1, "bench", backend="gloo")
    recv: dict[str, int] = {}

    def sglang_update(p):  # what SGLang's scheduler does for update_weights_from_distributed
        weights = updater.receive_weights_from_distributed(names=p["names"], dtypes=p["dtypes"], shapes=p["shapes"],
                                                           group_name="bench", load_format=p["load_format"])
        updater.begin_weight_update()
        ok, msg = updater.load_weights_from_distributed(weights)
        updater.end_weight_update(run_post_load=False)
        if not ok:
            raise RuntimeError(msg)
        recv[p["mode"]] = sum(t.numel() * t.element_size() for _n, t in weights)

    def update(p):
        ok, msg = updater.update_weights_from_tensor(**sglang_update_kwargs(p))
        if not ok:
            raise RuntimeError(msg)
        st = ts.engine_state(model)
        if st is not None and st.last_report is not None:
            recv["ours"] = st.last_report.recv_bytes

    serve(host, ctl_port, rank, {"sglang_update": sglang_update,
                                        "begin_weight_update": lambda _p: updater.begin_weight_update(),
                                        "update_weights_from_tensor": update,
                                        "end_weight_update": lambda _p: updater.end_weight_update(run_post_load=False)},
                       timeout=600)
    return recv


def trainer_job(rank: int, world: int, ckpt: str, ctl_port: int, upd_port: int, refit_port: int, tp: int,
                repeats: int, host: str = "127.0.0.1") -> dict:
    from safetensors.torch import load_file
    from sglang.srt.utils.common import init_custom_process_group
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    from triton_reshard.integrations.control import SGLangStoreClient
    from triton_reshard.integrations.sglang import SGLangTrainer
    from triton_reshard.presets import hf_layout

    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    full = load_file(os.path.join(ckpt, "model.safetensors"))
    names = sorted(full)
    client = SGLangStoreClient(host, ctl_port, tp, timeout=600)
    pg = init_custom_process_group(backend="gloo", init_method=f"tcp://{host}:{upd_port}", world_size=tp + 1,
                                   rank=0, group_name="bench")
    layout = hf_layout(cfg, ranks=0, dtype=torch.bfloat16)
    ours = SGLangTrainer(layout, rank=0, num_trainer_ranks=1, num_engine_ranks=tp, host=host,
                         port=refit_port, engine=client, timeout=600)
    meta = {"names": names, "dtypes": [str(full[n].dtype).removeprefix("torch.") for n in names],
            "shapes": [list(full[n].shape) for n in names]}

    def sglang(load_format):
        import threading

        err = []
        t = threading.Thread(target=lambda: _run(err, client.call, "sglang_update",
                                                 {**meta, "load_format": load_format,
                                                  "mode": "sglang-bucket" if load_format else "sglang"}))
        t.start()
        if load_format == "flattened_bucket":
            bucket = FlattenedTensorBucket(named_tensors=[(n, full[n]) for n in names])
            torch.distributed.broadcast(bucket.get_flattened_tensor(), src=0, group=pg)
        else:
            for w in [torch.distributed.broadcast(full[n], src=0, group=pg, async_op=True) for n in names]:
                w.wait()
        t.join()
        if err:
            raise err[0]

    from triton_reshard.testing.cluster import current_node, link_counters

    times: dict[str, list[float]] = {m: [] for m in MODES}
    link: dict[str, list[int]] = {m: [] for m in MODES}  # inside a cluster: the trainer node's tx per refit
    for k in range(repeats + 1):  # the first round warms up (plans, buffers) and is not timed
        for mode in MODES:
            c0 = link_counters() if current_node() is not None else None
            t0 = time.perf_counter()
            if mode == "ours":
                ours.send_weights(full, version=k)
            else:
                sglang("flattened_bucket" if mode == "sglang-bucket" else None)
            if k:
                times[mode].append(time.perf_counter() - t0)
                if c0 is not None:
                    link[mode].append((link_counters() - c0).tx)
    sent = ours.last_report.sent_bytes
    ours.shutdown()
    client.stop()
    return {"times": times, "model_bytes": sum(t.numel() * t.element_size() for t in full.values()), "sent": sent,
            "link_tx": link}


def cluster_rank(rank: int, world: int, ckpt: str, addr0: str, addr1: str, repeats: int) -> dict | None:
    """``--cluster``: one rank of a 2-node cluster run. Rank 0 (node 0) is the trainer job (and hosts the
    control store), the ranks of node 1 the SGLang engine job (TP = ranks per node, its own default group over
    node 1); node 0's other ranks idle. Each job leaves the harness's world for its own, as separate jobs do."""
    import torch.distributed as dist

    from triton_reshard.integrations.control import host_store

    rpn = world // 2
    ctl, upd, refit_port, eng = 29611, 29612, 29613, 29614  # fixed: the namespaces are this run's alone
    dist.destroy_process_group()
    if rank == 0:
        store = host_store(addr0, ctl, timeout=600)
        try:
            dist.init_process_group("gloo", init_method=f"tcp://{addr0}:{eng}", rank=0, world_size=1)
            return trainer_job(0, 1, ckpt, ctl, upd, refit_port, rpn, repeats, host=addr0)
        finally:
            store.close()
    if rank < rpn:
        return None
    dist.init_process_group("gloo", init_method=f"tcp://{addr1}:{eng}", rank=rank - rpn, world_size=rpn)
    return engine_job(rank - rpn, rpn, ckpt, ctl, upd, host=addr0)


def _run(err, fn, *a):
    try:
        fn(*a)
    except BaseException as e:  # noqa: BLE001
        err.append(e)


def _parse_args() -> argparse.Namespace:
    """The options; ``--cluster NxR`` checked (2 nodes, the cluster available) and its R made ``--tp``."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--out", default=None, help="write the results as JSON to this path")
    ap.add_argument("--cluster", default=None, metavar="2xR",
                    help="the trainer on node 0, SGLang TP R on node 1 of an emulated cluster "
                         "(triton_reshard.testing.cluster, root); --tp is then R")
    ap.add_argument("--rate", default="1gbit", help="--cluster: each node's link rate")
    args = ap.parse_args()
    if args.cluster:
        try:
            nodes, args.tp = (int(x) for x in args.cluster.lower().split("x"))
        except ValueError:
            ap.error(f"--cluster {args.cluster!r}: give NODESxRANKS, e.g. 2x2")
        if nodes != 2:
            ap.error(f"--cluster {args.cluster}: only 2 nodes (trainer node -> engine node)")
        from triton_reshard.testing.cluster import available

        can, why = available()
        if not can:
            ap.error(f"--cluster: {why}")
    return args


def main() -> int:
    args = _parse_args()
    import transformers

    from triton_reshard.testing.cluster import parse_rate
    from triton_reshard.tools.cliutil import check_output_file

    if args.out:
        check_output_file(args.out, "--out", make_folder=True)

    from triton_reshard.comm.group import free_port
    from triton_reshard.integrations.control import host_store
    from triton_reshard.testing.launch import run_jobs

    cfg = _config(args)
    with tempfile.TemporaryDirectory() as d:
        ckpt = os.path.join(d, "model")
        torch.manual_seed(0)
        kw = {k: v for k, v in cfg.items() if k not in ("model_type", "torch_dtype")}
        transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**kw)).to(torch.bfloat16).save_pretrained(ckpt)
        t0 = time.perf_counter()
        if args.cluster:
            res = _cluster_jobs(args, d, ckpt)
        else:
            ctl, upd, refit_port = free_port(), free_port(), free_port()
            store = host_store("127.0.0.1", ctl, timeout=600)
            try:
                res = run_jobs({"engine": (engine_job, args.tp, ckpt, ctl, upd),
                                "trainer": (trainer_job, 1, ckpt, ctl, upd, refit_port, args.tp, args.repeats)},
                               timeout=1200)
            finally:
                store.close()
    for name in ("engine", "trainer"):
        if isinstance(res[name], Exception):
            print(f"{name} job failed: {res[name]}", file=sys.stderr)
            return 1
    tr = res["trainer"][0]
    recv = {m: sum(r[m] for r in res["engine"]) for m in MODES}
    med = {m: statistics.median(tr["times"][m]) for m in MODES}
    mb = tr["model_bytes"]
    print(f"model: Qwen3-style, hidden {args.hidden}, {args.layers} layers, bf16, {mb / 2**20:.0f} MiB; SGLang TP{args.tp} "
          f"(engine job, {args.tp} processes) <- 1 trainer process; {args.repeats} repeats interleaved, median; "
          f"total {time.perf_counter() - t0:.0f} s")
    print("| path | wire bytes into the engine ranks | x model | refit time (median) | all repeats (s) | "
          "vs sglang-bucket |")
    print("|---|---|---|---|---|---|")
    for m in MODES:
        print(f"| {m} | {recv[m] / 2**20:.0f} MiB | {recv[m] / mb:.2f} | {med[m]:.3f} s | "
              f"{', '.join(f'{t:.2f}' for t in tr['times'][m])} | {med['sglang-bucket'] / med[m]:.2f}x |")
    print(f"ours vs SGLang's faster mode ({min(MODES[:2], key=med.get)}): "
          f"{min(med['sglang'], med['sglang-bucket']) / med['ours']:.2f}x faster; trainer sent {tr['sent'] / 2**20:.0f} MiB")
    if args.cluster:
        lim = mb * 8 / parse_rate(args.rate)
        print(f"across {args.cluster} emulated nodes at {args.rate}: link limit {lim:.3f} s (the model once); "
              + "; ".join(f"{m} {med[m] / lim:.2f}x the limit, trainer link tx "
                          f"{statistics.median(tr['link_tx'][m]) / mb:.2f}x model" for m in MODES))
    if args.out:
        _write_json(args, cfg, tr, recv, med, time.perf_counter() - t0)
    return 0


def _cluster_jobs(args, tmp: str, ckpt: str) -> dict:
    """Both jobs on a fresh 2-node cluster at ``--rate``; the control store and the groups need a secret off
    loopback (a fresh one, given to the ranks in their environment)."""
    import secrets

    from triton_reshard.testing.cluster import Cluster

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {"PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
           "TRITON_RESHARD_SECRET": secrets.token_hex(16)}
    with Cluster(nodes=2, ranks_per_node=args.tp, rate=args.rate) as c:
        run = c.run("perf.bench_sglang:cluster_rank", ckpt, c.address(0), c.address(1), args.repeats,
                    timeout=1200, pg_timeout=600, env=env)
    args.link_bytes = [lb.as_dict() for lb in run.link_bytes]
    return {"trainer": [run.results[0]], "engine": run.results[args.tp:]}


def _write_json(args, cfg: dict, tr: dict, recv: dict, med: dict, total_s: float) -> None:
    """The run as JSON: per path its wire bytes into the engine ranks, every repeat's time and the median."""
    import sglang

    from triton_reshard.testing.cluster import parse_rate

    fastest = min(MODES[:2], key=med.get)
    res = {"config": cfg, "tp": args.tp, "repeats": args.repeats, "model_bytes": tr["model_bytes"],
           "trainer_sent_bytes": tr["sent"], "total_s": total_s,
           "paths": {m: {"recv_bytes": recv[m], "times_s": list(tr["times"][m]), "median_s": med[m]} for m in MODES},
           **({"cluster": {"nodes": 2, "ranks_per_node": args.tp, "rate": args.rate,
                           "rate_bps": parse_rate(args.rate),
                           "trainer_tx_bytes": tr["link_tx"], "run_link_bytes": args.link_bytes}}
              if args.cluster else {}),
           "sglang_faster_mode": fastest, "ours_speedup_vs_sglang_faster": med[fastest] / med["ours"],
           "meta": {"argv": ["perf/bench_sglang.py", *sys.argv[1:]],
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "machine": f"CPU, {os.cpu_count()} cores, gloo"
                               + (f", {args.cluster} emulated nodes at {args.rate}" if args.cluster else ""),
                    "load_average": list(os.getloadavg()), "python": platform.python_version(),
                    "torch": torch.__version__, "sglang": getattr(sglang, "__version__", "?"),
                    "platform": platform.platform()}}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
