"""The sender's snapshot for delta refits (issue 24): what it last published, per local tensor, and when.

A :class:`Snapshot` holds, for every local tensor a sender publishes, a bit copy **on the tensor's own
device** with the same shape and strides, so that any view of the tensor (a transfer box) has the same view
into the snapshot (:meth:`Snapshot.pairs`) and the delta kernels compare the two elementwise. Cost: 1× the
bytes of the shard it covers, in device memory (a bf16 shard of 8 GB needs 8 GB more); one dense device
copy per :meth:`capture`. Pinned host memory would save the device memory but put the comparison on the
far side of PCIe (every refit would read the whole shard over the bus, ~50× slower than HBM): not offered.

Versions: ``version`` is the version the snapshot holds (None: nothing published yet). After a dense
refit of version ``v``: ``capture(v)``. After a delta refit from ``v`` to ``w`` whose packs were made with
``update=True`` (every published box packed once): ``advance(v, w)``; if one box went to several
destinations, pack every message with ``update=False`` and ``capture(w)`` after the last (a box packed
with ``update=True`` would be compared against itself by the second message). A snapshot must not be
advanced past a refit that failed: the destinations then hold neither version (torn), and only a dense
refit (``capture``) makes it a base again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .delta import Pair
from .launcher import bits


class Snapshot:
    """Bit copies of the local tensors a sender publishes, with the version they hold."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self._src: dict[str, torch.Tensor] = {}
        self._snap: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            snap = torch.empty_like(t, memory_format=torch.preserve_format)
            if snap.stride() != t.stride():
                raise ValueError(f"snapshot of {name!r}: shape {tuple(t.shape)} with strides {t.stride()} "
                                 "is not dense and non-overlapping; snapshot a dense tensor")
            self._src[name], self._snap[name] = t, snap
        self.version: int | None = None

    @property
    def nbytes(self) -> int:
        """Device bytes the snapshot holds (1× the covered tensors)."""
        return sum(t.numel() * t.element_size() for t in self._snap.values())

    def names(self) -> list[str]:
        return list(self._snap)

    def tensor(self, name: str) -> torch.Tensor:
        """The snapshot of local tensor ``name`` (same shape, strides, dtype and device)."""
        return self._snap[name]

    def capture(self, version: int) -> None:
        """Copy every tensor's current bits: the snapshot now holds ``version`` (after a dense refit, or
        after delta messages packed with ``update=False``)."""

        for name, t in self._src.items():
            bits(self._snap[name]).copy_(bits(t))
        self.version = version

    def advance(self, base: int, version: int) -> None:
        """Record that a delta refit from ``base`` to ``version``, packed with ``update=True``, completed."""
        if self.version is None or self.version != base:
            raise ValueError(f"snapshot holds version {self.version}; a delta from {base} cannot advance it")
        if version <= base:
            raise ValueError(f"snapshot versions increase: {base} -> {version}")
        self.version = version

    def view(self, name: str, view: torch.Tensor) -> torch.Tensor:
        """The view of ``name``'s snapshot that ``view`` is of the local tensor ``name``."""
        if name not in self._src:
            raise KeyError(f"no snapshot of {name!r} (have {sorted(self._src)})")
        base, snap = self._src[name], self._snap[name]
        if view.untyped_storage().data_ptr() != base.untyped_storage().data_ptr() or view.dtype != base.dtype:
            raise ValueError(f"snapshot of {name!r}: the view is not a view of the local tensor {name!r}")
        offset = view.storage_offset() - base.storage_offset()
        lo = offset + sum((n - 1) * s for n, s in zip(view.shape, view.stride(), strict=True) if s < 0)
        hi = offset + sum((n - 1) * s for n, s in zip(view.shape, view.stride(), strict=True) if s > 0)
        extent = sum((n - 1) * s for n, s in zip(base.shape, base.stride(), strict=True))
        if view.numel() and (lo < 0 or hi > extent):
            raise ValueError(f"snapshot of {name!r}: the view reaches outside the local tensor")
        return snap.as_strided(view.shape, view.stride(), snap.storage_offset() + offset)

    def pairs(self, views: Sequence[tuple[str, torch.Tensor]]) -> list[Pair]:
        """``(view, snapshot view)`` pairs for ``pack_delta``; refused before the first ``capture``."""
        if self.version is None:
            raise ValueError("the snapshot holds no version yet: publish densely and capture() first")
        return [(v, self.view(name, v)) for name, v in views]
