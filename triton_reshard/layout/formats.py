"""Quantization formats: one value per format, the registry that lists their names once, and the plan-format
version rule that says what a key, a digest or a wire record writes of a format.

A :class:`QuantFormat` is everything the planner, the executor, the kernels and the tools read of a format
(its dtypes, packing, block, scale encoding, global scale, its reference's name, its labels); they read its
attributes and never compare its name. Plans hold the value (``Transfer.fmt``), not a name looked up again.

Plan-format versions: block FP8 was the only format of plan format 1, and its keys, digests and wire records
did not name it; plan format 2 added the other formats, which are named (:attr:`QuantFormat.tag`). Each format
keeps the version it came in (``since``), so every plan, digest and record of a version-1 format stays what
it was, by this one rule (:attr:`QuantFormat.tag`, :func:`format_of_tag`) rather than a test of a name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

PLAN_FORMAT = 2  # the newest plan format: formats of version > 1 are named in keys, digests and wire records


@dataclass(frozen=True, slots=True, eq=False, repr=False)
class QuantFormat:
    """A block quantization format.

    ``value_dtype``: the dtype of the stored values (``uint8`` for packed sub-byte elements); ``pack``: logical
    elements per stored element along the last dim (2 for FP4 pairs: the low nibble holds the even element);
    ``value_bits``: bits per logical element; ``scale_dtype``: the stored dtype of one scale per block, and
    ``scale_encoding`` what it means (``"fp32"``: the dequantization multiplier; ``"e8m0"``: a biased power-of-
    two exponent byte, 2^(s-127); ``"e4m3"``: an fp8 multiplier of the global scale); ``block``: the fixed block
    extent along the last dim in *logical* elements (None: the tensor's ``BlockQuant`` gives the block);
    ``rounding``: the scale rule, named; ``global_scale``: one float32 per tensor (group) beside the block
    scales, computed from the whole tensor's amax; ``reference``: the name of the torch reference quantizer
    in ``triton_reshard.ops.quant_ref`` (called through :func:`triton_reshard.ops.quantize.reference`);
    ``since``: the plan-format version it came in (see the module doc); ``scale_suffix``: the name suffix of a
    weight's scale tensor in its engines; ``label``, ``summary`` (``{block}``: the block a
    caller gives), ``method``: how reports, help texts and the benchmark's method names (``reshard-<method>``)
    call it.

    Compared and hashed by identity (the registry holds the one value of each format; pickles and copies
    resolve to it); prints as its name.
    """

    name: str
    value_dtype: torch.dtype
    pack: int
    value_bits: int
    scale_dtype: torch.dtype
    scale_encoding: str
    block: int | None
    rounding: str
    global_scale: bool
    reference: str
    since: int
    scale_suffix: str
    label: str
    summary: str
    method: str
    scale_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "scale_bytes", torch.empty((), dtype=self.scale_dtype).element_size())

    def __repr__(self) -> str:
        return repr(self.name)

    def __reduce__(self):
        """Pickled and copied as its name: a spawned rank's (or a copy's) format is the registry's value."""
        return quant_format, (self.name,)

    def value_bytes(self, numel: int) -> int:
        """Stored bytes of ``numel`` logical elements (whole stored elements)."""
        return -(-numel * self.value_bits // 8)

    @property
    def tag(self) -> tuple[str, ...]:
        """What a key, a digest or a wire record writes of this format: nothing for a plan-format-1 format
        (block FP8: the one format then, so its plans keep their digests), its name for a later one."""
        return () if self.since == 1 else (self.name,)


FORMATS = (
    # vLLM / DeepSeek-V3 block FP8: e4m3 values, one fp32 scale (amax / 448, optionally a power of two) per block
    QuantFormat(
        name="fp8-block",
        value_dtype=torch.float8_e4m3fn,
        pack=1,
        value_bits=8,
        scale_dtype=torch.float32,
        scale_encoding="fp32",
        block=None,
        rounding="amax/448",
        global_scale=False,
        reference="quantize_blocks_ref",
        since=1,
        scale_suffix="_scale_inv",
        label="block-FP8",
        summary="{block}x{block} blocks, fp32 scales",
        method="fp8",
    ),
    # OCP MX FP8 (vLLM 0.33 ``mxfp8_utils``): e4m3 values, one E8M0 byte per 1x32 block along the last dim
    QuantFormat(
        name="mxfp8",
        value_dtype=torch.float8_e4m3fn,
        pack=1,
        value_bits=8,
        scale_dtype=torch.uint8,
        scale_encoding="e8m0",
        block=32,
        rounding="ceil(log2(amax/448))",
        global_scale=False,
        reference="quantize_mxfp8",
        since=2,
        scale_suffix="_scale",
        label="MXFP8",
        summary="1x32 blocks, E8M0 scales",
        method="mxfp8",
    ),
    # NVIDIA NVFP4 (ModelOpt, vLLM's ``ref_nvfp4_quant``): packed E2M1 pairs, one e4m3 scale per 1x16 block, and
    # an fp32 per-tensor ``weight_scale_2``
    QuantFormat(
        name="nvfp4",
        value_dtype=torch.uint8,
        pack=2,
        value_bits=4,
        scale_dtype=torch.float8_e4m3fn,
        scale_encoding="e4m3",
        block=16,
        rounding="e4m3(gs*amax/6)",
        global_scale=True,
        reference="quantize_nvfp4",
        since=2,
        scale_suffix="_scale",
        label="NVFP4",
        summary="packed E2M1, 1x16 blocks, e4m3 scales",
        method="nvfp4",
    ),
)
QUANT_FORMATS = {f.name: f for f in FORMATS}  # the format names, listed once (here)
FP8_BLOCK, MXFP8, NVFP4 = FORMATS
_UNTAGGED = tuple(f for f in FORMATS if not f.tag)
assert len(_UNTAGGED) == 1 and all(f.since <= PLAN_FORMAT for f in FORMATS), "one plan-format-1 format"


def quant_format(name: str | QuantFormat) -> QuantFormat:
    """The format called ``name`` (a :class:`QuantFormat` passes through)."""
    if isinstance(name, QuantFormat):
        return name
    f = QUANT_FORMATS.get(name)
    if f is None:
        raise ValueError(f"unknown quantization format {name!r}; expected one of {sorted(QUANT_FORMATS)}")
    return f


def format_of_tag(tag: tuple) -> QuantFormat:
    """The format a key or record names by ``tag`` (:attr:`QuantFormat.tag`; empty: the plan-format-1 one)."""
    return quant_format(tag[0]) if tag else _UNTAGGED[0]
