"""Compile plans (``kernels.compile_plan``): keys, recording, files and the preload pass.

Triton compiles nothing without a GPU, so the preload here drives fake kernels through the
real ``triton.AsyncCompileMode``; the GPU suite starts engines that record and replay."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from replaylm.kernels import compile_plan as cp

MODEL = {"name": "llama3.2-1b", "hidden_size": 2048, "num_layers": 16, "bos_token_id": 128000,
         "eos_token_ids": (128001,)}
ARGS = {"model": "llama3.2-1b", "seed": 0, "max_num_seqs": 256, "cuda_graph_mode": "ragged"}


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("REPLAYLM_CACHE", str(tmp_path))
    monkeypatch.setattr(cp, "_recorded", {})
    return tmp_path


def test_the_key_names_shapes_and_settings_not_the_checkpoint():
    key = cp.plan_key("NVIDIA H200", MODEL, ARGS, "ragged")
    assert key.startswith("nvidia-h200-")
    instruct = {"name": "/ckpt/Llama-3.2-1B-Instruct", "eos_token_ids": (128001, 128009)}
    assert cp.plan_key("NVIDIA H200", MODEL | instruct,
                       ARGS | {"model": "/ckpt/Llama-3.2-1B-Instruct", "seed": 7}, "ragged") == key
    assert cp.plan_key("NVIDIA H100", MODEL, ARGS, "ragged") != key
    assert cp.plan_key("NVIDIA H200", MODEL | {"hidden_size": 4096}, ARGS, "ragged") != key
    assert cp.plan_key("NVIDIA H200", MODEL, ARGS | {"max_num_seqs": 64}, "ragged") != key
    # The mode that runs, however it was asked for.
    default = ARGS | {"cuda_graph_mode": None}
    assert cp.plan_key("NVIDIA H200", MODEL, default, "ragged") == key
    assert cp.plan_key("NVIDIA H200", MODEL, default, "full") != key
    assert (cp.plan_key("NVIDIA H200", MODEL, default | {"enforce_eager": True}, "eager")
            == cp.plan_key("NVIDIA H200", MODEL, ARGS | {"cuda_graph_mode": "eager"}, "eager"))


def _info(module, name, cache_key="src-1"):
    return SimpleNamespace(module=module, name=name,
                           jit_function=SimpleNamespace(cache_key=cache_key))


def _compiled(info, data):
    cp._note(key="k", repr="r", fn=info, compile={"specialization_data": data},
             is_manual_warmup=False, already_compiled=False)


def test_replaylm_kernels_are_noted_and_saved(fresh):
    _compiled(_info("replaylm.kernels.argmax", "_argmax_kernel"), '{"a": 1}')
    _compiled(_info("replaylm.kernels.argmax", "_argmax_kernel"), '{"a": 1}')  # once
    _compiled(_info("someone.else", "kernel"), '{"b": 2}')
    assert cp.recorded() == [{"fn": "replaylm.kernels.argmax:_argmax_kernel",
                              "fn_key": "src-1", "data": '{"a": 1}'}]
    path = cp.save("plan")
    assert path == fresh / "compile_plans" / "plan.json"
    entries, source = cp.read("plan")
    assert entries == cp.recorded() and source == path
    assert cp.read("other") == ([], None)
    path.write_text("not json")
    assert cp.read("plan") == ([], None)


def test_a_shipped_plan_serves_when_the_user_has_none(fresh, tmp_path_factory):
    shipped = tmp_path_factory.mktemp("shipped")
    _compiled(_info("replaylm.kernels.argmax", "_argmax_kernel"), '{"a": 1}')
    cp.save("plan", directory=shipped)
    entries, source = cp.read("plan", shipped_dir=shipped)
    assert len(entries) == 1 and source == shipped / "plan.json"


def test_install_chains_the_hook_already_set(monkeypatch, fresh):
    triton = pytest.importorskip("triton")
    calls = []
    monkeypatch.setattr(cp, "_installed", False)
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook",
                        lambda **kw: calls.append(kw["key"]))
    cp.install()
    hook = triton.knobs.runtime.jit_post_compile_hook
    hook(key="k1", repr="r", fn=_info("replaylm.kernels.elementwise", "_silu_mul_kernel"),
         compile={"specialization_data": "{}"}, is_manual_warmup=True, already_compiled=False)
    assert calls == ["k1"] and len(cp.recorded()) == 1


def test_kernel_names_resolve_to_their_jit_functions():
    pytest.importorskip("triton")
    from replaylm.env import triton_interpreted

    fn = cp.resolve("replaylm.kernels.argmax:_argmax_kernel")
    if triton_interpreted():  # interpreted kernels compile nothing: no plan to replay
        assert fn is None
    else:
        assert hasattr(fn, "preload") and isinstance(fn.cache_key, str)
    assert cp.resolve("replaylm.kernels.argmax:no_such_kernel") is None
    assert cp.resolve("replaylm.no_such_module:kernel") is None


def test_preload_skips_changed_sources_and_survives_refusals(monkeypatch):
    pytest.importorskip("triton")
    preloaded = []

    class Kernel:
        def __init__(self, cache_key, refuse=False):
            self.cache_key, self.refuse = cache_key, refuse

        def preload(self, data):
            if self.refuse:
                raise RuntimeError("specialization for another kernel")
            preloaded.append(data)

    kernels = {"m:same": Kernel("src-1"), "m:changed": Kernel("src-2"),
               "m:refuses": Kernel("src-1", refuse=True)}
    monkeypatch.setattr(cp, "resolve", kernels.get)
    entries = [{"fn": name, "fn_key": "src-1", "data": name} for name in
               ("m:same", "m:changed", "m:refuses", "m:gone")]
    stats = cp.preload(entries, threads=2)
    assert preloaded == ["m:same"]
    assert (stats.submitted, stats.skipped, stats.refused) == (1, 2, 1)


def test_the_settings_left_out_of_the_key_are_engine_settings():
    import dataclasses

    from replaylm.config import EngineArgs

    assert cp.UNRELATED_ARGS <= {f.name for f in dataclasses.fields(EngineArgs)}


def test_every_shipped_plan_is_a_named_shape_at_default_settings():
    """Each shipped plan's name is the key a default start of a named shape computes on the
    GPU and versions of the shipped tuning tables. A change to the key, or to an engine
    default that is part of it, orphans the shipped plans (first starts then compile one
    kernel at a time): record and ship them again (``benchmarks/tuning_table.py plans``)."""
    import dataclasses
    import json

    import torch

    from replaylm.config import EngineArgs
    from replaylm.engine.loading import load_model_config
    from replaylm.graphs.policy import DEFAULT_GPU_MODE
    from replaylm.kernels.tuning_cache import SHIPPED_DIR as TABLES
    from replaylm.model.shapes import NAMED_SHAPES

    triton = pytest.importorskip("triton")

    plans = sorted(p.stem for p in cp.SHIPPED_DIR.glob("*.json"))
    assert plans, "no shipped plan"
    keys = set()
    for table in TABLES.glob("*.json"):
        for entry in json.loads(table.read_text()):
            gpu, torch_v, triton_v = entry.split("|")[:3]
            keys.add((gpu, torch_v.removeprefix("torch "), triton_v.removeprefix("triton ")))
    expected = {}
    for gpu, torch_v, triton_v in keys:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch, "__version__", torch_v)
            mp.setattr(triton, "__version__", triton_v)
            for name in NAMED_SHAPES:
                cfg = dataclasses.asdict(load_model_config(name)[0])
                args = dataclasses.asdict(EngineArgs(model=name))
                expected[cp.plan_key(gpu, cfg, args, DEFAULT_GPU_MODE)] = name
    assert all(p in expected for p in plans), {p: expected.get(p) for p in plans}


def test_a_checkpoint_of_a_named_shape_shares_its_plans(tmp_path):
    """A local Llama-3.2-1B-Instruct directory (its own end-of-turn tokens) keys as the
    ``llama3.2-1b`` named shape, so the plan shipped for that shape serves it."""
    import dataclasses
    import json

    from replaylm.config import EngineArgs
    from replaylm.engine.loading import load_model_config
    from replaylm.model.shapes import NAMED_SHAPES

    pytest.importorskip("triton")
    config = NAMED_SHAPES["llama3.2-1b"] | {"eos_token_id": [128001, 128008, 128009]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 128009}))

    def key(model: str) -> str:
        cfg = dataclasses.asdict(load_model_config(model)[0])
        return cp.plan_key("NVIDIA H200", cfg, dataclasses.asdict(EngineArgs(model=model)),
                           "ragged")

    assert key(str(tmp_path)) == key("llama3.2-1b")
