"""Where the kernel tuner's decisions come from (CPU, no timing): this process's memory, the
user's cache, the table shipped for the GPU, then timing; which entries count as valid; the
passes of ``decide_all``; the candidate set."""

from __future__ import annotations

import json

import pytest
import torch

GPU = "NVIDIA Test GPU"
KEY = ("plain", 1, 64, 1024, torch.bfloat16, False)
OTHER = ("norm", 2, 64, 1024, torch.bfloat16, False)


@pytest.fixture
def tuner(kernels, monkeypatch, tmp_path):
    """The tuner with a user cache and a shipped-table directory under ``tmp_path``, a fake
    GPU name, no capture, and ``_tune`` replaced by a recorder (timing needs CUDA)."""
    from replaylm.kernels import tuning_cache

    tuner = kernels.tuner
    monkeypatch.setattr(tuning_cache, "SHIPPED_DIR", tmp_path / "tuned")
    monkeypatch.setenv("REPLAYLM_CACHE", str(tmp_path / "user"))
    monkeypatch.setattr(tuner, "LINEAR_CHOICES", {})
    monkeypatch.setattr(tuner, "STATS", tuner.TuningStats())
    monkeypatch.setattr(tuner, "_gpu_name", lambda device: GPU)
    monkeypatch.setattr(tuner, "weight_rotation", lambda w: [w])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    tuned = []

    def fake_tune(key, weights, unfused, fused):
        tuned.append(key)
        return (1, 4, 1024, 4), 2.0, 3.0

    monkeypatch.setattr(tuner, "_tune", fake_tune)
    tuner.tuned = tuned
    for cached in (tuner._cache, tuner._shipped):
        cached.cache_clear()
    tuner.configure(shipped_table=True)
    yield tuner
    for cached in (tuner._cache, tuner._shipped):
        cached.cache_clear()
    tuner.configure(shipped_table=True)


def entry(tuner, key, gpu=GPU, **parts) -> str:
    """An entry key for ``key`` on ``gpu`` with this process's versions, PDL mode and kernel
    revision, or the ``parts`` given instead (torch, triton, pdl, src)."""
    import triton

    from replaylm.kernels import pdl
    from replaylm.kernels.tuning_cache import shape_key

    p = {"torch": torch.__version__, "triton": triton.__version__, "pdl": pdl.mode(),
         "src": tuner.kernels_revision(), **parts}
    return (f"{gpu}|torch {p['torch']}|triton {p['triton']}|pdl {p['pdl']}|src {p['src']}|"
            + shape_key(key))


def test_entry_keys_name_what_they_are_valid_for(tuner):
    from replaylm.kernels.tuning_cache import TuningCache, gpu_of, revision_of

    key = TuningCache(tuner.kernels_revision()).entry_key(KEY, GPU)
    assert key == entry(tuner, KEY)
    assert gpu_of(key) == GPU and revision_of(key) == tuner.kernels_revision()


def write_shipped(tuner, entries: dict, gpu=GPU):
    from replaylm.kernels.tuning_cache import shipped_path

    path = shipped_path(gpu)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(entries))
    return path


def choose(tuner, key=KEY):
    w = torch.zeros(4)
    return tuner.choose(key, w, unfused=lambda w: None, fused=lambda cfg, w: None)


def user_cache(tmp_path) -> dict:
    path = tmp_path / "user" / "linear_tuning.json"
    return json.loads(path.read_text()) if path.exists() else {}


def test_shipped_table_decides_when_the_user_cache_misses(tuner, tmp_path):
    write_shipped(tuner, {entry(tuner, KEY): [[1, 8, 512, 4], 2.5, 4.0]})
    assert choose(tuner) == (1, 8, 512, 4)
    assert tuner.tuned == [] and tuner.STATS.sources == {"shipped": 1}
    assert user_cache(tmp_path) == {}  # the table is not copied into the user's cache
    assert choose(tuner) == (1, 8, 512, 4)  # then from memory: counted once
    assert tuner.STATS.sources == {"shipped": 1}


def test_user_cache_wins_over_the_shipped_table(tuner, tmp_path):
    write_shipped(tuner, {entry(tuner, KEY): [[1, 8, 512, 4], 2.5, 4.0]})
    path = tmp_path / "user" / "linear_tuning.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({entry(tuner, KEY): [None, 3.0, 3.0]}))
    assert choose(tuner) is None
    assert tuner.STATS.sources == {"cache": 1} and tuner.tuned == []


def test_a_miss_everywhere_is_timed_and_saved_to_the_user_cache(tuner, tmp_path):
    write_shipped(tuner, {entry(tuner, OTHER): [None, 3.0, 3.0]})
    assert choose(tuner) == (1, 4, 1024, 4)
    assert tuner.tuned == [KEY] and tuner.STATS.sources == {"tuned": 1}
    assert tuner.STATS.candidates_timed == len(tuner.candidates(1, 1024))
    assert user_cache(tmp_path) == {entry(tuner, KEY): [[1, 4, 1024, 4], 2.0, 3.0]}


@pytest.mark.parametrize("stale", [
    {"src": "000000000000"},  # other kernel sources or decision rule: another digest
    {"torch": "0.0.1"},
    {"triton": "0.0.1"},
    {"pdl": "unknown"},
])
def test_shipped_entries_for_other_versions_are_ignored(tuner, stale):
    write_shipped(tuner, {entry(tuner, KEY, **stale): [[1, 8, 512, 4], 2.5, 4.0]})
    assert choose(tuner) == (1, 4, 1024, 4) and tuner.tuned == [KEY]


def test_another_gpus_table_is_not_read(tuner):
    """A table is found by the GPU's name; entries naming another GPU are ignored even in
    this GPU's file."""
    write_shipped(tuner, {entry(tuner, KEY, gpu="NVIDIA Other"): [[1, 8, 512, 4], 2.5, 4.0]},
                  gpu="NVIDIA Other")
    write_shipped(tuner, {entry(tuner, KEY, gpu="NVIDIA Other"): [[1, 8, 512, 4], 2.5, 4.0]})
    assert choose(tuner) == (1, 4, 1024, 4) and tuner.tuned == [KEY]


def test_shipped_table_can_be_turned_off(tuner):
    write_shipped(tuner, {entry(tuner, KEY): [[1, 8, 512, 4], 2.5, 4.0]})
    tuner.configure(shipped_table=False)
    assert choose(tuner) == (1, 4, 1024, 4) and tuner.STATS.sources == {"tuned": 1}


def test_shipped_table_is_read_only(tuner):
    from replaylm.kernels.tuning_cache import TuningCache, shipped_path

    table = TuningCache("rev", shipped_path(GPU), read_only=True)
    with pytest.raises(ValueError, match="read only"):
        table.store(KEY, GPU, (None, 1.0, 1.0))


def test_gpu_slug():
    from replaylm.kernels.tuning_cache import gpu_slug

    assert gpu_slug("NVIDIA H200") == "nvidia-h200"
    assert gpu_slug("NVIDIA GeForce RTX 4090 D") == "nvidia-geforce-rtx-4090-d"
    assert gpu_slug("NVIDIA A100-SXM4-80GB") == "nvidia-a100-sxm4-80gb"


def test_decide_all_compiles_ahead_then_decides(tuner, monkeypatch):
    """Three passes: unfused (nothing decided or compiled), precompile (every candidate of an
    undecided shape, the chosen tile of a decided one, submitted to compile; nothing decided),
    then deciding. With one thread, one deciding pass."""
    import triton

    write_shipped(tuner, {entry(tuner, OTHER): [[2, 4, 256, 4], 2.5, 4.0]})
    calls = []  # (pass, config, compiling only)

    def run():
        for key in (KEY, OTHER):
            def fused(cfg, w, key=key):
                calls.append((tuner._pass, key[0], cfg, tuner.skinny._COMPILE_ONLY.get()))
            got = tuner.choose(key, torch.zeros(4), unfused=lambda w: None, fused=fused)
            calls.append((tuner._pass, key[0], "->", got))

    class FakeAsync:  # triton.AsyncCompileMode needs a compiler; record that it was entered
        entered = 0

        def __init__(self, pool, ignore_errors=False):
            assert ignore_errors

        def __enter__(self):
            FakeAsync.entered += 1

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(triton, "AsyncCompileMode", FakeAsync)
    tuner.decide_all(run, threads=4)
    unfused = [c for c in calls if c[0] == "unfused"]
    assert unfused == [("unfused", "plain", "->", None), ("unfused", "norm", "->", None)]
    pre = [c for c in calls if c[0] == "precompile"]
    m1 = tuner.candidates(1, 1024)
    assert pre == ([("precompile", "plain", cfg, True) for cfg in m1]
                   + [("precompile", "plain", "->", None),
                      ("precompile", "norm", (2, 4, 256, 4), True),
                      ("precompile", "norm", "->", None)])
    assert [c for c in calls if c[0] is None] == [(None, "plain", "->", (1, 4, 1024, 4)),
                                                  (None, "norm", "->", (2, 4, 256, 4))]
    assert FakeAsync.entered == 1 and tuner.tuned == [KEY]
    assert tuner.STATS.precompiled == len(m1) + 1
    assert tuner.STATS.sources == {"shipped": 1, "tuned": 1}

    calls.clear()
    tuner.LINEAR_CHOICES.clear()
    tuner.decide_all(run, threads=1)
    assert {c[0] for c in calls} == {None} and FakeAsync.entered == 1


def test_passes_do_not_nest(tuner, monkeypatch):
    import triton

    monkeypatch.setattr(triton, "AsyncCompileMode",
                        lambda pool, ignore_errors: __import__("contextlib").nullcontext())
    with tuner.precompile(2), pytest.raises(RuntimeError, match="inside pass"):
        with tuner.precompile(2):
            pass
    assert tuner._pass is None


def test_candidates_drop_copies_made_by_capping_block_k(kernels):
    """At k = 1024 the 2048-wide tiles are capped to 1024: (2, 2048, 4) becomes (2, 1024, 4),
    already a candidate, and is timed once; (4, 2048, 8) becomes (4, 1024, 8), a tile of its
    own. Wide enough reductions keep every candidate."""
    tuner, skinny = kernels.tuner, kernels.skinny
    raw = skinny.candidate_configs(1, 1024)
    got = tuner.candidates(1, 1024)
    whole_k = [c for c in raw if len(c) == 4]  # then the split-K tiles with two ranges or more
    assert len(whole_k) == len(skinny.CANDIDATES[1]) and len(got) == len(raw) - 1
    assert set(got) == set(raw) and (1, 4, 1024, 8) in got
    assert got == [c for i, c in enumerate(raw) if c not in raw[:i]]
    for m in (1, 2, 4, 8):
        assert tuner.candidates(m, 4096) == skinny.candidate_configs(m, 4096)
    assert tuner.candidates(3, 4096) == skinny.candidate_configs(4, 4096)  # 3 rows: the 4-row tiles
    assert tuner.candidates(8, 64) == [(8, 2, 64, 4), (8, 4, 64, 4), (8, 4, 64, 8), (8, 8, 64, 4)]
    assert len(tuner.candidates(1, 64)) == len(set(skinny.candidate_configs(1, 64)))


def test_tuning_settings(kernels):
    """``EngineArgs.tuning_compile_threads``: 0 picks one thread per core (at most 16), a
    negative or non-integer count is refused naming the field; the shipped table is on by
    default."""
    from replaylm.config import EngineArgs

    args = EngineArgs()
    assert args.shipped_tuning_table is True and args.tuning_compile_threads == 0
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="tuning_compile_threads"):
            EngineArgs(tuning_compile_threads=bad)
    assert kernels.tuner.compile_threads(3) == 3
    assert 1 <= kernels.tuner.compile_threads(0) <= 16
