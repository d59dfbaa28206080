"""The fused kernels inside a tiny model's decode step: the rotary work done in the attention
launch equals the separate rotary kernel, through the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")


def _decode_step_both_ways(kernels, path, seed, choose):
    """A tiny model with the fused kernels: prefill 19 tokens, then run the 20th token's
    decode step twice from the same cache, after ``choose(model, False)`` and
    ``choose(model, True)``; the two steps must give the same hidden states and caches, and
    the new token's key must be in the cache. Returns the model."""
    from tests.model_helpers import bound_model, one_request_meta

    model = bound_model(path, kernels.backend, num_blocks=8)
    model.use_fused_kernels(True)
    assert model.layers[0].kernels is kernels.ops
    ids = torch.randint(3, 256, (20,), generator=torch.Generator().manual_seed(seed))
    results = []
    with torch.inference_mode():
        choose(model, True)
        model(ids[:19], torch.arange(19), one_request_meta(0, 19, [3, 5]))  # prefill
        saved = [(k.clone(), v.clone()) for k, v in model.kv_caches]
        for option in (False, True):
            for (k, v), (k0, v0) in zip(model.kv_caches, saved):
                k.copy_(k0)
                v.copy_(v0)
            meta = one_request_meta(19, 1, [3, 5])
            choose(model, option)
            hidden = model(ids[19:], torch.tensor([19]), meta)
            results.append((hidden, [(k.clone(), v.clone()) for k, v in model.kv_caches]))
    (h_off, caches_off), (h_on, caches_on) = results
    torch.testing.assert_close(h_on, h_off)
    for (k1, v1), (k2, v2) in zip(caches_on, caches_off):
        torch.testing.assert_close(k1, k2)
        torch.testing.assert_close(v1, v2)
        assert k1[5, 3].abs().sum() > 0  # the new token's key (position 19: block 5, slot 3)
    return model


def test_model_rope_in_attention(kernels, tiny_checkpoint):
    """On a decode step, q/k norm, rotary and the KV write inside the attention launch give
    the same hidden states and cache as the rotary kernel; a prefill step (more than one new
    token) keeps the rotary kernel, and so does a decode step of more request slots than
    the model's limit."""
    import dataclasses

    from tests.model_helpers import one_request_meta

    def choose(model, on):
        model.rope_in_attention_max_reqs = 1 if on else 0
        assert not model._defer_rope(one_request_meta(0, 19, [3, 5]))  # prefill: never
        decode = one_request_meta(19, 1, [3, 5])
        assert model._defer_rope(decode) == on
        assert not model._defer_rope(dataclasses.replace(decode, num_reqs=2))

    _decode_step_both_ways(kernels, tiny_checkpoint[1], 2, choose)
