"""Shared by the LoRA tests: a tiny checkpoint with three random PEFT adapters over it and
PEFT's greedy tokens for each, built once per session and checkpoint kind."""

from __future__ import annotations

import pytest

from replaylm import LoRARequest
from tests.lora.helpers import ALL, PROMPTS, N, greedy, make_adapter

# rank, seed, targets, alpha, rslora
ADAPTERS = [(8, 1, None, 16, False), (16, 2, None, 32, True),
            (16, 3, ["q_proj", "v_proj", "down_proj"], 8, False)]


def _build(kind, tmp_path_factory):
    """A tiny checkpoint, three adapters over it, and every (adapter, prompt)'s PEFT greedy
    tokens (adapter None: the base model)."""
    from tests.conftest import make_checkpoint

    base = tmp_path_factory.mktemp(f"lora-{kind}")
    model = make_checkpoint(kind, base)
    expected = {None: [greedy(model, p, N) for p in PROMPTS]}
    loras = []
    for i, (r, seed, targets, alpha, rslora) in enumerate(ADAPTERS):
        path = tmp_path_factory.mktemp(f"lora-{kind}-a{i}")
        peft_model = make_adapter(base, path, r, seed, targets or ALL, alpha, rslora)
        lora = LoRARequest(f"a{i}", i + 1, str(path))
        expected[lora] = [greedy(peft_model, p, N) for p in PROMPTS]
        loras.append(lora)
    for lora in loras:  # the adapters change the output (B is not zero)
        assert expected[lora] != expected[None]
    return base, loras, expected


@pytest.fixture(scope="session")
def lora_setup(tmp_path_factory):
    """``lora_setup(kind)`` -> (checkpoint dir, [LoRARequest] * 3, {adapter or None: PEFT
    greedy tokens per prompt}), cached per kind."""
    built = {}

    def get(kind: str):
        if kind not in built:
            built[kind] = _build(kind, tmp_path_factory)
        return built[kind]

    return get
