"""Where ``kernels.ops`` shrinks and adds a LoRA delta at a few rows, for each tuner decision:
the shrink is launched right before the projection, from the rows it reads (the raw input
with the fused norm prologue, else the rows it is given); a whole-K tile
folds the delta into the projection's launch, a split-K tile adds it with ``lora_expand``.

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
        def fn(x, *args, silu_pairs=False, **kw):
            made.append(name + (" + SiLU pairs" if silu_pairs else ""))
            return torch.zeros(x.shape[0], 8)
        return fn

    monkeypatch.setattr(ops, "_few_rows", lambda x: True)
    monkeypatch.setattr(ops.tuner, "choose", lambda key, *a, **kw: decisions[key[0]])
    monkeypatch.setattr(ops, "add_rms_norm", lambda x, r, w, eps: made.append("norm") or (x, x))
    monkeypatch.setattr(ops, "silu_and_mul",
                        lambda gu: made.append("silu") or gu[:, : gu.shape[1] // 2])
    monkeypatch.setattr(skinny, "skinny_linear", record("projection"))
    monkeypatch.setattr(skinny, "skinny_norm_linear",
                        lambda x, *a, **kw: (record("norm projection")(x, *a, **kw), x))
    monkeypatch.setattr(skinny_lora, "lora_linear", record("projection + delta"))
    monkeypatch.setattr(skinny_lora, "lora_norm_linear",
                        lambda x, *a, **kw: (record("norm projection + delta")(x, *a, **kw),
                                             x))
    monkeypatch.setattr(ops, "lora_expand", lambda y, *a: made.append("expand") or y)
    return made, decisions


def _group(made: list[str]) -> ref.LoRAGroup:
    """Adapters whose shrink records which prologue it computes."""

    def shrink_op(x, a, slots, ranks, num_segments, norm_weight, eps, residual):
        made.append("shrink" + (" (norm)" if norm_weight is not None else ""))
        return torch.zeros(x.shape[0], 1, 4)

    return ref.LoRAGroup(a=torch.zeros(1, 4, 16), b=torch.zeros(1, 8, 4),
                         slots=torch.zeros(4, dtype=torch.long), ranks=torch.ones(1),
                         scales=torch.ones(1), segments=(8,), shrink_op=shrink_op)


@pytest.mark.parametrize("prologue,plain,want", [
    (WHOLE_K, WHOLE_K, ["shrink (norm)", "norm projection + delta"]),
    (None, WHOLE_K, ["norm", "shrink", "projection + delta"]),
    (None, SPLIT_K, ["norm", "shrink", "projection", "expand"]),
    (SPLIT_K, WHOLE_K, ["shrink (norm)", "norm projection", "expand"]),
])
def test_norm_linear_shrinks_right_before_the_projection(calls, prologue, plain, want):
    made, decisions = calls
    decisions.update({"norm": prologue, "plain": plain})
    x, w, nw = torch.zeros(2, 16), torch.zeros(8, 16), torch.ones(16)
    ops.norm_linear(x, x, nw, 1e-6, w, lora=_group(made))
    assert made == want


@pytest.mark.parametrize("prologue,plain,want", [
    (WHOLE_K, WHOLE_K, ["shrink (norm)", "norm projection + delta + SiLU pairs"]),
    (None, WHOLE_K, ["norm", "shrink", "projection + delta + SiLU pairs"]),
    (None, SPLIT_K, ["norm", "shrink", "projection", "expand", "silu"]),
    (SPLIT_K, WHOLE_K, ["shrink (norm)", "norm projection", "expand", "silu"]),
])
def test_gate_up_with_adapters_keeps_silu_in_its_epilogue(calls, prologue, plain, want):
    """SiLU·mul after the delta: in the folded projection's epilogue where the tile is
    whole-K, else a launch after the expand."""
    made, decisions = calls
    decisions.update({"norm": prologue, "plain": plain})
    x, w, nw = torch.zeros(2, 16), torch.zeros(8, 16), torch.ones(16)
    ops.norm_linear(x, x, nw, 1e-6, w, lora=_group(made), silu_out=True)
    assert made == want


@pytest.mark.parametrize("plain,want", [
    (WHOLE_K, ["shrink", "projection + delta"]),
    (SPLIT_K, ["shrink", "projection", "expand"]),
    (None, ["shrink", "expand"]),
])
def test_linear_shrinks_right_before_the_projection(calls, plain, want):
    """o and down: the shrink reads the rows the projection is given."""
    made, decisions = calls
    decisions.update({"plain": plain})
    ops.linear(torch.zeros(2, 16), torch.zeros(8, 16), lora=_group(made))
    assert made == want


def test_without_adapters_nothing_is_added(calls):
    made, decisions = calls
    decisions.update({"norm": None, "plain": WHOLE_K})
    x = torch.zeros(2, 16)
    ops.norm_linear(x, x, torch.ones(16), 1e-6, torch.zeros(8, 16))
    assert made == ["norm", "projection"]
