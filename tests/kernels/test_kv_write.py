"""The KV cache write (``kernels.kv_write``, the Triton backend's ``write_kv``) vs the torch
reference, through the Triton interpreter."""

from __future__ import annotations

import torch

from replaylm.batch import BLOCK_SIZE
from replaylm.kernels import ref


def test_write_kv(kernels):
    g = torch.Generator().manual_seed(3)
    t, hkv, d = 7, 3, 16
    qkv = torch.randn(t, (4 + 2 * hkv) * d, generator=g)
    k = qkv[:, 4 * d:(4 + hkv) * d].view(t, hkv, d)  # strided view, as the model passes it
    v = qkv[:, (4 + hkv) * d:].view(t, hkv, d)
    slots = torch.tensor([17, 18, 40, 3, 0, 0, 63], dtype=torch.int64)  # last 2 padded → block 0
    caches = [torch.zeros(4, BLOCK_SIZE, hkv, d) for _ in range(4)]
    kernels.backend.write_kv(k, v, caches[0], caches[1], slots)
    ref.write_kv(k, v, caches[2], caches[3], slots)
    torch.testing.assert_close(caches[0][1:], caches[2][1:], rtol=0, atol=0)
    torch.testing.assert_close(caches[1][1:], caches[3][1:], rtol=0, atol=0)
