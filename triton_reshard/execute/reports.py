"""What a run or a verify reports, and verify mode's tally of differing elements."""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import ops


@dataclass(frozen=True, slots=True)
class RunReport:
    """What one ``run()`` did on this rank (in verify mode: ``unpack_seconds`` / ``local_seconds`` are compares).

    ``steps``: schedule steps this run went through. ``sent_bytes`` / ``recv_bytes``: bytes of the messages
    this rank sent / received, as they went on the wire: packed messages include the alignment padding between
    their chunks (each chunk starts at a multiple of ``plan.ALIGN`` = 16 bytes), so they can exceed the payload
    that ``Plan.stats().sent_bytes[rank]`` counts (e.g. 240 vs 224). ``local_bytes``: bytes copied from this
    rank's own source tensors into its destination tensors (no wire). ``staging_bytes``: the send + receive
    staging areas this rank holds (allocated once, reused; at most ``bucket_bytes``), plus, for block-quantized
    destinations, the regions of straddling blocks it stages to quantize (not bounded by the bucket). ``seconds``: the whole
    run on this rank, handshake included; the ``*_seconds`` below are parts of it. ``ignored``: destination
    tensors ``refit`` was given that the destination layout does not cover on this rank (sorted;
    ``Resharder.run`` itself takes none)."""

    rank: int
    steps: int
    sent_bytes: int
    recv_bytes: int
    local_bytes: int
    staging_bytes: int
    seconds: float
    pack_seconds: float = 0.0  # time in pack copies (host-side; on CUDA: launch time only)
    wire_seconds: float = 0.0  # time from posting a step's sends/receives until they completed
    unpack_seconds: float = 0.0
    local_seconds: float = 0.0
    in_place_bytes: int = 0  # of sent_bytes + recv_bytes: moved straight from/into the tensors, not staged
    ignored: tuple[str, ...] = ()
    # delta refits (execute/delta.py): "dense" (no delta asked), "delta" (changed elements only, from version
    # delta_base), "dense-fallback" (a delta was asked, the fence refused it: ``fallback`` says why, the same
    # on every rank). ``dense_sent_bytes``: what a dense refit sends from this rank (0 when no delta was asked);
    # with ``mode == "delta"``, ``sent_bytes`` counts the delta messages and their 8-byte length announcements
    mode: str = "dense"
    fallback: str | None = None
    delta_base: int | None = None
    dense_sent_bytes: int = 0
    # a delta into NVFP4 destinations: the global-scale groups whose per-tensor scale moved since the snapshot
    # (every block of those tensors changed: their chunks went dense inside the block-delta messages)
    rescaled: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Difference:
    """The first element of one destination local tensor that differs from what the reshard would write.

    ``tensor`` + ``offsets``/``sizes``: the logical box (one chunk of one transfer) it was found in; ``index``:
    the element's index in the logical tensor; ``local_index``: in the local tensor ``local``. ``expected``:
    the value the reshard would write, ``actual``: the value held (Python scalars of the destination dtype),
    with their raw bits (unsigned)."""

    local: str
    tensor: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    index: tuple[int, ...]
    local_index: tuple[int, ...]
    expected: object
    actual: object
    expected_bits: int
    actual_bits: int

    def __str__(self) -> str:
        box = ", ".join(f"{o}:{o + n}" for o, n in zip(self.offsets, self.sizes, strict=True))
        width = max(len(f"{self.expected_bits:x}"), len(f"{self.actual_bits:x}"))
        return (
            f"first in {self.tensor}[{box}] at {self.tensor}{list(self.index)} ({self.local}{list(self.local_index)}): "
            f"the reshard would write {self.expected!r} (bits 0x{self.expected_bits:0{width}x}), it holds "
            f"{self.actual!r} (bits 0x{self.actual_bits:0{width}x})"
        )


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """What one ``verify()`` found on this rank. Nothing was written.

    ``ok``, ``total_mismatches`` and ``mismatches_by_rank`` are the same on every rank of the group.
    ``mismatches``: {destination local tensor: number of elements that differ bit for bit} on this rank (only
    tensors with differences; empty when ok). ``differences``: the first differing element of each of those
    tensors. ``compared_elements``: destination elements this rank compared (every element the destination
    layout covers on it). ``stats``: the run statistics of the verify pass. ``ignored``: as in
    :class:`RunReport`. ``message`` / ``str()``: a readable summary.
    """

    ok: bool
    rank: int
    mismatches: dict[str, int]
    total_mismatches: int
    mismatches_by_rank: dict[int, int]
    compared_elements: int
    differences: dict[str, Difference]
    stats: RunReport
    ignored: tuple[str, ...] = ()

    @property
    def message(self) -> str:
        bad = {r: n for r, n in self.mismatches_by_rank.items() if n}
        if self.ok:
            head = (f"verify: OK, rank {self.rank}: all {self.compared_elements} destination elements match bit for "
                    f"bit; so do the other ranks ({len(self.mismatches_by_rank)} in all)")
        else:
            mine = sum(self.mismatches.values())
            head = (f"verify: MISMATCH, {self.total_mismatches} elements differ over ranks {sorted(bad)} "
                    f"(by rank: {bad}); rank {self.rank}: {mine} of {self.compared_elements} compared elements differ")
        lines = [head]
        for local, n in sorted(self.mismatches.items()):
            lines.append(f"  {local!r}: {n} elements differ; {self.differences[local]}")
        if self.ignored:
            lines.append(f"  ignored (not in the destination layout on rank {self.rank}): {list(self.ignored)}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.message


@dataclass
class Tally:
    """Verify mode's sink: counts differing elements per destination local tensor, keeps the first of each."""

    counts: dict[str, int] = field(default_factory=dict)
    first: dict[str, Difference] = field(default_factory=dict)
    compared: int = 0

    def compare(self, pairs, meta) -> None:
        for n, (got, have), (local, tensor, off, loc_off) in zip(ops.compare_views(pairs), pairs, meta, strict=True):
            self.compared += have.numel()
            if not n:
                continue
            self.counts[local] = self.counts.get(local, 0) + n
            idx, want, held, want_bits, held_bits = ops.first_difference(got, have)
            extra = len(loc_off) - len(idx)
            lidx = loc_off[:extra] + tuple(a + b for a, b in zip(loc_off[extra:], idx, strict=True))
            old = self.first.get(local)
            if old is None or lidx < old.local_index:
                self.first[local] = Difference(
                    local, tensor, off, tuple(have.shape), tuple(a + b for a, b in zip(off, idx, strict=True)),
                    lidx, want, held, want_bits, held_bits,
                )
