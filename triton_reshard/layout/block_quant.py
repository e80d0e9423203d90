"""Block-quantized layouts: :func:`block_quant_layout` turns chosen tensors of a layout into quantized tensors
with a per-block scale tensor beside each, in one :class:`~triton_reshard.specs.QuantFormat` (the DeepSeek-V3 /
vLLM block-FP8 format, MXFP8, NVFP4)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence

from ..specs import (
    FP8_BLOCK,
    BlockQuant,
    QuantFormat,
    Fragment,
    LocalSpec,
    TensorSpec,
    block_scale_box,
    dtype_name,
    gc_paused,
    misaligned_block,
    quant_format,
    scale_shape,
)
from .objects import Layout


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

    ``format``: the :class:`~triton_reshard.specs.QuantFormat` (or its name). Block FP8 takes ``block`` and
    ``ue8m0``; MXFP8 blocks 1x32 along the last dim with one E8M0 byte per block (uint8 scales, vLLM's
    ``weight_scale``; ``block`` is ignored). ``scale_suffix`` defaults to ``"_scale_inv"`` for block FP8 and
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
        raise NotImplementedError(f"block_quant_layout: format {fmt.name!r} is built by its own layout function")
    if scale_suffix is None:
        scale_suffix = "_scale_inv" if fmt is FP8_BLOCK else "_scale"
    if fmt.block is not None:
        block = (fmt.block,)
    if not isinstance(scale_suffix, str) or not scale_suffix:
        raise ValueError(f"block_quant_layout: scale_suffix must be a non-empty str, got {scale_suffix!r}")
    specs = _quantized_specs(layout, chosen, tuple(block), scale_suffix, ue8m0, fmt)
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


def _quantized_specs(layout: Layout, chosen: set[str], block: tuple[int, ...], scale_suffix: str,
                     ue8m0: bool, fmt: QuantFormat) -> dict[str, TensorSpec]:
    """The layout's tensor specs by name, the chosen ones quantized with their :class:`BlockQuant`."""
    specs: dict[str, TensorSpec] = {}
    for t in layout.tensors:
        if t.name not in chosen:
            specs[t.name] = t
            continue
        if t.quant is not None:
            raise ValueError(f"block_quant_layout: tensor {t.name!r} is already quantized")
        if not t.dtype.is_floating_point:
            raise ValueError(f"block_quant_layout: tensor {t.name!r} is {dtype_name(t.dtype)}, not floating point")
        if fmt.block is not None and t.shape and t.shape[-1] % fmt.block:
            raise ValueError(f"block_quant_layout: tensor {t.name!r} {t.shape}: {fmt.name} needs a last dim of whole "
                             f"blocks of {fmt.block} (vLLM refuses it too)")
        q = TensorSpec(t.name, t.shape, fmt.value_dtype, BlockQuant(block, t.name + scale_suffix, ue8m0, fmt))
        specs[t.name] = q
    return specs


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
