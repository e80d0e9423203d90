"""The torch reference copy: one ``Tensor.copy_`` per ``(src_view, dst_view)`` pair (casts like ``.to``).

Both copy backends use it (``ops.copy_views`` for ``"torch"``; ``triton_copy`` for the pairs its kernel does not
handle), so it sits below both: ``ops`` -> ``triton_copy`` -> ``torch_copy``, one way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Pair = tuple[torch.Tensor, torch.Tensor]


def torch_copy_views(pairs: Sequence[Pair]) -> None:
    """Reference: copy every ``src`` view into its ``dst`` view with ``Tensor.copy_`` (casts like ``.to``)."""
    for src, dst in pairs:
        if src.numel():
            dst.copy_(src)
