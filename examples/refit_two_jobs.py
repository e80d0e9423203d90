"""Refit a vLLM (or SGLang) model from a separately launched trainer job, on CPU, in one command:

    bash tests/engines/install.sh            # once: a venv with vLLM 0.33 + our package
    .venv-engines/bin/python examples/refit_two_jobs.py
    bash tests/engines/install_sglang.sh     # or SGLang 0.5.23 + our package
    .venv-sglang/bin/python examples/refit_two_jobs.py --engine sglang

Two jobs, as an RL stack runs them, each with its own torch.distributed world:

* the **engine job** (2 processes): vLLM's own model classes for a tiny Qwen3-MoE, TP2, loaded by vLLM's
  loader, with ``weight_transfer_config={"backend": "triton_reshard"}``; vLLM's factory creates our
  worker-side engine, which records vLLM's loader to learn its destination layout;
* the **trainer job** (2 processes): Megatron-Core-style TP2 shards of the same model (a stand-in for a live
  trainer: ``megatron_layout`` says which box of which weight each rank holds), driving our trainer-side
  engine (``WeightTransferTrainerFactory.trainer_init``) for three "training steps".

With ``--engine sglang`` the engine job is SGLang's own model classes and loader (``get_model``) and its own
``WeightUpdater``, with our plug-in as its custom weight loader
(``--custom-weight-loader triton_reshard.integrations.sglang.receive_weights``), and the trainer drives
``SGLangTrainer`` through SGLang's weight-update API (``begin_weight_update`` / ``update_weights_from_tensor``
/ ``end_weight_update``).

They meet only in the refit group (``init_refit_group``) and a control plane (here
``triton_reshard.integrations.control``, an authenticated store; in a deployment the engine's HTTP routes or
Ray's ``collective_rpc``). Both are guarded by one secret: the launcher writes a random one to a file only its
user can read and points both jobs at it with ``TRITON_RESHARD_SECRET_FILE`` (every process proves it holds
the secret before it takes a rank or reads a control message; see ``docs/security.md``). After every step
each engine rank checks its parameters against the step's weights sliced the way the engine's loader slices
them.
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
STEPS = 3
WORKERS = TRAINERS = 2
OK_LINE = "OK, every parameter as vLLM would load it"
SGLANG_OK_LINE = "OK, every parameter as SGLang would load it"


def step_weights(ckpt: str, step: int) -> dict:
    """The 'trained' weights after ``step`` steps (deterministic, so the engine can check them)."""
    from safetensors.torch import load_file

    return {n: t * (1.0 + 0.25 * step) for n, t in load_file(os.path.join(ckpt, "model.safetensors")).items()}


def engine_rank(rank: int, world: int, ckpt: str, ctl_port: int) -> float:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.plugins import load_general_plugins

    from triton_reshard.integrations.control import serve
    from triton_reshard.integrations.vllm import load_vllm_model

    load_general_plugins()  # registers "triton_reshard" (our vllm.general_plugins entry point)
    model, vc = load_vllm_model(ckpt, tensor_parallel_size=world, weight_transfer_config={"backend": "triton_reshard"})
    engine = WeightTransferEngineFactory.create_engine(vc.weight_transfer_config, vc, torch.device("cpu"), model)
    step = [0]

    def update(info):
        t0 = time.perf_counter()
        engine.update_weights(info)
        dt = time.perf_counter() - t0
        step[0] += 1
        want = engine.dst_layout.shard(step_weights(ckpt, step[0]), engine.group.rank)
        params = dict(model.named_parameters())
        bad = [n for n, t in want.items() if not torch.equal(params[n], t)]
        say(f"engine rank {rank}: {info['version']}: received {engine.last_report.recv_bytes / 2**20:.2f} MiB "
              f"in {dt * 1e3:.0f} ms; {OK_LINE if not bad else f'WRONG: {bad}'}")
        if bad:
            raise RuntimeError(f"wrong parameters after {info['version']}: {bad}")

    def init(d):
        engine.init_transfer_engine(engine.parse_init_info(d))
        say(f"engine rank {rank}: joined the refit group as rank {engine.group.rank} of {engine.group.size}; "
              f"destination layout {engine.dst_layout.digest} recorded from vLLM's loader")

    def in_vllm(fn):
        def call(payload):
            with set_current_vllm_config(vc):
                return fn(payload)
        return call

    handlers = {"init_weight_transfer_engine": in_vllm(init),
                "start_weight_update": in_vllm(lambda _p: engine.start_weight_update()),
                "update_weights": in_vllm(update),
                "finish_weight_update": in_vllm(lambda _p: engine.finish_weight_update())}
    serve("127.0.0.1", ctl_port, rank, handlers)
    engine.shutdown()
    return 0.0


def trainer_rank(rank: int, world: int, ckpt: str, refit_port: int, ctl_port: int) -> float:
    import json

    import torch
    import torch.distributed as dist
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from triton_reshard.integrations import vllm_transfer as vt
    from triton_reshard.integrations.control import StoreClient
    from triton_reshard.presets import megatron_layout

    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    layout = megatron_layout(cfg, tp=world, ranks=range(world), dtype=torch.float32)
    tensors = layout.shard(step_weights(ckpt, 0), rank)  # this rank's training shards
    client = StoreClient("127.0.0.1", ctl_port, WORKERS) if rank == 0 else None
    info = vt.ReshardTrainerInitInfo(rank=rank, host="127.0.0.1", port=refit_port, world_size=world + WORKERS,
                                     num_trainer_ranks=world, layout=layout, timeout=120)
    eng = WeightTransferTrainerFactory.trainer_init(info, client=client, source=vt.TensorsSource(tensors))
    total = 0.0
    for step in range(1, STEPS + 1):
        for n, t in layout.shard(step_weights(ckpt, step), rank).items():  # "a training step", in place
            tensors[n].copy_(t)
        t0 = time.perf_counter()
        eng.send_weights(version=f"step {step}")
        dt = time.perf_counter() - t0
        total += dt
        say(f"trainer rank {rank}: step {step}: sent {eng.last_report.sent_bytes / 2**20:.2f} MiB "
              f"in {dt * 1e3:.0f} ms")
    dist.barrier()  # the trainer job's own world is untouched by the refit group
    if client is not None:
        client.stop()
    eng.shutdown()
    return total


def sglang_engine_rank(rank: int, world: int, ckpt: str, ctl_port: int) -> float:
    import logging

    import torch

    from triton_reshard.integrations import sglang as ts
    from triton_reshard.integrations.control import serve, sglang_update_kwargs

    logging.disable(logging.WARNING)
    model, model_config, _ = ts.load_sglang_model(ckpt, tp=world)  # SGLang's get_model + its loader
    updater = ts.sglang_weight_updater(model, model_config)  # --custom-weight-loader <our receive_weights>
    step = [0]

    def update(payload):
        t0 = time.perf_counter()
        ok, msg = updater.update_weights_from_tensor(**sglang_update_kwargs(payload))
        if not ok:
            raise RuntimeError(msg)
        st, op = ts.engine_state(model), payload["control"]["op"]
        if op == "init":
            say(f"engine rank {rank}: joined the refit group as rank {st.group.rank} of {st.group.size}; "
                  f"destination layout {st.dst_layout.digest} recorded from SGLang's loader")
        if op != "refit":  # init, verify, close
            return
        dt = time.perf_counter() - t0
        step[0] += 1
        want = st.dst_layout.shard(step_weights(ckpt, step[0]), st.group.rank)
        params = dict(model.named_parameters())
        bad = [n for n, t in want.items() if not torch.equal(params[n], t)]
        version = ts.sglang_refit_state(model).version
        say(f"engine rank {rank}: {version}: received {st.last_report.recv_bytes / 2**20:.2f} MiB in "
              f"{dt * 1e3:.0f} ms; {SGLANG_OK_LINE if not bad else f'WRONG: {bad}'}")
        if bad:
            raise RuntimeError(f"wrong parameters after {version}: {bad}")

    serve("127.0.0.1", ctl_port, rank, {"begin_weight_update": lambda _p: updater.begin_weight_update(),
                                        "update_weights_from_tensor": update,
                                        "end_weight_update": lambda _p: updater.end_weight_update(run_post_load=False)})
    return 0.0


def sglang_trainer_rank(rank: int, world: int, ckpt: str, refit_port: int, ctl_port: int) -> float:
    import json

    import torch
    import torch.distributed as dist

    from triton_reshard.integrations.control import SGLangStoreClient
    from triton_reshard.integrations.sglang import SGLangTrainer
    from triton_reshard.presets import megatron_layout

    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    layout = megatron_layout(cfg, tp=world, ranks=range(world), dtype=torch.float32)
    tensors = layout.shard(step_weights(ckpt, 0), rank)  # this rank's training shards
    engine = SGLangStoreClient("127.0.0.1", ctl_port, WORKERS) if rank == 0 else None  # sglang.Engine's API
    trainer = SGLangTrainer(layout, rank=rank, num_trainer_ranks=world, num_engine_ranks=WORKERS, host="127.0.0.1",
                            port=refit_port, engine=engine, timeout=120)
    total = 0.0
    for step in range(1, STEPS + 1):
        for n, t in layout.shard(step_weights(ckpt, step), rank).items():  # "a training step", in place
            tensors[n].copy_(t)
        t0 = time.perf_counter()
        trainer.send_weights(tensors, version=f"step {step}")
        dt = time.perf_counter() - t0
        total += dt
        say(f"trainer rank {rank}: step {step}: sent {trainer.last_report.sent_bytes / 2**20:.2f} MiB "
              f"in {dt * 1e3:.0f} ms")
    dist.barrier()  # the trainer job's own world is untouched by the refit group
    trainer.shutdown()
    if engine is not None:
        engine.stop()
    return total


def make_checkpoint(path: str) -> None:
    import torch
    import transformers

    from triton_reshard.presets import get_config

    cfg = {k: v for k, v in get_config("tiny_qwen3_moe").items() if k != "model_type"}
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**cfg)).float().save_pretrained(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=["vllm", "sglang"], default="vllm", help="the inference engine (default vllm)")
    ap.add_argument("--role", choices=["engine", "trainer"], help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--refit-port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--ctl-port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    from triton_reshard.testing.launch import run_world

    sglang = args.engine == "sglang"
    if args.role == "engine":  # one job: its own world of WORKERS processes
        run_world(sglang_engine_rank if sglang else engine_rank, WORKERS, args.ckpt, args.ctl_port, backend="gloo",
                  timeout=300)
        return 0
    if args.role == "trainer":
        run_world(sglang_trainer_rank if sglang else trainer_rank, TRAINERS, args.ckpt, args.refit_port,
                  args.ctl_port, backend="gloo", timeout=300)
        return 0

    from triton_reshard.comm.group import free_port
    from triton_reshard.integrations.control import host_store

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        ckpt = os.path.join(d, "tiny_qwen3_moe")
        make_checkpoint(ckpt)
        secret_file = os.path.join(d, "refit.secret")  # the jobs' shared secret: readable by this user only
        with open(os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(secrets.token_hex(32))
        os.environ["TRITON_RESHARD_SECRET_FILE"] = secret_file  # inherited by both jobs
        refit_port, ctl_port = free_port(), free_port()
        store = host_store("127.0.0.1", ctl_port)  # the control plane both jobs reach (the secret: from the env)
        common = ["--engine", args.engine, "--ckpt", ckpt, "--refit-port", str(refit_port), "--ctl-port", str(ctl_port)]
        print(f"launching the engine job ({'SGLang' if sglang else 'vLLM'} TP{WORKERS}) and the trainer job "
              f"(Megatron TP{TRAINERS}) ...", flush=True)
        jobs = {role: subprocess.Popen([sys.executable, __file__, "--role", role, *common], stdout=subprocess.PIPE,
                                       text=True, bufsize=1)
                for role in ("engine", "trainer")}
        checks = {role: [] for role in jobs}  # the jobs' own lines saying a check passed
        relays = [threading.Thread(target=_relay, args=(p.stdout, checks[role])) for role, p in jobs.items()]
        for t in relays:
            t.start()
        codes = {role: p.wait(timeout=400) for role, p in jobs.items()}
        for t in relays:
            t.join(timeout=30)
        store.close()
    passed, want = len(checks["engine"]), STEPS * WORKERS
    ok = all(c == 0 for c in codes.values()) and passed == want
    # the verdict last, set apart: the engine's own warnings (on stderr) come before it
    print(f"\n{'=' * 100}", flush=True)
    print(f"{'done' if ok else 'FAILED'}: {STEPS} refits across two jobs in {time.perf_counter() - t0:.0f} s, "
          f"{passed} of {want} engine checks OK (after every step, every engine rank's parameters are what "
          f"{'SGLang' if sglang else 'vLLM'}'s loader loads; exit codes {codes})", flush=True)
    return 0 if ok else 1


def say(line: str) -> None:
    """One line in one write (the ranks of a job share its stdout pipe: a write under 4 KiB is not split)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _relay(stream, passed: list) -> None:
    """Print a job's output as it comes; keep the lines that say an engine rank's check passed (counted as they
    occur: the engine ranks share one pipe, so two ranks' lines can arrive run together on one line)."""
    for line in stream:
        print(line, end="", flush=True)
        passed.extend([line] * (line.count(OK_LINE) + line.count(SGLANG_OK_LINE)))


if __name__ == "__main__":
    sys.exit(main())
