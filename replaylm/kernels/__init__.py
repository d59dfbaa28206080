"""Kernels: Triton programs for CUDA, each with its torch reference in ``ref``.

``ref`` imports only torch and serves the CPU and the tests. Every other submodule imports
``triton`` and defines kernels at import time, so import them lazily
(``from replaylm.kernels import ops``) only where Triton is available. Kernels import
nothing from the model, the graphs or the engine: only ``replaylm.batch`` (the KV block
size), ``replaylm.env`` and ``replaylm.capture``.
"""
