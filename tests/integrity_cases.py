"""Worker side of ``test_integrity.py`` (issue 46): one spawned gloo world of 4 runs every scenario, each on a
fresh process group, through the public ``refit``. A scenario corrupts one thing on one rank (a bit flipped in
a received message, a chunk of it zeroed, two received messages swapped, one destination element changed after
its unpack) in a dense, delta, MXFP8 or NVFP4 refit, and records what every rank raised, its refit state, and
whether the next refit repaired the destination bit for bit. Results are plain dicts the tests read."""

from __future__ import annotations

import os
import traceback
from datetime import timedelta

import torch

from triton_reshard import Layout, Shard, refit, refit_state
from triton_reshard.comm.lanes import LaneRecv

WORLD = 4
TIMEOUT = 20.0  # seconds: every wait of the scenarios (a hang would be a failure, not a pass)
SHAPES = {"w": (32, 24), "b": (24,)}
# all-to-all: every destination rank needs a column block of every source rank's rows (staged receives)
SRC = Layout.from_placements(SHAPES, list(range(WORLD)), {"w": [Shard(0)], "b": [Shard(0)]})
DST = Layout.from_placements(SHAPES, list(range(WORLD)), {"w": [Shard(1)], "b": [Shard(0)]})
VICTIM = 1  # the rank whose received bytes are corrupted


def global_data(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(4600 + version)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def expected(rank: int, version: int) -> dict[str, torch.Tensor]:
    """Independent of the planner: slice the global tensors by hand (dst: w by columns, b by rows)."""
    g = global_data(version)
    cw, cb = SHAPES["w"][1] // WORLD, SHAPES["b"][0] // WORLD
    return {"w": g["w"][:, rank * cw : (rank + 1) * cw], "b": g["b"][rank * cb : (rank + 1) * cb]}


def same_bits(got: dict, want: dict) -> bool:
    return all(
        torch.equal(got[n].contiguous().view(torch.uint8), want[n].contiguous().view(torch.uint8))
        for n in want
    )


# -- the faults ----------------------------------------------------------------------------------------


class RecvFault:
    """Wrap this process's transport so that the first post with at least ``need`` payload receives (uint8
    buffers: messages, not the int64 control rows) runs ``action(buffers)`` once they arrived: what a link
    that corrupts bytes in flight delivers (the sender's buffer, and so its digest, is untouched); a message
    through a same-host lane is corrupted in the ring, before the receiver copies (and hashes) it."""

    def __init__(self, action, need: int = 1, skip_peer: int | None = None) -> None:
        self.action, self.need, self.fired, self.skip_peer = action, need, 0, skip_peer
        self.peer = None  # the peer of the corrupted message

    def __enter__(self):
        from triton_reshard.comm.group import RefitGroup, TorchGroup

        self.reals = {cls: cls.post for cls in (TorchGroup, RefitGroup)}
        for cls, real in self.reals.items():
            cls.post = self._post(real)
        return self

    def _post(self, real):
        fault = self

        class Work:
            def __init__(self, work, bufs):
                self.work, self.bufs = work, bufs

            def wait(self, timeout=None):
                ok = self.work.wait(timeout=timeout)
                if ok is not False and not fault.fired:
                    fault.fired = 1
                    fault.action(self.bufs)
                return ok

        def post(group, sends, recvs):
            works = real(group, sends, recvs)
            payload = [
                k
                for k, (p, buf) in enumerate(recvs)
                if buf.dtype == torch.uint8 and buf.numel() >= 16 and p != fault.skip_peer
            ]
            if not fault.fired and len(payload) >= fault.need:  # gloo: one work per receive, receives first
                last = payload[fault.need - 1]
                fault.peer = recvs[last][0]
                works = list(works)
                if fault.need == 1 and isinstance(works[last], LaneRecv):
                    works[last]._copy_out = in_ring(works[last]._copy_out)
                else:
                    works[last] = Work(works[last], [recvs[k][1] for k in payload[: fault.need]])
            return works

        def in_ring(copy_out):
            """A message through a same-host lane (comm/lanes.py) is corrupted where it travels: in the ring,
            before the receiver copies it out (and hashes what it copies)."""

            def corrupted(src, *at):
                if not fault.fired:
                    fault.fired = 1
                    fault.action([src])
                return copy_out(src, *at)

            return corrupted

        return post

    def __exit__(self, *exc):
        for cls, real in self.reals.items():
            cls.post = real
        return False


def flip_bit(bufs):
    bufs[0][bufs[0].numel() // 2] ^= 0x10


def drop_chunk(bufs):
    n = bufs[0].numel()
    bufs[0][n // 4 : n // 4 + 32] = 0  # 32 bytes of a message lost (zeros where the data was)


def swap_two(bufs):
    a, b = bufs[0], bufs[1]
    n = min(a.numel(), b.numel())
    t = a[:n].clone()
    a[:n] = b[:n]
    b[:n] = t


def flip_delta_value(bufs):
    """Flip one bit of the first changed value of a delta message (its header, directory and indices stay
    valid, so the unpack accepts it and writes a wrong element)."""
    msg = bufs[0]
    head = msg[:16].view(torch.int32).tolist()
    chunks = head[2]
    offs = msg[16 : 16 + 8 * chunks].view(torch.int64).tolist()
    for off in offs:
        kind_es, numel, count, _nbytes = msg[off : off + 16].view(torch.int32).tolist()
        if not count:
            continue
        kind = kind_es & 0xFF
        body = off + 16
        if kind == 3:  # narrow (format v2): 2-byte block descriptors, then the changed blocks' payloads
            nb = -(-numel // 256)
            for k in range(nb):  # blocks before the first changed one have no payload
                code_mode = int(msg[body + 2 * k])
                if code_mode:
                    n, mode, blen = int(msg[body + 2 * k + 1]) + 1, code_mode >> 4, min(256, numel - 256 * k)
                    lead = n if mode == 0 else -(-blen // 8) if mode == 1 else 0  # indices or bitmask first
                    msg[body + 2 * nb + lead] ^= 0x01  # the low bit of the block's first value
                    return
        if kind == 2:  # offsets: count uint16, padded to 16, then the values
            body += -(-2 * count // 16) * 16
        elif kind == 1:  # bitmask: ceil(numel / 32) uint32 words, padded to 16
            body += -(-4 * -(-numel // 32) // 16) * 16
        msg[body] ^= 0x01
        return
    raise AssertionError("a delta message with no changed element")


def corrupt_after_unpack(rank: int):
    """This process's unpacks write one destination element wrong (after the real copy): a bug in the
    unpack, or memory changed under it. Returns the undo. The unpack runs without the native fused copy
    (which hashes each block as it writes it, so a change made after it is not seen: docs/integrity.md): the
    receiver's digest then reads the destination after the land, which is what this proves."""
    from triton_reshard.execute.steps import StepLoop
    from triton_reshard.ops.delta_native import set_native

    real = StepLoop.copy_or_compare
    done = [False]

    def copy_or_compare(self, pairs, meta, list_key):
        real(self, pairs, meta, list_key)
        if not done[0] and self.tally is None and pairs and list_key[1] == "unpack":
            done[0] = True
            dv = pairs[0][1]
            idx = (0,) * dv.dim()
            dv[idx] = dv[idx] + 1

    StepLoop.copy_or_compare = copy_or_compare
    prev = set_native(False)

    def undo():
        set_native(prev)
        StepLoop.copy_or_compare = real

    return undo


# -- the scenarios ---------------------------------------------------------------------------------------


def _group():
    import torch.distributed as dist

    return dist.new_group(list(range(WORLD)), timeout=timedelta(seconds=60))


def _state(layout, instances: int = 1) -> dict:
    s = refit_state(layout, instances=instances)
    return {"version": s.version, "torn": s.torn, "torn_tensors": list(s.torn_tensors)}


def _caught(fn) -> dict:
    try:
        report = fn()
        return {"error": None, "mode": getattr(report, "mode", None)}
    except Exception as e:
        return {
            "error": type(e).__name__,
            "message": str(e),
            "torn": list(getattr(e, "torn", ())),
            "sender": getattr(e, "sender", None),
            "receiver": getattr(e, "receiver", None),
            "tensor": getattr(e, "tensor", None),
            "step": getattr(e, "step", None),
        }


def _settles() -> tuple[list, object]:
    """Record every digest comparison this process makes: (messages sent, messages landed, verdict, messages
    this rank sent in the exchange)."""
    from triton_reshard.execute import integrity

    real = integrity.Ledger.settle
    log: list = []

    def settle(self, link):
        entry = [sum(len(v) for v in self.sent.values()), sum(len(v) for v in self.recvd.values()), "ok", 0]
        log.append(entry)
        comm, post = link.comm, link.comm.post

        def counted(sends, recvs):  # the messages this rank sends in the exchange
            entry[3] += len(sends)
            return post(sends, recvs)

        comm.post = counted
        try:
            real(self, link)
        except integrity.ReshardIntegrityError:
            entry[2] = "mismatch"
            raise
        finally:
            del comm.post

    integrity.Ledger.settle = settle
    return log, lambda: setattr(integrity.Ledger, "settle", real)


def dense(rank: int, fault: str, digest: bool = True, backend: str | None = None, g=None) -> dict:
    """Version 0 clean; version 1 with ``fault`` on one rank; version 2 clean (the repair), same group (``g``,
    else a new torch.distributed group)."""
    g = _group() if g is None else g
    dst = {n: torch.full(s.shape, float("nan")) for n, s in DST.local_specs(rank).items()}

    def go(v):
        return refit(
            SRC.shard(global_data(v), rank), dst, SRC, DST, group=g, timeout=TIMEOUT, version=v, digest=digest,
            backend=backend,
        )

    out = {"v0": _caught(lambda: go(0)), "v0_ok": same_bits(dst, expected(rank, 0))}
    undo = lambda: None  # noqa: E731
    ctx = None
    if fault == "after_unpack" and rank == 0:
        undo = corrupt_after_unpack(rank)
    elif fault in ("flip", "drop", "swap") and rank == VICTIM:
        ctx = RecvFault(
            {"flip": flip_bit, "drop": drop_chunk, "swap": swap_two}[fault], 2 if fault == "swap" else 1
        )
    try:
        if ctx is not None:
            with ctx:
                out["v1"] = _caught(lambda: go(1))
            out["fired"] = ctx.fired
        else:
            out["v1"] = _caught(lambda: go(1))
    finally:
        undo()
    out["v1_ok"] = same_bits(dst, expected(rank, 1))
    out["state"] = _state(DST)
    out["v2"] = _caught(lambda: go(2))
    out["v2_ok"] = same_bits(dst, expected(rank, 2))
    out["state_after"] = _state(DST)
    return out


DSRC = Layout.from_placements({"d": (48, 32)}, list(range(WORLD)), [Shard(0)])
DDST = Layout.from_placements({"d": (48, 32)}, list(range(WORLD)), [Shard(1)])


def delta(rank: int, backend: str | None = None) -> dict:
    """Delta refits: version 0 (dense, the snapshot), version 1 a delta with one bit of a changed value
    flipped in flight to the victim, version 2 asks for a delta again: it must go dense and repair."""
    g = _group()
    base = torch.randn((48, 32), generator=torch.Generator().manual_seed(46))
    datas = [base.clone() for _ in range(3)]
    for v in (1, 2):
        datas[v].view(-1)[v::7] += 1.0  # a few elements change each version
    dst = {n: torch.full(s.shape, float("nan")) for n, s in DDST.local_specs(rank).items()}

    def go(v):
        return refit(
            DSRC.shard({"d": datas[v]}, rank),
            dst,
            DSRC,
            DDST,
            group=g,
            timeout=TIMEOUT,
            version=v,
            delta=True,
            backend=backend,
        )

    def ok(v):
        return same_bits(dst, DDST.shard({"d": datas[v]}, rank))

    out = {"v0": _caught(lambda: go(0)), "v0_ok": ok(0)}
    ctx = RecvFault(flip_delta_value) if rank == VICTIM else None
    if ctx is not None:
        with ctx:
            out["v1"] = _caught(lambda: go(1))
        out["fired"] = ctx.fired
    else:
        out["v1"] = _caught(lambda: go(1))
    out["v1_ok"] = ok(1)
    out["state"] = _state(DDST)
    out["v2"] = _caught(lambda: go(2))
    out["v2_ok"] = ok(2)
    return out


def quant(rank: int, fmt: str, backend: str | None = None) -> dict:
    """An MXFP8 / NVFP4 refit (quant_fmt_cases' raw case: fp32 column shards to quantized rows, values and
    scales on the wire, source- and destination-quantized chunks; ``fp8``: quant_cases' raw block-FP8 case,
    UE8M0 scales) with a bit flipped in a message to the victim; then the repair, compared byte for byte with
    the format's reference."""
    from . import quant_cases as qc
    from . import quant_fmt_cases as qf

    g = _group()
    mod, case = (
        (qc, qc.CASES["raw-fp32-rows24-to-cols-ue8m0"])
        if fmt == "fp8"
        else (qf, qf.CASES[f"{fmt}-raw-fp32-cols48-to-rows"])
    )
    src_l, dst_l = mod.layouts(case)
    data = qc.global_data(src_l, 0)
    src_t = qc.src_locals(src_l, rank, data)
    dst_t = mod.dst_locals(dst_l, rank)
    want = mod.expected(case, dst_l, rank, data)
    victim = 2  # a destination rank of the case

    def go():
        return refit(
            src_t, dst_t, src_l, dst_l, group=g, timeout=TIMEOUT, bucket_bytes=case.bucket_bytes, version=0,
            backend=backend,
        )

    ctx = RecvFault(flip_bit) if rank == victim else None
    if ctx is not None:
        with ctx:
            out = {"v1": _caught(go)}
        out["fired"] = ctx.fired
    else:
        out = {"v1": _caught(go)}
    out["state"] = _state(dst_l)
    out["v2"] = _caught(go)
    out["problems"] = [p for n in want for p in [qc.mismatch(dst_t[n], want[n], n)] if p]
    return out


RSHAPES = {"r": (64, 48)}
RSRC = Layout.from_placements(RSHAPES, [0], [Shard(0)])
RDST = Layout.from_placements(RSHAPES, [1], [Shard(0)])  # one engine rank; three engines (ranks 1, 2, 3)


def relay(rank: int) -> dict:
    """Three engines of one rank each fed by rank 0 with relays (the trainer sends each engine a part, the
    engines forward their parts to each other): a bit flipped in a message rank 2 gets from another engine
    (a relayed message); then the repair."""
    g = _group()
    data = {"r": torch.randn(RSHAPES["r"], generator=torch.Generator().manual_seed(7))}
    src = RSRC.shard(data, rank) if rank == 0 else {}
    dst = (
        {n: torch.full(sp.shape, float("nan")) for n, sp in RDST.instances(3).local_specs(rank).items()}
        if rank
        else {}
    )

    def go():
        return refit(src, dst, RSRC, RDST, group=g, timeout=TIMEOUT, instances=3, relay=True, version=0)

    ctx = RecvFault(flip_bit, skip_peer=0) if rank == 2 else None
    if ctx is not None:
        with ctx:
            out = {"v1": _caught(go)}
        out["fired"], out["peer"] = ctx.fired, ctx.peer
    else:
        out = {"v1": _caught(go)}
    out["state"] = _state(RDST, 3)
    out["v2"] = _caught(go)
    out["v2_ok"] = not dst or torch.equal(dst["r"].view(torch.int32), data["r"].view(torch.int32))
    return out


def clean_counts(rank: int) -> dict:
    """Two clean refits: every rank compares, and what it compared (messages sent and landed) is recorded."""
    log, undo = _settles()
    try:
        res = dense(rank, "none")
    finally:
        undo()
    res["settles"] = log
    return res


def refit_group(rank: int) -> dict:
    """``dense`` with a flipped bit on a RefitGroup (gloo, a secret): the digest rows go rooted (the messages
    each rank sends in the exchange: counted), the flip is caught on every rank and the next refit repairs it."""
    import torch.distributed as dist

    from triton_reshard import init_refit_group
    from triton_reshard.testing.launch import free_port

    port = [free_port() if rank == 0 else 0]
    dist.broadcast_object_list(port, src=0)
    g = init_refit_group("127.0.0.1", port[0], rank, WORLD, backend="gloo", secret=b"integrity-" * 4, timeout=TIMEOUT)
    log, undo = _settles()
    try:
        res = dense(rank, "flip", g=g)
    finally:
        undo()
        g.barrier()
        g.destroy()
    res["settles"] = log
    return res


SCENARIOS = {
    "clean": clean_counts,
    "refit_group_flip": refit_group,
    "flip": lambda r: dense(r, "flip"),
    "drop": lambda r: dense(r, "drop"),
    "swap": lambda r: dense(r, "swap"),
    "after_unpack": lambda r: dense(r, "after_unpack"),
    "flip_digest_off": lambda r: dense(r, "flip", digest=False),
    "delta_flip": delta,
    "mxfp8_flip": lambda r: quant(r, "mxfp8"),
    "nvfp4_flip": lambda r: quant(r, "nvfp4"),
    "relay_flip": relay,
    "flip_triton": lambda r: triton_flip(r),
    "mxfp8_flip_triton": lambda r: triton_quant(r, "mxfp8"),
    "nvfp4_flip_triton": lambda r: triton_quant(r, "nvfp4"),
    "fp8_flip_triton": lambda r: triton_quant(r, "fp8"),
    "delta_flip_triton": lambda r: triton_delta(r),
}


def triton_delta(rank: int) -> dict:
    """``delta`` with the Triton backend (interpreted on CPU): the delta messages are the encode kernels', which
    hash what they write (counted: ``hashed``), and the flipped bit is caught; the next refit goes dense."""
    from triton_reshard.execute import strategies

    os.environ["TRITON_INTERPRET"] = "1"
    real, hashed = strategies.triton_pack_digest, []

    def counting(*a, **k):
        got = real(*a, **k)
        hashed.append(1)
        return got

    strategies.triton_pack_digest = counting
    try:
        out = delta(rank, backend="triton")
    finally:
        strategies.triton_pack_digest = real
    out["hashed"] = len(hashed)
    return out


def triton_quant(rank: int, fmt: str) -> dict:
    """``quant`` with the Triton backend (interpreted on CPU, after ``flip_triton``): the quantizing packs are
    the digesting kernels' (counted: ``fused_quant``, the quantizations that hashed in their pass), the staged
    pieces of destination-quantized chunks land with the digesting unpack, and the flipped bit is caught."""
    from triton_reshard.execute import integrity

    os.environ["TRITON_INTERPRET"] = "1"
    real, fused = integrity.Ledger.add_hashed, []

    def counting(self, *a, **k):
        fused.append(1)
        return real(self, *a, **k)

    integrity.Ledger.add_hashed = counting
    try:
        out = quant(rank, fmt, backend="triton")
    finally:
        integrity.Ledger.add_hashed = real
    out["fused_quant"] = len(fused)
    return out


def triton_flip(rank: int) -> dict:
    """``flip`` with the Triton copy backend (interpreted on CPU): the packs and unpacks are the digesting
    kernel's (counted: ``fused``, the fused copies that ran), and the flipped bit is still caught."""
    from triton_reshard.execute import integrity

    os.environ["TRITON_INTERPRET"] = "1"  # the last scenario: the others run on torch's copies
    real, fused = integrity.fused_copy, []

    def counting(*a, **k):
        got = real(*a, **k)
        fused.append(got is not None and a[-1] == "triton")
        return got

    integrity.fused_copy = counting
    try:
        out = dense(rank, "flip", backend="triton")
    finally:
        integrity.fused_copy = real
    out["fused"] = sum(fused)
    return out


def world_main(rank: int, world: int, outdir: str) -> dict:
    out = {}
    for name, fn in SCENARIOS.items():
        try:
            out[name] = fn(rank)
        except Exception as e:  # report, keep going
            out[name] = {"crash": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
        torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))
    return out
