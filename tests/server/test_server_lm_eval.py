"""lm-evaluation-harness against a real ``replaylm serve`` process: ``local-completions``
(token-id prompts, ``echo`` + ``logprobs`` + ``max_tokens=1`` for loglikelihoods, ``stop``
for generate_until) on tasks defined in local files, compared with lm-eval's own ``hf``
model on the same fp32 checkpoint. Offline: the tasks' data are local JSON files, the
tokenizer is the checkpoint's."""

from __future__ import annotations

import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.conftest import make_checkpoint
from tests.serve_process import serve_process

lm_eval = pytest.importorskip("lm_eval", reason="the test extra installs lm-eval")

ASSETS = Path(__file__).resolve().parents[2] / "replaylm" / "assets" / "default"
QUESTIONS = [
    {"question": "The capital of France is", "choices": [" Paris", " Rome", " a city"],
     "answer": 0},
    {"question": "2 + 2 =", "choices": [" 4", " five", " 22 and more"], "answer": 0},
    {"question": "def add(a, b):\n    return", "choices": [" a + b", " None"], "answer": 0},
]
PROMPTS = [{"prompt": "Once upon a time", "target": " there"},
           {"prompt": "import numpy as", "target": " np"}]


def _tasks(root: Path) -> Path:
    """A multiple-choice (loglikelihood) task and a generate_until task, with their data."""
    root.mkdir()
    for name, rows in (("mc", QUESTIONS), ("gen", PROMPTS)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = (f"dataset_path: json\ndataset_kwargs:\n  cache_dir: {root / 'hf-cache'}\n"
              "  data_files:\n    test: {data}\ntest_split: test\n")
    (root / "replaylm_mc.yaml").write_text(
        "task: replaylm_mc\n" + common.format(data=root / "mc.jsonl")
        + "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n")
    (root / "replaylm_gen.yaml").write_text(
        "task: replaylm_gen\n" + common.format(data=root / "gen.jsonl")
        + "output_type: generate_until\ndoc_to_text: '{{prompt}}'\n"
        "doc_to_target: '{{target}}'\ngeneration_kwargs:\n  until: ['\\n']\n"
        "  max_gen_toks: 6\n  do_sample: false\n  temperature: 0.0\n"
        "metric_list:\n  - metric: exact_match\n")
    return root


def _evaluate(model: str, model_args: dict, tasks: Path) -> dict:
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=["replaylm_mc", "replaylm_gen"],
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        log_samples=True, use_cache=None,
        batch_size=1, bootstrap_iters=0, random_seed=0, numpy_random_seed=0,
        torch_random_seed=0, fewshot_random_seed=0)
    return out["samples"]


def _loglikelihoods(samples: dict) -> list[float]:
    """Each (question, choice) pair's loglikelihood, in document and choice order."""
    return [resp[0][0] for s in sorted(samples["replaylm_mc"], key=lambda s: s["doc_id"])
            for resp in s["resps"]]


def _generations(samples: dict) -> list[str]:
    return [s["filtered_resps"][0] for s in sorted(samples["replaylm_gen"],
                                                   key=lambda s: s["doc_id"])]


def _requests_served(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(m.group(1)) for m in re.finditer(
        r'^replaylm_requests_finished_total\{[^}]*\} ([0-9.e+]+)$', text, re.M))


def test_lm_eval_local_completions_matches_hf(tmp_path, monkeypatch):
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    ckpt = tmp_path / "ckpt"
    make_checkpoint("llama", ckpt, vocab_size=4096, bos_token_id=0, eos_token_id=1)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(ASSETS / f, ckpt / f)
    tasks = _tasks(tmp_path / "tasks")
    common = {"add_bos_token": True, "max_length": 256}

    with ThreadPoolExecutor(1) as pool:  # lm-eval's hf run while the server starts
        hf_run = pool.submit(_evaluate, "hf", {"pretrained": str(ckpt), "dtype": "float32",
                                               "device": "cpu", **common}, tasks)
        with serve_process(tmp_path / "serve.log", "--model", str(ckpt), "--dtype",
                           "float32", "--enforce-eager") as (_, url):
            hf = hf_run.result()
            before = _requests_served(url)
            served = _evaluate("local-completions", {
                "model": str(ckpt), "base_url": url + "/v1/completions",
                "tokenizer": str(ckpt), "tokenizer_backend": "huggingface",
                "tokenized_requests": True, "num_concurrent": 1, "max_retries": 1, **common},
                tasks)
            calls = _requests_served(url) - before

    want, got = _loglikelihoods(hf), _loglikelihoods(served)
    n_pairs = sum(len(q["choices"]) for q in QUESTIONS)
    # lm_eval really asked the server: one request per (question, choice) and per prompt
    assert calls == n_pairs + len(PROMPTS), calls
    assert len(got) == len(want) == n_pairs
    # a real comparison: the scores differ from each other and are far from 0
    assert len({round(v, 3) for v in want}) == n_pairs and max(want) < -1.0
    assert got == pytest.approx(want, abs=1e-4, rel=0)
    assert _generations(served) == _generations(hf)
    assert all(g for g in _generations(served))
