"""Bare Triton kernels of triton_reshard (launchers live in ``triton_reshard/``)."""
