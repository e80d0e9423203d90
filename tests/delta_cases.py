"""Worker side of ``test_delta_refit.py``: delta refits (issue 24) over spawned gloo worlds, driven by a real
optimizer, checked bit for bit against slicing the global tensors (destinations poisoned once, at the start:
an element a delta should have written and did not keeps the previous version's value or the poison).

The "trainer" is the same on every rank: fp32 master weights of every logical float tensor, updated by
``torch.optim.AdamW`` at an RL learning rate with seeded gradients; what it publishes is the masters rounded
to bf16 (then to the tensor's dtype), or the raw fp32 masters for cases that cast on the wire (the diff then
happens in the wire dtype). Integer and bool tensors change a seeded ~2 % of their elements per step. The
step schedule mixes optimizer steps with the edge cases: nothing changed, everything changed (sign flip),
one element changed.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import torch

from tests.dist_cases import CASES, build_locals, case_plan, mismatch, side_specs
from triton_reshard import Layout, Resharder, Shard, refit, refit_state
from triton_reshard.execute.delta import DeltaRefusedError, DeltaRequest
from triton_reshard.refit import forget_refit_state

LR = 3e-6
# per refit after the first: "adam" (an optimizer step), "same" (nothing changed), "all" (every element
# changed), "one" (a single element of the first tensor changed)
SCHEDULE = ("adam", "adam", "same", "adam", "all", "one", "adam", "adam")


class Trainer:
    """Global tensors of ``specs`` and their updates (identical on every rank: seeded)."""

    def __init__(self, specs: dict, seed: int = 0, raw: bool = False) -> None:
        self.specs, self.raw = specs, raw
        g = torch.Generator().manual_seed(seed)
        self.masters = {}
        self.ints = {}
        for n, (shape, dt) in sorted(specs.items()):
            if dt.is_floating_point:
                self.masters[n] = torch.nn.Parameter(torch.randn(shape, generator=g) * 0.02)
            elif dt == torch.bool:
                self.ints[n] = torch.rand(shape, generator=g) < 0.5
            else:
                self.ints[n] = torch.randint(-100, 100, shape, generator=g, dtype=dt)
        self.opt = torch.optim.AdamW(list(self.masters.values()), lr=LR) if self.masters else None
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.flip = {}  # name -> sign multiplier ("all" steps)

    def published(self) -> dict[str, torch.Tensor]:
        out = {}
        for n, (_shape, dt) in self.specs.items():
            if n in self.masters:
                m = self.masters[n].detach() * self.flip.get(n, 1.0)
                out[n] = m.to(dt) if self.raw else m.to(torch.bfloat16).to(dt)
            else:
                out[n] = self.ints[n].clone()
        return out

    def step(self, kind: str) -> None:
        if kind == "adam":
            if self.opt is not None:
                self.opt.zero_grad()
                for p in self.masters.values():
                    p.grad = torch.randn(p.shape, generator=self.gen)
                self.opt.step()
            for n, t in self.ints.items():
                mask = torch.rand(t.shape, generator=self.gen) < 0.02
                self.ints[n] = torch.where(mask, ~t if t.dtype == torch.bool else t + 1, t)
        elif kind == "all":
            for n in self.masters:
                self.flip[n] = -self.flip.get(n, 1.0)
            for n, t in self.ints.items():
                self.ints[n] = ~t if t.dtype == torch.bool else t + 1
        elif kind == "one":
            n = sorted(self.specs)[0]
            if n in self.masters:
                with torch.no_grad():
                    self.masters[n].view(-1)[0] += 0.5
            else:
                t = self.ints[n].clone()
                t.view(-1)[0] = ~t.view(-1)[0] if t.dtype == torch.bool else t.view(-1)[0] + 1
                self.ints[n] = t


def _expected(case, rank: int, pub: dict) -> dict:
    dspecs = side_specs(case.dst)
    return build_locals(case.dst, rank, {n: t.to(dspecs[n][1]) for n, t in pub.items()}, 0)


def run_delta_cases(rank: int, world: int, case_ids: list[str], schedule=SCHEDULE) -> dict:
    """Each case: a rank plan's Resharder, refits of the schedule (the first dense) into destinations
    poisoned once; per refit: mode, bytes, problems."""
    out = {}
    for cid in case_ids:
        case = CASES[cid]
        t0 = time.perf_counter()
        r = Resharder(case_plan(case, rank), bucket_bytes=case.bucket_bytes, timeout=30)
        tr = Trainer(side_specs(case.src), seed=len(cid), raw=case.allow_cast)
        pub = tr.published()
        src_t = build_locals(case.src, rank, pub, 0)
        dst_t = build_locals(case.dst, rank, None, 0)
        held, rows, problems = None, [], []
        for k in range(len(schedule) + 1):
            if k:
                tr.step(schedule[k - 1])
                pub = tr.published()
                for n, t in build_locals(case.src, rank, pub, 0).items():
                    src_t[n].copy_(t)
            t1 = time.perf_counter()
            rep = r.run(src_t, dst_t, delta=DeltaRequest(k, held=held))
            held = k
            rows.append({"mode": rep.mode, "sent": rep.sent_bytes, "dense": rep.dense_sent_bytes,
                         "base": rep.delta_base, "fallback": rep.fallback, "kind": schedule[k - 1] if k else "first",
                         "seconds": time.perf_counter() - t1})
            for n, want in _expected(case, rank, pub).items():
                m = mismatch(dst_t[n], want, f"{cid} refit {k} ({rows[-1]['kind']}, {rep.mode}): rank {rank} {n!r}")
                if m:
                    problems.append(m)
        out[cid] = {"rows": rows, "problems": problems, "snapshot_bytes": r.snapshot_bytes,
                    "seconds": time.perf_counter() - t0}
    return out


# --------------------------------------------------------------------------------------------------------
# refit(): the fence on refit_state, strict, fallbacks, and a peer failing mid-delta

SHAPES = {"w": (64, 48), "n": (48,)}
SRC = Layout.from_placements(SHAPES, [0, 1], {"w": [Shard(0)], "n": [Shard(0)]}, torch.bfloat16)
DST = Layout.from_placements(SHAPES, [2, 3], {"w": [Shard(1)], "n": [Shard(0)]}, torch.bfloat16)
TIMEOUT = 20.0  # generous: on a loaded 2-core machine the ranks reach a refit seconds apart


def _mode(rep) -> dict:
    return {"mode": rep.mode, "fallback": rep.fallback, "base": rep.delta_base, "sent": rep.sent_bytes,
            "dense": rep.dense_sent_bytes}


def _group():
    import torch.distributed as dist

    return dist.new_group(list(range(4)), timeout=timedelta(seconds=60))


def _refit_world(rank: int, tr: Trainer, dst: dict, group, version, delta=True, **kw):
    src = SRC.shard(tr.published(), rank) if rank in (0, 1) else None
    return refit(src, dst if rank in (2, 3) else None, SRC, DST, group=group, timeout=TIMEOUT, version=version,
                 delta=delta, **kw)


def _check(rank: int, tr: Trainer, dst: dict) -> bool:
    if rank not in (2, 3):
        return True
    want = DST.shard(tr.published(), rank)
    return all(torch.equal(dst[n].view(torch.int16), want[n].view(torch.int16)) for n in want)


def _state() -> dict:
    s = refit_state(DST)
    return {"version": s.version, "torn": s.torn, "torn_tensors": list(s.torn_tensors)}


def _fail_on_unpack(action):
    import triton_reshard.ops as ops

    real = ops.unpack_delta

    def unpack_delta(*a, **k):
        action()
        return real(*a, **k)

    ops.unpack_delta = unpack_delta
    return lambda: setattr(ops, "unpack_delta", real)


def fp8_scenario(rank: int, group) -> dict:
    """Block-FP8 destinations: delta=True refits run dense (said in the report), bit-exact; strict refuses."""
    from tests import quant_cases as qc

    case = qc.CASES["raw-fp32-rows24-to-cols-ue8m0"]
    src_l, dst_l = qc.layouts(case)
    out: dict = {"modes": [], "problems": []}
    dst_t = qc.dst_locals(dst_l, rank)
    for v in range(2):
        data = qc.global_data(src_l, v)
        rep = refit(qc.src_locals(src_l, rank, data), dst_t, src_l, dst_l, group=group, timeout=30,
                    bucket_bytes=case.bucket_bytes, version=v, delta=True)
        out["modes"].append(_mode(rep))
        out["problems"] += qc._check(case, dst_l, rank, dst_t, data, 0, f"fp8 delta=True refit {v}")
    try:
        refit(qc.src_locals(src_l, rank, data), dst_t, src_l, dst_l, group=group, timeout=30,
              bucket_bytes=case.bucket_bytes, version=2, delta="strict")
        out["strict"] = None
    except DeltaRefusedError as e:
        out["strict"] = str(e)
    return out


def fence_world(rank: int, world: int) -> dict:
    """The refit-level scenarios in order on one world of 4 (trainer TP2 on 0-1, engine TP2 on 2-3)."""
    import torch.distributed as dist

    out: dict = {}
    g = _group()
    out["fp8"] = fp8_scenario(rank, g)
    tr = Trainer({n: (s, torch.bfloat16) for n, s in SHAPES.items()}, seed=7)
    dst = {n: torch.full(s.shape, float("nan"), dtype=s.dtype) for n, s in DST.local_specs(rank).items()} \
        if rank in (2, 3) else {}
    # 1: the first refit with delta=True is dense (no snapshot, no held version); then deltas
    out["first"] = _mode(_refit_world(rank, tr, dst, g, 0))
    out["first_ok"] = _check(rank, tr, dst)
    tr.step("adam")
    out["second"] = _mode(_refit_world(rank, tr, dst, g, 1))
    out["second_ok"] = _check(rank, tr, dst)
    # 2: strict with a destination rank at the wrong base version (rank 3 believes it holds version 99)
    from triton_reshard.execute.session import SESSIONS, RefitState  # refit_state's store

    if rank == 3:
        SESSIONS.destination(DST, 1).state = RefitState(99)
    tr.step("adam")
    try:
        _refit_world(rank, tr, dst, g, 2, delta="strict")
        out["strict"] = {"error": None}
    except DeltaRefusedError as e:
        out["strict"] = {"error": type(e).__name__, "message": str(e)}
    out["strict_state"] = _state()
    # the same with delta=True: dense fallback, every rank says why
    out["wrong_base"] = _mode(_refit_world(rank, tr, dst, g, 2))
    out["wrong_base_ok"] = _check(rank, tr, dst)
    tr.step("adam")
    out["after_wrong_base"] = _mode(_refit_world(rank, tr, dst, g, 3))
    out["after_wrong_base_ok"] = _check(rank, tr, dst)
    # 3: a torn destination (as a failed refit leaves it) -> dense
    if rank == 2:
        SESSIONS.destination(DST, 1).state = RefitState(3, True, ("w",), 4, "injected")
    tr.step("adam")
    out["torn"] = _mode(_refit_world(rank, tr, dst, g, 4))
    out["torn_ok"] = _check(rank, tr, dst)
    # 4: a restarted destination (fresh process: no state, fresh tensors) -> dense
    if rank == 3:
        forget_refit_state(DST)
        dst = {n: torch.full(s.shape, float("nan"), dtype=s.dtype) for n, s in DST.local_specs(rank).items()}
    tr.step("adam")
    out["restarted"] = _mode(_refit_world(rank, tr, dst, g, 5))
    out["restarted_ok"] = _check(rank, tr, dst)
    # 5: a dense refit without delta= drops the snapshot: the next delta=True refit is dense again
    tr.step("adam")
    out["plain"] = _mode(_refit_world(rank, tr, dst, g, 6, delta=False))
    tr.step("adam")
    out["after_plain"] = _mode(_refit_world(rank, tr, dst, g, 7))
    out["after_plain_ok"] = _check(rank, tr, dst)
    tr.step("adam")
    out["delta_again"] = _mode(_refit_world(rank, tr, dst, g, 8))
    out["delta_again_ok"] = _check(rank, tr, dst)
    # ranks disagreeing on delta (rank 3 passes delta=False): refused in the handshake on every rank, nothing moved
    tr.step("adam")
    try:
        _refit_world(rank, tr, dst, g, 9, delta=rank != 3)
        out["mixed"] = {"error": None}
    except Exception as e:
        out["mixed"] = {"error": type(e).__name__, "message": str(e)}
    out["mixed_state"] = _state()
    # 6: rank 2 fails while unpacking a delta (mid-delta): torn everywhere it wrote, snapshot dropped
    restore = _fail_on_unpack(lambda: (_ for _ in ()).throw(RuntimeError("injected failure"))) \
        if rank == 2 else (lambda: None)
    tr.step("adam")
    try:
        _refit_world(rank, tr, dst, g, 9)
        out["fail"] = {"error": None}
    except Exception as e:
        out["fail"] = {"error": type(e).__name__, "torn": list(getattr(e, "torn", ()))}
    finally:
        restore()
    out["fail_state"] = _state()
    dist.destroy_process_group(g)
    g2 = _group()
    # the repair: the next refit (new group, new Resharder: no snapshot) is dense, then deltas again
    out["repair"] = _mode(_refit_world(rank, tr, dst, g2, 9))
    out["repair_ok"] = _check(rank, tr, dst)
    out["repair_state"] = _state()
    tr.step("adam")
    out["after_repair"] = _mode(_refit_world(rank, tr, dst, g2, 10))
    out["after_repair_ok"] = _check(rank, tr, dst)
    # 7: a sender SIGKILLed mid-delta: small buckets (several steps; a new Resharder, so first dense), then
    # a delta in which rank 1 dies packing its second step: the engine ranks raise within the timeout, torn
    tr.step("adam")
    out["small"] = _mode(_refit_world(rank, tr, dst, g2, 11, bucket_bytes=2048))
    tr.step("adam")
    out["small_delta"] = _mode(_refit_world(rank, tr, dst, g2, 12, bucket_bytes=2048))
    out["small_delta_ok"] = _check(rank, tr, dst)
    if rank == 1:
        import triton_reshard.ops as ops

        real, calls = ops.pack_delta, [0]

        def pack_delta(*a, **k):
            calls[0] += 1
            if calls[0] == 3:  # two messages per step (to ranks 2 and 3): the first of step 2
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*a, **k)

        ops.pack_delta = pack_delta
    tr.step("adam")
    t0 = time.perf_counter()
    try:
        _refit_world(rank, tr, dst, g2, 13, bucket_bytes=2048)
        out["kill"] = {"error": None}
    except Exception as e:
        out["kill"] = {"error": type(e).__name__, "torn": list(getattr(e, "torn", ())),
                       "seconds": time.perf_counter() - t0}
    out["kill_state"] = _state()
    return out



def refused_world(rank: int, world: int) -> dict:
    """Delta refits refused after the senders diffed their first step during the handshake (the diff is made
    before the fence is known: ``DeltaSide.prediff``): a strict refusal (rank 3 at the wrong base) and a
    handshake refusal (rank 3 without delta) move nothing and leave the snapshot as it was, so the next delta,
    from the old base, lands every change."""
    import triton_reshard.execute.delta as xd
    from triton_reshard.execute.session import SESSIONS, RefitState

    real, prediffs = xd.pack_deferred, [0]

    def counted(*a, **k):
        prediffs[0] += 1
        return real(*a, **k)

    xd.pack_deferred = counted
    out: dict = {}
    g = _group()
    tr = Trainer({n: (s, torch.bfloat16) for n, s in SHAPES.items()}, seed=11)
    dst = {n: torch.full(s.shape, float("nan"), dtype=s.dtype) for n, s in DST.local_specs(rank).items()} \
        if rank in (2, 3) else {}
    out["v0"] = _mode(_refit_world(rank, tr, dst, g, 0))
    tr.step("adam")
    out["v1"] = _mode(_refit_world(rank, tr, dst, g, 1))
    out["v1_ok"] = _check(rank, tr, dst)
    held = {n: t.clone() for n, t in dst.items()}
    tr.step("adam")
    if rank == 3:
        SESSIONS.destination(DST, 1).state = RefitState(99)
    before = prediffs[0]
    try:
        _refit_world(rank, tr, dst, g, 2, delta="strict")
        out["strict"] = {"error": None}
    except DeltaRefusedError as e:
        out["strict"] = {"error": type(e).__name__, "message": str(e)}
    out["strict_prediffs"] = prediffs[0] - before
    out["strict_untouched"] = all(torch.equal(dst[n].view(torch.int16), held[n].view(torch.int16)) for n in dst)
    if rank == 3:
        SESSIONS.destination(DST, 1).state = RefitState(1)  # what it holds: the delta from version 1 may go
    out["v2"] = _mode(_refit_world(rank, tr, dst, g, 2))
    out["v2_ok"] = _check(rank, tr, dst)
    held = {n: t.clone() for n, t in dst.items()}
    tr.step("adam")
    before = prediffs[0]
    try:  # rank 3 without delta: the handshake refuses on every rank
        _refit_world(rank, tr, dst, g, 3, delta=rank != 3)
        out["mixed"] = {"error": None}
    except Exception as e:
        out["mixed"] = {"error": type(e).__name__, "message": str(e)}
    out["mixed_prediffs"] = prediffs[0] - before
    out["mixed_untouched"] = all(torch.equal(dst[n].view(torch.int16), held[n].view(torch.int16)) for n in dst)
    out["v3"] = _mode(_refit_world(rank, tr, dst, g, 3))
    out["v3_ok"] = _check(rank, tr, dst)
    xd.pack_deferred = real
    return out
