"""A quantized format is one value (issue 43 item 5): the registry lists the names once, plans hold the value,
and the plan-format version rule keeps every digest, key and wire record of the plans made before it.

The pinned digests were computed on the tree before formats were values (main 42c5810), for one plan of each
format; a change to how a format enters a key, a digest, a fingerprint or a wire record changes them."""

from __future__ import annotations

import copy
import pathlib
import pickle
import re

import pytest
import torch

import triton_reshard
from triton_reshard import block_quant_layout, plan_reshard
from triton_reshard.comm.wire import layout_from_dict, layout_to_dict
from triton_reshard.layout import (
    FORMATS,
    FP8_BLOCK,
    PLAN_FORMAT,
    QUANT_FORMATS,
    BlockQuant,
    format_of_tag,
    quant_format,
)
from triton_reshard.plan.types import Transfer
from triton_reshard.presets import get_config, megatron_layout, vllm_layout

from . import quant_fmt_cases as qc

# case -> (plan digest, wire keys_digest[:16], local keys_digest[:16], destination fingerprint, rank 0's share digest)
PINNED = {
    "fp8-block": (
        "367b699217bece7e",
        "801d6e78a1518c0b",
        "8a99d9f28bce4ac7",
        "bc8e29091e64f820",
        "39c536b0e4578fd0",
    ),
    "fp8-block-ue8m0": (
        "628fc775a5b38d25",
        "801d6e78a1518c0b",
        "8a99d9f28bce4ac7",
        "3a492e051acc4a7b",
        "aa82a8e4a868dc9a",
    ),
    "mxfp8": (
        "4da0dedb3ea4113e",
        "0921faaa6fed6682",
        "d9db2ff18bbbd312",
        "beccd54c3e2bad2b",
        "62b7c8d0b1d10ffb",
    ),
    "nvfp4": (
        "e31600b60aa2db96",
        "db5e29e8e4395a75",
        "30f29dac8404a902",
        "600b1dc1bbb42884",
        "b3cf4046f4345e43",
    ),
}
# the package files a format's name may appear in: its value, its torch reference, its kernel, its presets
NAMED_IN = {
    "layout/formats.py",
    "ops/quant_ref.py",
    "ops/quantize.py",
    "presets/vllm.py",
    "presets/sglang.py",
}


def _layouts(case: str):
    if case.startswith("fp8-block"):
        cfg = get_config("tiny_llama")
        src = megatron_layout(cfg, tp=2, pp=2, ranks=range(4), dtype=torch.bfloat16)
        plain = vllm_layout(cfg, tp=2, dp=2, ranks=range(4), dtype=torch.bfloat16)
        dst = block_quant_layout(
            plain,
            lambda t: len(t.shape) == 2 and ".layers." in t.name,
            (16, 16),
            ue8m0=case.endswith("ue8m0"),
        )
        return src, dst
    return qc.layouts(qc.CASES[f"{case}-raw-fp32-cols48-to-rows"])


@pytest.mark.parametrize("case", sorted(PINNED))
def test_plans_of_every_format_keep_their_digests(case):
    src, dst = _layouts(case)
    plan_reshard.cache_clear()
    p = plan_reshard(src, dst)
    share = plan_reshard(src, dst, rank=p.ranks[0])
    got = (
        p.digest,
        p.transfers.keys_digest()[:16],
        p.local_copies.keys_digest()[:16],
        dst.fingerprint,
        share.digest,
    )
    assert got == PINNED[case]
    fmt = next(iter(dst.quantized.values())).quant.format
    quantized = [t for t in list(p.transfers) + list(p.local_copies) if t.quant]
    assert quantized and all(t.fmt is fmt for t in quantized)  # the value itself, not its name
    assert all(t.key()[-len(fmt.tag) - 1 :] == (t.scale_offsets, *fmt.tag) for t in quantized)


@pytest.mark.parametrize("name", sorted(QUANT_FORMATS))
def test_the_wire_record_names_a_format_by_its_tag_and_reads_back_the_same_value(name):
    fmt = quant_format(name)
    src, dst = _layouts("fp8-block" if name == FP8_BLOCK.name else name)
    d = layout_to_dict(dst)
    q = next(t[3] for t in d["tensors"] if t[3] is not None)
    assert len(q) == (3 if not fmt.tag else 6) and q[3:4] == list(fmt.tag)
    back = layout_from_dict(d)
    assert back.fingerprint == dst.fingerprint
    assert all(t.quant.format is fmt for t in back.quantized.values())


def test_one_registry_one_unnamed_format_and_tags_that_round_trip():
    assert tuple(QUANT_FORMATS.values()) == FORMATS and len({f.name for f in FORMATS}) == len(FORMATS)
    unnamed = [f for f in FORMATS if not f.tag]
    assert unnamed == [FP8_BLOCK] and FP8_BLOCK.since == 1
    assert all(1 <= f.since <= PLAN_FORMAT for f in FORMATS)
    for f in FORMATS:
        assert format_of_tag(f.tag) is f and quant_format(f.name) is f and quant_format(f) is f
        assert repr(f) == repr(f.name)  # plans and reports print a format as its name, as before
        # a spawned rank's (pickled) or a copied format is the registry's value
        assert pickle.loads(pickle.dumps(f)) is f and copy.deepcopy(f) is f
    # what the key of a plan-format-1 format omits is its default everywhere
    assert BlockQuant((1, 1), "s").format is FP8_BLOCK
    assert Transfer("t", (0,), (1,), 0, "a", (0,), 1, "b", (0,), torch.float32).fmt is FP8_BLOCK
    with pytest.raises(ValueError, match="unknown quantization format 'fp9'"):
        quant_format("fp9")


def test_format_names_appear_only_in_the_format_files():
    root = pathlib.Path(triton_reshard.__file__).parent
    names = re.compile("|".join(re.escape(f.name) for f in FORMATS))
    found = {p.relative_to(root).as_posix() for p in root.rglob("*.py") if names.search(p.read_text())}
    assert found <= NAMED_IN, sorted(found - NAMED_IN)
