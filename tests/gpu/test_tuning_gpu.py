"""The kernel tuner's start-up machinery on the GPU: candidates compiled ahead leave nothing
for the timing pass to compile, and a shipped table's decision is used as measured.

Run with ``pytest -m gpu tests/gpu/test_tuning_gpu.py``; skipped without CUDA/Triton.
"""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.gpu

from tests.gpu.requires import compiled_triton  # noqa: E402

triton = compiled_triton()

from replaylm.kernels import jit_clock, ops, ref, tuner, tuning_cache  # noqa: E402

DEV = torch.device("cuda")


@pytest.fixture
def fresh_tuner(monkeypatch, tmp_path):
    """An empty user cache and shipped-table directory, and this test's decisions only."""
    monkeypatch.setenv("REPLAYLM_CACHE", str(tmp_path / "user"))
    monkeypatch.setattr(tuning_cache, "SHIPPED_DIR", tmp_path / "tuned")
    monkeypatch.setattr(tuner, "LINEAR_CHOICES", {})
    monkeypatch.setattr(tuner, "STATS", tuner.TuningStats())
    tuner._cache.cache_clear()
    tuner._shipped.cache_clear()
    jit_clock.install()
    yield tmp_path
    tuner._cache.cache_clear()
    tuner._shipped.cache_clear()


def test_precompile_leaves_nothing_to_compile_for_timing(fresh_tuner):
    """After ``decide_all``'s unfused and precompile passes, the deciding pass times every
    candidate without a compile (K = 1536 and 3 rows: a kernel no other test builds)."""
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(3, 1536, device=DEV, dtype=torch.bfloat16, generator=g)
    w = torch.randn(2048, 1536, device=DEV, dtype=torch.bfloat16, generator=g) * 0.02

    def run():
        ops.linear(x, w)

    with tuner._passing("unfused"):
        run()
    before = jit_clock.snapshot()
    with tuner.precompile(4):
        run()
    ahead = jit_clock.snapshot().since(before)
    assert tuner.STATS.precompiled == len(tuner.candidates(3, 1536))
    assert ahead.compiled + ahead.loaded >= len(tuner.candidates(3, 1536))
    assert tuner.LINEAR_CHOICES == {}  # nothing decided yet
    before = jit_clock.snapshot()
    got = ops.linear(x, w)
    timing = jit_clock.snapshot().since(before)
    assert (timing.compiled, timing.loaded) == (0, 0)
    assert tuner.STATS.sources == {"tuned": 1}
    torch.testing.assert_close(got, ref.linear(x, w), atol=2e-2, rtol=2e-2)


def test_shipped_decision_is_used_without_timing(fresh_tuner):
    m, n, k = 2, 1024, 2048
    key = ("plain", m, n, k, torch.bfloat16, False)
    config = (2, 4, 512, 8)
    gpu = torch.cuda.get_device_name(DEV)
    table = tuning_cache.shipped_path(gpu)
    table.parent.mkdir(parents=True)
    entry = tuning_cache.validity(gpu, tuner.kernels_revision()) + tuning_cache.shape_key(key)
    table.write_text(json.dumps({entry: [list(config), 3.0, 9.0]}))
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02
    got = ops.linear(x, w)
    assert tuner.LINEAR_CHOICES[key] == (config, 3.0, 9.0)
    assert tuner.STATS.sources == {"shipped": 1} and tuner.STATS.candidates_timed == 0
    assert not (fresh_tuner / "user" / "linear_tuning.json").exists()
    torch.testing.assert_close(got, ref.linear(x, w), atol=2e-2, rtol=2e-2)
