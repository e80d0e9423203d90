"""What the Triton launchers of every op share: the interpreter switch, the kernel module in the current
mode, a group's base-pointer view, and the LRU cache of per-list device tables."""

from __future__ import annotations

import importlib.util
import os
import sys
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


_TWINS: dict[tuple[str, bool], ModuleType] = {}  # (kernel module, interpreted) -> its twin in that mode


def kernel_module(module: ModuleType, kernel: str) -> ModuleType:
    """``module`` (a ``triton_reshard.kernels`` module, imported as usual) with its ``@triton.jit`` functions
    in the current mode.

    ``@triton.jit`` picks compiled or interpreted when a module runs. A process whose mode is the one it
    imported the kernels in (every process that sets ``TRITON_INTERPRET`` before it starts) gets ``module``
    itself. One that changed ``TRITON_INTERPRET`` after the import (the kernel tests switch per test) gets the
    module's twin in the other mode: the same file run once more under its own name and kept, so that
    ``kernel`` and the device functions it calls agree with the mode. Nothing is reloaded: the imported module
    and every object taken from it stay as they are, and switching back and forth compiles nothing again."""
    from triton.runtime.interpreter import InterpretedFunction

    mode = interpreting()
    if isinstance(getattr(module, kernel), InterpretedFunction) == mode:
        return module
    key = (module.__name__, mode)
    twin = _TWINS.get(key)
    if twin is None:
        name = f"{module.__name__}.__{'interpreted' if mode else 'compiled'}__"
        spec = importlib.util.spec_from_file_location(name, module.__file__)
        twin = importlib.util.module_from_spec(spec)
        sys.modules[name] = twin  # as an import would: inspect and triton find the module by name
        spec.loader.exec_module(twin)
        _TWINS[key] = twin
    return twin


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
