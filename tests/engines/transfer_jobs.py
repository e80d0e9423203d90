"""The two jobs of the vLLM weight-transfer backend test (``test_vllm_transfer.py``) and of
``examples/two_jobs_vllm``: an engine job (real vLLM model classes, one process per TP rank, its own
torch.distributed world) and a trainer job (its own world), joined only by the refit group.

The control plane is what vLLM's ``collective_rpc`` / RLHF routes are in a deployment: here
``triton_reshard.integrations.control`` (a TCP store) on which the trainer's sender posts ``init_weight_transfer_engine`` / ``start_weight_update`` /
``update_weights`` / ``finish_weight_update`` and every engine worker runs it on its own
``WeightTransferEngine`` (created by vLLM's ``WeightTransferEngineFactory`` from the weight-transfer
config, as vLLM's GPU worker does) and acknowledges.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def engine_job(rank: int, world: int, ckpt: str, ctl_port: int, check_ckpt: str | None = None) -> dict:
    """One vLLM worker (TP rank ``rank``): build + load with vLLM's loader, poison, then serve the trainer."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.plugins import load_general_plugins

    from triton_reshard.integrations.control import serve
    from triton_reshard.integrations.vllm import load_vllm_model

    load_general_plugins()  # vLLM's plugin loader registers "triton_reshard" through our entry point
    model, vc = load_vllm_model(ckpt, tensor_parallel_size=world,
                                weight_transfer_config={"backend": "triton_reshard"})
    out: dict = {"problems": [], "backend": vc.weight_transfer_config.backend}
    loaded = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    # as vLLM's GPU worker does after load_model()
    engine = WeightTransferEngineFactory.create_engine(vc.weight_transfer_config, vc, torch.device("cpu"), model)
    out["engine_cls"] = type(engine).__name__
    rounds = []

    def check(_version):
        # round 1: the trainer sent the checkpoint's weights: every parameter must be what vLLM's loader loaded
        # (padding stays poisoned: nothing writes it); round 2: the trainer sent ``check_ckpt``'s weights: load
        # that checkpoint with vLLM's own loader on top and nothing may change
        params = dict(model.named_parameters())
        if not rounds:
            for n, p in params.items():
                m = ~torch.isnan(p)
                if not torch.equal(p[m], loaded[n][m]):
                    out["problems"].append(f"rank {rank}: {n}: refit differs from vLLM's loader")
                out.setdefault("unwritten", {})[n] = int((~m).sum())
        else:
            got = {n: p.detach().clone() for n, p in params.items()}
            vc.model_config.model = check_ckpt
            with set_current_vllm_config(vc):
                DefaultModelLoader(vc.load_config).load_weights(model, vc.model_config)
            for n, p in model.named_parameters():
                m = ~torch.isnan(got[n])
                if not torch.equal(got[n][m], p[m]):
                    out["problems"].append(f"rank {rank}: {n}: round 2 differs from vLLM's loader on the new weights")
        rounds.append(engine.last_report.recv_bytes)

    def wrapped(fn):
        def call(payload):
            with set_current_vllm_config(vc):
                return fn(payload)
        return call

    handlers = {
        "init_weight_transfer_engine": wrapped(lambda d: engine.init_transfer_engine(engine.parse_init_info(d))),
        "start_weight_update": wrapped(lambda _p: engine.start_weight_update()),
        "update_weights": wrapped(lambda d: (engine.update_weights(d), check(d))),
        "finish_weight_update": wrapped(lambda _p: engine.finish_weight_update()),
    }
    t0 = time.perf_counter()
    out["calls"] = serve("127.0.0.1", ctl_port, rank, handlers)
    out["seconds"] = time.perf_counter() - t0
    out["recv_bytes"] = rounds
    dist.all_reduce(torch.ones(1))  # the engine job's own world still works
    engine.shutdown()
    return out


def trainer_job(rank: int, world: int, cfg: dict, weights: list[str], refit_port: int, ctl_port: int,
                n_workers: int, secret_file: str | None = None, delta: bool = False) -> dict:
    """One trainer rank (Megatron TP layout over the trainer job's ranks), driving the backend as vLLM's
    trainer-side factory builds it; ``weights``: a safetensors file per round. ``secret_file``: where every
    member reads the refit group's secret (named in the init info; the workers read the file themselves);
    the control plane's secret comes from the environment (``TRITON_RESHARD_SECRET``)."""
    from safetensors.torch import load_file
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from triton_reshard.integrations import vllm_transfer as vt
    from triton_reshard.integrations.control import StoreClient
    from triton_reshard.presets import megatron_layout

    layout = megatron_layout(cfg, tp=world, ranks=range(world), dtype=torch.float32)
    tensors = layout.allocate(rank)
    info = vt.ReshardTrainerInitInfo(rank=rank, host="127.0.0.1", port=refit_port, world_size=world + n_workers,
                                     num_trainer_ranks=world, layout=layout, timeout=120, secret_file=secret_file,
                                     secret_env=None if secret_file else "TRITON_RESHARD_SECRET")
    client = StoreClient("127.0.0.1", ctl_port, n_workers) if rank == 0 else None
    eng = WeightTransferTrainerFactory.trainer_init(info, client=client, source=vt.TensorsSource(tensors))
    out = {"engine_cls": type(eng).__name__, "sent": [], "seconds": []}
    for k, path in enumerate(weights):
        full = load_file(path)
        for n, t in layout.shard(full, rank).items():  # the training step's new weights, in place
            tensors[n].copy_(t)
        t0 = time.perf_counter()
        if delta:  # delta refits need an int version: the first is dense, the later ones deltas
            eng.send_weights(version=k, delta=True)
        else:
            eng.send_weights(version=f"step-{k}")
        out["seconds"].append(time.perf_counter() - t0)
        out["sent"].append(eng.last_report.sent_bytes)
        out.setdefault("modes", []).append(eng.last_report.mode)
    if client is not None:
        client.stop()
    dist.all_reduce(torch.ones(1))  # the trainer job's own world still works
    eng.shutdown()
    return out


def extension_engine_job(rank: int, world: int, ckpt: str, refit_port: int, n_trainers: int) -> dict:
    """A vLLM worker driven through ``RefitWorkerExtension`` (the ``worker_extension_cls`` path for vLLMs
    without the weight-transfer API): vLLM mixes the class into its Worker, which has ``model_runner.model``
    and ``vllm_config``; here a plain object holds the real model and config, and we call the methods
    ``collective_rpc`` would call."""
    from types import SimpleNamespace

    from vllm.config import set_current_vllm_config

    from triton_reshard.integrations.vllm import load_vllm_model
    from triton_reshard.integrations.vllm_transfer import RefitWorkerExtension

    model, vc = load_vllm_model(ckpt, tensor_parallel_size=world)
    loaded = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    worker = type("Worker", (RefitWorkerExtension,), {})()
    worker.model_runner, worker.vllm_config = SimpleNamespace(model=model), vc
    with set_current_vllm_config(vc):
        worker.init_refit_group("127.0.0.1", refit_port, n_trainers, n_trainers + world, timeout=120)
        recv = worker.refit_from_trainer()
    problems = []
    for n, p in model.named_parameters():
        m = ~torch.isnan(p)
        if not torch.equal(p[m], loaded[n][m]):
            problems.append(f"rank {rank}: {n}: differs from vLLM's loader after refit_from_trainer")
    worker._tr_group.destroy()
    return {"problems": problems, "recv": recv}


def extension_trainer_job(rank: int, world: int, cfg: dict, weights: str, refit_port: int, n_workers: int) -> dict:
    """The trainer ranks' half of the worker-extension path: ``trainer_refit_group`` + ``refit``."""
    from safetensors.torch import load_file

    from triton_reshard import refit
    from triton_reshard.integrations.vllm_transfer import trainer_refit_group
    from triton_reshard.presets import megatron_layout

    layout = megatron_layout(cfg, tp=world, ranks=range(world), dtype=torch.float32)
    tensors = layout.shard(load_file(weights), rank)
    group, src, dst = trainer_refit_group("127.0.0.1", refit_port, rank, world + n_workers, layout, timeout=120)
    rep = refit(tensors, {}, src, dst, group=group, timeout=120)
    group.destroy()
    return {"sent": rep.sent_bytes}
