"""The engine tier: tests against the real vLLM and Megatron-Core packages.

They run in the environment ``tests/engines/install.sh`` builds (vLLM pins its own torch), from
``.ci/run``; in an environment without the engines they skip, naming what is missing.
"""

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before anything imports vllm: its CPU platform
