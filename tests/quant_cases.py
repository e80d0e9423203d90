"""Block-FP8 refit cases (issue 11) and the workers their gloo worlds run (importable by name for
``triton_reshard.testing.launch.run_world``).

Sources are Megatron-Core BF16 shards (``presets.megatron_layout``) or plain DTensor-style layouts; destinations
are vLLM's layouts (``presets.vllm_layout``) turned block-FP8 with ``block_quant_layout``. The expected bytes are
computed here without the planner: every quantized logical tensor is quantized whole with the torch reference
(``quant.quantize_blocks``, = vLLM's ``per_block_cast_to_fp8``) and sliced; the scales' places are derived from
the weights' boxes by this module's own arithmetic (``offset // block``), not read from the layout's scale
fragments. Destinations are poisoned (fp8 0x7F = NaN, scales NaN) so a byte nobody wrote fails.
"""

from __future__ import annotations

import dataclasses
import math
import os
import traceback
from dataclasses import dataclass, field

import torch

from triton_reshard import Layout, Replicate, Shard, block_quant_layout, plan_reshard
from triton_reshard.testing import synthetic_global

FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16
SUFFIX = "_scale_inv"


def is_linear(t) -> bool:
    """The tensors an FP8 checkpoint quantizes: every Linear weight (attention, MLP, experts); not the norms, the
    router gate, the embeddings or the LM head."""
    return t.name.endswith("proj.weight")


@dataclass(frozen=True)
class QCase:
    id: str
    world: int
    kind: str  # "preset" (block_quant_layout over vllm_layout), "preset-fp8" (vllm_layout of an FP8 config), "raw"
    model: str = ""
    src: dict = field(default_factory=dict)  # megatron_layout kwargs (preset) / description (raw)
    dst: dict = field(default_factory=dict)  # vllm_layout kwargs (preset) / description (raw)
    block: tuple[int, ...] = (16, 16)
    ue8m0: bool = False
    bucket_bytes: int = 64 << 10
    modes: tuple[str, ...] = ("src",)  # the quantization modes the plan must use
    src_dtype: torch.dtype = BF16
    instances: int = 1  # refit(..., instances=n): n engines, each a copy of ``dst`` (relays off for fp8)
    layers: int | None = None  # preset cases: the model's num_hidden_layers, if not the preset's


def _cases() -> list[QCase]:
    c = []
    # world 4
    c.append(QCase("dense-tp2pp2-to-vllm-tp2dp2-colocated", 4, "preset", "tiny_llama",
                   dict(tp=2, pp=2, ranks=range(4)), dict(tp=2, dp=2, ranks=range(4))))
    # Megatron TP4 MLP shards are 24 rows: blocks of 16 straddle them (destination-side quantization), the
    # experts' ETP4 shards of 8 rows too; q/k/o shards are whole blocks (source-side)
    c.append(QCase("moe-tp4-to-vllm-tp2dp2-ep-colocated", 4, "preset", "tiny_qwen3_moe",
                   dict(tp=4, ranks=range(4)), dict(tp=2, dp=2, enable_expert_parallel=True, ranks=range(4)),
                   modes=("src", "dst")))
    # vLLM's own FP8 preset (quantization_config fp8, weight_block_size [16, 16]: the router is FP8 too)
    c.append(QCase("moe-tp2-to-vllm-fp8-config-tp2-disagg", 4, "preset-fp8", "tiny_qwen3_moe",
                   dict(tp=2, ranks=range(2)), dict(tp=2, dp=1, ranks=range(2, 4)), modes=("src",)))
    c.append(QCase("dense-tp2-to-vllm-tp2-disagg", 4, "preset", "tiny_llama",
                   dict(tp=2, ranks=range(2)), dict(tp=2, dp=1, ranks=range(2, 4)), bucket_bytes=4096))
    # fp32 source, UE8M0 scales, a 24-row TP split under blocks of 16 into a column split, partial edge blocks
    c.append(QCase("raw-fp32-rows24-to-cols-ue8m0", 4, "raw", "",
                   dict(shapes={"a.proj.weight": (48, 64), "b.proj.weight": (20, 31)}, mesh=[0, 1], pl=[Shard(0)]),
                   dict(shapes={"a.proj.weight": (48, 64), "b.proj.weight": (20, 31)}, mesh=[2, 3], pl=[Shard(1)]),
                   ue8m0=True, modes=("src", "dst"), src_dtype=torch.float32, bucket_bytes=1024))
    # world 8
    c.append(QCase("moe-tp4pp2-to-vllm-tp2dp4-colocated", 8, "preset", "tiny_qwen3_moe",
                   dict(tp=4, pp=2, ranks=range(8)),
                   dict(tp=2, dp=4, enable_expert_parallel=True, ranks=range(8)), modes=("src", "dst")))
    c.append(QCase("dense-tp4-to-vllm-tp2dp2-disagg", 8, "preset", "tiny_llama",
                   dict(tp=4, ranks=range(4)), dict(tp=2, dp=2, ranks=range(4, 8)), modes=("src", "dst"),
                   bucket_bytes=8192))
    c.append(QCase("moe-tp2pp2-ep2-to-vllm-tp2dp2-ep-disagg", 8, "preset", "tiny_qwen3_moe",
                   dict(tp=2, pp=2, ep=2, etp=1, ranks=range(4)),
                   dict(tp=2, dp=2, enable_expert_parallel=True, ranks=range(4, 8))))
    # replicas 0-3 -> TP4 on ranks 3-6: rank 3 quantizes its own shard locally, the others get fp8 from a replica
    # three engines, each vLLM TP2, fed by Megatron TP2 on ranks 0-1 (refit's instances=3; fp8 is not relayed)
    c.append(QCase("dense-tp2-to-3x-vllm-tp2-instances", 8, "preset", "tiny_llama",
                   dict(tp=2, ranks=range(2)), dict(tp=2, dp=1, ranks=range(2, 4)), instances=3))
    c.append(QCase("replicated-to-tp4-partly-colocated-block8x16", 8, "raw", "",
                   dict(shapes={"w.proj.weight": (64, 48), "v.proj.weight": (32, 20)}, mesh=[0, 1, 2, 3],
                        pl=[Replicate()]),
                   dict(shapes={"w.proj.weight": (64, 48), "v.proj.weight": (32, 20)}, mesh=[3, 4, 5, 6],
                        pl=[Shard(0)]), block=(8, 16)))
    return c


CASES: dict[str, QCase] = {c.id: c for c in _cases()}


def case_ids(world: int) -> list[str]:
    return [c.id for c in CASES.values() if c.world == world]


def layouts(case: QCase) -> tuple[Layout, Layout]:
    """(BF16 source, block-FP8 destination) of ``case``."""
    if case.kind in ("preset", "preset-fp8"):
        from triton_reshard.presets import get_config, megatron_layout, vllm_layout

        cfg = dict(get_config(case.model))
        if case.layers:
            cfg["num_hidden_layers"] = case.layers
        src = megatron_layout(cfg, dtype=case.src_dtype, **case.src)
        if case.kind == "preset-fp8":
            cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                          "weight_block_size": list(case.block)}
            return src, vllm_layout(cfg, dtype=BF16, vllm_version="0.33.0", **case.dst)
        plain = vllm_layout(cfg, dtype=BF16, vllm_version="0.33.0", **case.dst)
    else:
        s, d = case.src, case.dst
        src = Layout.from_placements(s["shapes"], s["mesh"], s["pl"], case.src_dtype)
        plain = Layout.from_placements(d["shapes"], d["mesh"], d["pl"], BF16)
    return src, block_quant_layout(plain, is_linear, case.block, ue8m0=case.ue8m0)


def case_plan(case: QCase):
    src, dst = layouts(case)
    if case.instances > 1:
        return plan_reshard(src, dst.instances(case.instances), relay=False)
    return plan_reshard(src, dst)


# --------------------------------------------------------------------------------------------------------
# Data and the independent expectation
# --------------------------------------------------------------------------------------------------------


def global_data(src: Layout, version: int) -> dict[str, torch.Tensor]:
    """Synthetic source tensors whose block maxima differ from block to block (a smooth ramp times values in
    [-1, 1]), with one all-zero stretch (the scale floor) per tensor of more than 64 rows."""
    out = {}
    for t in src.tensors:
        g = synthetic_global(f"{t.name}#v{version}", t.shape, torch.float32) / 32768
        if t.dtype.is_floating_point and t.shape:
            ramp = torch.linspace(0.01, 50.0, g.numel(), dtype=torch.float32).reshape(g.shape)
            g = g * ramp
            if len(t.shape) == 2 and t.shape[0] > 64:
                g[16:32, :16] = 0
        out[t.name] = g.to(t.dtype)
    return out


def src_locals(src: Layout, rank: int, data) -> dict[str, torch.Tensor]:
    out = {n: torch.zeros(s.shape, dtype=s.dtype) for n, s in src.local_specs(rank).items()}
    for f in src.fragments:
        if f.rank == rank and f.numel:
            loc = out[f.local]
            extra = loc.dim() - len(f.sizes)
            idx = tuple(f.local_offsets[:extra]) + tuple(slice(o, o + n) for o, n in
                                                          zip(f.local_offsets[extra:], f.sizes, strict=True))
            loc[idx] = data[f.tensor][tuple(slice(o, o + n) for o, n in zip(f.offsets, f.sizes, strict=True))]
    return out


def poison_(t: torch.Tensor, pattern: int = 0) -> torch.Tensor:
    """NaN everywhere (fp8 0x7F / 0xFF, float NaN; pattern 1: all bits set)."""
    if t.numel():
        if t.dtype == FP8:
            t.view(torch.uint8).fill_(0xFF if pattern else 0x7F)
        elif pattern:
            t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]).fill_(-1)
        else:
            t.fill_(float("nan"))
    return t


def dst_locals(dst: Layout, rank: int, pattern: int = 0) -> dict[str, torch.Tensor]:
    return {n: poison_(torch.empty(s.shape, dtype=s.dtype), pattern) for n, s in dst.local_specs(rank).items()}


def expected(case: QCase, dst: Layout, rank: int, data, pattern: int = 0) -> dict[str, torch.Tensor]:
    """What ``rank``'s destination tensors must hold: poison, then every weight box of the destination layout
    filled with the reference quantization of the whole logical tensor (values and, at ``offset // block`` in
    ``local + "_scale_inv"``, scales), plain tensors with the data cast."""
    from triton_reshard.ops.quantize import quantize_blocks

    out = dst_locals(dst, rank, pattern)
    ref: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for f in dst.fragments:
        if f.rank != rank or not f.numel or f.tensor.endswith(SUFFIX):
            continue
        box = tuple(slice(o, o + n) for o, n in zip(f.offsets, f.sizes, strict=True))
        loc = out[f.local]
        extra = loc.dim() - len(f.sizes)
        lidx = tuple(f.local_offsets[:extra]) + tuple(
            slice(o, o + n) for o, n in zip(f.local_offsets[extra:], f.sizes, strict=True))
        spec = dst.specs[f.tensor]
        if spec.quant is None:
            loc[lidx] = data[f.tensor][box].to(loc.dtype)
            continue
        b = spec.quant.block
        assert b == case.block and spec.quant.ue8m0 == case.ue8m0, (f.tensor, spec.quant)
        if f.tensor not in ref:
            ref[f.tensor] = quantize_blocks(data[f.tensor], b, case.ue8m0)
        q, s = ref[f.tensor]
        loc.view(torch.uint8)[lidx] = q.view(torch.uint8)[box]
        s_box = tuple(slice(o // k, -(-(o + n) // k)) for o, n, k in zip(f.offsets, f.sizes, b, strict=True))
        sloc = out[f.local + SUFFIX]
        s_lidx = tuple(f.local_offsets[:extra]) + tuple(
            slice(o // k, o // k + (sl.stop - sl.start)) for o, k, sl in zip(f.local_offsets[extra:], b, s_box,
                                                                            strict=True))
        sloc[s_lidx] = s[s_box]
    return out


def mismatch(got: torch.Tensor, want: torch.Tensor, what: str) -> str | None:
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{what}: got {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}"
    ib = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    bad = got.contiguous().view(ib) != want.contiguous().view(ib)
    if not bool(bad.any()):
        return None
    idx = tuple(int(i) for i in bad.nonzero()[0])
    return (f"{what}: {int(bad.sum())} of {bad.numel()} elements differ; first at {idx}: got "
            f"{got[idx].float().item()!r}, want {want[idx].float().item()!r}")


# --------------------------------------------------------------------------------------------------------
# The worker
# --------------------------------------------------------------------------------------------------------


def _check(case, dst, rank, got, data, pattern, what) -> list[str]:
    want = expected(case, dst, rank, data, pattern)
    out = []
    for n in sorted(want):
        m = mismatch(got[n], want[n], f"{case.id}: {what}: rank {rank} {n!r}")
        if m:
            out.append(m)
    return out


def run_case(case: QCase, rank: int) -> dict:
    """Three refits and two verifies of ``case`` on this rank:

    1. ``refit`` into fresh poisoned destinations, compared byte for byte with the reference;
    2. new source data written into the same tensors, destinations re-poisoned (all bits set), the same
       ``Resharder`` again (cached views and staging reused), compared;
    3. ``verify_refit`` on the result: 0 mismatches; then one fp8 byte and one scale changed on every rank that
       holds quantized tensors: exactly those two counted;
    4. column-major destination tensors, a fresh Resharder: compared;
    5. ``overlap=True`` and ``direct_min_bytes=0`` (in-place sends and receives, two staging slots): compared.
    """
    from triton_reshard import Resharder, refit, verify_refit

    src_l, one = layouts(case)
    n_inst = case.instances
    dst_l = one.instances(n_inst) if n_inst > 1 else one  # what this world holds (refit takes one engine's layout + n)
    plan = case_plan(case)
    problems: list[str] = []
    data = global_data(src_l, 0)
    src_t = src_locals(src_l, rank, data)
    dst_t = dst_locals(dst_l, rank)
    refit(src_t, dst_t, src_l, one, bucket_bytes=case.bucket_bytes, timeout=60, instances=n_inst)
    problems += _check(case, dst_l, rank, dst_t, data, 0, "refit 1")
    data = global_data(src_l, 1)
    for n, t in src_locals(src_l, rank, data).items():
        src_t[n].copy_(t)
    for t in dst_t.values():
        poison_(t, 1)
    r = Resharder(plan, bucket_bytes=case.bucket_bytes, timeout=60)
    rep = r.run(src_t, dst_t)
    problems += _check(case, dst_l, rank, dst_t, data, 1, "run 2 (reused)")
    rep2 = r.run(src_t, dst_t)
    problems += _check(case, dst_l, rank, dst_t, data, 1, "run 3 (same tensors again)")
    v = verify_refit(src_t, dst_t, src_l, one, bucket_bytes=case.bucket_bytes, timeout=60, instances=n_inst)
    if not v.ok:
        problems.append(f"{case.id}: verify after refit: {v}")
    # corrupt one fp8 byte and one scale of the first quantized local tensor this rank holds
    qnames = sorted(n for n, s in dst_l.local_specs(rank).items() if s.dtype == FP8 and math.prod(s.shape))
    flipped = {}
    if qnames:
        q, s = dst_t[qnames[0]], dst_t[qnames[0] + SUFFIX]
        flat_q, flat_s = q.view(torch.uint8).view(-1), s.view(-1)
        flat_q[0] ^= 0x01
        flat_s[-1] = flat_s[-1] * 2
        flipped = {qnames[0]: 1, qnames[0] + SUFFIX: 1}
    v2 = verify_refit(src_t, dst_t, src_l, one, bucket_bytes=case.bucket_bytes, timeout=60, instances=n_inst)
    if v2.mismatches != flipped:
        problems.append(f"{case.id}: verify after corrupting {flipped}: counted {v2.mismatches}\n{v2}")
    # column-major destinations: every view strided, staging and quantized outputs through strides
    cm = {n: poison_(torch.empty(tuple(reversed(t.shape)), dtype=t.dtype).t() if t.dim() == 2 else torch.empty_like(t))
          for n, t in dst_t.items()}
    Resharder(plan, bucket_bytes=case.bucket_bytes, timeout=60).run(src_t, cm)
    problems += _check(case, dst_l, rank, cm, data, 0, "run 4 (column-major destinations)")
    # overlap (two staging slots) with every contiguous chunk a direct message: straddling pieces received in
    # place into the regions' staging, sent in place from the sources
    for t in dst_t.values():
        poison_(t, 1)
    rd = Resharder(plan, bucket_bytes=case.bucket_bytes, timeout=60, overlap=True, direct_min_bytes=0)
    rep5 = rd.run(src_t, dst_t)
    problems += _check(case, dst_l, rank, dst_t, data, 1, "run 5 (overlap, direct messages)")
    return {"problems": problems, "steps": rep.steps, "staging": rep2.staging_bytes, "verify_total": v2.total_mismatches,
            "flipped": len(flipped), "in_place": rep5.in_place_bytes}


def quant_world_main(rank: int, world: int, ids: list[str]) -> dict:
    """``ids``' cases on this rank. Under the Triton backend (the interpreter runs one program per block, one
    after another) a preset case's model has one layer: its second layer repeats the first's tensor kinds
    (no pipeline split in the Triton cases). Measured loaded (session 54): the MoE case's time went from 6.0x
    to 4.6x the unchanged raw case's in the same world (perf/results/h-ci_s54.json)."""
    triton = os.environ.get("TRITON_RESHARD_BACKEND") == "triton"
    out = {}
    for cid in ids:
        case = CASES[cid]
        if triton and case.kind != "raw" and "pp" not in case.src:
            case = dataclasses.replace(case, layers=1)
        try:
            out[cid] = run_case(case, rank)
        except Exception as e:  # the other ranks of this case fail too (timeouts); report every rank's error
            out[cid] = {"problems": [f"{cid}: rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"]}
            break
    return out


class Worlds:
    """The gloo worlds of a case worker (``main(rank, world, ids)``), spawned once per ``(world size, triton)`` and
    cached: the torch copy backend, or the Triton kernels under ``TRITON_INTERPRET=1`` for ``triton_ids``. The
    block-FP8 and the MXFP8 / NVFP4 refit tests share it."""

    def __init__(self, main, case_ids, triton_ids) -> None:
        self.main, self.case_ids, self.triton_ids = main, case_ids, triton_ids
        self.cache: dict = {}

    def spawn(self, world: int, ids: list[str], triton: bool) -> list:
        from triton_reshard.testing.launch import run_world

        env = {"TRITON_INTERPRET": "1", "TRITON_RESHARD_BACKEND": "triton"} if triton else {"TRITON_RESHARD_BACKEND": None}
        return run_world(self.main, world, ids, timeout=900, pg_timeout=120, allow_errors=True, env=env)

    def __call__(self, key: tuple) -> list[dict]:
        import pytest

        if key not in self.cache:
            world, triton = key
            self.cache[key] = self.spawn(world, self.triton_ids if triton else self.case_ids(world), triton)
        results = self.cache[key]
        failed = {r: v for r, v in enumerate(results) if not isinstance(v, dict)}
        if failed:
            pytest.fail(f"world {key} failed: " + "\n".join(f"rank {r}: {v}" for r, v in failed.items()))
        return results
