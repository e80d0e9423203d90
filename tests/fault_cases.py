"""Worker side of ``test_faults.py``: one spawned gloo world of 4 runs every failure scenario, each on a fresh
process group (a failure breaks the group it happened on, FACTS.md), the SIGKILLed peer last (the world has
3 ranks after it). Results are plain dicts the tests read."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import torch

from triton_reshard import Layout, Resharder, ReshardError, Shard, plan_reshard, refit, refit_state

WORLD = 4
TIMEOUT = 3.0  # seconds: the Resharder's timeout in the failure scenarios
SHAPES = {"w": (32, 24), "b": (24,)}
# all-to-all: every destination rank needs a column block of every source rank's rows
SRC = Layout.from_placements(SHAPES, list(range(WORLD)), {"w": [Shard(0)], "b": [Shard(0)]})
DST = Layout.from_placements(SHAPES, list(range(WORLD)), {"w": [Shard(1)], "b": [Shard(0)]})
BUCKET = 512  # bytes: several steps
ROT_SHAPES = {"w": (64, 8)}
ROT_SRC = Layout.from_placements(ROT_SHAPES, [0, 1, 2, 3], [Shard(0)])
ROT_DST = Layout.from_placements(ROT_SHAPES, [1, 2, 3, 0], [Shard(0)])  # each rank gets its neighbour's rows
RAISES, KILLED = 2, 3  # the rank that raises mid-run, the rank SIGKILLed mid-exchange


def global_data(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + version)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def shard_of(layout: Layout, rank: int, data) -> dict[str, torch.Tensor]:
    return layout.shard(data, rank)


def expected(rank: int, version: int) -> dict[str, torch.Tensor]:
    """Independent of the planner: slice the global tensors by hand (dst: w by columns, b by rows)."""
    g = global_data(version)
    cw, cb = SHAPES["w"][1] // WORLD, SHAPES["b"][0] // WORLD
    return {"w": g["w"][:, rank * cw:(rank + 1) * cw], "b": g["b"][rank * cb:(rank + 1) * cb]}


def _fail_on(rank: int, call: int, action):
    """Make this process's ``copy_views`` run ``action`` on its ``call``-th call (1-based): a mid-run fault.
    The native fused copy-and-digest (``execute/integrity.py``) is off meanwhile: every copy goes through here."""
    import triton_reshard.ops as ops
    from triton_reshard.ops.delta_native import set_native

    real = ops.copy_views
    prev = set_native(False)
    n = [0]

    def copy_views(pairs, backend="torch", key=None):
        if pairs:
            n[0] += 1
            if n[0] == call:
                action()
        return real(pairs, backend, key)

    ops.copy_views = copy_views

    def restore():
        set_native(prev)
        ops.copy_views = real

    return restore


def _error(e: BaseException | None, t0: float) -> dict:
    out = {"seconds": time.perf_counter() - t0, "error": None, "message": ""}
    if e is not None:
        out.update(error=type(e).__name__, message=str(e), is_reshard_error=isinstance(e, ReshardError),
                   torn=list(getattr(e, "torn", ())), kind=getattr(e, "kind", None),
                   elapsed=getattr(e, "elapsed", None), peers=list(getattr(e, "peers", None) or ()),
                   what=getattr(e, "what", None), cause=type(e.__cause__).__name__ if e.__cause__ else None)
    return out


def _state() -> dict:
    s = refit_state(DST)
    return {"version": s.version, "torn": s.torn, "torn_tensors": list(s.torn_tensors),
            "failed_version": s.failed_version}


def _group():
    import torch.distributed as dist

    return dist.new_group(list(range(WORLD)), timeout=timedelta(seconds=60))


def aliased_multistep(rank: int) -> dict:
    """Rank 1 passes one tensor as source and destination of a multi-step reshard that writes other rows
    into it (the case that silently corrupted 262,144 values per rank): refused before anything moves."""
    g = _group()
    r = Resharder(plan_reshard(ROT_SRC, ROT_DST), group=g, bucket_bytes=256, timeout=20)
    data = {"w": torch.arange(512, dtype=torch.float32).reshape(64, 8)}
    src = shard_of(ROT_SRC, rank, data)
    dst = {"w": src["w"] if rank == 1 else torch.full((16, 8), float("nan"))}
    before = {n: t.clone() for n, t in {**src, **{"dst_" + n: t for n, t in dst.items()}}.items()}
    t0 = time.perf_counter()
    try:
        r.run(src, dst)
        e = None
    except Exception as ex:
        e = ex
    out = _error(e, t0)
    out["untouched"] = all(torch.equal(t, before[n]) or (t.isnan().all() and before[n].isnan().all())
                           for n, t in {**src, **{"dst_" + n: t for n, t in dst.items()}}.items())
    out["steps"] = len(r.steps)
    return out


def peer_raises_then_retry(rank: int) -> dict:
    """Refit version 0 (fine), then version 1 with rank 2 raising in its second copy: rank 2 gets
    ReshardAbortedError, the others a ReshardTransportError subclass; their destinations are torn
    (refit_state says so). Then every rank destroys the group, builds a new one and refits version 1
    again: repaired, bit for bit, and refit_state is clean."""
    import torch.distributed as dist

    out: dict = {}
    g = _group()
    dst = {n: torch.full(s.shape, float("nan")) for n, s in DST.local_specs(rank).items()}
    refit(shard_of(SRC, rank, global_data(0)), dst, SRC, DST, group=g, bucket_bytes=BUCKET, timeout=TIMEOUT,
          version=0)
    out["v0_ok"] = all(torch.equal(dst[n], t) for n, t in expected(rank, 0).items())
    restore = _fail_on(rank, 2, lambda: (_ for _ in ()).throw(RuntimeError("injected failure"))) \
        if rank == RAISES else (lambda: None)
    t0 = time.perf_counter()
    try:
        refit(shard_of(SRC, rank, global_data(1)), dst, SRC, DST, group=g, bucket_bytes=BUCKET,
              timeout=TIMEOUT, version=1)
        e = None
    except Exception as ex:
        e = ex
    finally:
        restore()
    out["fail"] = _error(e, t0)
    out["state_after_failure"] = _state()
    out["partly_old"] = not all(torch.equal(dst[n], t) for n, t in expected(rank, 1).items())
    t1 = time.perf_counter()
    dist.destroy_process_group(g)
    g2 = _group()  # collective: every rank arrives here, the failed ones after their timeout
    refit(shard_of(SRC, rank, global_data(1)), dst, SRC, DST, group=g2, bucket_bytes=BUCKET, timeout=TIMEOUT,
          version=1)
    out["retry_seconds"] = time.perf_counter() - t1
    out["retry_ok"] = all(torch.equal(dst[n], t) for n, t in expected(rank, 1).items())
    out["state_after_retry"] = _state()
    return out


def sigkill_mid_exchange(rank: int) -> dict:
    """Refit version 2; rank 3 is SIGKILLed in its second copy (mid-exchange). Every survivor must raise a
    named ReshardTransportError within the timeout + a margin; refit_state keeps version 1 and says torn."""
    g = _group()
    dst = {n: torch.full(s.shape, float("nan")) for n, s in DST.local_specs(rank).items()}
    refit(shard_of(SRC, rank, global_data(1)), dst, SRC, DST, group=g, bucket_bytes=BUCKET, timeout=TIMEOUT,
          version=1)
    if rank == KILLED:
        _fail_on(rank, 2, lambda: os.kill(os.getpid(), signal.SIGKILL))
    t0 = time.perf_counter()
    try:
        refit(shard_of(SRC, rank, global_data(2)), dst, SRC, DST, group=g, bucket_bytes=BUCKET,
              timeout=TIMEOUT, version=2)
        e = None
    except Exception as ex:
        e = ex
    out = _error(e, t0)
    out["state"] = _state()
    return out


def world_main(rank: int, world: int, outdir: str) -> dict:
    """Every scenario in order; after each, this rank's results so far go to ``outdir`` (the SIGKILLed rank
    cannot return its earlier results)."""
    out = {}
    for name, fn in (("aliased", aliased_multistep), ("raise", peer_raises_then_retry),
                     ("sigkill", sigkill_mid_exchange)):
        t0 = time.perf_counter()
        try:
            out[name] = fn(rank)
        except Exception as e:  # report, keep going
            import traceback

            out[name] = {"crash": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
        out[name]["scenario_seconds"] = time.perf_counter() - t0
        torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))
    return out
