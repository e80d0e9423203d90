"""Single-process simulation: loop over ranks and apply a plan with plain torch slicing, then compare every
destination local tensor bit for bit with slices of the global tensors (computed by ``dist_cases``' own
reference, not by ``Layout.shard``). Two levels:

* transfers: every wire transfer and local copy as one slice assignment (``Transfer.src_offsets`` /
  ``dst_offsets`` / ``sizes``; local tensors may have extra leading dims);
* schedule: per step, each rank packs its messages into a byte staging area at the offsets
  ``Schedule.for_rank`` gives, the bytes are "sent" to the peer's receive area, and unpacked there.

Plus ``Resharder.run`` itself on one-rank plans (no process group) with strided views as local tensors.
"""

from __future__ import annotations

import math

import pytest
import torch

from triton_reshard import Fragment, Layout, Resharder, plan_reshard
from triton_reshard.plan import DIRECT_MIN_BYTES

from . import dist_cases as dc
from .dist_cases import S0, S1, S2, Case, F, P, R

F32, BF16 = torch.float32, torch.bfloat16


def _gqa_interleaved() -> F:
    """k and v [4 heads * 2 dims, 3] on one rank, interleaved per head in local 'kv': k0 v0 k1 v1 ..."""
    frags = []
    for h in range(4):
        frags.append(("k", 5, (2 * h, 0), (2, 3), "kv", (4 * h, 0)))
        frags.append(("v", 5, (2 * h, 0), (2, 3), "kv", (4 * h + 2, 0)))
    return F({"k": ((8, 3), F32), "v": ((8, 3), F32)}, tuple(frags), {(5, "kv"): (16, 3)})


def _padded_vocab() -> F:
    """An [11, 4] embedding in two vocab shards of 6 rows each (the last one padded with one row)."""
    return F({"emb": ((11, 4), BF16)},
             (("emb", 2, (0, 0), (6, 4), "emb", (0, 0)), ("emb", 3, (6, 0), (5, 4), "emb", (0, 0))),
             {(2, "emb"): (6, 4), (3, "emb"): (6, 4)})


SIM_ONLY = [
    Case("scalar-0d", 0, (P({"s": ()}, [0, 1, 2], [R]),), (P({"s": ()}, [3, 4], [R]),)),
    Case("gqa-interleaved-from-tp2", 0, (P({"k": (8, 3), "v": (8, 3)}, [5, 6], [S0]),), (_gqa_interleaved(),)),
    Case("gqa-interleaved-to-tp4", 0, (_gqa_interleaved(),), (P({"k": (8, 3), "v": (8, 3)}, [0, 1, 2, 3], [S1]),)),
    Case("padded-vocab-to-tp3", 0, (_padded_vocab(),), (P({"emb": (11, 4)}, [0, 1, 2], [S0], BF16),)),
    Case("tp2-to-padded-vocab", 0, (P({"emb": (11, 4)}, [3, 2], [S1], BF16),), (_padded_vocab(),)),
    Case("16-ranks-3d-to-1d", 0, (P({"w": (8, 6, 4)}, torch.arange(16).reshape(2, 2, 4).tolist(), [S0, S2, S1]),),
         (P({"w": (8, 6, 4)}, list(reversed(range(16))), [S2]),), bucket_bytes=256),
    Case("stacked-regrouped", 0, (dc.stacked_experts({0: 0, 1: 0, 2: 0, 3: 1}, 3, 5, torch.int32),),
         (dc.stacked_experts({0: 1, 1: 2, 2: 1, 3: 0}, 3, 5, torch.int32, pad=2),)),
    Case("fp32-to-bf16-cast", 0, (P({"w": (6, 5)}, [0, 1], [S0], F32),), (P({"w": (6, 5)}, [1, 2], [S1], BF16),),
         allow_cast=True),
]
ALL = list(dc.CASES.values()) + SIM_ONLY
PARAMS = [pytest.param(c, id=c.id) for c in ALL]


def _ranks(case):
    return dc.case_ranks(case.src, case.dst)


def _data(case, version=0):
    sspecs, dspecs = dc.side_specs(case.src), dc.side_specs(case.dst)
    return dc.global_data(sspecs, version), dc.global_data(sspecs, version, cast=dspecs)


def _expect(case, ranks, dst_data, pattern=0):
    return {r: dc.build_locals(case.dst, r, dst_data, pattern) for r in ranks}


def _compare(case, ranks, got, want):
    problems = [m for r in ranks for n in want[r] if (m := dc.mismatch(got[r][n], want[r][n], f"{case.id}: rank {r} {n!r}"))]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("case", PARAMS)
def test_sim_transfers(case):
    plan = dc.case_plan(case)
    ranks = _ranks(case)
    src_data, dst_data = _data(case)
    src_t = {r: dc.build_locals(case.src, r, src_data, 0) for r in ranks}
    dst_t = {r: dc.build_locals(case.dst, r, None, 0) for r in ranks}
    dc.apply_plan(plan, src_t, dst_t)
    _compare(case, ranks, dst_t, _expect(case, ranks, dst_data))


def simulate_schedule(plan, bucket, src_t, dst_t, direct_min_bytes=DIRECT_MIN_BYTES):
    """What every rank's Resharder does, step by step, with byte staging areas and plain slicing: each message
    staged at the offset ``Schedule.for_rank`` gives, the n-th message a rank sends a peer in a step received as
    the n-th message that peer receives from it (the order both sides post them in)."""
    sched = plan.schedule(bucket, direct_min_bytes)
    per_rank = {r: sched.for_rank(r) for r in plan.ranks}
    for t in plan.local_copies:
        s, d = src_t[t.src_rank][t.src_local], dst_t[t.dst_rank][t.dst_local]
        d[dc.sub_index(d.dim(), t.dst_offsets, t.sizes)] = s[dc.sub_index(s.dim(), t.src_offsets, t.sizes)]
    phase = 0
    for i, step in enumerate(sched.steps):
        assert step.phase >= phase, "relay steps come after all others"
        phase = step.phase
        send_area = {r: torch.full((per_rank[r][1],), 0xAB, dtype=torch.uint8) for r in plan.ranks}
        for r in plan.ranks:
            for _peer, at, m in per_rank[r][0][i].sends:
                for c in m.chunks:
                    t = plan.transfers[c.transfer]
                    assert t.relay == (step.phase == 1)
                    s = (dst_t if t.relay else src_t)[r][t.src_local]
                    buf = send_area[r][at + c.buffer_offset: at + c.buffer_offset + c.nbytes]
                    buf.view(t.wire_dtype).view(c.sizes).copy_(s[dc.sub_index(s.dim(), t.src_offsets, c.sizes, c.offsets)])
        for r in plan.ranks:
            recv_area = torch.full((per_rank[r][2],), 0xCD, dtype=torch.uint8)
            for peer in {p for p, _a, _m in per_rank[r][0][i].recvs}:
                got = [(a, m) for p, a, m in per_rank[r][0][i].recvs if p == peer]
                sent = [(a, m) for p2, a, m in per_rank[peer][0][i].sends if p2 == r]
                assert [m for _a, m in sent] == [m for _a, m in got], "sender and receiver disagree on the messages"
                for (at, m), (s_at, _m) in zip(got, sent, strict=True):
                    recv_area[at: at + m.payload] = send_area[peer][s_at: s_at + m.payload]
                    for c in m.chunks:
                        t = plan.transfers[c.transfer]
                        d = dst_t[r][t.dst_local]
                        buf = recv_area[at + c.buffer_offset: at + c.buffer_offset + c.nbytes]
                        d[dc.sub_index(d.dim(), t.dst_offsets, c.sizes, c.offsets)] = buf.view(t.wire_dtype).view(c.sizes)
    return sched


def _small(case) -> bool:
    """Under 64 KiB of source data: small enough to run with a 256-byte bucket (a chunk of at most 128 bytes
    per step and rank; a case of megabytes would take hundreds of thousands of steps)."""
    specs = dc.side_specs(case.src)
    return sum(math.prod(shape) * torch.empty((), dtype=dt).element_size() for shape, dt in specs.values()) < 64 << 10


SCHEDULE_PARAMS = [pytest.param(c, None, id=f"{c.id}-case-bucket") for c in ALL] + [
    pytest.param(c, 256, id=f"{c.id}-bucket-256") for c in ALL if _small(c)
]


@pytest.mark.parametrize("direct", [pytest.param(DIRECT_MIN_BYTES, id="packed"), pytest.param(0, id="direct")])
@pytest.mark.parametrize(("case", "bucket"), SCHEDULE_PARAMS)
def test_sim_schedule(case, bucket, direct):
    plan = dc.case_plan(case)
    ranks = _ranks(case)
    src_data, dst_data = _data(case, version=1)
    src_t = {r: dc.build_locals(case.src, r, src_data, 1) for r in ranks}
    dst_t = {r: dc.build_locals(case.dst, r, None, 1) for r in ranks}
    sched = simulate_schedule(plan, bucket or case.bucket_bytes, src_t, dst_t, direct)
    _compare(case, ranks, dst_t, _expect(case, ranks, dst_data, pattern=1))
    if case.multi_step and bucket is None:
        assert len(sched.steps) > 1


# --------------------------------------------------------------------------------------------------------
# Resharder.run on one rank (no process group): local copies through the executor's own views
# --------------------------------------------------------------------------------------------------------


def test_resharder_one_rank_with_strided_views():
    """Source given as a transposed view and as a slice with a storage offset; destination a fused tensor
    that is itself a column slice of a bigger buffer. Only rank 0 is involved, so no process group."""
    src = Layout.from_placements({"a": (5, 7), "b": (4, 3)}, [0], [R], BF16)
    dst = Layout.from_fragments(
        {"a": ((5, 7), BF16), "b": ((4, 3), BF16)},
        [Fragment("a", 0, (0, 0), (5, 7), "ab", (0, 0)), Fragment("b", 0, (0, 0), (4, 3), "ab", (6, 0))],
    )
    g = {n: dc.synthetic_global(n, s, BF16) for n, s in (("a", (5, 7)), ("b", (4, 3)))}
    a_src = g["a"].t().contiguous().t()  # column-major storage
    big = torch.zeros(20, 3, dtype=BF16)
    big[7:11] = g["b"]
    b_src = big[7:11]  # nonzero storage offset
    assert not a_src.is_contiguous() and b_src.storage_offset() == 21
    buf = dc.poison_(torch.empty(10, 9, dtype=BF16))
    ab = buf[:, 1:8]  # the fused local tensor [10, 7], strided inside buf
    r = Resharder(plan_reshard(src, dst), bucket_bytes=4096, timeout=5)
    rep = r.run({"a": a_src, "b": b_src}, {"ab": ab})
    want = dc.poison_(torch.empty(10, 9, dtype=BF16))
    want[0:5, 1:8] = g["a"]
    want[6:10, 1:4] = g["b"]
    assert dc.mismatch(buf, want, "buf") is None
    assert rep.sent_bytes == rep.recv_bytes == 0 and rep.local_bytes == (35 + 12) * 2
    # the same tensors again, new data written in place: cached views must see it
    g2 = {n: dc.synthetic_global(n + "#2", s, BF16) for n, s in (("a", (5, 7)), ("b", (4, 3)))}
    a_src.copy_(g2["a"])
    b_src.copy_(g2["b"])
    r.run({"a": a_src, "b": b_src}, {"ab": ab})
    want[0:5, 1:8] = g2["a"]
    want[6:10, 1:4] = g2["b"]
    assert dc.mismatch(buf, want, "buf after second run") is None


def test_resharder_one_rank_stacked_experts_and_cast():
    src = Layout.from_placements({f"e{e}.w": (3, 4) for e in range(3)}, [0], [R], F32)
    dst = Layout.from_fragments(
        {f"e{e}.w": ((3, 4), BF16) for e in range(3)},
        [Fragment(f"e{e}.w", 0, (0, 0), (3, 4), "experts", (2 - e, 0, 0)) for e in range(3)],
        local_shapes={(0, "experts"): (4, 3, 4)},
    )
    g = {f"e{e}.w": dc.synthetic_global(f"e{e}.w", (3, 4), F32) for e in range(3)}
    out = {"experts": dc.poison_(torch.empty(4, 3, 4, dtype=BF16))}
    Resharder(plan_reshard(src, dst, allow_cast=True), bucket_bytes=4096, timeout=5).run(g, out)
    want = dc.poison_(torch.empty(4, 3, 4, dtype=BF16))
    for e in range(3):
        want[2 - e] = g[f"e{e}.w"].to(BF16)
    assert dc.mismatch(out["experts"], want, "experts") is None
