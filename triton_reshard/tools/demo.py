"""triton-reshard demo: reshard a Llama-shaped model between two layouts on a local world (default: Megatron
TP4xPP2 -> vLLM TP2xDP4 on 8 gloo ranks, ~0.5 GiB), check every destination element bit for bit, and compare
with the all-gather baseline measured in the same run. It prints a progress line per phase, a table with a
legend of its columns, where the bytes and the speed-up come from, and a one-line verdict (exit 0: all exact)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from ..execute import Resharder
from ..layout import (
    FORMATS,
    FP8_BLOCK,
    QUANT_DTYPE,
    Layout,
    QuantFormat,
    block_quant_layout,
    box_slices,
    quant_format,
)
from ..plan import plan_reshard
from ..testing import synthetic_box
from ..testing.launch import WorldError, default_backend, run_world
from . import demo_report as report
from .baselines import allgather_refit
from .cliutil import DTYPE_HELP, UsageError, check_outputs, parse_dtype, parse_sizes
from .parallel import Parallelism, llama_for_bytes, llama_tensors, parallel_layout

POISON = float("nan")


def reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (peak RSS) on Linux
    except OSError:
        pass


def _proc_status_bytes(field: str) -> int:
    """A ``kB`` field of /proc/self/status (``VmHWM``: peak RSS, ``VmRSS``: RSS) in bytes; 0 where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def peak_rss() -> int:
    return _proc_status_bytes("VmHWM")


def current_rss() -> int:
    return _proc_status_bytes("VmRSS")


def preset_layouts(src_text: str, dst_text: str, size_bytes: int, dtype: torch.dtype,
                   config: str = "llama_demo") -> tuple[Layout, Layout, dict]:
    """Megatron-Core training layout (TP x PP x DP) -> vLLM inference layout (TP x DP) of a Llama-3-like
    preset config, with the layer count scaled to about ``size_bytes``. Raises ``ValueError`` for a layout
    the model cannot take (named in the message)."""
    from ..presets import get_config, megatron_layout, model_nbytes, vllm_layout

    sp, dp_ = Parallelism.parse(src_text), Parallelism.parse(dst_text)
    if dp_.pp > 1:
        raise ValueError("the vLLM preset has no pipeline parallelism: use tp and dp on the inference side")
    cfg = get_config(config)
    one, two = ({**cfg, "num_hidden_layers": n} for n in (1, 2))
    per_layer = model_nbytes(two, dtype) - model_nbytes(one, dtype)
    fixed = model_nbytes(one, dtype) - per_layer
    layers = max(1, round((size_bytes - fixed) / per_layer / sp.pp)) * sp.pp
    cfg["num_hidden_layers"] = layers
    src = megatron_layout(cfg, tp=sp.tp, pp=sp.pp, dp=sp.dp, ranks=sp.offset, dtype=dtype)
    dst = vllm_layout(cfg, tp=dp_.tp, dp=dp_.dp, ranks=dp_.offset, dtype=dtype)
    return src, dst, cfg


def is_linear_weight(t) -> bool:
    """The tensors a block-FP8 checkpoint quantizes (vLLM's Fp8LinearMethod: every Linear layer's weight):
    attention and MLP projections; not the norms, embeddings or LM head."""
    return t.name.endswith("proj.weight") and len(t.shape) == 2


QUANT_DST_DTYPES = tuple(f.name for f in FORMATS)  # --dst-dtype's quantized destinations: every format


def dst_dtype_help() -> str:
    """What ``--dst-dtype`` says of each format (from the format registry)."""
    return "; ".join(f"'{f.name}': {f.label} ({f.summary.format(block='B')})" for f in FORMATS)


def quant_layout(dst: Layout, dst_dtype: str | QuantFormat, block: int = 128) -> Layout:
    """``dst`` with every Linear weight quantized in format ``dst_dtype`` (a format or its name): in ``block`` x
    ``block`` blocks when the format takes its block from the caller (block FP8, fp32 ``*_scale_inv``), else in
    the format's own (its scale tensors ``*_scale``, and a global scale per tensor group where it has one)."""
    return block_quant_layout(dst, is_linear_weight, (block, block), format=dst_dtype)


def fp8_layout(dst: Layout, block: int) -> Layout:
    """``dst`` with every Linear weight block-FP8 (``block`` x ``block`` blocks, fp32 ``*_scale_inv`` scales)."""
    return quant_layout(dst, FP8_BLOCK, block)


def expected_quantized(dst: Layout, src: Layout, rank: int, device) -> list[tuple[str, tuple, torch.Tensor]]:
    """As :func:`expected_tensors` for a block-quantized destination: each quantized tensor quantized whole from the
    synthetic source (the format's torch reference: ``ops.quantize.quantize_blocks`` for block FP8) and sliced,
    values and scales; global scales (NVFP4) from the amax of each tensor group, as the refit's exchange."""
    from ..ops.quantize import global_scales
    from ..ops.quantize import reference as quant_reference
    from ..testing import synthetic_global

    ref: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    gscale: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    owner = {t.quant.global_scale: t for t in dst.quantized.values() if t.quant.global_scale}

    def logical(name: str) -> torch.Tensor:
        sspec = src.specs[name]
        return synthetic_global(name, sspec.shape, sspec.dtype).to(device)

    def gs_of(group: str):
        if group not in gscale:
            amax = max(logical(t.name).abs().amax().float() for t in dst.quantized.values()
                       if t.quant.global_group == group)
            gscale[group] = global_scales(amax)
        return gscale[group]

    def of(name: str):
        if name not in ref:
            q = dst.specs[name].quant
            ref[name] = quant_reference(q.format, logical(name), q.logical_block, q.ue8m0,
                                        global_scale=gs_of(q.global_group)[0] if q.format.global_scale else None)
        return ref[name]

    out = []
    for f in dst.fragments:
        if f.rank != rank or not f.numel:
            continue
        loff, lsize = f.local_box(f.offsets, f.sizes)
        box = box_slices(f.offsets, f.sizes)
        if f.tensor in dst.quantized:
            exp = of(f.tensor)[0][box]
        elif f.tensor in dst.scale_of:
            exp = of(dst.scale_of[f.tensor])[1][box]
        elif f.tensor in owner:  # NVFP4's weight_scale_2: 1 / the group's global scale
            exp = gs_of(owner[f.tensor].quant.global_group)[1].reshape(1)
        else:
            spec = dst.specs[f.tensor]
            exp = synthetic_box(f.tensor, spec.shape, spec.dtype, f.offsets, f.sizes, device=device)
        out.append((f.local, box_slices(loff, lsize), exp.reshape(lsize).view(_int_of(exp.dtype))))
    return out


def build_layouts(args) -> tuple[Layout, Layout, dict]:
    dtype = parse_dtype(args.dtype)
    if args.layouts == "megatron-vllm":
        return preset_layouts(args.src, args.dst, int(args.size_gb * (1 << 30)), dtype)
    cfg = llama_for_bytes(int(args.size_gb * (1 << 30)), dtype)
    tensors = llama_tensors(**cfg)
    src = parallel_layout(tensors, Parallelism.parse(args.src), cfg["layers"], dtype)
    dst = parallel_layout(tensors, Parallelism.parse(args.dst), cfg["layers"], dtype)
    return src, dst, cfg


def make_src(layout: Layout, rank: int, device) -> dict[str, torch.Tensor]:
    out = layout.allocate(rank, device=device, fill=0)
    for f in layout.fragments:
        if f.rank != rank or not f.numel:
            continue
        spec = layout.specs[f.tensor]
        loff, lsize = f.local_box(f.offsets, f.sizes)
        view = out[f.local][box_slices(loff, lsize)]
        view.copy_(synthetic_box(f.tensor, spec.shape, spec.dtype, f.offsets, f.sizes, device=device).reshape(lsize))
    return out


def expected_tensors(layout: Layout, rank: int, device) -> list[tuple[str, tuple, torch.Tensor]]:
    """Each destination fragment's expected contents, built once (as integer bit patterns)."""
    out = []
    for f in layout.fragments:
        if f.rank != rank or not f.numel:
            continue
        spec = layout.specs[f.tensor]
        loff, lsize = f.local_box(f.offsets, f.sizes)
        exp = synthetic_box(f.tensor, spec.shape, spec.dtype, f.offsets, f.sizes, device=device)
        out.append((f.local, box_slices(loff, lsize),
                    exp.reshape(lsize).view(_int_of(exp.dtype))))
    return out


def verify_tensors(expected, tensors: dict[str, torch.Tensor]) -> int:
    """Number of destination elements that differ from the global tensor (bit-exact)."""
    bad = 0
    for local, sl, exp in expected:
        got = tensors[local][sl]
        got = got.view(_int_of(got.dtype))
        if not torch.equal(got, exp):
            bad += int((got != exp).sum())
    return bad


def _int_of(dtype: torch.dtype) -> torch.dtype:
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[torch.empty((), dtype=dtype).element_size()]


def poison(tensors: dict[str, torch.Tensor]) -> None:
    for t in tensors.values():
        if t.dtype == QUANT_DTYPE:
            t.view(torch.uint8).fill_(0x7F)  # an fp8 NaN
        elif t.dtype == torch.uint8:  # packed E2M1 / E8M0 scales: a byte no refit writes everywhere
            t.fill_(0xA5)
        elif t.dtype.is_floating_point:
            t.fill_(POISON)
        else:
            t.fill_(-1)


def _timed(fn, device) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()  # wall time of the slowest rank
    return time.perf_counter() - t0


def _say(args, text: str) -> None:
    """A progress line with the time since the demo started (rank 0 and the parent print them)."""
    print(f"[{time.time() - args.started_at:6.1f} s] {text}", flush=True)


def demo_worker(rank: int, world: int, args) -> dict:
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    say = (lambda text: _say(args, text)) if rank == 0 else (lambda text: None)
    t_setup = time.perf_counter()
    say(f"{world} ranks up ({dist.get_backend()}); each builds the layouts, plans and fills its source tensors")
    src, dst, _cfg = build_layouts(args)
    src_t = make_src(src, rank, device)
    dst_t = dst.allocate(rank, device=device)
    bucket = int(args.bucket_mb * (1 << 20))
    t0 = time.perf_counter()
    plan = plan_reshard(src, dst)
    digest = not getattr(args, "no_digest", False)
    r = Resharder(plan, bucket_bytes=bucket, timeout=args.timeout, backend=args.backend, digest=digest)
    plan_s = time.perf_counter() - t0
    expected = expected_tensors(dst, rank, device)
    out: dict = {"rank": rank, "plan_seconds": plan_s}
    rss_peaks = []
    check = [0.0]

    def measured(fn, tensors=dst_t, want=expected):
        poison(tensors)
        reset_peak_rss()
        rss0 = current_rss()
        secs = _timed(fn, device)
        rss_peaks.append(peak_rss() - rss0)
        t = time.perf_counter()
        bad = verify_tensors(want, tensors)
        check[0] += time.perf_counter() - t
        return secs, bad

    out["setup_seconds"] = time.perf_counter() - t_setup
    dist.barrier()
    say(f"all ranks set up (rank 0 in {out['setup_seconds']:.1f} s, its plan {plan_s:.2f} s); first reshard run "
        f"(binds the tensors: builds the copy lists, allocates the staging buffers) ...")
    t_ours = time.perf_counter()
    out["ours_first_seconds"], out["ours_bad"] = measured(lambda: r.run(src_t, dst_t))
    times = []
    for i in range(args.repeats):
        secs, bad = measured(lambda: r.run(src_t, dst_t))
        times.append(secs)
        out["ours_bad"] += bad
        say(f"reshard run {i + 1}/{args.repeats}: {secs:.3f} s (rank 0's view), {bad} wrong elements on rank 0")
    out["ours_seconds"] = times
    out["ours_total_seconds"] = time.perf_counter() - t_ours
    out["ours_peak_extra_rss"] = max(rss_peaks)
    out["ours_staging_bytes"] = r.send_area_bytes + r.recv_area_bytes
    qd = getattr(args, "dst_dtype", "same")
    if qd in QUANT_DST_DTYPES:  # the same refit into quantized inference weights, checked the same way
        out.update(_quant_runs(args, qd, src, dst, src_t, rank, device, measured, rss_peaks, say))
    if not args.no_baseline:
        out.update(_baseline_runs(args, src, dst, src_t, dst_t, measured, rss_peaks, say))
    out["check_seconds"] = check[0]
    return out


def _quant_runs(args, qd: str, src: Layout, dst: Layout, src_t, rank: int, device, measured, rss_peaks: list,
                say) -> dict:
    """The same refit into the quantized destination ``qd`` (every Linear weight), checked against the torch
    reference's bytes: its setup, first run and repeats (rank ``rank``'s timers)."""
    out: dict = {}
    bucket = int(args.bucket_mb * (1 << 20))
    label = quant_format(qd).label
    say(f"{label} destination: each rank plans it, allocates its tensors and quantizes the reference it checks "
        "against (every Linear weight, whole, with the torch reference) ...")
    t_q = time.perf_counter()
    dst_q = quant_layout(dst, qd, args.quant_block)
    rq = Resharder(plan_reshard(src, dst_q), bucket_bytes=bucket, timeout=args.timeout, backend=args.backend,
                   digest=not getattr(args, "no_digest", False))
    dst_qt = dst_q.allocate(rank, device=device)
    poison(dst_qt)
    want_q = expected_quantized(dst_q, src, rank, device)
    dist.barrier()
    out["fp8_setup_seconds"] = time.perf_counter() - t_q  # the slowest rank's, as the user waits for it
    say(f"{label} set up in {out['fp8_setup_seconds']:.1f} s; first run (binds, allocates the staging "
        f"and the straddling blocks' regions) ...")
    out["fp8_first_seconds"], out["fp8_bad"] = measured(lambda: rq.run(src_t, dst_qt), dst_qt, want_q)
    qtimes = []
    for i in range(args.repeats):
        secs, bad = measured(lambda: rq.run(src_t, dst_qt), dst_qt, want_q)
        qtimes.append(secs)
        out["fp8_bad"] += bad
        say(f"{label} run {i + 1}/{args.repeats}: {secs:.3f} s, {bad} wrong bytes or scales on rank 0")
    out["fp8_seconds"] = qtimes
    out["fp8_total_seconds"] = time.perf_counter() - t_q
    out["fp8_staging_bytes"] = rq.staging_bytes
    out["fp8_peak_extra_rss"] = max(rss_peaks[-(args.repeats + 1):])
    return out


def _baseline_runs(args, src: Layout, dst: Layout, src_t, dst_t, measured, rss_peaks: list, say) -> dict:
    """The all-gather baseline's runs, checked the same way."""
    out: dict = {}
    reports, btimes = [], []
    out["base_bad"] = 0
    rss_peaks.clear()
    t_base = time.perf_counter()
    for i in range(max(1, args.repeats)):
        secs, bad = measured(lambda: reports.append(allgather_refit(src_t, dst_t, src, dst, timeout=args.timeout)))
        btimes.append(secs)
        out["base_bad"] += bad
        say(f"all-gather baseline run {i + 1}/{max(1, args.repeats)}: {secs:.3f} s")
    out["base_seconds"] = btimes
    out["base_total_seconds"] = time.perf_counter() - t_base
    out["base_recv_bytes"] = reports[-1].recv_bytes
    out["base_peak_extra_bytes"] = reports[-1].peak_extra_bytes
    out["base_peak_extra_rss"] = max(rss_peaks)
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world", type=int, default=None,
                   help="number of ranks to spawn (default: as many as the layouts use, 8 for the defaults)")
    p.add_argument("--src", default="tp=4,pp=2",
                   help="training layout: comma-separated tp=N, pp=N, dp=N, offset=N (first rank), no spaces "
                        "(default tp=4,pp=2)")
    p.add_argument("--dst", default="tp=2,dp=4",
                   help="inference layout, same keys; with --layouts megatron-vllm pp must be 1 (default tp=2,dp=4)")
    p.add_argument("--layouts", choices=["megatron-vllm", "simple"], default="megatron-vllm",
                   help="'megatron-vllm' (default): Megatron-Core training -> vLLM inference formats of the "
                        "Llama-3-like preset 'llama_demo'; 'simple': DTensor-style shards on HF names")
    p.add_argument("--size-gb", type=float, default=0.5,
                   help="model size in GiB: the layer count is scaled to reach it (default 0.5)")
    p.add_argument("--dtype", default="float32", help=f"weight dtype: {DTYPE_HELP} (default float32)")
    p.add_argument("--bucket-mb", type=float, default=64,
                   help="staging memory per rank per step, MiB: bigger means fewer steps (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs after the first, untimed one (default 3)")
    p.add_argument("--backend", choices=["torch", "triton"], default=None,
                   help="copy backend (default: triton on CUDA, torch on CPU)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds before a missing peer is an error (default 120)")
    p.add_argument("--no-baseline", action="store_true", help="skip the all-gather baseline (about halves the time)")
    p.add_argument("--no-digest", action="store_true",
                   help="refit without the per-message integrity digest (docs/integrity.md; on by default)")
    p.add_argument("--plot", default=None, metavar="PATH",
                   help="also write a rank x rank heatmap of who sends how much to whom (PNG; needs matplotlib)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON to this path")
    p.add_argument("--dst-dtype", choices=["same", *QUANT_DST_DTYPES], default="same",
                   help="also refit into quantized inference weights (every Linear weight) in this format, as "
                        f"vLLM loads them: {dst_dtype_help()}; checked against the reference quantization of the "
                        "whole tensor, and print its wire bytes and time beside the plain refit's (default same: "
                        "the --dtype of the source)")
    p.add_argument("--quant-block", type=int, default=128,
                   help="B, the block size (rows and columns) of a --dst-dtype that takes it (default 128, as "
                        "DeepSeek-V3 / Qwen3-FP8)")


def _dtype_name(args) -> str:
    return str(parse_dtype(args.dtype)).removeprefix("torch.")


def _model_line(cfg: dict, args, model_bytes: int) -> str:
    if args.layouts == "megatron-vllm":
        c = cfg
        shape = (f"preset llama_demo with {c['num_hidden_layers']} layers (scaled to --size-gb {args.size_gb:g}): "
                 f"hidden {c['hidden_size']}, {c['num_attention_heads']} heads ({c['num_key_value_heads']} KV), "
                 f"intermediate {c['intermediate_size']}, vocab {c['vocab_size']}")
    else:
        c = cfg
        shape = (f"Llama-shaped, {c['layers']} layers: hidden {c['hidden']}, {c['heads']} heads "
                 f"({c['kv_heads']} KV), intermediate {c['intermediate']}, vocab {c['vocab']}")
    return f"model: {shape}; {_dtype_name(args)} weights, {report.fmt_bytes(model_bytes)} in all"


def _layout_words(text: str, kind: str, offset_rank: int, ranks: int) -> str:
    p = Parallelism.parse(text)
    parts = [f"TP{p.tp}"] + ([f"PP{p.pp}"] if p.pp > 1 else []) + ([f"DP{p.dp}"] if p.dp > 1 else [])
    return f"{kind} {'x'.join(parts)} on ranks {offset_rank}..{offset_rank + ranks - 1}"


def _validate(args) -> tuple[Parallelism, Parallelism]:
    parse_dtype(args.dtype)
    sp = Parallelism(**parse_sizes(args.src, ("tp", "pp", "dp", "offset"), "--src", "tp=4,pp=2"))
    dp_ = Parallelism(**parse_sizes(args.dst, ("tp", "pp", "dp", "offset"), "--dst", "tp=2,dp=4"))
    if args.layouts == "megatron-vllm" and dp_.pp > 1:
        raise UsageError(f"--dst {args.dst!r}: the vLLM layout has no pipeline stages (pp must be 1); use tp and dp "
                         f"or --layouts simple")
    need = max(sp.size + sp.offset, dp_.size + dp_.offset)
    if args.world is None:
        args.world = need
    if args.world < need:
        raise UsageError(f"--world {args.world}: the layouts need {need} ranks (--src {args.src} uses ranks "
                         f"{sp.offset}..{sp.offset + sp.size - 1}, --dst {args.dst} ranks "
                         f"{dp_.offset}..{dp_.offset + dp_.size - 1})")
    if args.world > need:
        raise UsageError(f"--world {args.world}: the layouts use only {need} ranks, ranks {need}..{args.world - 1} "
                         f"would idle; drop --world or give layouts that use them")
    for name, low in (("size_gb", 0), ("bucket_mb", 0), ("timeout", 0)):
        v = getattr(args, name)
        if not v > low:
            raise UsageError(f"--{name.replace('_', '-')} {v:g}: must be > {low}")
    if args.repeats < 0:
        raise UsageError(f"--repeats {args.repeats}: must be >= 0")
    if getattr(args, "quant_block", 128) < 1:
        raise UsageError(f"--quant-block {args.quant_block}: must be >= 1")
    check_outputs(args)
    if args.backend == "triton":
        _check_triton_backend(args.world)
    return sp, dp_


def _check_triton_backend(world: int) -> None:
    """``--backend triton`` before spawning: the ranks' tensors are CUDA tensors (NCCL, one GPU per rank) or, on
    CPU, Triton's interpreter is on (``TRITON_INTERPRET=1``); else a :class:`UsageError`."""
    try:
        from triton import knobs
    except ImportError:
        raise UsageError("--backend triton: Triton is not installed (pip install triton), or use --backend torch") from None
    on_cuda = default_backend(world) == "nccl"
    interpret = bool(knobs.runtime.interpret)
    if not on_cuda and not interpret:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise UsageError(f"--backend triton: the Triton copy needs CUDA tensors, and the {world} ranks run on CPU "
                         f"({gpus} GPUs here); use --backend torch, or set TRITON_INTERPRET=1 to run the Triton "
                         f"kernels on CPU under its interpreter (slow)")
    if on_cuda and interpret:
        raise UsageError(f"--backend triton: TRITON_INTERPRET=1 runs the Triton copy on CPU tensors, but the {world} "
                         f"ranks run on CUDA; unset TRITON_INTERPRET")


def run_demo(args) -> int:
    args.started_at = time.time()
    sp, dp_ = _validate(args)
    try:
        src, dst, cfg = build_layouts(args)
        plan = plan_reshard(src, dst)
        qd = getattr(args, "dst_dtype", "same")
        qplan = plan_reshard(src, quant_layout(dst, qd, args.quant_block)) if qd in QUANT_DST_DTYPES else None
    except (ValueError, TypeError) as e:  # a layout the model cannot take: one line, no traceback
        raise UsageError(f"--src {args.src} -> --dst {args.dst}: {e}") from None
    st = plan.stats()
    sched = plan.schedule(int(args.bucket_mb * (1 << 20)))
    model_bytes = sum(t.itemsize * torch.Size(t.shape).numel() for t in src.tensors)
    prep_s = time.time() - args.started_at
    print(_model_line(cfg, args, model_bytes))
    print(f"layouts: {_layout_words(args.src, 'training (Megatron)' if args.layouts == 'megatron-vllm' else 'source', sp.offset, sp.size)}"
          f" -> {_layout_words(args.dst, 'inference (vLLM)' if args.layouts == 'megatron-vllm' else 'destination', dp_.offset, dp_.size)}")
    _say(args, f"planned in {prep_s:.1f} s: plan {plan.digest}, {st.num_transfers} wire transfers and "
               f"{st.num_local_copies} local copies in {len(sched.steps)} steps of <= {args.bucket_mb:g} MiB staging")
    if args.plot:
        from .plot import plot_traffic

        plot_traffic(plan, args.plot, f"triton-reshard demo: {args.src} -> {args.dst} ({args.layouts})",
                     f"{report.fmt_bytes(model_bytes)} of {_dtype_name(args)} weights on {args.world} ranks")
        _say(args, f"traffic heatmap written to {args.plot}")
    _say(args, f"spawning {args.world} ranks (each imports torch; ~10-30 s on a small machine) ...")
    t0 = time.perf_counter()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        res = run_world(demo_worker, args.world, args, timeout=max(600.0, 10 * args.timeout))
    except WorldError as e:
        # the rank that failed first, not the peers that then lost their connection to it
        errs = e.errors
        first = min(errs, key=lambda r: ("lost the connection" in errs[r] or "timed out" in errs[r], r))
        lines = [x for x in errs[first].strip().splitlines() if x.strip()]
        print(f"triton-reshard demo: rank {first} failed: {lines[0] if lines else '?'}", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - t0
    qst = qplan.stats() if qplan is not None else None
    rows = report.result_rows(res, args, st, qst)
    report.print_table(rows, args.repeats)
    if qst is not None:
        print(report.quant_line(args, st, qst, rows, _dtype_name(args)))
    print(report.lower_bound_line(st, model_bytes, dst.nbytes(), dp_.dp))
    verdict_extra = ""
    if not args.no_baseline:
        line, verdict_extra = report.speedup_against_allgather(args, st, rows, len(sched.steps), src)
        print(line)
    first = max(r["ours_first_seconds"] for r in res)
    print(f"first run: {first:.3f} s, not in the median (it binds the tensors: builds the copy lists and "
          f"allocates the staging buffers once; later runs reuse them; noise on a shared machine can make it "
          f"faster than a later run)")
    print(report.time_breakdown(res[0], time.time() - args.started_at, prep_s, elapsed,
                                quant_format(qd).label if qd in QUANT_DST_DTYPES else FP8_BLOCK.label))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "stats": st.as_dict(), "ranks": res,
                       "fp8_stats": qst.as_dict() if qst is not None else None}, f, indent=1, default=str)
    bad = sum(r[-1] for r in rows)
    if bad:
        print(f"FAILED: {bad} destination elements differ from the global tensor")
        return 1
    print(f"OK: every destination element equals the global tensor, bit for bit; ours moved "
          f"{st.wire_bytes / max(1, st.lower_bound_bytes):.2f}x the lower bound{verdict_extra}")
    return 0
