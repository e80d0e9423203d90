"""Integrations with live frameworks: layouts read off real engines, framework plug-ins.

Framework knowledge lives here and in ``presets``, never in the planner or the kernels. Nothing here imports
a framework at module import time: each integration imports it when called. What every plug-in does the same
way (join the refit group, exchange layouts, plan the pair, delta options) is the integration kit,
:mod:`.engine`, with :mod:`.stage` (both sides of one update: staging mirror, vote, torn refusal).
"""

from .megatron import layout_from_megatron, megatron_layout_args
from .record import LoadRecord, checkpoint_shapes, layout_from_records, record_load

__all__ = [
    "LoadRecord",
    "checkpoint_shapes",
    "layout_from_megatron",
    "layout_from_records",
    "megatron_layout_args",
    "record_load",
]
