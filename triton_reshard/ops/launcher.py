"""What the Triton launchers of every op share: the interpreter switch, the kernel module in the current
mode, a group's base-pointer view, and the LRU cache of per-list device tables."""

from __future__ import annotations

import importlib
import os
from collections import OrderedDict
from collections.abc import Callable, Hashable
from types import ModuleType

import torch

BACKENDS = ("torch", "triton")
ENV_VAR = "TRITON_RESHARD_BACKEND"
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def resolve_backend(device: torch.device | str | None, backend: str | None = None) -> str:
    """Pick the copy backend: explicit argument > ``TRITON_RESHARD_BACKEND`` > by device type."""
    choice = backend or os.environ.get(ENV_VAR) or None
    if choice is not None:
        if choice not in BACKENDS:
            raise ValueError(f"unknown copy backend {choice!r}; expected one of {BACKENDS}")
        return choice
    dev = torch.device(device) if device is not None else torch.device("cpu")
    return "triton" if dev.type == "cuda" else "torch"


def bits(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as a signed integer view of the same element size (no copy; any strides)."""
    return t.view(_INT_OF_SIZE[t.element_size()])


def interpreting() -> bool:
    """True when Triton runs kernels with its CPU interpreter (``TRITON_INTERPRET=1``)."""
    from triton import knobs  # triton is imported only by the Triton backend

    return bool(knobs.runtime.interpret)


def kernel_module(module: ModuleType, kernel: str) -> ModuleType:
    """``module`` (a ``kernels/`` module) with its ``@triton.jit`` functions in the current mode.

    ``@triton.jit`` picks compiled or interpreted when the module is imported; if the mode changed since
    (``TRITON_INTERPRET`` set after the import, as the kernel tests do), the module is reloaded so that the
    kernel ``kernel`` and the device functions it calls agree with the mode."""
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(getattr(module, kernel), InterpretedFunction) != interpreting():
        module = importlib.reload(module)
    return module


def storage_view(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A one-element ``dtype`` view at the start of ``t``'s storage: the base pointer of a group."""
    return t.view(dtype).as_strided((1,), (1,), 0)


def cached_table(cache: OrderedDict, key: Hashable, signature: Callable[[], tuple], build: Callable[[], object],
                 size: int):
    """The table cached under ``key`` if its ``.signature`` is ``signature()``, else ``build()`` (cached, the
    least recently used entry dropped beyond ``size``)."""
    table = cache.get(key)
    if table is None or table.signature != signature():
        table = build()
        cache[key] = table
        if len(cache) > size:
            cache.popitem(last=False)
    cache.move_to_end(key)
    return table
