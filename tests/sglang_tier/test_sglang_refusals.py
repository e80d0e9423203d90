"""Configurations the plug-in does not cover are refused in one line naming what, read from SGLang's own
parallel context (its ``get_parallel().override``), before any group is joined or byte moved."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sglang", reason="SGLang is not installed here: the SGLang tier runs in the env "
                                     "tests/engines/install_sglang.sh builds (bash .ci/run does both)")


@pytest.fixture(scope="module")
def parallel():
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    reset_context()
    publish(ServerArgs(model_path="dummy", tp_size=1, device="cpu"), role="test", ranks=SpawnRanks(world_rank=0))
    yield get_parallel()
    reset_context()


# (attention DP / CP widths cannot be overridden alone: SGLang checks the topology's consistency; the
# preset refuses enable_dp_attention, tests/test_sglang_plugin_unit.py)
@pytest.mark.parametrize("width,what", [("pp_size", "pipeline parallelism")])
def test_refused(parallel, width, what):
    from triton_reshard.integrations.sglang import unsupported

    model = torch.nn.Linear(2, 2)
    assert unsupported(model) is None
    with parallel.override(**{width: 2}):
        why = unsupported(model)
    assert why is not None and what in why and f"{width}=2" in why and "\n" not in why


def test_quantized_refused(parallel):
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    from triton_reshard.integrations.sglang import unsupported

    model = torch.nn.Linear(2, 2)
    model.quant_config = Fp8Config(is_checkpoint_fp8_serialized=True, weight_block_size=[128, 128])
    why = unsupported(model)
    assert why is not None and "quantized model (fp8)" in why and "\n" not in why
