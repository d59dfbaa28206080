"""LoRA in the server: ``--lora-modules`` adapters picked by ``model``, listed by
``/v1/models``; an unknown model is a 404 ``model_not_found``; adapters load and unload at
runtime through vLLM's routes, which exist only behind the admin key or with
``--enable-lora-updates``."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

import replaylm
from replaylm import LLM
from replaylm.config import EngineArgs
from replaylm.engine.core import EngineCore
from replaylm.server.app import build_app
from replaylm.server.lora import parse_lora_modules
from tests.lora.conftest import lora_setup  # noqa: F401, F811  (the LoRA tests' fixture)
from tests.lora.helpers import GREEDY, PROMPTS
from tests.server.conftest import serve

KEY = "k3y"
AUTH = {"Authorization": f"Bearer {KEY}"}
ARGS = dict(device="cpu", enable_lora=True, max_loras=2, max_lora_rank=16, enforce_eager=True,
            max_num_seqs=4, max_model_len=64, num_kv_blocks=40, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def setup(lora_setup, tmp_path_factory):  # noqa: F811
    """The llama checkpoint with a tokenizer beside it (the default model's: ids below 256
    decode to text), and the texts an engine generates for prompt 0 under each adapter."""
    base, loras, _ = lora_setup("llama")
    with_tok = tmp_path_factory.mktemp("lora-served")
    shutil.copytree(base, with_tok, dirs_exist_ok=True)
    assets = Path(replaylm.__file__).parent / "assets" / "default"
    for f in assets.glob("*token*"):
        shutil.copy(f, with_tok / f.name)
    llm = LLM(str(with_tok), **ARGS)
    texts = {lora: llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False,
                                lora_request=lora)[0].outputs[0].text
             for lora in [None, *loras]}
    assert len(set(texts.values())) == 4
    return with_tok, loras, texts


def _complete(url: str, model: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=60, json={
        "model": model, "prompt": PROMPTS[0], "temperature": 0.0, "max_tokens": 6,
        "ignore_eos": True})


def test_served_adapters(setup):
    path, loras, texts = setup
    core = EngineCore(EngineArgs(model=str(path), **ARGS))
    modules = {"alpha": loras[0].lora_path, "beta": loras[1].lora_path}
    with serve(core, lora_modules=modules) as server:
        url = server.url
        models = httpx.get(url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == [str(path), "alpha", "beta"]
        assert models[1]["parent"] == str(path) and models[1]["root"] == loras[0].lora_path
        for model, want in ((str(path), texts[None]), ("alpha", texts[loras[0]]),
                            ("beta", texts[loras[1]])):
            r = _complete(url, model)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want and r.json()["model"] == model
        r = _complete(url, "gamma")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        # No key and no --enable-lora-updates: the routes do not exist.
        r = httpx.post(url + "/v1/load_lora_adapter",
                       json={"lora_name": "gamma", "lora_path": loras[2].lora_path})
        assert r.status_code == 404
        server.wait_idle()


def test_load_and_unload_at_runtime(setup):
    path, loras, texts = setup
    core = EngineCore(EngineArgs(model=str(path), **ARGS))
    with serve(core, admin_api_key=KEY) as server:
        url = server.url
        body = {"lora_name": "gamma", "lora_path": loras[2].lora_path}
        assert httpx.post(url + "/v1/load_lora_adapter", json=body).status_code == 401
        r = httpx.post(url + "/v1/load_lora_adapter", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        assert _complete(url, "gamma").json()["choices"][0]["text"] == texts[loras[2]]
        again = httpx.post(url + "/v1/load_lora_adapter", json=body, headers=AUTH)
        assert again.status_code == 400 and "already been loaded" in again.text
        bad = httpx.post(url + "/v1/load_lora_adapter", headers=AUTH,
                         json={"lora_name": "bad", "lora_path": "/no/such/dir"})
        assert bad.status_code == 400 and "adapter_config.json" in bad.text
        r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "gamma"},
                       headers=AUTH)
        assert r.status_code == 200, r.text
        assert _complete(url, "gamma").status_code == 404
        r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "gamma"},
                       headers=AUTH)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        # Loaded again under the same name: a new id, the same output.
        r = httpx.post(url + "/v1/load_lora_adapter", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        assert _complete(url, "gamma").json()["choices"][0]["text"] == texts[loras[2]]
        server.wait_idle()


def test_updates_without_a_key_need_the_flag(setup):
    path, loras, _ = setup
    core = EngineCore(EngineArgs(model=str(path), **ARGS))
    client = TestClient(build_app(core, enable_lora_updates=True))  # routing alone
    r = client.post("/v1/unload_lora_adapter", json={"lora_name": "nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"


def test_lora_modules_flag():
    assert parse_lora_modules(["a=/x", "b=/y=z"]) == {"a": "/x", "b": "/y=z"}
    for bad in (["a"], ["=/x"], ["a=/x", "a=/y"]):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_modules(bad)
    with pytest.raises(ValueError, match="enable_lora=True"):
        build_app(EngineCore(EngineArgs(model="default", device="cpu", enforce_eager=True,
                                        num_kv_blocks=8, max_model_len=32,
                                        load_format="dummy")),
                  lora_modules={"a": "/x"})
