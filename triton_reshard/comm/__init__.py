"""The control plane: who is in a refit group and proves it (``secret``: where the job's secret comes
from; ``auth``: the store its members prove it to), the group itself with its store,
liveness and versions (``group``), the data-only messages ranks and layout files exchange (``wire``), and
how a group's messages travel (a group's ``post``: gloo/NCCL, and between ranks of one host the shared-memory
``lanes``). What a message holds and where it lands is the data plane's, :mod:`triton_reshard.execute`."""

from .auth import AuthError
from .group import RefitGroup, RefitGroupError, init_refit_group
from .wire import WireError, dumps, load_layout, loads, save_layout

__all__ = [
    "AuthError",
    "RefitGroup",
    "RefitGroupError",
    "WireError",
    "dumps",
    "init_refit_group",
    "load_layout",
    "loads",
    "save_layout",
]
