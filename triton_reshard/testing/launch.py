"""Spawn a small world of processes on this machine (gloo on CPU, NCCL when there are enough GPUs).

Used by the demo, the benchmarks and the multi-process tests. Every process group gets a timeout, the
parent waits with a deadline and kills stragglers, and ``destroy_process_group`` runs in ``finally``.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import traceback
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..comm.group import free_port as _free_port


def free_port() -> int:
    """A free loopback port for the world's rendezvous (:func:`triton_reshard.comm.group.free_port`)."""
    return _free_port("127.0.0.1")


def default_backend(world_size: int) -> str:
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def _worker(rank, world_size, port, backend, pg_timeout, fn, args, queue) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout),
        )
        try:
            result = fn(rank, world_size, *args)
            buf = io.BytesIO()  # torch.save: tensors in the result survive the worker's exit
            torch.save(result, buf)
            queue.put((rank, True, buf.getvalue()))
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # report every failure to the parent, with its traceback
        queue.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


class WorldError(RuntimeError):
    """One or more ranks of a spawned world failed; ``errors`` maps rank -> traceback text."""

    def __init__(self, errors: dict[int, str]):
        self.errors = errors
        first = min(errors)
        super().__init__(f"ranks {sorted(errors)} failed; rank {first}:\n{errors[first]}")


def _set_env(values: dict[str, str | None]) -> None:
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def run_world(
    fn: Callable,
    world_size: int,
    *args,
    backend: str | None = None,
    timeout: float = 300.0,
    pg_timeout: float = 120.0,
    allow_errors: bool = False,
    env: dict[str, str | None] | None = None,
) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes; return the results by rank.

    ``env``: environment variables the ranks start with (None: unset), e.g. ``TRITON_INTERPRET=1`` before they
    import triton; this process's environment is as before once they are started.

    ``fn`` must be importable (a module-level function). If a rank raises, :class:`WorldError` is raised
    (or, with ``allow_errors=True``, the error text is returned in that rank's slot and the other results are
    kept). If the world does not finish within ``timeout`` seconds its processes are killed and
    ``TimeoutError`` is raised.
    """
    backend = backend or default_backend(world_size)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, backend, pg_timeout, fn, args, queue), daemon=True)
        for r in range(world_size)
    ]
    saved = {k: os.environ.get(k) for k in env or {}}
    try:
        _set_env(env or {})
        for p in procs:
            p.start()
    finally:
        _set_env(saved)
    results: dict[int, tuple[bool, object]] = {}
    import queue as _q
    import time

    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"world of {world_size} did not finish within {timeout:g}s; ranks done: {sorted(results)}"
                )
            try:
                rank, ok, val = queue.get(timeout=min(left, 1.0))
                results[rank] = (ok, val)
            except _q.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results]
                if dead:
                    # give a just-finished rank a moment to flush its message, then report it as lost
                    time.sleep(0.5)
                    while not queue.empty():
                        rank, ok, val = queue.get()
                        results[rank] = (ok, val)
                    for r in dead:
                        if r not in results:
                            results[r] = (False, f"process exited with code {procs[r].exitcode} without a result")
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    errors = {r: v for r, (ok, v) in results.items() if not ok}
    if errors and not allow_errors:
        raise WorldError(errors)
    return [_load_result(r, val) if ok else val for r, (ok, val) in sorted(results.items())]


def _load_result(rank: int, data: bytes):
    """A rank's result, loaded data-only (``weights_only=True``: tensors, numbers, strings, containers;
    nothing in the bytes is run, even though they come from our own child)."""
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # noqa: BLE001 (torch raises UnpicklingError or RuntimeError by version)
        raise WorldError({rank: f"rank {rank} returned a value that does not load as data only "
                                f"(weights_only=True): return dicts, lists, tuples, tensors, numbers and "
                                f"strings\n{str(e).splitlines()[0] if str(e) else type(e).__name__}"}) from None


def run_jobs(jobs: dict[str, tuple], *, backend: str | None = "gloo", timeout: float = 300.0) -> dict[str, object]:
    """Run several independent worlds at once, as separately launched jobs would run (each world its own
    processes and its own default process group, on its own port): ``jobs`` maps a name to ``(fn,
    world_size, *args)`` for :func:`run_world`. Returns ``{name: results by rank}``, or the exception that
    job raised (a :class:`WorldError`, a ``TimeoutError``) in its place; waits at most ``timeout`` + 60 s."""
    import threading

    out: dict[str, object] = {}

    def one(name, fn, world_size, *args):
        try:
            out[name] = run_world(fn, world_size, *args, backend=backend, timeout=timeout)
        except Exception as e:  # noqa: BLE001 (returned to the caller)
            out[name] = e

    threads = [threading.Thread(target=one, args=(name, *spec), daemon=True) for name, spec in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 60)
    for name in jobs:
        out.setdefault(name, TimeoutError(f"job {name!r} did not finish within {timeout + 60:g}s"))
    return out


def run_script(argv: list[str], *, timeout: float, cwd: str | None = None,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True, text=True, timeout=timeout)`` for a script that starts
    processes of its own (an engine's workers, a world of ranks): it runs in a session of its own, and on the
    timeout the whole session is killed, not just the script, so no engine outlives a test that gave up on it
    (an orphaned engine kept ~3.5 GB and a core busy, and every later test of the tier slower). Raises
    ``subprocess.TimeoutExpired`` (with the output so far) after the kill."""
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, env=env,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise subprocess.TimeoutExpired(argv, timeout, output=out, stderr=err) from None
    finally:
        if p.poll() is None:  # an exception in the parent (e.g. KeyboardInterrupt): the session goes too
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return subprocess.CompletedProcess(argv, p.returncode, out, err)
