"""What the subcommands of ``triton-reshard`` share: one-line usage errors, dtype names, layout texts, sizes.

Every mistake a user can make on the command line is a :class:`UsageError`: ``cli.main`` prints it as one
line (``triton-reshard <cmd>: error: ...``) and exits 2, the way argparse reports its own mistakes.
"""

from __future__ import annotations

import argparse
import os

import torch


class UsageError(ValueError):
    """A mistake in the command line (a value that cannot work): printed as one line, exit code 2."""


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a mistake is one line (``prog: error: message``, exit 2) instead of usage + error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Show every option's default, unless its help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        h = action.help or ""
        if (action.option_strings and "default" not in h and "%(default)" not in h
                and action.default not in (None, False, argparse.SUPPRESS)):
            h += " (default: %(default)s)"
        return h


# torch's own names plus the short ones people type; the value is torch's name
DTYPES: dict[str, str] = {
    "float32": "float32", "float": "float32", "fp32": "float32", "f32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "half": "float16", "fp16": "float16", "f16": "float16",
    "float64": "float64", "double": "float64", "fp64": "float64", "f64": "float64",
    "float8_e4m3fn": "float8_e4m3fn", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "e4m3": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2", "fp8_e5m2": "float8_e5m2", "e5m2": "float8_e5m2",
    "int8": "int8", "int16": "int16", "int32": "int32", "int64": "int64", "uint8": "uint8",
}
DTYPE_HELP = "float32 (fp32), bfloat16 (bf16), float16 (fp16, half), float64, float8_e4m3fn (fp8), float8_e5m2"


def parse_dtype(text: str, option: str = "--dtype") -> torch.dtype:
    """``"bf16"``, ``"torch.bfloat16"``, ``"bfloat16"`` ... -> ``torch.bfloat16``; anything else a UsageError."""
    key = text.strip().lower().removeprefix("torch.")
    name = DTYPES.get(key)
    dt = getattr(torch, name, None) if name else None
    if not isinstance(dt, torch.dtype):
        raise UsageError(f"{option} {text!r} is not a dtype; use one of {DTYPE_HELP}")
    return dt


def parse_sizes(text: str, keys: tuple[str, ...], option: str, example: str) -> dict[str, int]:
    """``"tp=4,pp=2"`` -> ``{"tp": 4, "pp": 2}``. Every mistake names the bad part: a key not in ``keys``, a
    missing ``=``, a value that is not a whole number >= 1 (``offset`` may be 0), a key given twice, sizes
    separated by spaces instead of commas."""
    out: dict[str, int] = {}
    allowed = ", ".join(keys)
    if not text.strip():
        raise UsageError(f"{option} is empty; expected e.g. {example!r}")
    for part in (x.strip() for x in text.split(",")):
        if not part:
            continue
        if len(part.split()) > 1:
            raise UsageError(f"{option} {text!r}: separate the sizes with commas, no spaces (e.g. {example!r})")
        key, sep, val = part.partition("=")
        key = key.strip().lower()
        if not sep:
            raise UsageError(f"{option} {text!r}: {part!r} has no '='; expected KEY=N with KEY one of {allowed} "
                             f"(e.g. {example!r})")
        if key not in keys:
            raise UsageError(f"{option} {text!r}: unknown key {key!r}; expected one of {allowed}")
        if key in out:
            raise UsageError(f"{option} {text!r}: {key} is given twice")
        try:
            n = int(val)
        except ValueError:
            raise UsageError(f"{option} {text!r}: {key}={val.strip()!r} is not a whole number") from None
        low = 0 if key == "offset" else 1
        if n < low:
            raise UsageError(f"{option} {text!r}: {key} must be >= {low}, got {n}")
        out[key] = n
    return out


def check_output_file(path: str | os.PathLike | None, option: str, make_folder: bool = False) -> None:
    """Before any work: a file ``path`` can be written (its folder exists and is writable, and ``path`` is not
    a folder), else a :class:`UsageError` naming the option and the path. ``make_folder``: the caller creates
    the folder, so it may be missing as long as it can be created. ``None``: nothing to check."""
    if path is None:
        return
    path = os.fspath(path)
    if os.path.isdir(path):
        raise UsageError(f"{option} {path}: is a folder; give the path of a file to write")
    folder = os.path.dirname(path) or "."
    if make_folder and not os.path.exists(folder):
        why = _cannot_create(folder)
        if why:
            raise UsageError(f"{option} {path}: cannot create its folder, {why}")
        return
    if not os.path.isdir(folder):
        what = "is not a folder" if os.path.exists(folder) else "does not exist"
        raise UsageError(f"{option} {path}: the folder {folder!r} {what} (create it first)")
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise UsageError(f"{option} {path}: no permission to write there")


def check_outputs(args) -> None:
    """Before any work: ``--plot`` has matplotlib, and the ``--plot`` / ``--json`` files can be written."""
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib (pip install matplotlib, or the 'test' extra)") from None
    check_output_file(args.plot, "--plot")
    check_output_file(args.json, "--json")


def check_output_folder(path: str | os.PathLike | None, option: str) -> None:
    """Before any work: a folder ``path`` exists and is writable, or can be created (its nearest existing
    ancestor is a writable folder), else a :class:`UsageError` naming the option and the path."""
    if path is None:
        return
    path = os.fspath(path)
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise UsageError(f"{option} {path}: is a file, not a folder")
        if not os.access(path, os.W_OK | os.X_OK):
            raise UsageError(f"{option} {path}: no permission to write in this folder")
        return
    why = _cannot_create(path)
    if why:
        raise UsageError(f"{option} {path}: cannot create it, {why}")


def _cannot_create(folder: str) -> str | None:
    """Why the missing ``folder`` cannot be created (its nearest existing ancestor is a file or not writable)."""
    parent = os.path.dirname(os.path.abspath(folder))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent!r} is a file"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"no permission to write in {parent!r}"
    return None


def fmt_mib(n: float) -> str:
    """Bytes as MiB with one decimal, without the unit (for a table whose header says MiB)."""
    return f"{n / (1 << 20):.1f}"


def fmt_bytes(n: float) -> str:
    for unit, k in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= k:
            return f"{n / k:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_seconds(x: float) -> str:
    return f"{x:.3f} s" if x >= 1 else f"{x * 1e3:.3g} ms" if x >= 1e-3 else f"{x * 1e6:.3g} us"
