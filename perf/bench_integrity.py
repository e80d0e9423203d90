"""What the per-message integrity digest (issue 46, ``execute/integrity.py``) costs: the same refits with
``digest=True`` and ``digest=False``, side by side in one gloo world on this machine.

* ``refit``: a Llama-shaped model of ``--mb`` MB, Megatron-style TP2 x DP2 -> TP1 x DP4 (every rank sends
  and receives), dense; the two settings alternate call by call (which goes first alternates too), each
  call timed from a barrier to the slowest rank's return (max over ranks).
* ``delta``: the same model, ``delta=True``, ``--fraction`` of the elements changed per version; a phase of
  ``--repeats`` delta refits per setting, twice each, alternating (each phase's first refit goes dense and
  is not counted).

The ratio ``on / off`` of the medians is the digest's cost (goal: <= 1.05 on CPU), in wall seconds and in CPU
seconds (every rank's process, all threads, summed: on a shared machine the steadier of the two). Also
reported: the seconds inside the digest's hooks on rank 0, wall and the hooks' own thread CPU (the hash of
every send and landed receive, the keyed combine and the end-of-refit exchange).

``--split``: a third setting alternates with the two, ``hash``: the digest on, but the end-of-refit exchange
replaced by the keyed combine alone (each rank makes its row and tag; no round, no verdict). ``hash / off`` is
then the cost of the hashing (the fused copies, the in-place messages' passes, the hooks), ``on / hash`` that of
the exchange round. A measurement only: a refit never skips its exchange. ``--direct-rows``: a fourth setting,
the digest on with its rows exchanged peer to peer (``n (n - 1)`` messages: the round before session 52); the
round's own CPU (every rank's process inside ``settle``, summed) is reported for both. ``--late``: a fifth
setting, the digest on with the delta refit's round posted after the last step's apply (as before session 53)
instead of before it (``StepLoop.apply``), alternating call by call with "on" inside its delta phases (the same
session): ``late / on`` is what the overlap saves. ``--group refit``: the
refits on a RefitGroup instead of the torch.distributed world.
``--rounds``: that round alone (no refit), each way in turn: direct and rooted on a torch.distributed gloo group,
the same two on a RefitGroup.

    python perf/bench_integrity.py --mb 64 --repeats 9 --out perf/results/bench_integrity.json

``--kernel``: the Triton copy kernel alone, digest on vs off on one pack and one unpack of a TP2 column block of
every tensor (bf16); the same blocks quantized to MXFP8 into a message (the quantizing pack) and delta-encoded
against a snapshot with ``--fraction`` of them changed (format v2), digest on vs off; median of ``--repeats`` (on
a GPU: the kernels' extra work; ``TRITON_INTERPRET=1`` runs it on CPU, for the smoke test only):

    python perf/bench_integrity.py --kernel --mb 512 --repeats 50
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

WORLD = 4


def _layouts(mb: float):
    from triton_reshard.tools.parallel import llama_pair

    return llama_pair(mb)


def _global(src, version: int, fraction: float, base: dict | None = None) -> dict:
    g = torch.Generator().manual_seed(46 + version)
    if base is None:
        return {t.name: torch.randn(t.shape, generator=g) for t in src.tensors}
    out = {}
    for n, t in base.items():
        t = t.clone()
        k = max(1, int(t.numel() * fraction))
        idx = torch.randint(0, t.numel(), (k,), generator=g)
        t.view(-1)[idx] += 1e-3
        out[n] = t
    return out


class DigestClock:
    """Rank-local seconds inside the digest's hooks (wrapping Ledger.on_post / on_land / post_round / settle: the hashing
    and the exchange the copies do not do), and apart, the fused copies (Ledger.pack / unpack,
    Digests.pack_ahead: the pack's and unpack's own copies with the hash in them, which the digest-off run
    makes with torch)."""

    HOOKS = ("on_post", "on_land", "post_round", "settle")

    def __init__(self) -> None:
        from triton_reshard.execute import integrity

        self.seconds = self.cpu = 0.0
        self.by_hook = {
            "on_post": 0.0,
            "on_land": 0.0,
            "post_round": 0.0,
            "settle": 0.0,
            "pack": 0.0,
            "unpack": 0.0,
            "pack_ahead": 0.0,
        }
        self.cpu_by_hook = dict(self.by_hook)
        # the process's CPU (all threads: gloo's too) inside post_round and settle: the end-of-refit round (posted
        # early in a delta refit: then the process CPU of the apply it overlaps counts into it too, an upper bound)
        self.round_cpu = 0.0
        for name in self.by_hook:
            owner = integrity.Digests if name == "pack_ahead" else integrity.Ledger
            real = getattr(owner, name)

            def timed(*a, _real=real, **k):
                t, c, pc = time.perf_counter(), time.thread_time(), time.process_time()
                try:
                    return _real(*a, **k)
                finally:
                    dt = time.perf_counter() - t
                    if _real.__name__ in ("post_round", "settle"):
                        self.round_cpu += time.process_time() - pc
                    if _real.__name__ in self.HOOKS:
                        self.seconds += dt
                        self.cpu += time.thread_time() - c
                    self.cpu_by_hook[_real.__name__] += time.thread_time() - c
                    self.by_hook[_real.__name__] += dt

            setattr(owner, name, timed)


CPU: list[float] = []  # per timed call: the CPU seconds of every rank's process (all threads), summed
EXCHANGE = [True]  # --split: False while the "hash" setting runs (the exchange replaced by the combine alone)
EARLY = [True]  # --late: False while the "late" setting runs (the round not posted before the last apply)
GROUP: list = [None]  # the refits' group: None (the torch.distributed world) or a RefitGroup (--group refit)


def _refit_group(rank: int, world: int):
    """``--group refit``: a RefitGroup of the world (gloo, a secret)."""
    import torch.distributed as dist

    from triton_reshard import init_refit_group
    from triton_reshard.testing.launch import free_port

    port = [free_port() if rank == 0 else 0]
    dist.broadcast_object_list(port, src=0)
    return init_refit_group("127.0.0.1", port[0], rank, world, backend="gloo", secret=b"bench-integrity-" * 2)


def _split_settle() -> None:
    """``--split``: make ``Ledger.settle`` skip the exchange while :data:`EXCHANGE` says so (the combine, each
    rank's keyed row and its tag, is still made: the work of the exchange that is not the round)."""
    from triton_reshard.execute import integrity

    real, real_post = integrity.Ledger.settle, integrity.Ledger.post_round

    def settle(self, link, _real=real):
        if EXCHANGE[0]:
            return _real(self, link)
        self._values()
        row = []
        for r in link.ranks:
            row += [self._pair(self.rank, r, self.sent.get(r, [])), self._pair(r, self.rank, self.recvd.get(r, []))]
        self._row_tag(self.rank, row)
        return None

    def post_round(self, link, _real=real_post):  # (the round posted early in a delta refit: not in "hash", "late")
        return _real(self, link) if EXCHANGE[0] and EARLY[0] else False

    integrity.Ledger.settle = settle
    integrity.Ledger.post_round = post_round


def _refit_with(setting, *args, **kw):
    """``refit`` with the digest ``setting``: True, False, "hash" (on, the exchange skipped: ``--split``) or
    "direct" (on, the rows exchanged peer to peer as before session 52: ``--direct-rows``) or "late" (on, a
    delta refit's round posted after its last apply, as before session 53: ``--late``)."""
    from triton_reshard import refit
    from triton_reshard.execute import integrity, transport

    EXCHANGE[0], EARLY[0] = setting != "hash", setting != "late"
    gather = integrity.post_gather
    if setting == "direct":  # (rooted from more ranks than the world has: the rows peer to peer)
        integrity.post_gather = lambda link, row, what: transport.post_gather(link, row, what, WORLD + 1)
    try:
        return refit(*args, digest=bool(setting), group=GROUP[0], **kw)
    finally:
        EXCHANGE[0] = EARLY[0] = True
        integrity.post_gather = gather


def _timed(fn) -> float:
    """Wall seconds of ``fn`` from a barrier to the slowest rank's return; its CPU seconds summed over the
    ranks go to :data:`CPU` (on a shared machine the CPU time is the steadier measure of the work)."""
    import torch.distributed as dist

    dist.barrier()
    t, c = time.perf_counter(), time.process_time()
    fn()
    dt = torch.tensor([time.perf_counter() - t, time.process_time() - c], dtype=torch.float64)
    wall = dt[:1].clone()
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    cpu = dt[1:].clone()
    dist.all_reduce(cpu, op=dist.ReduceOp.SUM)
    CPU.append(float(cpu))
    return float(wall)


class Tally:
    """One part's measurements per setting: wall and CPU per refit (``_timed``), the round's CPU (inside
    settle), and for the digest on its hooks' seconds on this rank."""

    def __init__(self, clock: DigestClock, settings: tuple) -> None:
        self.clock = clock
        self.times: dict = {s: [] for s in settings}
        self.cpus: dict = {s: [] for s in settings}
        self.rounds: dict = {s: [] for s in settings}
        self.digest_s: list[float] = []
        self.hook_cpu: list[float] = []
        self.hooks0, self.hooks_cpu0 = dict(clock.by_hook), dict(clock.cpu_by_hook)

    def timed(self, digest, fn, keep: bool = True) -> None:
        """Time ``fn`` (a refit with setting ``digest``); kept unless ``keep`` is False."""
        c = self.clock
        before, before_cpu, before_round = c.seconds, c.cpu, c.round_cpu
        dt = _timed(fn)
        if not keep:
            return
        self.times[digest].append(dt)
        self.cpus[digest].append(CPU[-1])
        self.rounds[digest].append(c.round_cpu - before_round)
        if digest is True:
            self.digest_s.append(c.seconds - before)
            self.hook_cpu.append(c.cpu - before_cpu)

    def result(self, **extra) -> dict:
        c, t = self.clock, self.times
        return {
            "on": t[True],
            "off": t[False],
            "cpu_on": self.cpus[True],
            "cpu_off": self.cpus[False],
            "digest_cpu_s_rank": self.digest_s,
            "hook_thread_cpu_s_rank": self.hook_cpu,
            "hooks_s_total": {k: v - self.hooks0[k] for k, v in c.by_hook.items()},
            "hooks_thread_cpu_s_total": {k: v - self.hooks_cpu0[k] for k, v in c.cpu_by_hook.items()},
            **({s: t[s] for s in ("hash", "direct", "late") if s in t}),
            **({f"cpu_{s}": self.cpus[s] for s in ("hash", "direct", "late") if s in t}),
            **({f"round_cpu_{'on' if s is True else s}": self.rounds[s] for s in (True, "direct") if s in t}),
            **extra,
        }


def worker(rank: int, world: int, spec: dict) -> dict:
    clock = DigestClock()
    settings: tuple = (True, False)
    if spec.get("split") or spec.get("late"):
        _split_settle()
    if spec.get("split"):
        settings = (True, False, "hash")
    if spec.get("direct_rows"):
        settings += ("direct",)
    if spec.get("late"):
        settings += ("late",)
    if spec.get("group") == "refit":
        GROUP[0] = _refit_group(rank, world)
    src_l, dst_l = _layouts(spec["mb"])
    data = _global(src_l, 0, 0.0)
    src = src_l.shard(data, rank)
    dst = dst_l.allocate(rank)
    out: dict = {"rank": rank}
    if "refit" in spec["parts"]:
        tally = Tally(clock, settings)
        for digest in settings * 2:  # warm-up: plans, buffers, connections
            _refit_with(digest, src, dst, src_l, dst_l)
        for r in range(spec["repeats"]):
            k = r % len(settings)  # which goes first turns round
            for digest in settings[k:] + settings[:k]:
                tally.timed(digest, lambda d=digest: _refit_with(d, src, dst, src_l, dst_l))
        out["refit"] = tally.result()
    if "delta" in spec["parts"]:
        version, base = 1, data
        tally = Tally(clock, settings)
        modes: list[str] = []
        for phase in tuple(s for s in settings if s != "late") * 2:  # ("late": inside the digest-on phases)
            for k in range(spec["repeats"] + 1):
                version += 1
                base = _global(src_l, version, spec["fraction"], base)
                for n, t in src_l.shard(base, rank).items():
                    src[n].copy_(t)
                # --late: call by call with the digest on in its phases (the same options: one session, no dense
                # refit between), in pairs whose first call alternates: on on late late on on ...
                digest = ("late", True)[(k + k // 2) % 2] if phase is True and "late" in settings and k else phase

                def go(d=digest, v=version):
                    modes.append(_refit_with(d, src, dst, src_l, dst_l, delta=True, version=v).mode)

                tally.timed(digest, go, keep=k > 0)  # the phase's first refit is dense (a new session)
                if not k:
                    modes.pop()
        out["delta"] = tally.result(modes=modes)
    if GROUP[0] is not None:
        GROUP[0].barrier()
        GROUP[0].destroy()
    return out


def _round_cpu(res: list[dict], part: str, setting: str) -> float | None:
    """The median over refits of the end-of-refit round's process CPU, summed over the ranks."""
    per = [r[part].get(f"round_cpu_{setting}") for r in res]
    if not all(per):
        return None
    return statistics.median(sum(x) for x in zip(*per, strict=True))


def summarize(res: list[dict], spec: dict) -> dict:
    out = {"spec": spec, "world": WORLD, "backend": "gloo", "machine": "cpu"}
    for part in spec["parts"]:
        r0 = res[0][part]
        on, off = statistics.median(r0["on"]), statistics.median(r0["off"])
        c_on, c_off = statistics.median(r0["cpu_on"]), statistics.median(r0["cpu_off"])
        row = {
            "median_on_s": on,
            "median_off_s": off,
            "ratio_on_off": on / off if off else None,
            "median_cpu_on_s": c_on,
            "median_cpu_off_s": c_off,
            "cpu_ratio_on_off": c_on / c_off if c_off else None,
            "hook_thread_cpu_s_rank0_median": statistics.median(r0["hook_thread_cpu_s_rank"])
            if r0["hook_thread_cpu_s_rank"]
            else None,
            "digest_cpu_s_rank0_median": statistics.median(r0["digest_cpu_s_rank"])
            if r0["digest_cpu_s_rank"]
            else None,
            "on_s": r0["on"],
            "off_s": r0["off"],
            "hooks_s_total_rank0": r0.get("hooks_s_total"),
            "hooks_thread_cpu_s_total_rank0": r0.get("hooks_thread_cpu_s_total"),
        }
        if part == "delta":
            row["modes"] = sorted(set(r0["modes"]))
        if "hash" in r0:  # --split
            h, c_h = statistics.median(r0["hash"]), statistics.median(r0["cpu_hash"])
            row.update(median_hash_s=h, median_cpu_hash_s=c_h, hash_s=r0["hash"], ratio_hash_off=h / off if off else None,
                       cpu_ratio_hash_off=c_h / c_off if c_off else None)
        row.update(round_cpu_on_s=_round_cpu(res, part, "on"), round_cpu_direct_s=_round_cpu(res, part, "direct"))
        if "late" in r0:  # --late
            lt, c_lt = statistics.median(r0["late"]), statistics.median(r0["cpu_late"])
            row.update(median_late_s=lt, median_cpu_late_s=c_lt, late_s=r0["late"], ratio_late_off=lt / off if off else None,
                       cpu_ratio_late_off=c_lt / c_off if c_off else None)
        if "direct" in r0:  # --direct-rows
            d, c_d = statistics.median(r0["direct"]), statistics.median(r0["cpu_direct"])
            row.update(median_direct_s=d, median_cpu_direct_s=c_d, direct_s=r0["direct"],
                       ratio_direct_off=d / off if off else None, cpu_ratio_direct_off=c_d / c_off if c_off else None)
        out[part] = row
    return out


def _pieces(mb: float, device: str):
    """A pack's pairs: the column block of rank 0 of TP2 of every tensor of a Llama-shaped bf16 model of ``mb``
    MB (strided sources), laid one after another in one message buffer."""
    from triton_reshard.tools.parallel import llama_for_bytes, llama_tensors

    cfg = llama_for_bytes(int(mb * (1 << 20)), torch.bfloat16)
    srcs = []
    for shape, _kind, _layer in llama_tensors(**cfg).values():
        full = torch.randn(shape, dtype=torch.float32, device=device).to(torch.bfloat16)
        srcs.append(full[..., : max(1, full.shape[-1] // 2)])
    n = sum(v.numel() * 2 for v in srcs)
    msg = torch.empty(n, dtype=torch.uint8, device=device)
    pairs, at = [], 0
    for v in srcs:
        nb = v.numel() * 2
        pairs.append((v, msg[at : at + nb].view(torch.bfloat16).view(v.shape)))
        at += nb
    return pairs, msg


def _quant_delta_runs(pairs, fraction: float, coefs) -> tuple[dict, list]:
    """The MXFP8 quantizing pack and the v2 delta encode of the pieces' sources, digest off and on (``runs``), and
    checks that each digest is the CPU digest of the message its run made (``checks``: each runs its digest-on
    run once and returns (name, digest, message))."""
    from triton_reshard.execute import integrity as ig
    from triton_reshard.ops import delta_triton as dt
    from triton_reshard.ops import quantize as Q
    from triton_reshard.ops.quant_digest import quantize_digest

    srcs = [v for v, _m in pairs if v.dim() == 2 and v.shape[-1] % 32 == 0]  # the matrices: MXFP8 1 x 32 blocks
    dev, sizes = srcs[0].device, [(v.numel(), v.numel() // 32) for v in srcs]
    qmsg = torch.zeros(sum(-(-q // 16) * 16 + -(-sc // 16) * 16 for q, sc in sizes), dtype=torch.uint8, device=dev)
    items, at = [], 0
    for v, (q, sc) in zip(srcs, sizes, strict=True):
        s0 = at + -(-q // 16) * 16
        items.append((v, qmsg[at:at + q].view(v.shape), qmsg[s0:s0 + sc].view(*v.shape[:-1], v.shape[-1] // 32)))
        at = s0 + -(-sc // 16) * 16
    qcoef = coefs.get(-(-qmsg.numel() // 1024) + qmsg.numel() % 8, dev)
    snaps = []
    g = torch.Generator(device=dev).manual_seed(46)
    for v in srcs:
        snap = v.clone()
        snap.view(-1)[torch.rand(snap.numel(), generator=g, device=dev) < fraction] += 1
        snaps.append(snap)
    dpairs = list(zip(srcs, snaps, strict=True))
    caches: tuple[dict, dict] = ({}, {})
    coef_for = lambda n: coefs.get(-(-n // (8 * ig.ROW_WORDS)), dev)  # noqa: E731
    runs = {
        "mxfp8 pack, digest off": lambda: Q.quantize_views(items, (1, 32), backend="triton", key="b-q", fmt="mxfp8"),
        "mxfp8 pack, digest on": lambda: quantize_digest(items, (1, 32), False, [(qmsg, qmsg.numel())], qcoef,
                                                         key="b-q", fmt="mxfp8"),
        "delta encode, digest off": lambda: dt.triton_pack(dpairs, update=False, version=2, cache=caches[0]),
        "delta encode, digest on": lambda: dt.triton_pack_digest(dpairs, coef_for, update=False, cache=caches[1]),
    }

    def check_quant():  # (the message's padding is zeros: it adds nothing to the digest)
        return "mxfp8 pack", runs["mxfp8 pack, digest on"]()[0][0], qmsg

    def check_delta():
        msg, h = runs["delta encode, digest on"]()
        return "delta encode", h, msg

    return runs, [check_quant, check_delta]


def kernel_main(a) -> int:
    """``--kernel``: the Triton copy kernel with its digest on vs off on the same pack and unpack (CUDA; or the
    interpreter with TRITON_INTERPRET=1, which times nothing useful): the kernels' extra work on a GPU."""
    from triton_reshard.execute import integrity as ig
    from triton_reshard.ops import copy as tc

    device = "cuda" if torch.cuda.is_available() else "cpu"
    pairs, msg = _pieces(a.mb, device)
    back = [(m, torch.empty_like(v)) for v, m in pairs]
    coefs = ig.Coefficients(b"k" * 32)
    coef = coefs.get(ig._entries(msg.numel()), msg.device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    runs = {
        "pack, digest off": lambda: tc.triton_copy_views(pairs, key="bench-pack"),
        "pack, digest on": lambda: tc.triton_copy_digest(pairs, [(msg, msg.numel())], 1, coef, key="bench-pack"),
        "unpack, digest off": lambda: tc.triton_copy_views(back, key="bench-unpack"),
        "unpack, digest on": lambda: tc.triton_copy_digest(back, [(msg, msg.numel())], 0, coef, key="bench-unpack"),
    }
    more, checks = _quant_delta_runs(pairs, a.fraction, coefs)
    runs.update(more)
    times: dict[str, list[float]] = {k: [] for k in runs}
    for fn in runs.values():  # warm-up: compile, autotune, tables
        fn()
    sync()
    sums, gaps = runs["pack, digest on"]()  # the kernels' digest is the CPU digest of the message
    if gaps[0] or int(sums[0]) & ((1 << 64) - 1) != ig.partial(msg.cpu(), coefs):
        raise SystemExit("bench_integrity --kernel: the kernels' digest is not the CPU digest of the message")
    for check in checks:  # the quantizer's and the delta encode's too
        name, digest, message = check()
        if int(digest) & ((1 << 64) - 1) != ig.partial(message.cpu(), coefs):
            raise SystemExit(f"bench_integrity --kernel: the {name} digest is not the CPU digest of its message")
    for _ in range(a.repeats):
        for k, fn in runs.items():
            sync()
            t = time.perf_counter()
            fn()
            sync()
            times[k].append(time.perf_counter() - t)
    out = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)", "bytes": msg.numel()}
    for k, ts in times.items():
        out[k] = statistics.median(ts)
    for side in ("pack", "unpack", "mxfp8 pack", "delta encode"):
        on, off = out[f"{side}, digest on"], out[f"{side}, digest off"]
        out[f"{side} on/off"] = on / off
        print(f"{side}: {msg.numel() / 1e6:.1f} MB of sources, digest off {off * 1e3:.3f} ms "
              f"({msg.numel() / off / 1e9:.0f} GB/s), on {on * 1e3:.3f} ms, on/off {on / off:.3f}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


def rounds_worker(rank: int, world: int, spec: dict) -> dict:
    """``--rounds``: the end-of-refit row exchange alone, each way in turn (interleaved), ``spec["repeats"]``
    times 10 rounds of a digest row (``2 n + 1`` int64): per way, the CPU of every rank's process (all threads)
    summed, and the slowest rank's wall, per round."""
    from datetime import timedelta

    import torch.distributed as dist

    from triton_reshard.comm.group import TorchGroup
    from triton_reshard.execute.integrity import post_gather
    from triton_reshard.execute.transport import Link

    torch_link = Link(TorchGroup(None), timedelta(seconds=60))
    rg = _refit_group(rank, world)
    refit_link = Link(rg, timedelta(seconds=60))
    row = list(range(2 * world + 1))
    ways = {
        "direct (torch gloo group, before s52)": lambda: torch_link.all_gather_row(row, "bench"),
        "rooted (torch gloo group, s52)": lambda: post_gather(torch_link, row, "bench").rows(),
        "direct (RefitGroup, before s52)": lambda: refit_link.all_gather_row(row, "bench"),
        "rooted (RefitGroup, s52)": lambda: post_gather(refit_link, row, "bench").rows(),
    }
    got: dict = {k: [] for k in ways}
    for _ in range(spec["repeats"]):
        for name, fn in ways.items():
            dist.barrier()
            t, c = time.perf_counter(), time.process_time()
            for _ in range(10):
                fn()
            dt = torch.tensor([time.process_time() - c, time.perf_counter() - t], dtype=torch.float64)
            cpu, wall = dt[:1].clone(), dt[1:].clone()
            dist.all_reduce(cpu, op=dist.ReduceOp.SUM)
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)
            got[name].append((float(cpu) / 10, float(wall) / 10))
    rg.barrier()
    rg.destroy()
    return {k: {"cpu_s_all_ranks": statistics.median(c for c, _w in v), "wall_s": statistics.median(w for _c, w in v),
                "runs": v} for k, v in got.items()}


def rounds_main(a) -> int:
    from triton_reshard.testing.launch import run_world

    out = {"world": WORLD, "repeats": a.repeats, "ways": run_world(rounds_worker, WORLD, {"repeats": a.repeats})[0]}
    for k, v in out["ways"].items():
        print(f"{k}: {v['cpu_s_all_ranks'] * 1e3:.2f} ms CPU (all ranks) a round, {v['wall_s'] * 1e3:.2f} ms wall")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=64.0, help="model size in MB (fp32)")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--fraction", type=float, default=0.02, help="delta: elements changed per version")
    p.add_argument("--parts", default="refit,delta")
    p.add_argument("--out", default=None)
    p.add_argument("--kernel", action="store_true", help="the Triton copy kernel, digest on vs off (GPU)")
    p.add_argument("--split", action="store_true", help="also the digest on with its exchange skipped (hash only)")
    p.add_argument("--direct-rows", action="store_true",
                   help="also the digest on with its rows exchanged peer to peer (the round before session 52)")
    p.add_argument("--late", action="store_true",
                   help="also the digest on with a delta refit's round posted after its last apply (before session 53)")
    p.add_argument("--group", choices=("torch", "refit"), default="torch",
                   help="the refits' group: the torch.distributed world, or a RefitGroup")
    p.add_argument("--rounds", action="store_true", help="the end-of-refit row exchange alone, each way")
    a = p.parse_args(argv)
    if a.kernel:
        return kernel_main(a)
    if a.rounds:
        return rounds_main(a)
    from triton_reshard.testing.launch import run_world

    spec = {"mb": a.mb, "repeats": a.repeats, "fraction": a.fraction, "parts": a.parts.split(","), "split": a.split,
            "direct_rows": a.direct_rows, "group": a.group, "late": a.late}
    res = run_world(worker, WORLD, spec, timeout=1800)
    out = summarize(res, spec)
    for part in spec["parts"]:
        r = out[part]
        print(
            f"{part}: digest on {r['median_on_s'] * 1e3:.1f} ms, off {r['median_off_s'] * 1e3:.1f} ms, "
            f"on/off {r['ratio_on_off']:.3f}; CPU (all ranks) on {r['median_cpu_on_s'] * 1e3:.1f} ms, off "
            f"{r['median_cpu_off_s'] * 1e3:.1f} ms, on/off {r['cpu_ratio_on_off']:.3f}; in the digest's hooks on "
            f"rank 0: {r['digest_cpu_s_rank0_median'] * 1e3:.1f} ms wall, "
            f"{r['hook_thread_cpu_s_rank0_median'] * 1e3:.1f} ms CPU"
            + (f"; modes {r['modes']}" if "modes" in r else "")
        )
        if "ratio_hash_off" in r:
            print(f"{part}, the exchange skipped (--split): hash/off {r['ratio_hash_off']:.3f} wall, "
                  f"{r['cpu_ratio_hash_off']:.3f} CPU; on/hash {r['median_on_s'] / r['median_hash_s']:.3f} wall, "
                  f"{r['median_cpu_on_s'] / r['median_cpu_hash_s']:.3f} CPU (the round)")
        if "ratio_late_off" in r:
            print(f"{part}, the round after the last apply (--late): late/off {r['ratio_late_off']:.3f} wall, "
                  f"{r['cpu_ratio_late_off']:.3f} CPU; late/on {r['median_late_s'] / r['median_on_s']:.3f} wall, "
                  f"{r['median_cpu_late_s'] / r['median_cpu_on_s']:.3f} CPU (what the overlap saves)")
        if "ratio_direct_off" in r:
            print(f"{part}, the rows direct (--direct-rows): direct/off {r['ratio_direct_off']:.3f} wall, "
                  f"{r['cpu_ratio_direct_off']:.3f} CPU; the round's CPU (all ranks, inside settle) this build's "
                  f"{r['round_cpu_on_s'] * 1e3:.2f} ms, direct {r['round_cpu_direct_s'] * 1e3:.2f} ms")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
