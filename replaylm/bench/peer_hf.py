"""Hugging Face transformers as the anchor of ``bench decode`` (``--peer hf``).

The same checkpoint (a model directory loads its weights; where replaylm runs random weights
- named shapes, the built-in default, ``--load-format dummy`` - transformers gets random
weights of the same config), dtype, device, token-id prompts and protocol as replaylm's rows:
greedy, exactly ``new_tokens`` new tokens per request (EOS never stops a run), one warm-up
call (its time is reported as ``first_call_s``: compilation shows there), then the best of
``repeats`` timed calls at batch 1 and one timed call for larger batches. Modes:

- ``generate``: ``model.generate`` with the default dynamic cache, eager;
- ``static_compile``: ``model.generate`` with ``cache_implementation="static"`` and the
  model's forward compiled by ``torch.compile(mode="reduce-overhead", fullgraph=True)``;
- ``generate_batch``: transformers' continuous batching (``model.generate_batch``).

A mode the installed transformers lacks, or that fails, is reported with its error in the
JSON instead of failing the benchmark.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from replaylm.bench.common import random_prompts
from replaylm.config import EngineArgs

HF_MODES = ("generate", "static_compile", "generate_batch")


@dataclasses.dataclass
class PeerRow:
    """One measured peer configuration."""

    peer: str
    mode: str
    batch: int
    prompt_len: int
    new_tokens: int
    generated_tokens: int = 0
    wall_s: float | None = None
    tok_s: float | None = None
    all_wall_s: list[float] = dataclasses.field(default_factory=list)
    first_call_s: float | None = None
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def parse_hf_modes(text: str) -> list[str]:
    """``--peer-hf-modes``: a comma-separated subset of :data:`HF_MODES`."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in HF_MODES]
    if bad or not modes:
        raise ValueError(f"unknown --peer-hf-modes {bad or text!r}; choose from {list(HF_MODES)}")
    return modes


def load_hf_model(args: EngineArgs) -> Any:
    """The transformers model of ``args.model`` on replaylm's device and dtype."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from replaylm.engine.runner_setup import resolve_device, resolve_dtype
    from replaylm.model.shapes import DEFAULT_MODEL_DIR, hf_config_from_dict, resolve_model

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    directory, shape = resolve_model(args.model)
    if directory is not None and directory != DEFAULT_MODEL_DIR and args.load_format != "dummy":
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    else:
        cfg = hf_config_from_dict(shape) if shape is not None else \
            AutoConfig.from_pretrained(directory)
        torch.manual_seed(args.seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.to(device).eval()
    model.generation_config.eos_token_id = None  # runs always produce new_tokens tokens
    model.generation_config.pad_token_id = 0
    return model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _runner(model: Any, mode: str, prompts: list[list[int]], new_tokens: int
            ) -> Callable[[], int]:
    """A call that generates for ``prompts`` in ``mode`` and returns the tokens generated."""
    if mode == "generate_batch":
        from transformers import ContinuousBatchingConfig, GenerationConfig

        gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
        cb = None
        if model.device.type != "cuda":  # the GPU default sizes itself from free memory
            tokens = len(prompts) * (len(prompts[0]) + new_tokens)
            cb = ContinuousBatchingConfig(block_size=16, num_blocks=tokens // 16 + 2 * len(prompts),
                                          max_batch_tokens=max(64, len(prompts[0])))
        return lambda: sum(len(r.generated_tokens) for r in model.generate_batch(
            prompts, generation_config=gen, continuous_batching_config=cb).values())
    ids = torch.tensor(prompts, device=model.device)
    mask = torch.ones_like(ids)
    extra = {"cache_implementation": "static", "disable_compile": True} \
        if mode == "static_compile" else {}

    def run() -> int:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                             do_sample=False, **extra)
        return int(out.shape[0] * (out.shape[1] - ids.shape[1]))
    return run


def bench_hf(model: Any, mode: str, batch: int, prompt_len: int, new_tokens: int,
             repeats: int, seed: int) -> PeerRow:
    """One (mode, batch) row with ``bench decode``'s prompts and protocol."""
    row = PeerRow("hf", mode, batch, prompt_len, new_tokens)
    if mode == "generate_batch" and not hasattr(model, "generate_batch"):
        row.error = "this transformers has no generate_batch"
        return row
    vocab = int(model.config.vocab_size)
    compiled = mode == "static_compile"
    if compiled:
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    try:
        warm = _runner(model, mode, random_prompts(batch, prompt_len, vocab, seed + 1), new_tokens)
        timed = _runner(model, mode, random_prompts(batch, prompt_len, vocab, seed), new_tokens)
        row.first_call_s, _ = _timed(warm, model.device)
        runs = [_timed(timed, model.device) for _ in range(max(1, repeats if batch == 1 else 1))]
    except Exception as e:  # a peer that cannot run is a finding, not a crash
        row.error = f"{type(e).__name__}: {e}"[:500]
        return row
    finally:
        if compiled:
            del model.forward  # back to the class's eager forward
    row.all_wall_s = [w for w, _ in runs]
    row.wall_s, row.generated_tokens = min(runs)
    expected = batch * new_tokens
    if row.generated_tokens != expected:
        row.error = f"generated {row.generated_tokens} of {expected} tokens"
    row.tok_s = row.generated_tokens / row.wall_s
    return row


def _timed(fn: Callable[[], int], device: torch.device) -> tuple[float, int]:
    _sync(device)
    start = time.perf_counter()
    n = fn()
    _sync(device)
    return time.perf_counter() - start, n


def run_hf_peer(base: EngineArgs, modes: list[str], batch_sizes: list[int], prompt_len: int,
                batched_prompt_len: int, new_tokens: int, repeats: int, seed: int,
                log: Callable[[str], None] = print) -> list[PeerRow]:
    """Every (mode, batch size) of the transformers peer on ``base``'s checkpoint."""
    model = load_hf_model(base)
    rows = []
    with torch.inference_mode():
        for mode in modes:
            for bs in batch_sizes:
                length = prompt_len if bs == 1 else batched_prompt_len
                row = bench_hf(model, mode, bs, length, new_tokens, repeats, seed)
                what = f"{row.tok_s:,.1f} tok/s" if row.tok_s else "-"
                log(f"[bench] peer=hf mode={mode} batch={bs}: {what}"
                    + (f" ({row.error})" if row.error else ""))
                rows.append(row)
    del model
    return rows


def ratios(rows: list[dict[str, Any]], peers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """replaylm tok/s ÷ peer tok/s for every replaylm row and peer row of the same batch."""
    out = []
    for r in rows:
        for p in peers:
            if p["batch"] == r["batch"] and p.get("tok_s") and not p.get("error"):
                out.append({"mode": r["mode"], "batch": r["batch"],
                            "peer": f"{p['peer']} {p['mode']}",
                            "ratio": round(r["tok_s"] / p["tok_s"], 3)})
    return out


def format_peers(peers: list[dict[str, Any]], ratio_rows: list[dict[str, Any]]) -> str:
    """Plain-text peer table and replaylm's ratios against each peer."""
    lines = [f"{'peer':<22} {'batch':>5} {'tok/s':>12} {'first call s':>13}  note"]
    for p in peers:
        tok = f"{p['tok_s']:,.1f}" if p.get("tok_s") else "-"
        first = f"{p['first_call_s']:.2f}" if p.get("first_call_s") is not None else "-"
        lines.append(f"{'hf ' + p['mode']:<22} {p['batch']:>5} {tok:>12} {first:>13}  "
                     f"{p.get('error') or ''}")
    for q in ratio_rows:
        lines.append(f"replaylm {q['mode']} / {q['peer']}, batch {q['batch']}: {q['ratio']:.2f}x")
    return "\n".join(lines)
