"""Data-only messages: what ranks exchange through a store or a socket, and what layout files hold.

Nothing that crosses a process boundary is unpickled. :func:`dumps` / :func:`loads` carry JSON values
(``None``, bools, ints, floats, strings, lists, dicts) plus a fixed set of tagged types, each decoded by a
strict schema check that names the field that is wrong: tuples, ``torch.dtype`` (by name, only real dtypes),
:class:`~triton_reshard.Layout` (eager or columnar; :func:`layout_to_dict` / :func:`layout_from_dict`),
:class:`~triton_reshard.layout.TensorSpec`, :class:`~triton_reshard.layout.BlockQuant`,
:class:`~triton_reshard.layout.Fragment`, and the types other rooms register with :func:`register_codec`
(:class:`~triton_reshard.integrations.record.LoadRecord` registers itself).
A tagged value is ``{"$": type, "v": ...}``; a plain dict with a ``"$"`` key or keys that are not strings is
sent as ``{"$": "dict", "v": [[key, value], ...]}``.

:func:`save_layout` / :func:`load_layout` write and read a layout file as JSON (no code runs on load).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from ..layout import (
    QUANT_FORMATS,
    BlockQuant,
    ColumnarLayout,
    Fragment,
    Layout,
    LocalSpec,
    TensorSpec,
    columnar,
    dtype_name,
)

FORMAT = "triton_reshard.layout/1"
_DTYPES: dict[str, torch.dtype] = {n: v for n, v in vars(torch).items() if isinstance(v, torch.dtype)}


class WireError(ValueError):
    """A message or layout file that does not match its schema (the text names the field)."""


# ---------------------------------------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------------------------------------

def fail(path: str, what: str, v) -> WireError:
    r = repr(v)
    return WireError(f"{path}: expected {what}, got {r[:80]}{'...' if len(r) > 80 else ''}")


def expect_str(v, path: str) -> str:
    if not isinstance(v, str):
        raise fail(path, "a string", v)
    return v


def expect_int(v, path: str, lo: int = 0) -> int:
    if type(v) is not int or v < lo:
        raise fail(path, f"an int >= {lo}", v)
    return v


def expect_ints(v, path: str) -> tuple[int, ...]:
    if not isinstance(v, list):
        raise fail(path, "a list of ints >= 0", v)
    return tuple(expect_int(x, f"{path}[{i}]") for i, x in enumerate(v))


def expect_list(v, path: str, n: int | None = None) -> list:
    if not isinstance(v, list) or (n is not None and len(v) != n):
        raise fail(path, "a list" if n is None else f"a list of {n} items", v)
    return v


def expect_dict(v, path: str, keys: set[str], optional: set[str] = frozenset()) -> dict:
    if not isinstance(v, dict):
        raise fail(path, "an object", v)
    missing, extra = keys - v.keys(), v.keys() - keys - optional
    if missing or extra:
        raise WireError(f"{path}: " + "; ".join(
            ([f"missing fields {sorted(missing)}"] if missing else []) + ([f"unknown fields {sorted(extra)}"]
                                                                          if extra else [])))
    return v


def dtype_from_name(v, path: str) -> torch.dtype:
    if not isinstance(v, str) or v not in _DTYPES:
        raise fail(path, "a torch dtype name (e.g. 'bfloat16')", v)
    return _DTYPES[v]


def _check(fn, path: str, *args):
    """Build a layout part; its own validation error is reported at ``path``."""
    try:
        return fn(*args)
    except (TypeError, ValueError, OverflowError) as e:  # OverflowError: an int too big for an index array
        raise WireError(f"{path}: {e}") from None


# ---------------------------------------------------------------------------------------------------------
# layouts
# ---------------------------------------------------------------------------------------------------------

def quant_to_data(q: BlockQuant | None):
    if q is None:
        return None
    out = [list(q.block), q.scale, q.ue8m0]  # a plan-format-1 format (block FP8): three entries, as then
    tag = q.format.tag
    return out + [*tag, q.global_scale, q.global_group] if tag else out


def quant_from_data(v, path: str) -> BlockQuant | None:
    if v is None:
        return None
    n = len(v) if isinstance(v, list) else 3
    if n == 6:
        block, scale, ue8m0, fmt, gscale, ggroup = expect_list(v, path, 6)
        extra = (expect_str(fmt, f"{path}[3] (format)"), expect_str(gscale, f"{path}[4] (global scale)"),
                 expect_str(ggroup, f"{path}[5] (global group)"))
        if extra[0] not in QUANT_FORMATS:
            raise fail(f"{path}[3] (format)", f"one of {sorted(QUANT_FORMATS)}", extra[0])
        extra = (QUANT_FORMATS[extra[0]],) + extra[1:]
    else:
        block, scale, ue8m0 = expect_list(v, path, 3)
        extra = ()
    if not isinstance(ue8m0, bool):
        raise fail(f"{path}[2] (ue8m0)", "a bool", ue8m0)
    return _check(BlockQuant, path, expect_ints(block, f"{path}[0] (block)"), expect_str(scale, f"{path}[1] (scale)"), ue8m0,
                  *extra)


def layout_to_dict(layout: Layout) -> dict:
    """A JSON-ready dict of ``layout`` (its tensors, fragments and local tensors; ``columnar``: whether to
    rebuild it as a :class:`~triton_reshard.layout.ColumnarLayout`)."""
    if not isinstance(layout, Layout):
        raise TypeError(f"layout_to_dict: expected a Layout, got {type(layout).__name__}")
    tensors = [t.name for t in layout.tensors]
    tid = {n: i for i, n in enumerate(tensors)}
    locs = layout.locals
    lnames = sorted({x.name for x in locs} | {f.local for f in layout.fragments})
    lid = {n: i for i, n in enumerate(lnames)}
    return {
        "format": FORMAT,
        "columnar": isinstance(layout, ColumnarLayout),
        "tensors": [[t.name, list(t.shape), dtype_name(t.dtype), quant_to_data(t.quant)] for t in layout.tensors],
        "local_names": lnames,
        "fragments": [[tid[f.tensor], f.rank, list(f.offsets), list(f.sizes), lid[f.local], list(f.local_offsets)]
                      for f in layout.fragments],
        "locals": [[x.rank, lid[x.name], list(x.shape), dtype_name(x.dtype)] for x in locs],
        "digest": layout.digest,
    }


def layout_from_dict(d, path: str = "layout") -> Layout:
    """The Layout of a :func:`layout_to_dict` dict, checked field by field (then by the Layout's own
    validation); a mismatch raises :class:`WireError` naming the field."""
    d = expect_dict(d, path, {"format", "columnar", "tensors", "local_names", "fragments", "locals", "digest"})
    if d["format"] != FORMAT:
        raise fail(f"{path}.format", repr(FORMAT), d["format"])
    if not isinstance(d["columnar"], bool):
        raise fail(f"{path}.columnar", "a bool", d["columnar"])
    specs = []
    for i, t in enumerate(expect_list(d["tensors"], f"{path}.tensors")):
        p = f"{path}.tensors[{i}]"
        name, shape, dt, q = expect_list(t, p, 4)
        specs.append(_check(TensorSpec, p, expect_str(name, f"{p}[0] (name)"), expect_ints(shape, f"{p}[1] (shape)"),
                            dtype_from_name(dt, f"{p}[2] (dtype)"), quant_from_data(q, f"{p}[3] (quant)")))
    lnames = [expect_str(n, f"{path}.local_names[{i}]") for i, n in enumerate(expect_list(d["local_names"], f"{path}.local_names"))]

    def ref(v, table, p):
        if type(v) is not int or not 0 <= v < len(table):
            raise fail(p, f"an index into a table of {len(table)}", v)
        return table[v]

    names = [s.name for s in specs]
    frags = []
    for i, f in enumerate(expect_list(d["fragments"], f"{path}.fragments")):
        p = f"{path}.fragments[{i}]"
        t, rank, off, size, local, lo = expect_list(f, p, 6)
        frags.append(_check(Fragment, p, ref(t, names, f"{p}[0] (tensor)"), expect_int(rank, f"{p}[1] (rank)"),
                            expect_ints(off, f"{p}[2] (offsets)"), expect_ints(size, f"{p}[3] (sizes)"),
                            ref(local, lnames, f"{p}[4] (local)"), expect_ints(lo, f"{p}[5] (local_offsets)")))
    locs = []
    for i, x in enumerate(expect_list(d["locals"], f"{path}.locals")):
        p = f"{path}.locals[{i}]"
        rank, local, shape, dt = expect_list(x, p, 4)
        locs.append(_check(LocalSpec, p, expect_int(rank, f"{p}[0] (rank)"), ref(local, lnames, f"{p}[1] (name)"),
                           expect_ints(shape, f"{p}[2] (shape)"), dtype_from_name(dt, f"{p}[3] (dtype)")))
    if d["columnar"]:
        lay = _check(columnar, path, specs, frags, locs)
    else:
        lay = _check(Layout, path, tuple(specs), tuple(frags), tuple(locs))
    if lay.digest != d["digest"]:
        raise WireError(f"{path}.digest: the layout's contents have digest {lay.digest}, the message says "
                        f"{d['digest']!r}")
    return lay


def save_layout(layout: Layout, path: str | os.PathLike) -> None:
    """Write ``layout`` to ``path`` as JSON (read back with :func:`load_layout`)."""
    with open(path, "w") as f:
        json.dump(layout_to_dict(layout), f, separators=(",", ":"))


def load_layout(path: str | os.PathLike) -> Layout:
    """The layout in the JSON file ``path`` (as :func:`save_layout` writes it); nothing in it is run."""
    try:
        with open(path, "rb") as f:
            d = json.loads(f.read())
    except (ValueError, RecursionError) as e:  # ValueError: bad UTF-8 or JSON, or an int of over 4300 digits
        raise WireError(f"layout file {os.fspath(path)!r} is not JSON ({e}); write it with "
                        f"triton_reshard.comm.wire.save_layout") from None
    return layout_from_dict(d, f"layout file {os.fspath(path)!r}")


# ---------------------------------------------------------------------------------------------------------
# values
# ---------------------------------------------------------------------------------------------------------

_BUILTIN_TAGS = ("tuple", "dict", "float", "dtype", "Layout", "Fragment", "TensorSpec", "BlockQuant")
_CODECS: dict[str, tuple[type, Callable, Callable]] = {}


def register_codec(tag: str, cls: type, to_data: Callable, from_data: Callable) -> None:
    """Let a module outside the control plane send its own data type: ``to_data(x)`` gives JSON values (use
    :func:`encode` for nested values), ``from_data(v, path)`` checks them field by field (the ``expect_*``
    helpers, :func:`fail`) and rebuilds the object. Nothing else is ever decoded: an unregistered tag is
    refused by name. Registering a tag twice with another class is an error."""
    if tag in _BUILTIN_TAGS or (tag in _CODECS and _CODECS[tag][0] is not cls):
        raise ValueError(f"wire tag {tag!r} is already taken")
    _CODECS[tag] = (cls, to_data, from_data)


def encode(x):
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, int):
        return int(x)
    if isinstance(x, float):
        return x if math.isfinite(x) else {"$": "float", "v": repr(x)}
    if isinstance(x, list):
        return [encode(v) for v in x]
    if isinstance(x, tuple):
        return {"$": "tuple", "v": [encode(v) for v in x]}
    if isinstance(x, Mapping):
        if all(isinstance(k, str) for k in x) and "$" not in x:
            return {k: encode(v) for k, v in x.items()}
        return {"$": "dict", "v": [[encode(k), encode(v)] for k, v in x.items()]}
    if isinstance(x, torch.dtype):
        return {"$": "dtype", "v": dtype_name(x)}
    if isinstance(x, Layout):
        return {"$": "Layout", "v": layout_to_dict(x)}
    if isinstance(x, Fragment):
        return {"$": "Fragment", "v": [x.tensor, x.rank, list(x.offsets), list(x.sizes), x.local,
                                       list(x.local_offsets)]}
    if isinstance(x, TensorSpec):
        return {"$": "TensorSpec", "v": [x.name, list(x.shape), dtype_name(x.dtype), quant_to_data(x.quant)]}
    if isinstance(x, BlockQuant):
        return {"$": "BlockQuant", "v": quant_to_data(x)}
    for tag, (cls, to_data, _) in _CODECS.items():
        if isinstance(x, cls):
            return {"$": tag, "v": to_data(x)}
    raise TypeError(f"cannot send a {type(x).__name__} (data only: JSON values, tuples, dtypes, "
                    f"{', '.join([*_BUILTIN_TAGS[3:], *_CODECS])})")


def _hashable(k, path: str):
    try:
        hash(k)
    except TypeError:
        raise fail(path, "a hashable key", k) from None
    return k


def decode(x, path: str):
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, list):
        return [decode(v, f"{path}[{i}]") for i, v in enumerate(x)]
    if not isinstance(x, dict):
        raise fail(path, "a JSON value", x)
    if "$" not in x:
        return {k: decode(v, f"{path}[{k!r}]") for k, v in x.items()}
    x = expect_dict(x, path, {"$", "v"})
    tag, v = x["$"], x["v"]
    p = f"{path}<{tag}>"
    if tag == "tuple":
        return tuple(decode(e, f"{p}[{i}]") for i, e in enumerate(expect_list(v, p)))
    if tag == "dict":
        out = {}
        for i, kv in enumerate(expect_list(v, p)):
            k, val = expect_list(kv, f"{p}[{i}]", 2)
            out[_hashable(decode(k, f"{p}[{i}][0]"), f"{p}[{i}][0]")] = decode(val, f"{p}[{i}][1]")
        return out
    if tag == "float":
        if v not in ("nan", "inf", "-inf"):
            raise fail(p, "'nan', 'inf' or '-inf'", v)
        return float(v)
    if tag == "dtype":
        return dtype_from_name(v, p)
    if tag == "Layout":
        return layout_from_dict(v, p)
    if tag == "Fragment":
        t, rank, off, size, local, lo = expect_list(v, p, 6)
        return _check(Fragment, p, expect_str(t, f"{p}[0] (tensor)"), expect_int(rank, f"{p}[1] (rank)"),
                      expect_ints(off, f"{p}[2] (offsets)"), expect_ints(size, f"{p}[3] (sizes)"), expect_str(local, f"{p}[4] (local)"),
                      expect_ints(lo, f"{p}[5] (local_offsets)"))
    if tag == "TensorSpec":
        name, shape, dt, q = expect_list(v, p, 4)
        return _check(TensorSpec, p, expect_str(name, f"{p}[0] (name)"), expect_ints(shape, f"{p}[1] (shape)"),
                      dtype_from_name(dt, f"{p}[2] (dtype)"), quant_from_data(q, f"{p}[3] (quant)"))
    if tag == "BlockQuant":
        q = quant_from_data(v, p)
        if q is None:
            raise fail(p, "a block quantization", v)
        return q
    if tag in _CODECS:
        return _CODECS[tag][2](v, p)
    raise WireError(f"{path}: unknown type tag {tag!r}")


def _no_constant(c: str):
    raise json.JSONDecodeError(f"{c} is not JSON (non-finite floats travel tagged)", c, 0)


def dumps(obj) -> bytes:
    """``obj`` as data-only JSON bytes (see the module docstring for the types it carries)."""
    return json.dumps(encode(obj), separators=(",", ":"), allow_nan=False).encode()


def loads(data: bytes, what: str = "message"):
    """The value of :func:`dumps` bytes, checked against the schema; :class:`WireError` names ``what`` and
    the field that is wrong."""
    try:
        raw = json.loads(data, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # ValueError: bad UTF-8 or JSON, or an int of over 4300 digits
        raise WireError(f"{what}: not a data-only JSON message ({type(e).__name__}: {str(e)[:120]})") from None
    try:
        return decode(raw, what)
    except RecursionError:
        raise WireError(f"{what}: nested too deeply") from None


def all_gather_data(obj, group=None, what: str = "all_gather_data") -> list:
    """Every rank's ``obj`` (a value :func:`dumps` carries), in rank order, over the torch.distributed group
    ``group`` (``None``: the default one; without an initialised world, ``[obj]``): ``dumps`` bytes as uint8
    tensors, so nothing a peer sends is unpickled (``torch.distributed.all_gather_object`` would unpickle it)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [obj]
    dev = (torch.device("cuda", torch.cuda.current_device()) if str(dist.get_backend(group)) == "nccl"
           else torch.device("cpu"))
    data = torch.frombuffer(bytearray(dumps(obj)), dtype=torch.uint8).to(dev)
    n = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(n)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=dev), group=group)
    lengths = [int(t.item()) for t in sizes]
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=dev)
    padded[:data.numel()] = data
    out = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(out, padded, group=group)
    return [loads(bytes(t[:m].cpu().numpy()), f"{what} from rank {r}") for r, (t, m) in enumerate(zip(out, lengths, strict=True))]

