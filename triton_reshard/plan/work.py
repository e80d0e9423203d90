"""A rank's work: everything the executor needs from a plan to move one rank's bytes, for given staging
options, so that the executor carries the plan out and plans nothing.

:func:`rank_work` gives the rank's schedule steps (cut for the per-slot cap), its local copies, the
block-quantized regions it stages and quantizes itself (with which transfers fill each), and
:meth:`RankWork.local_chunks`, the sub-boxes a local copy is cut into when verify bounds its temporaries.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..box import split_box
from ..layout import BlockQuant
from .options import StepBudget
from .quant import QUANT_SRC, QuantRegion, plan_targets, quant_regions, split_src_chunks
from .types import ALIGN, RankStep, Schedule, Transfer

MAX_CHUNKS = 1 << 22  # a plan cut into more chunks than this is refused (scheduling it would not finish)


@dataclass(frozen=True, slots=True)
class RankWork:
    """What rank ``rank`` carries out of a plan with ``slots`` staging slots of ``slot_bytes`` each.

    ``steps``: ``(index in schedule.steps, the rank's part)`` of the steps it takes part in (step k of
    those uses staging slot ``k % slots``); ``phases``: their phases (1: relays). ``local``: its local
    copies (destination on this rank). ``regions``: the quantization regions it stages (``plan/quant.py``);
    ``wire_region``: transfer index -> region of its destination-quantized received pieces; ``local_region``:
    per local copy, its region (None for others). ``quant``: the :class:`~triton_reshard.layout.BlockQuant` of
    each quantized destination tensor (format, block, scale rule, scale tensor).
    """

    rank: int
    slots: int
    slot_bytes: int
    schedule: Schedule
    steps: tuple[tuple[int, RankStep], ...]
    phases: tuple[int, ...]
    local: tuple[Transfer, ...]
    local_bytes: int
    regions: tuple[QuantRegion, ...]
    wire_region: Mapping[int, int]
    local_region: tuple[int | None, ...]
    quant: Mapping[str, BlockQuant]
    # formats with a global scale (NVFP4): every group of the plan (sorted: the same on every rank), this rank's
    # source boxes of each group's tensors (group, source local, local offsets, sizes: its amax inputs), and the
    # global-scale fragments it holds (group, global-scale tensor, destination local, local offsets)
    global_groups: tuple[str, ...] = ()
    amax_sources: tuple[tuple, ...] = ()
    global_dst: tuple[tuple, ...] = ()

    @property
    def verify_cap(self) -> int:
        """Bytes of the pieces verify compares a local copy in: half a bucket (aligned)."""
        return max(ALIGN, self.slot_bytes * self.slots // 2 // ALIGN * ALIGN)

    def local_chunks(self, t: Transfer, itemsize: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """Local copy ``t`` cut into sub-boxes (offsets relative to ``t``, sizes) of at most
        :attr:`verify_cap` bytes of ``itemsize`` elements; a source-quantized one only at block multiples."""
        if t.quant == QUANT_SRC:
            return [(off, size) for off, size, _n in split_src_chunks(t, self.verify_cap)]
        return split_box(t.sizes, itemsize, self.verify_cap)


def check_chunk_count(plan, slot_bytes: int) -> None:
    """Raise ``ValueError`` for a plan that buckets of ``slot_bytes`` would cut into more than ``MAX_CHUNKS``
    chunks (scheduling it would take hours; no real refit needs this many steps)."""
    wire_bytes = sum(t.nbytes for t in plan.transfers)
    chunks = wire_bytes // slot_bytes
    if chunks > MAX_CHUNKS:
        raise ValueError(f"Resharder: {wire_bytes} wire bytes in buckets of "
                         f"{slot_bytes} B would need ~{chunks} chunks (more than {MAX_CHUNKS}): raise bucket_bytes")


def rank_work(plan, rank: int, budget: StepBudget) -> RankWork:
    """The work of ``rank`` in ``plan`` (the whole ``Plan`` or ``rank``'s share of it) within ``budget`` (its
    ``slots`` staging slots of ``slot_bytes``, the schedule's per-step cap; see :func:`check_chunk_count` for
    the plans it refuses)."""
    schedule = plan.schedule(budget)
    mine, _send_area, _recv_area = schedule.for_rank(rank)
    steps = tuple((i, st) for i, st in enumerate(mine) if st.sends or st.recvs)
    local_idx = [i for i, t in enumerate(plan.local_copies) if t.dst_rank == rank]
    regions = quant_regions(plan).get(rank, ()) if plan.dst.quantized else ()
    wire_region: dict[int, int] = {}
    of_local: dict[int, int] = {}
    for k, g in enumerate(regions):
        for i in g.wire:
            wire_region[i] = k
        for i in g.local:
            of_local[i] = k
    local = tuple(plan.local_copies[i] for i in local_idx)
    return RankWork(
        rank=rank, slots=budget.slots, slot_bytes=budget.slot_bytes, schedule=schedule, steps=steps,
        phases=tuple(schedule.step_phase(i) for i, _st in steps), local=local,
        local_bytes=sum(t.nbytes for t in local), regions=regions, wire_region=wire_region,
        local_region=tuple(of_local.get(i) for i in local_idx),
        quant={n: s.quant for n, s in plan.dst.quantized.items()},
        **_globals(plan, rank),
    )


def _globals(plan, rank: int) -> dict:
    """``rank_work``'s global-scale fields (empty for plans without a global-scale format)."""
    if not any(s.quant.global_scale for s in plan.dst.quantized.values()):
        return {}
    targets = plan_targets(plan)
    groups = sorted({t.quant.global_group for t in targets.values() if t.quant.global_group})
    src_of, dst_of = [], []
    for name in sorted(targets):
        q = targets[name].quant
        if not q.global_group:
            continue
        src_of += [(q.global_group, f.local, f.local_offsets, f.sizes)
                   for f in plan.src.fragments_by_tensor.get(name, ()) if f.rank == rank and f.numel]
        dst_of += [(q.global_group, q.global_scale, f.local, f.local_offsets)
                   for f in plan.dst.fragments_by_tensor.get(q.global_scale, ()) if f.rank == rank]
    return dict(global_groups=tuple(groups), amax_sources=tuple(src_of), global_dst=tuple(dst_of))
