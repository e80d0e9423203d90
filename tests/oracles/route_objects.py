"""The routing rule over the objects: every destination box of every tensor routed one at a time by
``holders.route_box`` into :class:`~triton_reshard.plan.types.Transfer` objects (what the package's ``route_all``
was). The package routes on the columns (``plan/rows.py:route_tables``, the whole plan and a rank's share);
``tests/test_plan_rows.py`` compares the two on the presets and on random layouts."""

from __future__ import annotations

from collections.abc import Sequence

from triton_reshard.layout import Layout
from triton_reshard.plan.holders import route_box
from triton_reshard.plan.index import TensorIndex, check_own_overlaps
from triton_reshard.plan.relay import relay_dtype
from triton_reshard.plan.routing import wire_dtype_of
from triton_reshard.plan.types import Transfer


def route_all(src: Layout, dst: Layout, gpn: int | None, relay: bool, groups: dict[int, int],
              names: Sequence[str] | None = None) -> tuple[list[Transfer], list[Transfer]]:
    """Every rank's ``(local copies, wire transfers)`` as lists of objects: ``route_box`` over every destination
    box of every tensor (``names``: of those tensors only)."""
    local: list[Transfer] = []
    wire: list[Transfer] = []
    order = dst.tensor_order()
    for name in (names if names is not None else [spec.name for spec in dst.tensors]):
        dix = TensorIndex(dst, name)
        if not dix.boxes:
            continue
        check_own_overlaps(name, [f for b in dix.boxes for f in dix.by_box[b]])
        spec, sspec = dst.specs[name], src.specs[name]
        wdt = wire_dtype_of(sspec, spec)
        rdt = relay_dtype(sspec.dtype, spec.dtype, wdt) if relay else None
        six = TensorIndex(src, name)
        for box in dix.boxes:
            route_box(name, box, dix.group(name, box), six.overlapping(*box), wdt, rdt, gpn, groups, local, wire,
                      base=order[name])
    return local, wire
