"""Triton kernels (CUDA only; the torch references beside them serve CPU and tests).

Submodules import ``triton`` and define kernels at import time, so import them lazily
(``from replaylm.kernels import attention``) only where Triton is available.
"""
