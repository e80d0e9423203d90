"""Layout: what is where.

A :class:`Layout` describes, for a set of named *logical* tensors (global shape, dtype), which ranks hold
which *box* of each one and where that box sits inside which *local* tensor on that rank. Everything is a
box: TP/PP/EP/DP sharding, fused QKV or gate_up, interleaved GQA groups and padded vocabularies are all just
lists of :class:`Fragment` s. Special cases belong in layout builders (``from_placements``, presets), never
in the planner or the kernels. Layouts are immutable, validated on construction and hashable, so plans can
be cached on them.

One storage: every layout is numpy columns (``columns``), however it was built (``ColumnBuilder`` for the
presets, ``Layout(tensors, fragments, locals)`` / ``from_fragments`` / ``from_placements`` / ``merge`` /
``restrict`` from objects, converted once); validated once, on the columns (``check.columns_valid``; the eager
``check.check_layout`` words a refusal, naming tensor and rank).

The query interface, what the planner (``plan/``) reads, answered from the columns:

- identity: ``digest``, ``fingerprint``, ``==`` / ``hash``, ``ranks``;
- the logical tensors: ``tensors``, ``specs`` / ``spec(name)``, ``quantized``, ``scale_of``, ``tensor_order()``,
  ``shapes_and_dtypes()``, ``same_tensors(other)``;
- tensors on a rank: ``tensor_names_on_rank(rank)``, ``fragments_on_rank(rank)``;
- fragments overlapping a box, holders of a box: ``table(name)`` (a :class:`FragmentTable`: ``overlapping``,
  ``boxes``), ``overlapping(name, offsets, sizes)``, ``tensor_rows(names)``;
- local shapes: ``local_specs(rank)``, ``local_spec(rank, name)``, ``local_shape_columns(ranks, names, codes)``.

The object view, built from the columns on first use and kept (``objects_built``; ``release_objects()`` drops
it): ``fragments``, ``locals``, ``fragments_by_tensor``, ``fragments_by_local``: for users, the whole plan's
block-quantized tensors and its validation; a plain preset pair is planned (whole plan and shares) without it.

- ``columnar``: :class:`Layout` (``ColumnarLayout``: the same class, its former name);
- ``objects``: the object-facing constructors (``LayoutBuilders``) and ``to_columns``;
- ``builder``: :class:`ColumnBuilder`, which builds a layout per family of tensors (the presets);
- ``check``: the validation (vectorized on the columns, and the eager checks that word a refusal);
- ``block_quant``: :func:`block_quant_layout`, the block-quantized form of a layout (block FP8, MXFP8, NVFP4).
"""

from ..box import box_slices, boxes_overlap, find_overlap
from .block_quant import block_quant_layout
from .builder import ColumnBuilder
from .check import check_fragment, check_layout, misaligned_block, overlap_free, validate_quant_fragments
from .columnar import ColumnarLayout, Layout, columnar
from .columns import LogicalTensors, numel_of, trusted_spec
from .formats import (
    FORMATS,
    FP8_BLOCK,
    MXFP8,
    NVFP4,
    PLAN_FORMAT,
    QUANT_FORMATS,
    QuantFormat,
    format_of_tag,
    quant_format,
)
from .fragment_table import FragmentTable, content_fingerprint
from .specs import (
    FRAG_KEY,
    MAX_TENSOR_BYTES,
    QUANT_DTYPE,
    SCALE_DTYPE,
    BlockQuant,
    Fragment,
    LocalSpec,
    Placement,
    Replicate,
    Shard,
    TensorSpec,
    as_shape,
    block_scale_box,
    check_bytes,
    check_names,
    chunk_range,
    dtype_name,
    gc_paused,
    itemsize_of,
    nested_box,
    scale_shape,
    slot_setters,
    trusted_fragment,
)

__all__ = [
    "FORMATS", "FP8_BLOCK", "FRAG_KEY", "MAX_TENSOR_BYTES", "MXFP8", "NVFP4", "QUANT_DTYPE", "PLAN_FORMAT", "QUANT_FORMATS", "QuantFormat",
    "SCALE_DTYPE", "format_of_tag", "quant_format", "BlockQuant", "ColumnBuilder", "ColumnarLayout",
    "Fragment", "FragmentTable", "Layout", "LocalSpec", "LogicalTensors", "Placement", "Replicate", "Shard",
    "TensorSpec", "as_shape", "block_quant_layout", "block_scale_box", "box_slices", "boxes_overlap",
    "check_bytes", "check_fragment", "check_layout", "check_names", "chunk_range", "columnar",
    "content_fingerprint", "dtype_name", "find_overlap", "gc_paused", "itemsize_of", "misaligned_block",
    "nested_box", "numel_of", "overlap_free", "scale_shape", "slot_setters", "trusted_fragment", "trusted_spec",
    "validate_quant_fragments",
]
