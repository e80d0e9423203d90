"""MXFP8 / NVFP4 refit cases (issue 33) and the worker their gloo worlds run (importable by name for
``triton_reshard.testing.launch.run_world``): the block-FP8 worlds of ``quant_cases`` in the other formats.

Sources are Megatron-Core BF16 shards (``presets.megatron_layout``) or plain layouts; destinations are vLLM's
layouts turned quantized with ``block_quant_layout(..., format=...)`` (or, ``kind="preset-cfg"``, ``vllm_layout``
of a config whose ``quantization_config`` asks for the format). The expected bytes are computed here without the
planner: every quantized logical tensor is quantized whole with the format's torch reference and sliced; the
scales' places come from this module's own arithmetic (``offset // block``). Destinations are poisoned so a byte
nobody wrote fails.
"""

from __future__ import annotations

import math
import traceback
from dataclasses import dataclass, field

import torch

from triton_reshard import Layout, Shard, block_quant_layout, plan_reshard
from triton_reshard.layout import quant_format

from .quant_cases import BF16, global_data, is_linear, mismatch, poison_, src_locals
from .quant_cases import Worlds as Worlds  # the world cache of the refit tests

SUFFIX = "_scale"


@dataclass(frozen=True)
class FCase:
    id: str
    world: int
    fmt: str
    kind: str  # "preset" (block_quant_layout over vllm_layout), "preset-cfg" (vllm_layout of a quantized config), "raw"
    model: str = ""
    cfg: dict = field(default_factory=dict)  # config overrides (preset)
    src: dict = field(default_factory=dict)
    dst: dict = field(default_factory=dict)
    bucket_bytes: int = 64 << 10
    modes: tuple[str, ...] = ("src",)
    src_dtype: torch.dtype = BF16
    instances: int = 1


# dims that MXFP8 / NVFP4 take at vLLM TP2 (a row-parallel K of 64 per rank: whole 1x32 blocks)
WIDE = dict(intermediate_size=128, moe_intermediate_size=64)


def _cases() -> list[FCase]:
    c = []
    for fmt in ("mxfp8", "nvfp4"):
        # ETP4 experts' w2 shards (16 columns) straddle MXFP8's 1x32 blocks; NVFP4's 1x16 fit them
        straddle = ("src", "dst") if fmt == "mxfp8" else ("src",)
        c.append(FCase(f"{fmt}-dense-tp2pp2-to-vllm-tp2dp2-colocated", 4, fmt, "preset", "tiny_llama", WIDE,
                       dict(tp=2, pp=2, ranks=range(4)), dict(tp=2, dp=2, ranks=range(4))))
        c.append(FCase(f"{fmt}-moe-tp4-to-vllm-tp2dp2-ep-colocated", 4, fmt, "preset", "tiny_qwen3_moe", WIDE,
                       dict(tp=4, ranks=range(4)), dict(tp=2, dp=2, enable_expert_parallel=True, ranks=range(4)),
                       modes=straddle))
        # column shards of 48 (MXFP8) / 24 (NVFP4) values: blocks straddle them
        c.append(FCase(f"{fmt}-raw-fp32-cols48-to-rows", 4, fmt, "raw", "", {},
                       dict(shapes={"a.proj.weight": (40, 96), "b.proj.weight": (8, 64)},
                            mesh=[0, 1] if fmt == "mxfp8" else [0, 1, 2, 3], pl=[Shard(1)]),
                       dict(shapes={"a.proj.weight": (40, 96), "b.proj.weight": (8, 64)}, mesh=[2, 3], pl=[Shard(0)]),
                       modes=("src", "dst"), src_dtype=torch.float32, bucket_bytes=1024))
        c.append(FCase(f"{fmt}-moe-tp2-to-vllm-modelopt-config-tp2-disagg", 4, fmt, "preset-cfg", "tiny_qwen3_moe",
                       WIDE, dict(tp=2, ranks=range(2)), dict(tp=2, dp=1, ranks=range(2, 4))))
        c.append(FCase(f"{fmt}-moe-tp4pp2-to-vllm-tp2dp4-colocated", 8, fmt, "preset", "tiny_qwen3_moe", WIDE,
                       dict(tp=4, pp=2, ranks=range(8)),
                       dict(tp=2, dp=4, enable_expert_parallel=True, ranks=range(8)), modes=straddle))
        c.append(FCase(f"{fmt}-moe-tp2pp2-ep2-to-vllm-tp2dp2-ep-disagg", 8, fmt, "preset", "tiny_qwen3_moe", WIDE,
                       dict(tp=2, pp=2, ep=2, etp=1, ranks=range(4)),
                       dict(tp=2, dp=2, enable_expert_parallel=True, ranks=range(4, 8))))
        c.append(FCase(f"{fmt}-dense-tp2-to-3x-vllm-tp2-instances", 8, fmt, "preset", "tiny_llama", WIDE,
                       dict(tp=2, ranks=range(2)), dict(tp=2, dp=1, ranks=range(2, 4)), instances=3))
    return c


CASES: dict[str, FCase] = {c.id: c for c in _cases()}


def case_ids(world: int) -> list[str]:
    return [c.id for c in CASES.values() if c.world == world]


def layouts(case: FCase) -> tuple[Layout, Layout]:
    """(BF16 source, quantized destination) of ``case``."""
    if case.kind in ("preset", "preset-cfg"):
        from triton_reshard.presets import get_config, megatron_layout, vllm_layout

        cfg = dict(get_config(case.model), **case.cfg)
        src = megatron_layout(cfg, dtype=case.src_dtype, **case.src)
        if case.kind == "preset-cfg":  # vLLM's own preset of a ModelOpt config (the router gate quantized too)
            cfg["quantization_config"] = {"quant_method": "modelopt", "quantization": {
                "quant_algo": case.fmt.upper(), "group_size": 16, "kv_cache_quant_algo": None,
                "exclude_modules": ["lm_head"]}}
            return src, vllm_layout(cfg, dtype=BF16, vllm_version="0.33.0", **case.dst)
        plain = vllm_layout(cfg, dtype=BF16, vllm_version="0.33.0", **case.dst)
    else:
        s, d = case.src, case.dst
        src = Layout.from_placements(s["shapes"], s["mesh"], s["pl"], case.src_dtype)
        plain = Layout.from_placements(d["shapes"], d["mesh"], d["pl"], BF16)
    return src, block_quant_layout(plain, is_linear, None, format=case.fmt)


def case_plan(case: FCase):
    src, dst = layouts(case)
    if case.instances > 1:
        return plan_reshard(src, dst.instances(case.instances), relay=False)
    return plan_reshard(src, dst)


def dst_locals(dst: Layout, rank: int, pattern: int = 0) -> dict[str, torch.Tensor]:
    out = {}
    for n, s in dst.local_specs(rank).items():
        t = torch.empty(s.shape, dtype=s.dtype)
        if t.dtype == torch.uint8 and t.numel():
            t.fill_(0xA5 if pattern else 0x5A)  # E8M0 / packed bytes: no value a refit writes everywhere
        else:
            poison_(t, pattern)
        out[n] = t
    return out


def expected(case: FCase, dst: Layout, rank: int, data, pattern: int = 0) -> dict[str, torch.Tensor]:
    """What ``rank``'s destination tensors must hold: poison, then every weight box filled with the format's
    reference quantization of the whole logical tensor (values, and scales at ``offset // block`` in ``local +
    "_scale"``), plain tensors with the data cast."""
    from triton_reshard.ops.quantize import nvfp4_global_scale, reference

    fmt = quant_format(case.fmt)
    out = dst_locals(dst, rank, pattern)
    ref: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    gscale: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # group -> (gs, weight_scale_2)
    if fmt.global_scale:
        amax: dict[str, torch.Tensor] = {}
        for t in dst.quantized.values():
            a = data[t.name].abs().amax().float()
            g = t.quant.global_group
            amax[g] = torch.maximum(amax[g], a) if g in amax else a
        gscale = {g: nvfp4_global_scale(a) for g, a in amax.items()}
        owner = {t.quant.global_scale: t for t in dst.quantized.values()}
    for f in dst.fragments:
        if f.rank != rank or not f.numel or f.tensor.endswith(SUFFIX):
            continue
        if f.tensor.endswith(SUFFIX + "_2"):  # the global scale: weight_scale_2 of the tensor's group
            loc = out[f.local]
            loc[f.local_offsets[:loc.dim() - 1] + (slice(f.local_offsets[-1], f.local_offsets[-1] + 1),)] = \
                gscale[owner[f.tensor].quant.global_group][1]
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
        assert spec.quant.format is fmt, (f.tensor, spec.quant)
        b = (1,) * (len(spec.shape) - 1) + (fmt.block // fmt.pack,)
        assert spec.quant.block == b
        if f.tensor not in ref:
            gs = gscale[spec.quant.global_group][0] if fmt.global_scale else None
            ref[f.tensor] = reference(fmt, data[f.tensor], (fmt.block,), global_scale=gs)
        q, s = ref[f.tensor]
        loc.view(torch.uint8)[lidx] = q.view(torch.uint8)[box]
        s_box = tuple(slice(o // k, -(-(o + n) // k)) for o, n, k in zip(f.offsets, f.sizes, b, strict=True))
        sloc = out[f.local + SUFFIX]
        s_lidx = tuple(f.local_offsets[:extra]) + tuple(
            slice(o // k, o // k + (sl.stop - sl.start)) for o, k, sl in zip(f.local_offsets[extra:], b, s_box,
                                                                            strict=True))
        sloc[s_lidx] = s[s_box]
    return out


def _check(case, dst, rank, got, data, pattern, what) -> list[str]:
    want = expected(case, dst, rank, data, pattern)
    return [m for n in sorted(want) if (m := mismatch(got[n], want[n], f"{case.id}: {what}: rank {rank} {n!r}"))]


def run_case(case: FCase, rank: int) -> dict:
    """``refit`` into poisoned destinations; new data through the same ``Resharder`` twice; ``verify_refit``
    (0, then exactly one value byte and one scale byte corrupted); column-major destinations; overlap with
    direct messages. Each compared byte for byte with the reference."""
    from triton_reshard import Resharder, refit, verify_refit

    src_l, one = layouts(case)
    n_inst = case.instances
    dst_l = one.instances(n_inst) if n_inst > 1 else one
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
    dst_t = {n: t.copy_(w) for (n, t), w in zip(dst_t.items(), dst_locals(dst_l, rank, 1).values(), strict=True)}
    r = Resharder(plan, bucket_bytes=case.bucket_bytes, timeout=60)
    rep = r.run(src_t, dst_t)
    problems += _check(case, dst_l, rank, dst_t, data, 1, "run 2 (reused)")
    r.run(src_t, dst_t)
    problems += _check(case, dst_l, rank, dst_t, data, 1, "run 3 (same tensors again)")
    v = verify_refit(src_t, dst_t, src_l, one, bucket_bytes=case.bucket_bytes, timeout=60, instances=n_inst)
    if not v.ok:
        problems.append(f"{case.id}: verify after refit: {v}")
    fmt = quant_format(case.fmt)
    qnames = sorted(n for n, s in dst_l.local_specs(rank).items()
                    if s.dtype == fmt.value_dtype and not n.endswith((SUFFIX, SUFFIX + "_2")) and (n + SUFFIX) in dst_t
                    and math.prod(s.shape))
    flipped = {}
    if qnames:
        q, s = dst_t[qnames[0]], dst_t[qnames[0] + SUFFIX]
        q.view(torch.uint8).view(-1)[0] ^= 0x01
        s.view(torch.uint8).view(-1)[-1] ^= 0x01
        flipped = {qnames[0]: 1, qnames[0] + SUFFIX: 1}
    v2 = verify_refit(src_t, dst_t, src_l, one, bucket_bytes=case.bucket_bytes, timeout=60, instances=n_inst)
    if v2.mismatches != flipped:
        problems.append(f"{case.id}: verify after corrupting {flipped}: counted {v2.mismatches}\n{v2}")
    cm = {}
    for n, t in dst_locals(dst_l, rank).items():
        if t.dim() == 2:
            c = torch.empty(tuple(reversed(t.shape)), dtype=t.dtype).t()
            c.copy_(t)
            t = c
        cm[n] = t
    Resharder(plan, bucket_bytes=case.bucket_bytes, timeout=60).run(src_t, cm)
    problems += _check(case, dst_l, rank, cm, data, 0, "run 4 (column-major destinations)")
    dst_t = dst_locals(dst_l, rank, 1)
    rd = Resharder(plan, bucket_bytes=case.bucket_bytes, timeout=60, overlap=True, direct_min_bytes=0)
    rd.run(src_t, dst_t)
    problems += _check(case, dst_l, rank, dst_t, data, 1, "run 5 (overlap, direct messages)")
    return {"problems": problems, "steps": rep.steps, "verify_total": v2.total_mismatches, "flipped": len(flipped)}


def fmt_world_main(rank: int, world: int, ids: list[str]) -> dict:
    out = {}
    for cid in ids:
        try:
            out[cid] = run_case(CASES[cid], rank)
        except Exception as e:  # the other ranks of this case fail too (timeouts); report every rank's error
            out[cid] = {"problems": [f"{cid}: rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"]}
            break
    return out


def nonfinite_main(rank: int, world: int, values: list[float]) -> list[dict]:
    """Per value of ``values`` (inf, NaN), an NVFP4 refit from a source holding it on rank 1 (a fresh Resharder
    each: a refused one is broken): every rank raises naming the tensor group, before any byte of the refit
    moves (the destinations keep their poison)."""
    return [_nonfinite(rank, v) for v in values]


def _nonfinite(rank: int, value: float) -> dict:
    from triton_reshard import refit

    src = Layout.from_placements({"w.proj.weight": (8, 64)}, [0, 1], [Shard(0)], BF16)
    dst = block_quant_layout(Layout.from_placements({"w.proj.weight": (8, 64)}, [0, 1], [Shard(1)], BF16),
                             ["w.proj.weight"], None, format="nvfp4")
    data = {"w.proj.weight": torch.ones(8, 64, dtype=BF16)}
    data["w.proj.weight"][5, 3] = value
    src_t = src_locals(src, rank, data)
    dst_t = dst_locals(dst, rank)
    before = {n: t.clone() for n, t in dst_t.items()}
    try:
        refit(src_t, dst_t, src, dst, timeout=30)
    except Exception as e:  # noqa: BLE001
        untouched = all(torch.equal(before[n].view(torch.uint8), t.view(torch.uint8)) for n, t in dst_t.items())
        return {"error": f"{type(e).__name__}: {e}", "untouched": untouched}
    return {"error": None}


# ---------------------------------------------------------------------------------------------------------
# block deltas (MXFP8 / NVFP4): only the touched blocks travel, bit-exact with a dense quantized refit

DELTA_IDS = ("mxfp8-dense-tp2pp2-to-vllm-tp2dp2-colocated", "nvfp4-moe-tp4-to-vllm-tp2dp2-ep-colocated",
             "mxfp8-raw-fp32-cols48-to-rows", "nvfp4-raw-fp32-cols48-to-rows")


def sparse_change(data: dict, frac: float, seed: int, keep_amax: bool = True) -> dict:
    """``data`` with ``frac`` of every tensor's elements moved by one ulp (their lowest mantissa bit flipped),
    never the elements at the tensor's amax when ``keep_amax`` (NVFP4's global scale then stays)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, t in data.items():
        t = t.clone()
        flat = t.view(-1)
        k = max(1, int(flat.numel() * frac))
        idx = torch.randperm(flat.numel(), generator=g)[:k]
        if keep_amax:
            idx = idx[flat[idx].abs() < flat.abs().max()]
        ib = flat.view({2: torch.int16, 4: torch.int32}[t.element_size()])
        ib[idx] ^= 1
        out[n] = t
    return out


def delta_case(case: FCase, rank: int) -> dict:
    """Versions 0..3 through one Resharder with ``delta=``: 0 dense (captures the snapshot) into poisoned
    destinations; 1 and 2 about 2 % of the elements moved by one ulp (block deltas); 3 one tensor's amax
    doubled (NVFP4: its group's global scale moves, its blocks all change and go dense, named in
    ``RunReport.rescaled``). Every version compared byte for byte with the reference of the whole tensors."""
    from triton_reshard import Resharder
    from triton_reshard.execute.delta import DeltaRequest

    src_l, dst_l = layouts(case)
    plan = case_plan(case)
    r = Resharder(plan, bucket_bytes=case.bucket_bytes, timeout=60)
    data = global_data(src_l, 0)
    src_t = src_locals(src_l, rank, data)
    dst_t = dst_locals(dst_l, rank)
    problems, reps = [], []
    held = None
    for v in range(4):
        if v in (1, 2):
            data = sparse_change(data, 0.02, 100 + v)
        elif v == 3:
            name = sorted(dst_l.quantized)[0]
            data = dict(data)
            data[name] = data[name].clone()
            data[name].view(-1)[0] = data[name].abs().max() * 2
        for n, t in src_locals(src_l, rank, data).items():
            src_t[n].copy_(t)
        rep = r.run(src_t, dst_t, delta=DeltaRequest(v, held=held))
        held = v
        reps.append({"mode": rep.mode, "fallback": rep.fallback, "sent": rep.sent_bytes,
                     "dense": rep.dense_sent_bytes, "rescaled": list(rep.rescaled)})
        problems += _check(case, dst_l, rank, dst_t, data, 0, f"delta version {v}")
    return {"problems": problems, "reps": reps, "changed": sorted(dst_l.quantized)[0]}


def delta_world_main(rank: int, world: int, ids: list[str]) -> dict:
    out = {}
    for cid in ids:
        try:
            out[cid] = delta_case(CASES[cid], rank)
        except Exception as e:  # noqa: BLE001
            out[cid] = {"problems": [f"{cid}: rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"]}
            break
    return out
