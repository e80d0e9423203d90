"""Bare Triton kernels of triton_reshard (launchers live in ``triton_reshard/ops/``).

The kernel sources live in the repository's top-level ``kernels/`` folder (the design card's place for them);
this package holds a link to each (``copy.py -> ../../kernels/copy.py``), and a wheel or sdist holds the files
themselves. The top-level folder has no ``__init__.py`` on purpose: it is not a package, so code run from the
repository root never finds it under the name ``kernels`` in place of another distribution's (Hugging Face's
``kernels``, which transformers imports). Import the kernels as ``triton_reshard.kernels`` only."""
