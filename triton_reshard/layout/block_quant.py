"""Block-quantized layouts: :func:`block_quant_layout` turns chosen tensors of a layout into quantized tensors
with a per-block scale tensor beside each, in one :class:`~triton_reshard.layout.specs.QuantFormat` (the DeepSeek-V3 /
vLLM block-FP8 format, MXFP8, NVFP4)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from .check import misaligned_block
from .columnar import Layout
from .formats import FP8_BLOCK, QuantFormat, quant_format
from .specs import (
    BlockQuant,
    Fragment,
    LocalSpec,
    TensorSpec,
    block_scale_box,
    dtype_name,
    gc_paused,
    scale_shape,
)


def block_quant_layout(
    layout: Layout,
    names: Iterable[str] | Callable[[TensorSpec], bool],
    block: Sequence[int] | None = (128, 128),
    ue8m0: bool = False,
    scale_suffix: str | None = None,
    format: QuantFormat | str = FP8_BLOCK,
) -> Layout:
    """``layout`` with some tensors block-quantized (block FP8): what an engine that loads an FP8 checkpoint
    (``quantization_config`` ``fp8`` with ``weight_block_size``, vLLM / DeepSeek-V3) holds.

    ``names``: the logical tensors to quantize (an iterable of names, or a predicate on TensorSpecs). Each
    becomes ``float8_e4m3fn`` with a :class:`BlockQuant` of ``block`` (trailing dims; leading dims get 1) and a
    float32 scale tensor ``name + scale_suffix`` of shape ``ceil(shape / block)``; every fragment gets the
    scale fragment of its blocks, in local tensor ``local + scale_suffix`` at the weight's local offsets
    divided by the block (e.g. vLLM's ``qkv_proj.weight`` -> ``qkv_proj.weight_scale_inv``, ``[ceil(rows /
    128), ceil(cols / 128)]``; extra leading local dims, like stacked experts, unchanged). The local tensors
    holding them become ``float8_e4m3fn``.

    ``format``: the :class:`~triton_reshard.layout.specs.QuantFormat` (or its name). Block FP8 takes ``block`` and
    ``ue8m0``; MXFP8 blocks 1x32 along the last dim with one E8M0 byte per block (uint8 scales, vLLM's
    ``weight_scale``; ``block`` is ignored). NVFP4 (ModelOpt, as vLLM and SGLang load it): each tensor becomes
    packed E2M1 pairs, uint8 ``[..., K/2]`` (its fragments and local tensors in stored elements: the last dim
    halved), float8_e4m3fn scales ``name + "_scale"`` ``[..., K/16]`` and a float32 global scale ``name +
    "_scale_2"`` of shape ``(1,)``, held by every rank holding the weight in local tensor ``local + "_scale_2"``:
    ``[n]`` for a local tensor fusing ``n`` tensors (vLLM's ``qkv_proj.weight_scale_2`` ``[3]``, in the order the
    parts sit in the local tensor), extra leading dims kept (``w13_weight_scale_2`` ``[E, 2]``, ``w2_weight_scale_2``
    ``[E]``). Tensors fused in one local tensor share one global scale (``BlockQuant.global_group``: ModelOpt's
    rule, which vLLM's loader expects: it takes their max and requires w1 = w3). ``scale_suffix`` defaults to ``"_scale_inv"`` for block FP8 and
    ``"_scale"`` for the other formats (the engines' names).

    Raises ``ValueError`` naming the tensor and rank when a fragment is not block-aligned (it would split a
    block between ranks, or put it at an unaligned local offset: vLLM refuses such shards too), when a local
    tensor would mix quantized and plain tensors, or a scale name is already taken; ``KeyError`` for an
    unknown name.
    """
    if not isinstance(layout, Layout):
        raise TypeError(f"block_quant_layout: expected a Layout, got {type(layout).__name__}")
    chosen = _chosen(layout, names)
    fmt = quant_format(format)
    if fmt.pack != 1 or fmt.global_scale:
        return _packed_layout(layout, chosen, fmt, scale_suffix or fmt.scale_suffix)
    if scale_suffix is None:
        scale_suffix = fmt.scale_suffix
    if fmt.block is not None:
        block = (fmt.block,)
    if not isinstance(scale_suffix, str) or not scale_suffix:
        raise ValueError(f"block_quant_layout: scale_suffix must be a non-empty str, got {scale_suffix!r}")
    specs = _quantized_specs(layout, chosen, fmt,
                             lambda t: BlockQuant(tuple(block), t.name + scale_suffix, ue8m0, fmt))
    frags, qlocals = _with_scale_fragments(layout, specs, chosen, scale_suffix)
    locs = {(s.rank, s.name): s for s in layout.locals}
    for t in list(specs.values()):
        if t.quant is not None:
            if t.quant.scale in specs:
                raise ValueError(f"block_quant_layout: the scale tensor name {t.quant.scale!r} of {t.name!r} is taken")
            specs[t.quant.scale] = TensorSpec(t.quant.scale, t.scale_shape, fmt.scale_dtype)
    for (rank, local), blk in qlocals.items():
        ls = locs[(rank, local)]
        sname = local + scale_suffix
        if (rank, sname) in locs:
            raise ValueError(f"block_quant_layout: local tensor {sname!r} on rank {rank} already exists")
        extra = len(ls.shape) - len(blk)
        locs[(rank, local)] = LocalSpec(rank, local, ls.shape, fmt.value_dtype)
        locs[(rank, sname)] = LocalSpec(rank, sname, ls.shape[:extra] + scale_shape(ls.shape[extra:], blk),
                                        fmt.scale_dtype)
    with gc_paused():
        return Layout(tuple(specs.values()), tuple(frags), tuple(locs.values()))


def _chosen(layout: Layout, names: Iterable[str] | Callable[[TensorSpec], bool]) -> set[str]:
    """The names of the tensors to quantize (a predicate's choice, or the names given, each known)."""
    if callable(names):
        chosen = {t.name for t in layout.tensors if names(t)}
    else:
        if isinstance(names, str):
            raise TypeError(f"block_quant_layout: names must be an iterable of tensor names or a predicate, got "
                            f"the string {names!r}")
        chosen = set(names)
        unknown = sorted(chosen - set(layout.specs))
        if unknown:
            raise KeyError(f"block_quant_layout: unknown tensor {unknown[0]!r}")
    return chosen


def _quantized_specs(layout: Layout, chosen: set[str], fmt: QuantFormat,
                     quant_of: Callable[[TensorSpec], BlockQuant] | None) -> dict[str, TensorSpec]:
    """The layout's tensor specs by name, the chosen ones quantized with ``quant_of(spec)`` (their stored shape:
    a packed format's last dim divided by its pack). Each chosen tensor is checked first (``quant_of=None``: only
    checked)."""
    for t in layout.tensors:
        if t.name not in chosen:
            continue
        if t.quant is not None:
            raise ValueError(f"block_quant_layout: tensor {t.name!r} is already quantized")
        if not t.dtype.is_floating_point:
            raise ValueError(f"block_quant_layout: tensor {t.name!r} is {dtype_name(t.dtype)}, not floating point")
        if fmt.block is not None and (not t.shape or t.shape[-1] % fmt.block):
            raise ValueError(f"block_quant_layout: tensor {t.name!r} {t.shape}: {fmt.name} needs a last dim of whole "
                             f"blocks of {fmt.block} (vLLM refuses it too)")
    if quant_of is None:
        return {}
    stored = lambda t: t.shape if fmt.pack == 1 else t.shape[:-1] + (t.shape[-1] // fmt.pack,)  # noqa: E731
    return {t.name: TensorSpec(t.name, stored(t), fmt.value_dtype, quant_of(t)) if t.name in chosen else t
            for t in layout.tensors}


def _with_scale_fragments(layout: Layout, specs: Mapping[str, TensorSpec], chosen: set[str], scale_suffix: str,
                          ) -> tuple[list[Fragment], dict[tuple[int, str], tuple[int, ...]]]:
    """The layout's fragments plus the scale fragment of each quantized one (each checked block-aligned, its
    local tensor holding quantized tensors of one block only), and the block of each quantized local tensor."""
    frags = list(layout.fragments)
    holds: dict[tuple[int, str], set[str]] = defaultdict(set)
    for f in frags:
        holds[(f.rank, f.local)].add(f.tensor)
    qlocals: dict[tuple[int, str], tuple[int, ...]] = {}  # weight local -> the block of its tensors
    for f in layout.fragments:
        spec = specs[f.tensor]
        if spec.quant is None:
            continue
        key = (f.rank, f.local)
        plain = sorted(holds[key] - chosen)
        if plain:
            raise ValueError(f"block_quant_layout: local tensor {f.local!r} on rank {f.rank} holds quantized tensor "
                             f"{f.tensor!r} and plain tensor {plain[0]!r}: one local tensor has one dtype")
        if f.numel:
            why = misaligned_block(f, spec)
            if why is not None:
                raise ValueError(f"block_quant_layout: fragment of tensor {f.tensor!r} on rank {f.rank} (box "
                                 f"{f.offsets}+{f.sizes}) is not block-aligned for blocks {spec.quant.block}: it {why}")
        prev = qlocals.get(key)
        if prev is not None and prev != spec.quant.block[-len(prev):]:
            raise ValueError(f"block_quant_layout: local tensor {f.local!r} on rank {f.rank} holds tensors with "
                             f"different blocks")
        qlocals[key] = spec.quant.block
        off, sizes, lo = block_scale_box(f, spec.quant.block)
        frags.append(Fragment(spec.quant.scale, f.rank, off, sizes, f.local + scale_suffix, lo))
    return frags, qlocals


def _packed_layout(layout: Layout, chosen: set[str], fmt: QuantFormat, scale_suffix: str) -> Layout:
    """:func:`block_quant_layout` for a packed format with a global scale (NVFP4)."""
    gsuffix = scale_suffix + "_2"
    holds: dict[tuple[int, str], set[str]] = defaultdict(set)
    for f in layout.fragments:
        holds[(f.rank, f.local)].add(f.tensor)
    _quantized_specs(layout, chosen, fmt, None)  # each chosen tensor checked before any fragment is
    parts, frags_of = _packed_parts(layout, chosen, fmt, holds)
    group = _scale_groups(chosen, parts)
    n_parts: dict[tuple[int, str], int] = defaultdict(lambda: 1)
    for (r, lname, _lead), m in parts.items():
        n_parts[(r, lname)] = max(n_parts[(r, lname)], len(m))
    specs = _quantized_specs(layout, chosen, fmt, lambda t: BlockQuant(
        (fmt.block // fmt.pack,), t.name + scale_suffix, False, fmt, t.name + gsuffix, group[t.name]))
    for name in sorted(chosen):
        t = specs[name]
        for extra_name in (t.quant.scale, t.quant.global_scale):
            if extra_name in specs:
                raise ValueError(f"block_quant_layout: the scale tensor name {extra_name!r} of {name!r} is taken")
        specs[t.quant.scale] = TensorSpec(t.quant.scale, t.scale_shape, fmt.scale_dtype)
        specs[t.quant.global_scale] = TensorSpec(t.quant.global_scale, (1,), torch.float32)
    frags = [f for f in layout.fragments if f.tensor not in chosen]
    frags += _packed_fragments(specs, frags_of, parts, n_parts, fmt, scale_suffix, gsuffix)
    locs = {(s.rank, s.name): s for s in layout.locals}
    _packed_locals(layout, holds, chosen, locs, n_parts, fmt, scale_suffix, gsuffix)
    with gc_paused():
        return Layout(tuple(specs.values()), tuple(frags), tuple(locs.values()))


def _packed_parts(layout: Layout, chosen: set[str], fmt: QuantFormat, holds: dict) -> tuple[dict, dict]:
    """The chosen tensors' fragments, checked (one dtype per local tensor, whole blocks along the last dim):
    ``parts`` per (rank, local, leading index) the chosen tensors and where each sits in the local tensor, and
    ``frags_of`` each chosen tensor's fragments."""
    lb = fmt.block  # logical block along the last dim
    parts: dict[tuple[int, str, tuple], dict[str, int]] = defaultdict(dict)
    frags_of: dict[str, list] = defaultdict(list)
    for f in layout.fragments:
        if f.tensor not in chosen:
            continue
        plain = sorted(holds[(f.rank, f.local)] - chosen)
        if plain:
            raise ValueError(f"block_quant_layout: local tensor {f.local!r} on rank {f.rank} holds quantized tensor "
                             f"{f.tensor!r} and plain tensor {plain[0]!r}: one local tensor has one dtype")
        if f.numel and (f.offsets[-1] % lb or f.sizes[-1] % lb or f.local_offsets[-1] % lb):
            raise ValueError(f"block_quant_layout: fragment of tensor {f.tensor!r} on rank {f.rank} (box {f.offsets}+"
                             f"{f.sizes}, local offsets {f.local_offsets}) is not block-aligned for {fmt.name} blocks "
                             f"of {lb} along the last dim (a block would be split between ranks)")
        extra = len(f.local_offsets) - len(f.offsets)
        lead = f.local_offsets[:extra]
        parts[(f.rank, f.local, lead)].setdefault(f.tensor, f.local_offsets[extra] if f.offsets else 0)
        frags_of[f.tensor].append(f)
    return parts, frags_of


def _scale_groups(chosen: set[str], parts: dict) -> dict[str, str]:
    """Each chosen tensor's global-scale group (named by its smallest member): tensors fused in one local tensor
    share a global scale, the union over every rank's locals."""
    root = {n: n for n in chosen}

    def find(n):
        while root[n] != n:
            root[n] = root[root[n]]
            n = root[n]
        return n

    for members in parts.values():
        names = sorted(members)
        for n in names[1:]:
            a, b = find(names[0]), find(n)
            if a != b:
                root[max(a, b)] = min(a, b)
    return {n: find(n) for n in chosen}


def _packed_fragments(specs: dict, frags_of: dict, parts: dict, n_parts: dict, fmt: QuantFormat,
                      scale_suffix: str, gsuffix: str) -> list[Fragment]:
    """Per fragment of a chosen tensor: its packed box, its block scales' box, and (once per local part) where
    its global scale sits in the local global-scale tensor."""
    frags: list[Fragment] = []
    seen_g: set = set()
    for name in sorted(frags_of):
        spec = specs[name]
        for f in frags_of[name]:
            sf = Fragment(name, f.rank, _half(f.offsets, fmt.pack), _half(f.sizes, fmt.pack), f.local,
                          _half(f.local_offsets, fmt.pack))
            frags.append(sf)
            off, sizes, lo = block_scale_box(sf, spec.quant.block)
            frags.append(Fragment(spec.quant.scale, f.rank, off, sizes, f.local + scale_suffix, lo))
            extra = len(f.local_offsets) - len(f.offsets)
            lead = f.local_offsets[:extra]
            members = parts[(f.rank, f.local, lead)]
            gkey = (f.rank, f.local, lead, name)
            if gkey in seen_g:
                continue
            seen_g.add(gkey)
            order = sorted(members, key=lambda n, m=members: (m[n], n))
            glo = lead + ((order.index(name),) if n_parts[(f.rank, f.local)] > 1 or not lead else ())
            frags.append(Fragment(spec.quant.global_scale, f.rank, (0,), (1,), f.local + gsuffix, glo))
    return frags


def _packed_locals(layout: Layout, holds: dict, chosen: set[str], locs: dict, n_parts: dict, fmt: QuantFormat,
                   scale_suffix: str, gsuffix: str) -> None:
    """Into ``locs``: each local tensor holding chosen tensors becomes packed values, plus its block-scale and
    global-scale local tensors (a name already taken is refused)."""
    for (rank, local), names in holds.items():
        if not names & chosen:
            continue
        ls = locs[(rank, local)]
        extra = len(ls.shape) - len(layout.specs[next(iter(names))].shape)
        locs[(rank, local)] = LocalSpec(rank, local, _half(ls.shape, fmt.pack), fmt.value_dtype)
        for nm in (local + scale_suffix, local + gsuffix):
            if (rank, nm) in locs:
                raise ValueError(f"block_quant_layout: local tensor {nm!r} on rank {rank} already exists")
        locs[(rank, local + scale_suffix)] = LocalSpec(
            rank, local + scale_suffix, ls.shape[:-1] + (ls.shape[-1] // fmt.block,), fmt.scale_dtype)
        n = n_parts[(rank, local)]
        lead_shape = ls.shape[:extra]
        gshape = lead_shape + (n,) if (n > 1 or not lead_shape) else lead_shape
        locs[(rank, local + gsuffix)] = LocalSpec(rank, local + gsuffix, gshape, torch.float32)


def _half(box: tuple[int, ...], pack: int) -> tuple[int, ...]:
    return box[:-1] + (box[-1] // pack,) if box else box
