"""The ``triton_reshard`` verl checkpoint engine, driven through verl 0.9.1's own registry and config.

Two separately spawned jobs (``run_world``, each its own gloo world): an actor job (2 workers) and a rollout
job (2 workers). Each worker builds the engine exactly as verl does (``verl/workers/engine_workers.py`` on
the actor, ``CheckpointEngineWorker.__init__`` in ``verl/checkpoint_engine/base.py`` on the rollout): from a
``CheckpointEngineConfig`` (``backend="triton_reshard"``, ``custom_backend_module=
"triton_reshard.integrations.verl"``, imported by verl's ``import_external_libs``), through
``CheckpointEngineRegistry.new``. This test process plays ``CheckpointEngineManager``: it gathers every
worker's ``prepare()``, runs the backend class's ``build_topology`` and hands each worker its
``init_process_group`` kwargs, through an authenticated store with data-only messages (in verl: Ray calls). Each worker then runs
``send_weights`` / ``receive_weights`` (consumed as verl's server adapter does) and ``finalize``, every round.

Round 1 streams verl's generator of full tensors (both actor workers hold them); round 2 sends from a
sharded trainer layout (``set_source``; the generator is never touched). Rollout buffers are poisoned (NaN);
every received tensor must equal the global tensor exactly (full destinations), or exactly inside the box
that worker's destination layout reads and still NaN outside it (``dst_layout``: TP2 reads, a JSON layout
file). Every worker holds the refit group's secret (round 1 from ``TRITON_RESHARD_SECRET``, round 2 from a
``secret_file`` named in the engine kwargs); while they rendezvous, strangers knock on the master's refit port
(junk bytes, a pickle, wrong secrets claiming an actor and a rollout rank) and must be refused.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("verl.checkpoint_engine", reason="verl is not installed here (tests/engines/install.sh)")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests import strangers  # noqa: E402
from triton_reshard.comm import wire  # noqa: E402
from triton_reshard.comm.auth import AuthStore, AuthStoreServer, resolve_secret  # noqa: E402
from triton_reshard.comm.group import free_port  # noqa: E402
from triton_reshard.layout import Layout, Replicate, Shard  # noqa: E402
from triton_reshard.testing.launch import run_world  # noqa: E402

A, W = 2, 2  # actor workers, rollout workers
SHAPES = {  # odd sizes; lm_head alone is over the 1 MiB bucket
    "model.embed_tokens.weight": ((301, 256), torch.float32),
    "model.layers.0.self_attn.qkv.weight": ((384, 255), torch.bfloat16),
    "model.layers.0.self_attn.o_proj.weight": ((63, 384), torch.float16),
    "model.layers.0.input_layernorm.weight": ((33,), torch.float32),
    "model.norm.weight": ((1,), torch.bfloat16),
    "lm_head.weight": ((1027, 256), torch.float32),
}
PLACEMENT = {  # a TP2 layout: rows, columns, replicated
    "model.embed_tokens.weight": Shard(0), "model.layers.0.self_attn.qkv.weight": Shard(0),
    "model.layers.0.self_attn.o_proj.weight": Shard(1), "model.layers.0.input_layernorm.weight": Replicate(),
    "model.norm.weight": Replicate(), "lm_head.weight": Shard(0),
}


def tp2_layout(ranks) -> Layout:
    return Layout.from_placements({n: s for n, (s, _) in SHAPES.items()}, list(ranks),
                                  {n: (p,) for n, p in PLACEMENT.items()}, {n: d for n, (_, d) in SHAPES.items()})


def global_weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(d) for n, (s, d) in SHAPES.items()}


def _engine(role: str, rank: int, engine_kwargs: dict):
    """As verl builds it, from its config dataclass and registry."""
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs
    from verl.workers.config import CheckpointEngineConfig

    cfg = CheckpointEngineConfig(backend="triton_reshard", update_weights_bucket_megabytes=1,
                                 engine_kwargs={"triton_reshard": engine_kwargs},
                                 custom_backend_module="triton_reshard.integrations.verl")
    import_external_libs(cfg.custom_backend_module or None)
    bucket_size = cfg.update_weights_bucket_megabytes << 20
    kw = cfg.engine_kwargs.get(cfg.backend, {})
    if role == "actor":
        return CheckpointEngineRegistry.new(cfg.backend, is_master=rank == 0, bucket_size=bucket_size, **kw)
    return CheckpointEngineRegistry.new(cfg.backend, bucket_size=bucket_size, **kw)


def _store(port: int, timeout: float = 200) -> AuthStore:
    return AuthStore("127.0.0.1", port, resolve_secret(), timedelta(seconds=timeout))


def _rendezvous(store, engine, role: str, rank: int, step: int) -> None:
    store.set(f"meta/{step}/{role}/{rank}", wire.dumps(engine.prepare()))
    store.wait([f"topo/{step}/{role}/{rank}"])
    engine.init_process_group(**wire.loads(store.get(f"topo/{step}/{role}/{rank}")))


CONFIGS = ("full", "tp2-reads")  # the rollout receives full tensors / only the boxes its loader reads
STEPS = 2  # weight updates per config


def _kwargs(config: str, dst_layout_path: str) -> dict:
    """``engine_kwargs["triton_reshard"]``: verl hands the same dict to the actor and the rollout side."""
    kw = {"host": "127.0.0.1", "timeout": 60, "fill": float("nan"), "device": "cpu"}
    if config == "tp2-reads":  # the secret from a file named in the config (round 1: the environment's)
        kw["dst_layout"] = dst_layout_path
        kw["secret_file"] = os.path.join(os.path.dirname(dst_layout_path), "secret")
    return kw


def actor_job(rank: int, world: int, ctl_port: int, dst_layout_path: str) -> list[dict]:
    store = _store(ctl_port)
    outs = []
    for c, config in enumerate(CONFIGS):
        engine = _engine("actor", rank, _kwargs(config, dst_layout_path))
        out = {"cls": type(engine).__name__, "sent": [], "metrics": []}
        for k in range(STEPS):
            step = c * STEPS + k
            full = global_weights(step)
            _rendezvous(store, engine, "actor", rank, step)
            if k == 0:  # verl's get_per_tensor_param(): full tensors on every actor worker, lazily
                weights = ((n, full[n]) for n in SHAPES)
            else:  # the trainer's own shards; the generator must stay untouched
                layout = tp2_layout(range(A))
                engine.set_source(layout, layout.shard(full, rank))

                def untouched():
                    raise AssertionError("send_weights iterated verl's generator although set_source was given")
                    yield
                weights = untouched()
            out["metrics"].append(asyncio.run(engine.send_weights(weights, global_steps=step)))
            out["sent"].append(sum(r.sent_bytes for r in engine.reports))
            engine.finalize()
        out["group_kept"] = engine.group is not None
        engine.shutdown()
        outs.append(out)
    dist.all_reduce(torch.ones(1))  # the job's own world still works
    return outs


def rollout_job(rank: int, world: int, ctl_port: int, dst_layout_path: str) -> list[dict]:
    from verl.workers.rollout.utils import ensure_async_iterator

    store = _store(ctl_port)
    outs = []
    for c, config in enumerate(CONFIGS):
        engine = _engine("rollout", rank, _kwargs(config, dst_layout_path))
        reads = tp2_layout(range(W)) if config == "tp2-reads" else None
        out = {"cls": type(engine).__name__, "problems": [], "recv": []}
        for k in range(STEPS):
            step = c * STEPS + k
            full = global_weights(step)
            _rendezvous(store, engine, "rollout", rank, step)

            got = asyncio.run(_consume(engine, step, ensure_async_iterator))
            out["recv"].append(sum(r.recv_bytes for r in engine.reports))
            engine.finalize()
            out["problems"] += _check(got, full, reads, rank, f"{config} step {k}")
        engine.shutdown()
        outs.append(out)
    dist.all_reduce(torch.ones(1))
    return outs


async def _consume(engine, step, ensure_async_iterator):
    """As verl's server adapter (``update_weights``): ``async for name, t in ensure_async_iterator(...)``."""
    return [(n, t.clone()) async for n, t in ensure_async_iterator(engine.receive_weights(step))]


def _check(got, full, reads, rank, where) -> list[str]:
    """Exact inside the boxes this rank reads (all of every tensor without ``reads``), NaN outside."""
    problems = []
    names = [n for n, _ in got]
    want = sorted(SHAPES) if reads is None else sorted({f.tensor for f in reads.fragments if f.rank == rank})
    if sorted(names) != want or len(set(names)) != len(names):
        problems.append(f"{where}: received {sorted(names)}, want {want}")
    for n, t in got:
        ref = full[n]
        if t.shape != ref.shape or t.dtype != ref.dtype:
            problems.append(f"{where}: {n}: {tuple(t.shape)} {t.dtype}, want {tuple(ref.shape)} {ref.dtype}")
            continue
        mask = torch.ones(ref.shape, dtype=torch.bool)
        if reads is not None:
            mask.zero_()
            for f in reads.fragments:
                if f.rank == rank and f.tensor == n:
                    mask[tuple(slice(o, o + s) for o, s in zip(f.offsets, f.sizes, strict=True))] = True
        if not torch.equal(t[mask], ref[mask]):
            problems.append(f"{where}: {n}: the received box differs from the global tensor")
        if not torch.isnan(t[~mask].float()).all():
            problems.append(f"{where}: {n}: elements outside this worker's box were written")
    return problems


def _manager(store, steps: int, results: dict) -> None:
    """CheckpointEngineManager.build_process_group's part: prepare -> build_topology -> init kwargs."""
    try:
        from verl.checkpoint_engine import CheckpointEngineRegistry

        cls = CheckpointEngineRegistry.get("triton_reshard")
        knockers = []
        for step in range(steps):
            keys = [f"meta/{step}/actor/{r}" for r in range(A)] + [f"meta/{step}/rollout/{r}" for r in range(W)]
            store.wait(keys)
            meta = [wire.loads(store.get(k)) for k in keys]
            if step in (0, 2):  # strangers at the refit group's port while the workers join it
                knock = threading.Thread(target=strangers.knock_all, args=(meta[0]["host"], meta[0]["port"],
                                                                          A + W, [0, A], results, f"stranger{step}"))
                knock.start()
                knockers.append(knock)
            actor_kw, rollout_kw = cls.build_topology(A, W, meta)
            for role, kw, n in (("actor", actor_kw, A), ("rollout", rollout_kw, W)):
                assert all(len(v) == n for v in kw.values())
                for r in range(n):
                    store.set(f"topo/{step}/{role}/{r}", wire.dumps({k: v[r] for k, v in kw.items()}))
        for k in knockers:
            k.join(60)
        results["manager"] = cls.__name__
    except Exception as e:  # noqa: BLE001 (asserted below)
        results["manager"] = e


def test_verl_checkpoint_engine_two_jobs(tmp_path, monkeypatch):
    import triton_reshard.integrations.verl  # noqa: F401  (the test process knows the backend, as verl's driver)

    secret = os.urandom(32).hex()
    monkeypatch.setenv("TRITON_RESHARD_SECRET", secret)  # inherited by the spawned workers
    (tmp_path / "secret").write_text(secret + "\n")
    os.chmod(tmp_path / "secret", 0o600)  # a world-readable secret file draws a warning
    dst_path = str(tmp_path / "dst_layout.json")
    wire.save_layout(tp2_layout(range(W)), dst_path)
    ctl_port = free_port()
    server = AuthStoreServer("127.0.0.1", ctl_port, secret.encode())
    store = _store(ctl_port, timeout=200)  # waits while the workers import verl (slow on a loaded machine)
    results: dict = {}

    def launch(name, *args):
        try:
            results[name] = run_world(*args, backend="gloo", timeout=240)
        except Exception as e:  # noqa: BLE001 (asserted below)
            results[name] = e

    threads = [threading.Thread(target=_manager, args=(store, len(CONFIGS) * STEPS, results)),
               threading.Thread(target=launch, args=("actor", actor_job, A, ctl_port, dst_path)),
               threading.Thread(target=launch, args=("rollout", rollout_job, W, ctl_port, dst_path))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    server.close()
    for name in ("manager", "actor", "rollout"):
        assert not isinstance(results.get(name), Exception), f"{name} failed: {results.get(name)}"
    for step in (0, 2):
        strangers.assert_refused(results[f"stranger{step}"])
    problems = [p for r in results["rollout"] for out in r for p in out["problems"]]
    assert not problems, "\n".join(problems)
    full_bytes = sum(torch.empty(s, dtype=d).nbytes for s, d in SHAPES.values())
    for c, config in enumerate(CONFIGS):
        actor = [r[c] for r in results["actor"]]
        rollout = [r[c] for r in results["rollout"]]
        assert {r["cls"] for r in actor + rollout} == {"TritonReshardCheckpointEngine"}
        assert all(r["group_kept"] for r in actor)  # rebuild_group=False: one refit group for both updates
        want = W * full_bytes if config == "full" else sum(tp2_layout(range(W)).nbytes(r) for r in range(W))
        for k in range(STEPS):
            sent = [r["sent"][k] for r in actor]
            recv = sum(r["recv"][k] for r in rollout)
            assert sum(sent) == recv, (config, k, sent, recv)
            assert all(s > 0 for s in sent), f"{config} step {k}: both actor workers send a share, got {sent}"
            assert [r["metrics"][k]["triton_reshard/sent_bytes"] for r in actor] == sent
            # what crosses the wire: the bytes each rollout worker needs (plus a few bytes of alignment
            # padding per message), never more
            assert want <= recv <= want + 8 * len(SHAPES) * A * W, (config, k, recv, want)
