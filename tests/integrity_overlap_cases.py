"""Worker side of ``test_integrity_overlap.py`` (issue 46): the digest exchange of a delta refit is posted before
the last step's apply and runs while it does (``StepLoop.apply``). One spawned gloo world of 4 runs delta refits of
several steps through the public ``refit`` and records, per rank, the order of the events (the digest round
posted, each delta message applied, in which step), the posts each rank makes in the round, and what every rank
raised when the victim's LAST step is corrupted: a changed value (the decode accepts it) or a broken header (the
decode refuses it, after the round was posted)."""

from __future__ import annotations

import os
import traceback
from datetime import timedelta

import torch

from triton_reshard import Layout, Shard, refit, refit_state

WORLD = 4
TIMEOUT = 20.0  # seconds: every wait (a hang is a failure, not a pass)
SHAPES = {f"t{k}": (64, 32) for k in range(4)}
# all-to-all (rows to columns): every rank receives a block of every tensor from every other rank
SRC = Layout.from_placements(SHAPES, list(range(WORLD)), {n: [Shard(0)] for n in SHAPES})
DST = Layout.from_placements(SHAPES, list(range(WORLD)), {n: [Shard(1)] for n in SHAPES})
BUCKET = 2048  # bytes per step: the refit takes several steps
VICTIM = 1


APPLY_RAISES = "apply_raises"  # the victim's first delta apply of its last step raises (a bug, not corruption)


def versions() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(4646)
    base = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    out = [base]
    for v in (1, 2, 3):
        nxt = {n: t.clone() for n, t in out[-1].items()}
        for t in nxt.values():
            t.view(-1)[v::5] += 0.5  # every block of every tensor has changed elements: every message is a delta
        out.append(nxt)
    return out


def flip_value(msg: torch.Tensor) -> None:
    """One bit of the first changed value of the message's first chunk (format v2 "narrow" or v1 kinds): the
    decode accepts it and writes a wrong element."""
    head = msg[:16].view(torch.int32).tolist()
    offs = msg[16 : 16 + 8 * head[2]].view(torch.int64).tolist()
    for off in offs:
        kind_es, numel, count, _nbytes = msg[off : off + 16].view(torch.int32).tolist()
        if not count:
            continue
        kind, body = kind_es & 0xFF, off + 16
        if kind == 3:  # narrow: 2-byte block descriptors, then each changed block's indices or mask and values
            nb = -(-numel // 256)
            for k in range(nb):
                code_mode = int(msg[body + 2 * k])
                if code_mode:
                    n, mode, blen = int(msg[body + 2 * k + 1]) + 1, code_mode >> 4, min(256, numel - 256 * k)
                    lead = n if mode == 0 else -(-blen // 8) if mode == 1 else 0
                    msg[body + 2 * nb + lead] ^= 0x01
                    return
        body += -(-2 * count // 16) * 16 if kind == 2 else -(-4 * -(-numel // 32) // 16) * 16 if kind == 1 else 0
        msg[body] ^= 0x01
        return
    raise AssertionError("a delta message with no changed element")


def break_header(msg: torch.Tensor) -> None:
    """The chunk count of the message's header made impossible: the decode refuses the message."""
    msg[8:12].view(torch.int32)[0] = 1000


class Recorder:
    """Patches (undone by :meth:`undo`): the events of this process's refits in order, ``("round",)`` when the
    digest exchange is posted, ``("apply", last)`` per delta message applied (``last``: in the run's last
    step); the messages each digest round sends (``posts``, per refit); and, on the victim, ``fault`` applied
    to its first delta message of its last step once it arrived (before anything reads it), or with
    ``APPLY_RAISES`` its first delta apply of its last step raising."""

    def __init__(self, fault=None) -> None:
        from triton_reshard import ops
        from triton_reshard.execute import integrity, steps, strategies

        self.events: list = []
        self.posts: list[int] = []
        self.fault, self.fired, self.step = fault, 0, None
        self.undos = []
        state = {"last": False}
        rec = self

        def patch(owner, name, make):
            real = getattr(owner, name)
            setattr(owner, name, make(real))
            self.undos.append(lambda: setattr(owner, name, real))

        def finish(real):
            def f(loop, p):
                state["last"] = p.pos == len(loop.work.steps) - 1
                return real(loop, p)
            return f

        def land(real):
            def f(strategy, loop, pos):
                if callable(rec.fault) and not rec.fired and pos == len(loop.work.steps) - 1:
                    rec.fired, rec.step = 1, loop.work.steps[pos][0] + 1
                    rec.fault(strategy.inbox[pos][0])
                return real(strategy, loop, pos)
            return f

        def unpack(real):
            def f(*a, **k):
                rec.events.append(("apply", state["last"]))
                if rec.fault == APPLY_RAISES and state["last"] and not rec.fired:
                    rec.fired = 1
                    raise RuntimeError("injected: the apply raised on a message that verifies")
                return real(*a, **k)
            return f

        def counted(link, fn, *a):  # the messages this rank sends inside fn (posts of the digest round)
            comm = link.comm
            if "post" in vars(comm):  # already counting (a post made inside settle)
                return fn(link, *a)
            post = comm.post

            def counting(sends, recvs):
                rec.posts[-1] += len(sends)
                return post(sends, recvs)

            comm.post = counting
            try:
                return fn(link, *a)
            finally:
                del comm.post

        def gather(real):  # the digest round's post
            def f(link, *a):
                rec.events.append(("round",))
                return counted(link, real, *a)
            return f

        def settle(real):
            def f(ledger, link):
                return counted(link, lambda lk: real(ledger, lk))
            return f

        patch(steps.StepLoop, "finish", finish)
        patch(strategies.Delta, "land", land)
        patch(ops, "unpack_delta", unpack)
        patch(integrity, "post_gather", gather)
        patch(integrity.Ledger, "settle", settle)

    def refit(self, fn):
        self.events.append(("refit",))
        self.posts.append(0)
        return fn()

    def undo(self) -> None:
        for u in reversed(self.undos):
            u()


def _caught(fn) -> dict:
    try:
        report = fn()
        return {"error": None, "mode": report.mode}
    except Exception as e:
        return {"error": type(e).__name__, "message": str(e), "torn": list(getattr(e, "torn", ())),
                "sender": getattr(e, "sender", None), "receiver": getattr(e, "receiver", None),
                "tensor": getattr(e, "tensor", None), "step": getattr(e, "step", None),
                "context": type(e.__context__).__name__ if e.__context__ is not None else None}


def scenario(rank: int, fault) -> dict:
    """Version 0 dense (the snapshot), 1 a delta (``fault`` on the victim's last step), 2 a delta request
    (dense after a failure: the repair), 3 a delta again; each compared bit for bit with slicing by hand."""
    import torch.distributed as dist

    g = dist.new_group(list(range(WORLD)), timeout=timedelta(seconds=60))
    data = versions()
    dst = {n: torch.full(s.shape, float("nan")) for n, s in DST.local_specs(rank).items()}
    rec = Recorder(fault if rank == VICTIM else None)
    out: dict = {}
    try:
        for v in range(4):
            out[f"v{v}"] = _caught(lambda v=v: rec.refit(lambda: refit(
                SRC.shard(data[v], rank), dst, SRC, DST, group=g, timeout=TIMEOUT, version=v, delta=True,
                bucket_bytes=BUCKET)))
            want = DST.shard(data[v], rank)
            out[f"v{v}_ok"] = all(torch.equal(dst[n].view(torch.int32), want[n].view(torch.int32)) for n in want)
            if v == 1:
                s = refit_state(DST)
                out["state"] = {"torn": s.torn, "torn_tensors": list(s.torn_tensors)}
    finally:
        rec.undo()
    out.update(events=rec.events, posts=rec.posts, fired=rec.fired, step=rec.step)
    return out


SCENARIOS = {"clean": None, "last_flip": flip_value, "bad_header": break_header, APPLY_RAISES: APPLY_RAISES}


def world_main(rank: int, world: int, outdir: str) -> dict:
    out = {}
    for name, fault in SCENARIOS.items():
        try:
            out[name] = scenario(rank, fault)
        except Exception as e:  # report, keep going
            out[name] = {"crash": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
        torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))
    return out
