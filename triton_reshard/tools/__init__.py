"""User-facing tools: the ``triton-reshard`` command (``cli``), the demo and benchmark worlds it runs, the traffic
plot, and the Llama-shaped parallel layouts they use (``parallel``). Nothing in the library imports them."""
