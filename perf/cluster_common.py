"""What ``perf/bench_cluster.py`` and its parts (``cluster_delta``, ``cluster_probe``) share: the layouts of a
setting, the timed calls on each rank and their spans, and the exactness check. Its own module so that the
parts import it, not each other (no import circle)."""

from __future__ import annotations

import statistics
import time

import torch


def layouts(model: str, nodes: int, rpn: int):
    """(src layout, one engine's layout, engine instances) of ``model`` on ``nodes`` nodes of ``rpn`` ranks:
    the trainer on the first ``nodes // 2`` nodes (Megatron TP = ``rpn``, PP = its nodes, EP = ``rpn`` for
    MoE), one vLLM engine (TP = ``rpn``, EP for MoE) on each other node."""
    from triton_reshard.presets import get_config, megatron_layout, vllm_layout

    cfg = get_config(model)
    moe = "moe" in model
    trainer_nodes = nodes // 2
    trainer_ranks = rpn * trainer_nodes
    src = megatron_layout(cfg, tp=rpn, pp=trainer_nodes, ep=rpn if moe else 1, etp=1 if moe else None,
                          ranks=range(trainer_ranks), dtype=torch.bfloat16)
    dst = vllm_layout(cfg, tp=rpn, enable_expert_parallel=moe, ranks=range(trainer_ranks, trainer_ranks + rpn),
                      dtype=torch.bfloat16)
    return src, dst, nodes - trainer_nodes


def timed(fn, repeats: int) -> dict:
    """``fn`` ``repeats`` times between barriers: per call this rank's clock on entering and leaving it
    (``time.perf_counter``, the host's monotonic clock, which every rank of the emulated cluster shares: one
    machine), its CPU seconds, and the bytes its node's interface counted over the last call. The refit's time
    is taken from all ranks' marks (:func:`span`): the barrier after a call is not timed."""
    import torch.distributed as dist

    from triton_reshard.testing.cluster import link_counters

    enter, leave, cpu, link = [], [], [], None
    for _ in range(repeats):
        dist.barrier()
        c0 = link_counters()
        p0, t0 = time.process_time(), time.perf_counter()
        fn()
        t1, p1 = time.perf_counter(), time.process_time()
        dist.barrier()
        enter.append(t0)
        leave.append(t1)
        cpu.append(p1 - p0)
        link = (link_counters() - c0).as_dict()
    return {"seconds": [b - a for a, b in zip(enter, leave, strict=True)], "enter": enter, "leave": leave,
            "cpu": cpu, "link": link}


def span(per: list[dict], i: int) -> float:
    """Call ``i``'s time over every rank's :func:`timed` marks ``per``: from the first rank entering the call to
    the last rank leaving it (what a caller waits for; the barrier skew on entering is counted, the barrier
    after the call is not). Results without marks (older files): the slowest rank's own seconds."""
    if all("enter" in p for p in per):
        return max(p["leave"][i] for p in per) - min(p["enter"][i] for p in per)
    return max(p["seconds"][i] for p in per)


def median_span(per: list[dict]) -> float:
    """The median over the repeats of every rank's :func:`timed` marks ``per`` of their :func:`span`."""
    return statistics.median(span(per, i) for i in range(len(per[0]["seconds"])))


def median_cpu(per: list[dict]) -> float:
    """The median over the repeats of every rank's :func:`timed` marks ``per`` of all ranks' CPU seconds."""
    reps = len(per[0]["seconds"])
    return statistics.median(sum(p.get("cpu", [0.0] * reps)[i] for p in per) for i in range(reps))


def exact(layout, rank: int, dst: dict, pub: dict) -> bool:
    """Every element ``layout`` puts on ``rank`` equals the global tensor's, bit for bit (padding is not
    compared: nobody writes it)."""
    from triton_reshard.layout import box_slices

    for f in layout.fragments_on_rank(rank):
        if not f.numel:
            continue
        loff, lsize = f.local_box(f.offsets, f.sizes)
        got = dst[f.local][box_slices(loff, lsize)].reshape(f.sizes)
        if not torch.equal(got.view(torch.int16), pub[f.tensor][box_slices(f.offsets, f.sizes)].view(torch.int16)):
            return False
    return True


def poison(tensors: dict) -> dict:
    for t in tensors.values():
        t.view(torch.int16).fill_(-1)
    return tensors
