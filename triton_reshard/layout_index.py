"""The columnar layout's names at their old path (they live in :mod:`triton_reshard.layout`: ``columnar``,
``columns``, ``builder``, ``check``); kept so that ``from triton_reshard.layout_index import ...`` works."""

from .layout.builder import ColumnBuilder
from .layout.check import overlap_free
from .layout.columnar import ColumnarLayout, columnar
from .layout.columns import LogicalTensors, numel_of, trusted_spec

__all__ = ["ColumnBuilder", "ColumnarLayout", "LogicalTensors", "columnar", "numel_of", "overlap_free", "trusted_spec"]
