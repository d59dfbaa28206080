"""Drive a model directly (no engine): one request's batch metadata over given blocks."""

from __future__ import annotations

import torch

from replaylm.attention.backend import AttentionBackend
from replaylm.batch import BLOCK_SIZE, AttentionMetadata
from replaylm.engine.loading import load_model_config
from replaylm.model.loader import load_model


def bound_model(path, backend: AttentionBackend, dtype=torch.float32, device="cpu",
                num_blocks: int = 64):
    """Load a checkpoint and bind it to a fresh KV pool and ``backend``."""
    device = torch.device(device)
    cfg, _ = load_model_config(str(path))
    model = load_model(cfg, path, "auto", dtype, device, seed=0)
    pool = torch.zeros(cfg.num_layers, 2, num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim,
                       dtype=dtype, device=device)
    model.bind(backend, [(pool[i, 0], pool[i, 1]) for i in range(cfg.num_layers)],
               cfg.max_position_embeddings)
    return model


def one_request_meta(start: int, n: int, blocks: list[int], device="cpu") -> AttentionMetadata:
    """Metadata for one request adding tokens ``start .. start+n-1`` over ``blocks``."""
    pos = torch.arange(start, start + n)
    bt = torch.tensor(blocks, dtype=torch.int32)
    slots = bt[pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
    return AttentionMetadata(
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=device),
        kv_lens=torch.tensor([start + n], dtype=torch.int32, device=device),
        block_table=bt[None].to(device), slot_mapping=slots.to(device), num_tokens=n,
        num_reqs=1, max_q_len=n, max_kv_len=start + n, cu_seqlens_q_cpu=[0, n],
        kv_lens_cpu=[start + n],
    )


def decode_step(model, seq: list[int], token: int, blocks: list[int], device="cpu"):
    """Append ``token`` to ``seq`` and run it through ``model`` as one decode step over
    ``blocks`` (the earlier tokens' K/V already there); returns its logits ``[1, V]``."""
    seq.append(token)
    pos = len(seq) - 1
    return model.compute_logits(model(torch.tensor([token], device=device),
                                      torch.tensor([pos], device=device),
                                      one_request_meta(pos, 1, blocks, device)))
