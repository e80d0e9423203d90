"""Layout: what is where.

A :class:`Layout` describes, for a set of named *logical* tensors (global shape, dtype), which ranks hold
which *box* of each one and where that box sits inside which *local* tensor on that rank. Everything is a
box: TP/PP/EP/DP sharding, fused QKV or gate_up, interleaved GQA groups and padded vocabularies are all just
lists of :class:`Fragment` s. Special cases belong in layout builders (``from_placements``, presets), never
in the planner or the kernels. Layouts are immutable, validated on construction and hashable, so plans can
be cached on them.

Two storages behind one query interface (``table``, ``fragments_on_rank``, ``tensor_names_on_rank``,
``local_specs``, ``fragments_by_tensor``), the one the planner reads:

- ``objects``: :class:`Layout`, Python objects (the eager layout);
- ``columnar``: :class:`ColumnarLayout`, the same layout as numpy columns (``columns``) for thousand-rank
  worlds, built per family of tensors by :class:`ColumnBuilder` (``builder``);
- ``check``: the validation of both (eager, and the same checks vectorized);
- ``block_quant``: :func:`block_quant_layout`, the block-quantized form of a layout (block FP8, MXFP8, NVFP4).
"""

from ..box import box_slices, boxes_overlap, find_overlap
from .block_quant import block_quant_layout
from .builder import ColumnBuilder
from .check import check_layout, overlap_free
from .columnar import ColumnarLayout, columnar
from .columns import LogicalTensors, numel_of, trusted_spec
from .fragment_table import FragmentTable, content_fingerprint
from .objects import Layout
from .specs import (
    FP8_BLOCK,
    FRAG_KEY,
    MAX_TENSOR_BYTES,
    MXFP8,
    NVFP4,
    QUANT_DTYPE,
    QUANT_FORMATS,
    SCALE_DTYPE,
    BlockQuant,
    Fragment,
    LocalSpec,
    Placement,
    QuantFormat,
    Replicate,
    Shard,
    TensorSpec,
    as_shape,
    block_scale_box,
    check_bytes,
    check_fragment,
    check_names,
    chunk_range,
    dtype_name,
    gc_paused,
    itemsize_of,
    misaligned_block,
    nested_box,
    quant_format,
    scale_shape,
    slot_setters,
    trusted_fragment,
    validate_quant_fragments,
)

__all__ = [
    "FP8_BLOCK", "FRAG_KEY", "MAX_TENSOR_BYTES", "MXFP8", "NVFP4", "QUANT_DTYPE", "QUANT_FORMATS", "QuantFormat",
    "SCALE_DTYPE", "quant_format", "BlockQuant", "ColumnBuilder", "ColumnarLayout",
    "Fragment", "FragmentTable", "Layout", "LocalSpec", "LogicalTensors", "Placement", "Replicate", "Shard",
    "TensorSpec", "as_shape", "block_quant_layout", "block_scale_box", "box_slices", "boxes_overlap",
    "check_bytes", "check_fragment", "check_layout", "check_names", "chunk_range", "columnar",
    "content_fingerprint", "dtype_name", "find_overlap", "gc_paused", "itemsize_of", "misaligned_block",
    "nested_box", "numel_of", "overlap_free", "scale_shape", "slot_setters", "trusted_fragment", "trusted_spec",
    "validate_quant_fragments",
]
