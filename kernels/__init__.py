"""Bare Triton kernels of triton_reshard (launchers live in ``triton_reshard/ops/``).

Imported as ``triton_reshard.kernels``: ``triton_reshard/kernels`` is a symlink to this folder, so a checkout on
the path, an editable install and the wheel (which holds the files themselves) all import these files under
one name."""
