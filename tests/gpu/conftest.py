"""GPU-suite fixtures."""

from __future__ import annotations

import pytest

from tests.conftest import make_checkpoint

#: The checkpoints the graph-machinery tests replay: a dense Llama, Qwen3 (q/k norm, rotary in
#: the attention launch) and Qwen2-MoE (routed and shared experts, the side stream). Graph
#: capture, padding and replay do not depend on the rest; the model tests run every tiny
#: checkpoint through the engine's graph modes, and the suite must finish in 8 minutes.
GRAPH_KINDS = ("llama", "qwen2_moe", "qwen3")


@pytest.fixture(scope="session", params=GRAPH_KINDS)
def graph_checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"graph-{request.param}")
    model = make_checkpoint(request.param, path)
    return request.param, path, model

#: The checkpoints the smoke subset (``-m "gpu and smoke"``) runs: a dense model and an MoE
#: one. Each further kind compiles its own kernel variants, and the subset has two minutes
#: on a fresh machine.
SMOKE_KINDS = ("llama", "qwen2_moe")


def pytest_collection_modifyitems(config, items):
    """Keep the smoke mark only on the smoke kinds' runs of checkpoint-parametrized tests."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        kind = params.get("tiny_checkpoint", params.get("graph_checkpoint"))
        if kind is not None and kind not in SMOKE_KINDS:
            item.own_markers = [m for m in item.own_markers if m.name != "smoke"]
