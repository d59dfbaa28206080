"""GPU-suite fixtures."""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path

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

#: The checkpoints the smoke subset (``-m "gpu and smoke"``) runs, and the graph modes it runs
#: each in (None: every mode): a dense model in every mode, an MoE one in ``ragged``. Each
#: further kind or mode compiles its own kernel variants, and the subset has two minutes on
#: a fresh machine.
SMOKE_KINDS: dict[str, tuple[str, ...] | None] = {"llama": None, "qwen2_moe": ("ragged",)}


def pytest_collection_modifyitems(config, items):
    """Keep the smoke mark only on the smoke kinds' (and modes') runs of
    checkpoint-parametrized tests."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        kind = params.get("tiny_checkpoint", params.get("graph_checkpoint"))
        if kind is None:
            continue
        mode = params.get("mode")
        modes = SMOKE_KINDS.get(kind, ())
        smoke = kind in SMOKE_KINDS and (modes is None or mode is None or mode in modes)
        if not smoke:
            item.own_markers = [m for m in item.own_markers if m.name != "smoke"]


def _lock(path: Path, mode: int):
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, mode)
    return fd


def _unlock(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under pytest-xdist (``pytest -m gpu -n 4``) the workers share one GPU. A test marked
    ``exclusive`` (it reads the device's free memory) runs while no other worker's test
    does: it holds the gate while it waits, so no new test starts, then takes the device
    lock exclusively; every other test passes the gate and holds the device lock shared.
    The locks cover the whole protocol, so module fixtures (engines) are set up and torn
    down under them too."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:
        yield
        return
    base = Path(tempfile.gettempdir()) / f"replaylm-gpu-{run}"
    gate = _lock(base.with_suffix(".gate"), fcntl.LOCK_EX)
    exclusive = item.get_closest_marker("exclusive") is not None
    device = _lock(base.with_suffix(".device"), fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
    if not exclusive:
        _unlock(gate)
    try:
        yield
    finally:
        _unlock(device)
        if exclusive:
            _unlock(gate)
