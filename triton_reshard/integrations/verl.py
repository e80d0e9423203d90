"""A verl checkpoint-engine backend: ``checkpoint_engine.backend=triton_reshard``.

verl (>= 0.7; written against verl 0.9.1, ``verl/checkpoint_engine/base.py``) moves weights from the actor
workers to the rollout replicas through a :class:`~verl.checkpoint_engine.CheckpointEngine` chosen by name from
``CheckpointEngineRegistry``. This module registers :class:`TritonReshardCheckpointEngine` under
``"triton_reshard"`` with the registry's own decorator. A verl user changes the rollout's checkpoint-engine
config (the module is imported on every worker before the backend is built, through verl's
``custom_backend_module`` hook)::

    actor_rollout_ref.rollout.checkpoint_engine.backend=triton_reshard
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=triton_reshard.integrations.verl

and optionally ``+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.triton_reshard.<arg>=<value>``
for the constructor's keyword arguments (``dst_layout``, ``senders``, ``host``, ``timeout``, ...).

How verl's interface maps onto ours (``CheckpointEngineManager.update_weights``, every weight update):

* ``prepare()`` on every actor and rollout worker: the master (actor rank 0) picks the refit group's
  ``host:port`` (kept across updates unless ``rebuild_group``); ``build_topology`` (a classmethod, run by the
  manager on the gathered metadata) numbers the refit group: actor ranks ``0..S-1`` (every actor worker with
  ``senders="all"``, only rank 0 with ``"master"``), rollout worker ``w`` rank ``S + w``;
  ``init_process_group(**kwargs)``: :func:`~triton_reshard.init_refit_group` (or the group kept from the last
  update).
* ``send_weights(weights)`` on the actor workers, ``receive_weights()`` on the rollout workers (an async
  generator the rollout's server adapter consumes): one :func:`~triton_reshard.refit` per bucket of
  ``bucket_size`` bytes over the refit group. The source layout is what verl's generator yields: every
  actor worker in the group holds the full tensors (verl's FSDP and Megatron engines gather them on every
  rank), so the planner spreads the sends over all of them instead of broadcasting from rank 0. The
  destination layout: each rollout worker gets the full tensors (default, as verl's own engines), or, with
  ``dst_layout``, only the box of each tensor its own loader reads (the bounding box of its fragments in a
  destination :class:`~triton_reshard.Layout` over rollout ranks ``0..W-1`` in the checkpoint's names, e.g.
  recorded off the vLLM workers with :func:`~triton_reshard.integrations.vllm.layout_from_vllm` /
  :func:`~triton_reshard.integrations.vllm.record_vllm` and saved with :func:`triton_reshard.comm.wire.save_layout`,
  a JSON file: nothing in it is run when it is read): the tensors it
  yields have the full shape, the boxes the loader narrows to are exact and the rest is never sent (left
  uninitialised), so a TP-``k`` rollout receives ~1/k of the bytes.
* A trainer that keeps its sharded weights: :meth:`TritonReshardCheckpointEngine.set_source` (the trainer's
  Layout over actor ranks ``0..A-1`` and this rank's named local tensors, e.g.
  :func:`~triton_reshard.integrations.layout_from_megatron`); ``send_weights`` then sends the boxes each
  rank holds, straight from its local tensors, and leaves verl's generator unused (no gather at all).
* ``finalize()``: drops the step's buffers; destroys the group only with ``rebuild_group=True``.

The secret (``docs/security.md``): every actor and rollout worker reads the refit group's secret from the
environment variable named by ``secret_env`` (default ``TRITON_RESHARD_SECRET``) or the file ``secret_file``
(engine kwargs name where the secret is, never the secret: verl's config is logged). The master listens on a
routable address by default (Ray's node IP), so without a secret ``init_process_group`` refuses to start
unless ``insecure=True``.

Not handled: verl's ``delta_flush`` wire format (this engine yields ``named_tensors``), and LoRA adapter
sync (verl sends merged weights through this path with ``lora.merge=True``).
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

import torch

from ..comm.group import RefitGroup, free_port
from ..comm.secret import SECRET_ENV
from ..layout import Fragment, Layout, TensorSpec
from ..refit import refit
from .engine import delta_options, join_group

BACKEND = "triton_reshard"

try:  # subclass verl's base and register by name when verl is installed; the module imports without it
    from verl.checkpoint_engine.base import CheckpointEngine as _Base
    from verl.checkpoint_engine.base import CheckpointEngineRegistry
except ImportError:  # pragma: no cover - the main test env has no verl
    _Base, CheckpointEngineRegistry = object, None  # type: ignore[assignment,misc]


# ---------------------------------------------------------------------------------------------------------
# layouts (pure: no group, no verl)
# ---------------------------------------------------------------------------------------------------------

Meta = tuple[str, tuple[int, ...], torch.dtype]


def read_boxes(dst_layout: Layout) -> dict[tuple[int, str], tuple[tuple[int, ...], tuple[int, ...]]]:
    """``{(rank, tensor): (offsets, sizes)}``: the bounding box of every tensor's fragments on each rank of a
    destination layout (what that rank's loader reads of the tensor; a superset where it reads several
    disjoint boxes of one tensor)."""
    lo: dict[tuple[int, str], list[int]] = {}
    hi: dict[tuple[int, str], list[int]] = {}
    for f in dst_layout.fragments:
        if not f.numel:
            continue
        key = (f.rank, f.tensor)
        ends = [o + s for o, s in zip(f.offsets, f.sizes, strict=True)]
        if key in lo:
            lo[key] = [min(a, b) for a, b in zip(lo[key], f.offsets, strict=True)]
            hi[key] = [max(a, b) for a, b in zip(hi[key], ends, strict=True)]
        else:
            lo[key], hi[key] = list(f.offsets), ends
    return {k: (tuple(lo[k]), tuple(e - o for o, e in zip(lo[k], hi[k], strict=True))) for k in lo}


def destination_layout(metas: Sequence[Meta], rollout_ranks: Sequence[int],
                       boxes: Mapping[tuple[int, str], tuple[tuple[int, ...], tuple[int, ...]]] | None = None
                       ) -> Layout:
    """Every rollout rank holds each tensor full-shaped under its own name; it receives all of it
    (``boxes=None``) or only its box ``boxes[(w, name)]`` (``w``: the rollout rank's index, 0-based)."""
    frags, shapes = [], {}
    for w, rank in enumerate(rollout_ranks):
        for name, shape, _ in metas:
            if boxes is None:
                off, size = (0,) * len(shape), tuple(shape)
            elif (w, name) in boxes:
                off, size = boxes[(w, name)]
            else:
                continue
            frags.append(Fragment(name, rank, off, size, name, off))
            shapes[(rank, name)] = tuple(shape)
    return Layout.from_fragments({n: (s, d) for n, s, d in metas}, frags, shapes)


def replicated_layout(metas: Sequence[Meta], ranks: Sequence[int]) -> Layout:
    """Every one of ``ranks`` holds every tensor in full, under its own name (what verl's generator yields)."""
    specs = [TensorSpec(n, tuple(s), d) for n, s, d in metas]
    frags = [Fragment(n, r, (0,) * len(s), tuple(s)) for r in ranks for n, s, _ in metas]
    return Layout.from_fragments(specs, frags)


def split_buckets(metas: Iterable[Meta], bucket_bytes: int) -> list[list[Meta]]:
    """Consecutive tensors in buckets of at most ``bucket_bytes`` (a bigger tensor is a bucket of its own)."""
    out: list[list[Meta]] = []
    size = bucket_bytes
    for m in metas:
        n = _nbytes(m)
        if not out or size + n > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(m)
        size += n
    return out


def _nbytes(m: Meta) -> int:
    n = 1
    for d in m[1]:
        n *= d
    return n * torch.empty((), dtype=m[2]).element_size()


def _meta(name: str, t: torch.Tensor) -> Meta:
    return name, tuple(t.shape), t.dtype


def _load_layout(obj: Layout | str | os.PathLike | None) -> Layout | None:
    """A Layout, or one read from a JSON layout file (:func:`triton_reshard.comm.wire.save_layout`)."""
    if obj is None or isinstance(obj, Layout):
        return obj
    from ..comm.wire import load_layout

    return load_layout(os.fspath(obj))


async def _aiter(weights) -> AsyncIterator[tuple[str, torch.Tensor]]:
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


# ---------------------------------------------------------------------------------------------------------
# the engine
# ---------------------------------------------------------------------------------------------------------

class TritonReshardCheckpointEngine(_Base):
    """verl checkpoint engine over a refit group (see the module docstring).

    verl builds it as ``CheckpointEngineRegistry.new("triton_reshard", bucket_size=..., is_master=...,
    **engine_kwargs["triton_reshard"])`` (``is_master`` on the actor workers only).

    ``bucket_size``: bytes of tensors per refit (verl's ``update_weights_bucket_megabytes``); also refit's
    staging bound. ``dst_layout``: a destination Layout (or a JSON file of one,
    :func:`triton_reshard.comm.wire.save_layout`) over rollout ranks ``0..W-1`` in the checkpoint's names; ``None``: every rollout rank receives the full tensors.
    ``senders``: ``"all"`` (every actor worker sends a share: verl's generator yields the full tensors on
    each) or ``"master"`` (actor rank 0 sends everything; the others only drain the generator).
    ``host``: the address the master's rendezvous listens on (default: Ray's node IP, else this host's
    name). ``device``: where the rollout side receives (default: CUDA if available). ``group_backend``:
    ``"gloo"`` / ``"nccl"`` (default: NCCL with CUDA). ``fill``: fill the rollout side's fresh buffers
    with this value before each refit (debugging: ``float("nan")`` shows every element nobody wrote).
    ``allow_cast``: as in :func:`~triton_reshard.refit`. ``secret_env`` / ``secret_file``: where this worker
    reads the refit group's secret; ``insecure``: run without one on a routable address (see
    :func:`~triton_reshard.init_refit_group`).

    ``delta``: ``refit``'s ``delta`` (False, True, ``"strict"`` or ``"auto"``; docs/delta.md) with verl's
    ``global_steps`` as the version: after the first update only the changed elements travel. Every actor
    rank's cached Resharder keeps a snapshot of the bytes it sends (1x them, on its device), and every
    rollout worker keeps its receive buffers across updates (1x the bytes it receives, on its device, instead
    of fresh buffers per update: a delta lands on the previous version). Needs the group kept across updates
    (``rebuild_group=False``, the default): a new group means new Resharders, so a dense update.
    """

    wire_format = "named_tensors"

    def __init__(self, bucket_size: int, is_master: bool = False, *, dst_layout: Layout | str | None = None,
                 senders: str = "all", host: str | None = None, port: int = 0, timeout: float = 300.0,
                 rebuild_group: bool = False, group_backend: str | None = None, device: str | None = None,
                 allow_cast: bool = False, fill: float | None = None, secret_env: str | None = SECRET_ENV,
                 secret_file: str | None = None, insecure: bool | None = None, delta: bool | str = False) -> None:
        if delta not in (False, True, "strict", "auto"):
            raise ValueError(
                f"triton_reshard checkpoint engine: delta={delta!r} is not False, True, 'strict' or 'auto'")
        if senders not in ("all", "master"):
            raise ValueError(f"triton_reshard checkpoint engine: senders={senders!r} is not 'all' or 'master'")
        self.bucket_size = int(bucket_size)
        self.is_master = is_master
        self.dst_layout = _load_layout(dst_layout)
        self.boxes = read_boxes(self.dst_layout) if self.dst_layout is not None else None
        self.senders, self.host, self.port, self.timeout = senders, host, int(port), float(timeout)
        self.rebuild_group, self.group_backend, self.allow_cast = rebuild_group, group_backend, allow_cast
        self.fill = fill
        self.secret_env, self.secret_file, self.insecure = secret_env, secret_file, insecure
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.group: RefitGroup | None = None
        self._addr: tuple[str, int] | None = None
        self._where: tuple[str, int] | None = None
        self.rank: int | None = None
        self.world_size = self.num_senders = 0
        self.source: tuple[Layout, Mapping[str, torch.Tensor]] | None = None
        self.reports: list = []
        self.delta, self._version = delta, None
        self._kept: dict[Layout, dict[str, torch.Tensor]] = {}  # delta: the receive buffers, per bucket layout

    # -- verl's rendezvous -------------------------------------------------------------------------------

    def set_source(self, layout: Layout, tensors: Mapping[str, torch.Tensor]) -> None:
        """Send from the trainer's own sharded tensors: ``layout`` over actor ranks ``0..A-1``, ``tensors``
        this rank's local tensors under its local names (call on every actor worker, ``senders="all"``)."""
        self.source = (layout, tensors)

    def _listen(self) -> tuple[str, int]:
        host = self.host
        if host is None:
            try:
                import ray

                host = ray.util.get_node_ip_address().strip("[]") if ray.is_initialized() else None
            except ImportError:
                host = None
            if host is None:
                try:
                    host = socket.gethostbyname(socket.gethostname())
                except OSError:
                    host = "127.0.0.1"
        return host, self.port or free_port(host)

    def prepare(self) -> dict[str, Any]:
        """The master's rendezvous address (the one in use while the group is kept); ``{}`` elsewhere."""
        if not self.is_master:
            return {}
        if self.group is None or self.rebuild_group:
            self._addr = self._listen()
        return {"host": self._addr[0], "port": self._addr[1], "senders": self.senders}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
                       ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Refit-group ranks: the sending actor workers first, then every rollout worker; ``-1``: an actor
        worker outside the group (``senders="master"``)."""
        master = metadata[0]
        if not master or "port" not in master:
            raise ValueError("triton_reshard checkpoint engine: actor rank 0 must be the master (is_master=True)")
        senders = actor_wg_world_size if master["senders"] == "all" else 1
        world = senders + rollout_world_size
        common = {"world_size": world, "host": master["host"], "port": master["port"], "num_senders": senders}
        actor = {"rank": [r if r < senders else -1 for r in range(actor_wg_world_size)]}
        rollout = {"rank": list(range(senders, world))}
        for k, v in common.items():
            actor[k], rollout[k] = [v] * actor_wg_world_size, [v] * rollout_world_size
        return actor, rollout

    def init_process_group(self, rank: int, world_size: int, host: str, port: int, num_senders: int) -> None:
        """Join the refit group (kept from the last update when it is the same group)."""
        same = (self.group is not None and (self.rank, self.world_size, self._where) == (rank, world_size,
                                                                                           (host, port)))
        self.rank, self.world_size, self.num_senders = rank, world_size, num_senders
        if rank < 0 or same:
            return
        if self.group is not None:
            self.group.destroy()
        self._where = (host, port)
        self.group = join_group(host, port, rank, world_size, backend=self.group_backend, timeout=self.timeout,
                                secret_env=self.secret_env, secret_file=self.secret_file, insecure=self.insecure,
                                where=f"triton_reshard checkpoint engine rank {rank}")

    def finalize(self) -> None:
        """Drop the step's state; destroy the group only with ``rebuild_group``."""
        if self.rebuild_group and self.group is not None:
            self.group.destroy()
            self.group = None

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.destroy()
            self.group = None

    # -- one update ------------------------------------------------------------------------------------

    def _gather(self, obj) -> list:
        return self.group.all_gather_object(obj)

    def _refit(self, src: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor], src_layout: Layout,
               dst_layout: Layout):
        kw = delta_options(self._version, self.delta)
        rep = refit(src, dst, src_layout, dst_layout, group=self.group, bucket_bytes=self.bucket_size,
                    timeout=self.timeout, allow_cast=self.allow_cast, **kw)
        self.reports.append(rep)
        return rep

    def _header(self, mine: dict | None) -> dict:
        heads = self._gather(mine)
        actor = heads[: self.num_senders]
        modes = {h["mode"] for h in actor}
        if len(modes) != 1:
            raise RuntimeError(f"triton_reshard checkpoint engine: actor ranks disagree on the source: "
                               f"{[h['mode'] for h in actor]} (call set_source on every actor worker or none)")
        head = actor[0]
        if head["mode"] == "layout":
            bad = [r for r in head["layout"].ranks if r >= self.num_senders]
            if bad:
                raise ValueError(f"triton_reshard checkpoint engine: the trainer layout holds ranks {bad}, but "
                                 f"only actor ranks 0..{self.num_senders - 1} are in the refit group "
                                 f"(set_source needs senders='all')")
        return head

    def _dst_layout(self, metas: Sequence[Meta]) -> Layout:
        rollout = range(self.num_senders, self.world_size)
        if self.boxes is not None:
            missing = sorted({n for n, _, _ in metas} - {n for _, n in self.boxes})
            if missing:
                raise ValueError(f"triton_reshard checkpoint engine: the destination layout reads none of "
                                 f"{missing[:6]} (rank {self.rank})")
        return destination_layout(metas, rollout, self.boxes)

    def _layout_buckets(self, src_layout: Layout) -> list[tuple[Layout, Layout]]:
        metas = [(t.name, t.shape, t.dtype) for t in src_layout.tensors]
        out = []
        for bucket in split_buckets(metas, self.bucket_size):
            names = [n for n, _, _ in bucket]
            out.append((src_layout.restrict(names), self._dst_layout(bucket)))
        return out

    async def send_weights(self, weights, global_steps: int | None = None):
        """Actor side: refit this rank's share of ``weights`` (verl's generator of full named tensors), or
        of the tensors given to :meth:`set_source`, to the rollout workers; returns verl's metrics dict."""
        if self.rank is None:
            raise RuntimeError("triton_reshard checkpoint engine: init_process_group was not called")
        if self.rank >= self.num_senders:
            raise RuntimeError("triton_reshard checkpoint engine: rollout workers do not send weights")
        self.reports = []
        self._version = global_steps
        if self.rank < 0:  # outside the group: producing each weight is collective over the actor group
            async for _ in _aiter(weights):
                pass
            return {}
        if self.source is not None:
            layout, tensors = self.source
            await self._thread(self._header, {"mode": "layout", "layout": layout if self.rank == 0 else None})
            for src_l, dst_l in self._layout_buckets(layout):
                names = src_l.local_specs(self.rank)
                await self._thread(self._refit, {n: tensors[n] for n in names}, {}, src_l, dst_l)
        else:
            await self._thread(self._header, {"mode": "stream"})
            async for bucket in _buckets(_aiter(weights), self.bucket_size):
                await self._thread(self._stream_bucket, [_meta(n, t) for n, t in bucket], dict(bucket), None)
            await self._thread(self._stream_bucket, [], {}, None)
        sent = sum(r.sent_bytes for r in self.reports)
        return {"triton_reshard/sent_bytes": sent, "triton_reshard/refits": len(self.reports)}

    async def _thread(self, fn, *args):
        """Run a blocking exchange or refit off the event loop (on this thread's CUDA device)."""
        dev = torch.cuda.current_device() if self.device.type == "cuda" else None

        def call():
            if dev is not None:
                torch.cuda.set_device(dev)
            return fn(*args)

        return await asyncio.to_thread(call)

    def _stream_bucket(self, mine: list[Meta] | None, src: Mapping[str, torch.Tensor],
                       dst_device: torch.device | None):
        """One bucket of the stream: every rank learns the actor ranks' tensor lists, then one refit.
        Returns ``None`` at the end of the stream, else this rank's received tensors (empty on the actor)."""
        lists = self._gather(mine)
        actor = lists[: self.num_senders]
        if not actor[0]:
            if any(actor):
                raise RuntimeError("triton_reshard checkpoint engine: actor ranks' weight generators ended "
                                   "at different tensors")
            return None
        for r, lst in enumerate(actor):
            if lst != actor[0]:
                raise RuntimeError(f"triton_reshard checkpoint engine: actor rank {r} yields "
                                   f"{[m[0] for m in lst][:4]}..., actor rank 0 {[m[0] for m in actor[0]][:4]}...: "
                                   f"with senders='all' every actor worker must yield the same tensors")
        metas = actor[0]
        src_l = replicated_layout(metas, range(self.num_senders))
        dst_l = self._dst_layout(metas)
        dst = self._buffers(dst_l, dst_device) if dst_device is not None else {}
        self._refit(src, dst, src_l, dst_l)
        return [(n, dst[n]) for n, _, _ in metas if n in dst] if dst_device is not None else []

    def _buffers(self, dst_l: Layout, device: torch.device) -> dict[str, torch.Tensor]:
        """This bucket's receive buffers: fresh each update, or with ``delta`` the ones kept from the last
        update of the same bucket layout (a delta writes only what changed into them)."""
        if not self.delta:
            return dst_l.allocate(self.rank, device, self.fill)
        kept = self._kept.get(dst_l)
        if kept is None or any(t.device != device for t in kept.values()):
            kept = self._kept[dst_l] = dst_l.allocate(self.rank, device, self.fill)
        return kept

    async def receive_weights(self, global_steps: int | None = None):
        """Rollout side: an async generator of ``(name, tensor)``, full-shaped, bucket by bucket (with
        ``dst_layout``: only the box this worker's loader reads is written)."""
        if self.rank is None or self.rank < self.num_senders:
            raise RuntimeError("triton_reshard checkpoint engine: receive_weights on a worker that is not a "
                               "rollout rank of the refit group (init_process_group not called?)")
        self.reports = []
        self._version = global_steps
        head = await self._thread(self._header, None)
        if head["mode"] == "layout":
            for src_l, dst_l in self._layout_buckets(head["layout"]):
                dst = self._buffers(dst_l, self.device)
                await self._thread(self._refit, {}, dst, src_l, dst_l)
                for n in dst:
                    yield n, dst[n]
            return
        while True:
            got = await self._thread(self._stream_bucket, None, {}, self.device)
            if got is None:
                return
            for item in got:
                yield item


async def _buckets(items: AsyncIterator[tuple[str, torch.Tensor]], bucket_bytes: int):
    """Consecutive ``(name, tensor)`` pairs in lists of at most ``bucket_bytes`` (a bigger tensor alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    async for name, t in items:
        if bucket and size + t.nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += t.nbytes
    if bucket:
        yield bucket


if CheckpointEngineRegistry is not None:
    CheckpointEngineRegistry.register(BACKEND)(TritonReshardCheckpointEngine)
