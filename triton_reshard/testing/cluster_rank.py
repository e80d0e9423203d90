"""Inside a rank of a :meth:`triton_reshard.testing.cluster.Cluster.run`: the node it runs on, its node's
link counters, and the entry point the harness starts in each node's namespace
(``python -m triton_reshard.testing.cluster_rank SPEC``), which joins the gloo group, runs the function the
spec names and writes its JSON result (or the error) where the harness reads it: nothing is pickled."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from collections.abc import Callable

from .links import LinkBytes


def current_node() -> int | None:
    """This rank's node index inside a cluster run (None outside one)."""
    v = os.environ.get("TRITON_RESHARD_CLUSTER_NODE")
    return int(v) if v is not None else None


def link_counters() -> LinkBytes:
    """Inside a rank of a cluster run: its node's interface counters now (every rank of a node reads the same
    counters: take differences around an operation between two barriers)."""
    ifname = os.environ.get("TRITON_RESHARD_CLUSTER_IFNAME")
    if ifname is None:
        raise RuntimeError("link_counters() runs only inside a rank of a Cluster.run")
    base = f"/sys/class/net/{ifname}/statistics/"

    def rd(name: str) -> int:
        with open(base + name) as f:
            return int(f.read())

    return LinkBytes(rd("tx_bytes"), rd("rx_bytes"), rd("tx_packets"), rd("rx_packets"))


def _resolve(target: str) -> Callable:
    import importlib

    mod, _, name = target.partition(":")
    obj = importlib.import_module(mod)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _rank_main(spec_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    result_path = spec["result"]

    def write(payload: dict) -> None:
        tmp = result_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(payload, f)
        os.replace(tmp, result_path)

    try:
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        fn = _resolve(spec["fn"])
        dist.init_process_group("gloo", init_method=spec["init_method"], rank=spec["rank"],
                                world_size=spec["world_size"], timeout=timedelta(seconds=spec["pg_timeout"]))
        try:
            result = fn(spec["rank"], spec["world_size"], *spec["args"])
        finally:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        write({"ok": True, "result": result})
        return 0
    except BaseException as e:  # reported to the harness by node and rank
        write({"ok": False, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"})
        return 1


if __name__ == "__main__":
    sys.exit(_rank_main(sys.argv[1]))
