"""The two jobs of the SGLang tier (``test_sglang_real.py``): an engine job (SGLang's real model classes, one
process per TP rank, its own gloo world) and a separately started trainer job (its own world: Megatron-style
TP shards of the same checkpoint, ``megatron_layout``), joined only by the refit group and a control plane.

The control plane stands in for SGLang's ``Engine`` / HTTP API: trainer rank 0 posts SGLang's weight-update
calls (``begin_weight_update``, ``update_weights_from_tensor(named_tensors, load_format=...)``,
``end_weight_update``) and every engine rank runs them on SGLang's own ``WeightUpdater`` over the model
``get_model`` built and loaded, which calls our plug-in through SGLang's custom-weight-loader path (or, for
the case with ``plugin=True``, through SGLang's ``load_plugins()`` and its HookRegistry, no
``--custom-weight-loader`` at all).

Every engine rank checks, per case, on its own shard: the parameters against ``sglang_layout`` (names, shapes,
dtypes, every element); the layout recorded from SGLang's ``load_weights`` (its digest is compared with the
preset's by the parent); a refit into poisoned parameters (exactly the loader's values, nothing else
written); ``verify_refit`` (0, then the exact count after a corruption); the version recorded.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

CORRUPT = 7  # elements engine rank 0 corrupts before the second verify
# bounds of every wait (a fresh CI machine is slower than a warm one; nothing waits unbounded)
GROUP_TIMEOUT = 240.0  # the refit group's
CONTROL_TIMEOUT = 480.0  # the control plane's (it spans a refit-group timeout)


def mark(rep: dict, what: str) -> None:
    """A timeline entry (wall clock, so the two jobs' entries interleave): printed when a case fails."""
    rep.setdefault("timeline", []).append((round(time.time(), 3), what))


@dataclass(frozen=True)
class Case:
    model: str  # a name of triton_reshard.presets.CONFIGS
    tp: int
    ep: int = 1
    preset: bool = True  # sglang_layout describes it (else: the recorded layout only)
    plugin: bool = False  # reach the plug-in through SGLang's plugin entry point, not --custom-weight-loader
    bad_expect: bool = False  # first, a trainer expecting another release's layout: refused, naming the tensor
    refuse_quant: bool = False  # first, the model reports a quantization config: refused in one line
    stage: bool = False  # then stage, then commit (issue 45): weights halved, staged while served, committed

    @property
    def id(self) -> str:
        return f"{self.model}-tp{self.tp}{f'-ep{self.ep}' if self.ep > 1 else ''}"


def _quiet() -> None:
    import logging

    logging.disable(logging.WARNING)


def engine_job(rank: int, world: int, cases: list[Case], ckpt_root: str, ctl_ports: dict) -> dict:
    """One SGLang TP rank: every case of this TP size, one after another, each served until ``stop``."""
    _quiet()
    out: dict[str, dict] = {}
    for case in cases:
        rep: dict = {"problems": [], "seconds": {}, "events": []}
        out[case.id] = rep
        mark(rep, f"engine rank {rank}: case starts")
        t0 = time.perf_counter()
        try:
            _engine_case(rank, world, case, os.path.join(ckpt_root, case.model), ctl_ports[case.id], rep)
        except Exception as e:  # noqa: BLE001 (reported per case)
            import traceback

            rep["problems"].append(f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
        rep["seconds"]["total"] = time.perf_counter() - t0
    return out


def _engine_case(rank: int, world: int, case: Case, ckpt: str, ctl_port: int, rep: dict) -> None:
    from safetensors.torch import load_file

    from triton_reshard.integrations import checkpoint_shapes
    from triton_reshard.integrations import sglang as ts
    from triton_reshard.integrations.control import serve, sglang_update_kwargs
    from triton_reshard.presets import get_config, sglang_layout

    t0 = time.perf_counter()
    model, mc, _sa = ts.load_sglang_model(ckpt, tp=world, ep=case.ep)
    rep["seconds"]["build"] = time.perf_counter() - t0
    mark(rep, f"engine rank {rank}: model built")
    params = dict(model.named_parameters())
    loaded = {n: p.detach().clone() for n, p in params.items()}
    rep["params"] = {n: (tuple(p.shape), str(p.dtype)) for n, p in params.items()}
    sd = {k: v.float() for k, v in load_file(os.path.join(ckpt, "model.safetensors")).items()}
    shapes = checkpoint_shapes(ckpt)
    ts.record_sglang(model, shapes, rank)  # a LoadRecord: not returned (run_world returns data only)
    for n, p in params.items():  # recording must not write anything
        if not torch.equal(p, loaded[n]):
            rep["problems"].append(f"rank {rank}: recording load_weights changed {n!r}")
    derived = ts.layout_from_sglang(model, shapes)
    rep["derived_digest"] = derived.digest
    preset = sglang_layout(get_config(case.model), tp=world, ep=case.ep, dtype=torch.float32) \
        if case.preset else None
    rep["preset_digest"] = None if preset is None else preset.digest
    if preset is not None:
        want = {n: (s.shape, str(s.dtype)) for n, s in preset.local_specs(rank).items()}
        if want != rep["params"]:
            rep["problems"].append(f"rank {rank}: SGLang's parameters differ from sglang_layout: only in SGLang "
                                   f"{sorted(set(rep['params']) - set(want))[:6]}, only in the preset "
                                   f"{sorted(set(want) - set(rep['params']))[:6]}")
        else:
            mine = preset.shard(sd, rank)
            for n, p in loaded.items():
                if not torch.equal(mine[n], p):
                    rep["problems"].append(f"rank {rank}: {n}: {int((mine[n] != p).sum())} of {p.numel()} "
                                           f"elements differ from sglang_layout's shard of the checkpoint")
    # the recorded layout slices the checkpoint exactly as SGLang's loader did (every parameter it writes)
    mine = derived.shard(sd, rank)
    for n in sorted(mine):
        if not torch.equal(mine[n], loaded[n]):
            rep["problems"].append(f"rank {rank}: {n}: the recorded layout's shard differs from SGLang's loader")
    dst = preset or derived
    covered = dst.shard({t.name: torch.ones(t.shape) for t in dst.tensors}, rank)
    rep["not_in_layout"] = sorted(set(params) - set(covered))
    with torch.no_grad():
        for n in covered:
            params[n].fill_(float("nan"))

    if case.plugin:  # SGLang's plugin loader runs our entry point: its HookRegistry routes load_format
        from sglang.srt.plugins import load_plugins

        load_plugins()
        updater = ts.sglang_weight_updater(model, mc, custom_weight_loaders=())
    else:  # --custom-weight-loader triton_reshard.integrations.sglang.receive_weights
        updater = ts.sglang_weight_updater(model, mc)
    saved_quant = getattr(model, "quant_config", None)
    if case.refuse_quant:
        from sglang.srt.layers.quantization.fp8 import Fp8Config

        model.quant_config = Fp8Config(is_checkpoint_fp8_serialized=True, weight_block_size=[128, 128])

    def post(op: str) -> None:
        st = ts.engine_state(model)
        if op == "refit":
            for n, p in params.items():
                if n in covered:
                    m = covered[n].bool()
                    if not torch.equal(p[m], loaded[n][m]):
                        rep["problems"].append(f"rank {rank}: refit wrote {int((p[m] != loaded[n][m]).sum())} "
                                               f"wrong elements into {n}")
                    if not bool(torch.isnan(p[~m]).all()):
                        rep["problems"].append(f"rank {rank}: refit wrote outside the layout's boxes in {n}")
                elif not torch.equal(p, loaded[n]):
                    rep["problems"].append(f"rank {rank}: {n} (not in the layout) changed after the refit")
            state = ts.sglang_refit_state(model)
            rep["state"] = (state.version, state.torn)
            rep["recv_bytes"] = st.last_report.recv_bytes
            rep["dst_digest"] = st.dst_layout.digest
        elif op == "stage":  # the receive runs on in a thread: what the engine serves, to compare at the commit
            rep["served_at_stage"] = {n: p.detach().clone() for n, p in params.items()}
        elif op == "commit":  # every staged box is in, exactly the loader's values halved, nothing else written
            for n, p in params.items():
                if n in covered:
                    m = covered[n].bool()
                    if not torch.equal(p[m], loaded[n][m] * 0.5):
                        rep["problems"].append(f"rank {rank}: commit wrote {int((p[m] != loaded[n][m] * 0.5).sum())} "
                                               f"wrong elements into {n}")
                    if not bool(torch.isnan(p[~m]).all()):
                        rep["problems"].append(f"rank {rank}: commit wrote outside the layout's boxes in {n}")
            state = ts.sglang_refit_state(model)
            rep["state_after_commit"] = (state.version, state.torn)
        elif op == "verify":
            r = st.last_report
            rep.setdefault("verify", []).append((r.ok, r.total_mismatches, sum(r.mismatches.values())))
            if len(rep["verify"]) == 1 and rank == 0:  # corrupt CORRUPT covered elements
                name = next(n for n in sorted(covered) if int(covered[n].sum()) >= CORRUPT)
                idx = covered[name].reshape(-1).nonzero().reshape(-1)[:CORRUPT]
                with torch.no_grad():
                    params[name].view(-1)[idx] += 1.0
                rep["corrupted"] = name

    def update(payload):  # the control plane carries the control message as JSON: rebuild SGLang's tensor
        op = payload["control"]["op"]
        mark(rep, f"engine rank {rank}: {op} starts")
        if op == "commit":  # staged, not committed: the engine served its weights untouched all along
            state = ts.sglang_refit_state(model)
            rep["state_while_staged"] = (state.version, state.torn)
            was = rep.pop("served_at_stage")
            rep["untouched_while_staged"] = all(
                torch.equal(torch.isnan(p), torch.isnan(was[n])) and torch.equal(p.nan_to_num(0.0), was[n].nan_to_num(0.0))
                for n, p in params.items())
        try:
            ok, msg = updater.update_weights_from_tensor(**sglang_update_kwargs(payload))
        except Exception as e:
            rep["events"].append((op, f"{type(e).__name__}: {e}"))
            mark(rep, f"engine rank {rank}: {op} raised {type(e).__name__}")
            if case.refuse_quant and op == "init":
                model.quant_config = saved_quant  # refused once; the real init follows
            raise
        if not ok:
            raise RuntimeError(msg)
        rep["events"].append((op, "ok"))
        mark(rep, f"engine rank {rank}: {op} ok")
        post(op)

    def timed(what, fn):
        def run(_payload):
            mark(rep, f"engine rank {rank}: {what} starts")
            fn()
            mark(rep, f"engine rank {rank}: {what} done")
        return run

    handlers = {"begin_weight_update": timed("begin_weight_update", updater.begin_weight_update),
                "update_weights_from_tensor": update,
                "end_weight_update": timed("end_weight_update",
                                           lambda: updater.end_weight_update(run_post_load=False))}
    t1 = time.perf_counter()
    mark(rep, f"engine rank {rank}: serving")
    serve("127.0.0.1", ctl_port, rank, handlers, timeout=CONTROL_TIMEOUT)
    rep["seconds"]["served"] = time.perf_counter() - t1


def trainer_job(rank: int, world: int, cases: list[Case], ckpt_root: str, ctl_ports: dict, refit_ports: dict,
                n_engine: int) -> dict:
    """The trainer ranks: Megatron TP shards of each case's checkpoint, driving :class:`SGLangTrainer`."""
    from safetensors.torch import load_file

    from triton_reshard.integrations.control import SGLangStoreClient
    from triton_reshard.integrations.sglang import SGLangTrainer
    from triton_reshard.presets import get_config, megatron_layout, sglang_layout, vllm_layout

    out: dict[str, dict] = {}
    for case in cases:
        rep: dict = {"problems": [], "refused": []}
        out[case.id] = rep
        mark(rep, f"trainer rank {rank}: case starts")
        client = None
        try:
            cfg = get_config(case.model)
            layout = megatron_layout(cfg, tp=world, dtype=torch.float32)
            tensors = layout.shard(load_file(os.path.join(ckpt_root, case.model, "model.safetensors")), rank)
            if rank == 0:
                client = SGLangStoreClient("127.0.0.1", ctl_ports[case.id], n_engine, timeout=CONTROL_TIMEOUT)
            common = dict(rank=rank, num_trainer_ranks=world, num_engine_ranks=n_engine, host="127.0.0.1",
                          engine=client, timeout=GROUP_TIMEOUT)
            ports = iter(refit_ports[case.id])
            if case.bad_expect:  # vLLM 0.24+'s FusedMoE names: "another release" of the engine's layout
                other = vllm_layout(cfg, tp=n_engine, enable_expert_parallel=case.ep > 1, dtype=torch.float32,
                                    vllm_version="0.33.0", ranks=world)
                try:
                    SGLangTrainer(layout, port=next(ports), expect=other, **common)
                    rep["problems"].append("a trainer expecting another layout was not refused")
                except Exception as e:  # noqa: BLE001
                    rep["refused"].append(f"{type(e).__name__}: {e}")
                mark(rep, f"trainer rank {rank}: refused")
            if case.refuse_quant:
                try:
                    SGLangTrainer(layout, port=next(ports), **common)
                    rep["problems"].append("a quantized engine was not refused")
                except Exception as e:  # noqa: BLE001
                    rep["refused"].append(f"{type(e).__name__}: {e}")
                mark(rep, f"trainer rank {rank}: refused")
            # the engine's layout on its refit-group ranks (after the trainer's)
            expect = sglang_layout(cfg, tp=n_engine, ep=case.ep, dtype=torch.float32, ranks=world) \
                if case.preset else None
            rep["expect_digest"] = None if expect is None else expect.digest
            mark(rep, f"trainer rank {rank}: joins")
            tr = SGLangTrainer(layout, port=next(ports), expect=expect, **common)
            mark(rep, f"trainer rank {rank}: joined")
            t0 = time.perf_counter()
            tr.send_weights(tensors, version="step-1")
            rep["refit_s"] = time.perf_counter() - t0
            rep["sent_bytes"] = tr.last_report.sent_bytes
            v1 = tr.verify(tensors)
            v2 = tr.verify(tensors)
            rep["verify"] = [(v1.ok, v1.total_mismatches), (v2.ok, v2.total_mismatches)]
            rep["trainer_s"] = time.perf_counter() - t0
            if case.stage:  # stage, then commit: the weights halved (exact), staged while the engine serves
                halved = {n: t * 0.5 for n, t in tensors.items()}
                st: dict = {}
                try:
                    tr.commit()
                except RuntimeError as e:
                    st["empty_commit"] = str(e)
                t1 = time.perf_counter()
                tr.send_weights(halved, version="step-2", overlap=True)
                st["stage_s"] = time.perf_counter() - t1
                st["staged_bytes"] = tr.last_report.sent_bytes
                t1 = time.perf_counter()
                tr.commit()
                st["commit_s"] = time.perf_counter() - t1
                v3 = tr.verify(halved)
                st["verify"] = (v3.ok, v3.total_mismatches)
                rep["stage"] = st
            tr.shutdown()
            mark(rep, f"trainer rank {rank}: done")
        except Exception as e:  # noqa: BLE001
            import traceback

            rep["problems"].append(f"trainer rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
        finally:
            if client is not None:
                client.stop()
    return out
