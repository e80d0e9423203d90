"""The SGLang tier: tests against the real SGLang (0.5.23), in the environment
``tests/engines/install_sglang.sh`` builds (SGLang pins its own torch and transformers), from ``.ci/run``;
in an environment without SGLang they skip, naming what is missing."""

import os

os.environ.setdefault("SGLANG_NCCL_SO_PATH", "/nonexistent/libnccl.so.2")  # no pynccl on a CPU-only host (FACTS.md)
