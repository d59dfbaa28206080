"""Where ``kernels.ops`` adds a LoRA delta at a few rows, for each tuner decision: the fused
prologue's whole-K tile folds it into that launch, right after the shrink (``fresh``);
where the separate norm or SiLU·mul won, the plain projection after it folds it, no longer
fresh; a split-K tile adds it with ``lora_expand``.

The CUDA-only pieces (the few-row check, the tuner, the kernels) are replaced by recorders,
so this runs on the CPU; the kernels themselves are tested in ``tests/kernels`` and on the
GPU."""

from __future__ import annotations

import pytest
import torch

from replaylm.kernels import ops, ref, skinny, skinny_lora

WHOLE_K = (1, 4, 64, 4)
SPLIT_K = (1, 4, 64, 4, 2)


@pytest.fixture
def calls(monkeypatch):
    """The launches the ops make, by name; ``decisions``: the tile per tuner key kind."""
    made: list[str] = []
    decisions: dict[str, tuple[int, ...] | None] = {}

    def record(name):
        def fn(x, *args, **kw):
            deltas = [a for a in (*args, *kw.values()) if isinstance(a, ref.LoRADelta)]
            # "fresh": the delta's shrink was the last launch before this one.
            made.append(name + (" (fresh)" if deltas and deltas[0].fresh else ""))
            return torch.zeros(x.shape[0], 8)
        return fn

    monkeypatch.setattr(ops, "_few_rows", lambda x: True)
    monkeypatch.setattr(ops.tuner, "choose", lambda key, *a, **kw: decisions[key[0]])
    monkeypatch.setattr(ops, "add_rms_norm", lambda x, r, w, eps: (x, x))
    monkeypatch.setattr(ops, "silu_and_mul", lambda gu: gu[:, : gu.shape[1] // 2])
    monkeypatch.setattr(skinny, "skinny_linear", record("projection"))
    monkeypatch.setattr(skinny, "skinny_norm_linear",
                        lambda x, *a, **kw: (record("norm projection")(x, *a, **kw), x))
    monkeypatch.setattr(skinny, "skinny_silu_linear", record("silu projection"))
    monkeypatch.setattr(skinny_lora, "lora_linear", record("projection + delta"))
    monkeypatch.setattr(skinny_lora, "lora_norm_linear",
                        lambda x, *a, **kw: (record("norm projection + delta")(x, *a, **kw),
                                             x))
    monkeypatch.setattr(skinny_lora, "lora_silu_linear", record("silu projection + delta"))
    monkeypatch.setattr(ops, "lora_expand", lambda y, *a: made.append("expand") or y)
    return made, decisions


def _delta() -> ref.LoRADelta:
    """A delta as ``LoRASlots.shrink`` returns it on CUDA: its shrink was the last launch."""
    return ref.LoRADelta(s=torch.zeros(2, 1, 4), b=torch.zeros(1, 8, 4),
                         slots=torch.zeros(2, dtype=torch.long), ranks=torch.ones(1),
                         scales=torch.ones(1), segments=(8,), fresh=True)


@pytest.mark.parametrize("prologue,plain,want", [
    (WHOLE_K, WHOLE_K, ["norm projection + delta (fresh)"]),
    (None, WHOLE_K, ["projection + delta"]),
    (None, SPLIT_K, ["projection", "expand"]),
    (SPLIT_K, WHOLE_K, ["norm projection", "expand"]),
])
def test_norm_linear_adds_the_delta_once_where_it_can_fold(calls, prologue, plain, want):
    made, decisions = calls
    decisions.update({"norm": prologue, "plain": plain})
    x, w, nw = torch.zeros(2, 16), torch.zeros(8, 16), torch.ones(16)
    ops.norm_linear(x, x, nw, 1e-6, w, lora=_delta())
    assert made == want


@pytest.mark.parametrize("prologue,plain,want", [
    (WHOLE_K, WHOLE_K, ["silu projection + delta (fresh)"]),
    (None, WHOLE_K, ["projection + delta"]),
    (None, SPLIT_K, ["projection", "expand"]),
])
def test_silu_linear_adds_the_delta_once_where_it_can_fold(calls, prologue, plain, want):
    made, decisions = calls
    decisions.update({"silu": prologue, "plain": plain})
    ops.silu_linear(torch.zeros(2, 32), torch.zeros(8, 16), lora=_delta())
    assert made == want


def test_without_a_delta_nothing_is_added(calls):
    made, decisions = calls
    decisions.update({"norm": None, "plain": WHOLE_K})
    x = torch.zeros(2, 16)
    ops.norm_linear(x, x, torch.ones(16), 1e-6, torch.zeros(8, 16))
    assert made == ["projection"]
