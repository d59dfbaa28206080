"""Structured outputs against none (a CUDA GPU; ``--tiny`` runs on a CPU), on one engine or
over ``--tensor-parallel-size`` / ``--data-parallel-size`` GPUs.

    PYTHONPATH=. python benchmarks/structured.py --model llama3.2-1b --json so.json
    PYTHONPATH=. python benchmarks/structured.py --model llama3-8b --tensor-parallel-size 2

The named shape runs with random weights and a byte-level BPE tokenizer of the model's whole
vocabulary (128,256 entries for Llama 3) built here: the 256 byte tokens, then merges of
existing tokens into new ones up to the vocabulary size (printable text, JSON punctuation,
digits and spaces, as a real tokenizer's entries are), so xgrammar's mask work is that of a
real 128k vocabulary.

Measured, each repeat interleaving the two variants:

- output tok/s of ``--batch-sizes`` requests (every request ``--max-tokens`` tokens at
  ``--temperature``, all started together) with no constraint, and with every request
  constrained by a nested JSON schema that cannot close within ``--max-tokens`` (so both
  variants generate the same number of tokens);
- the graph fallbacks the engine counted during each variant, by reason (structured outputs
  must add none);
- TTFT of one request with the schema already compiled against one without a constraint;
- the stall a new schema's compilation causes: the longest gap between tokens of running
  unconstrained streams while a request with a never-seen schema is admitted.

``--grammar-host`` measures the host's share alone, no model and no GPU: per step of
``--batch-sizes`` matchers of the schema over the vocabulary (the named shape's size), the
mask fill of every row together (xgrammar's ``BatchGrammarMatcher``, its default threads, as
``structured.masks`` fills them) and each matcher taking one allowed token, median over
``--max-tokens`` steps. Beside each fill it times the choice ``structured.masks`` makes
between filling and then applying the step in flight, and applying it on a worker thread
while this one fills: Python work as long as the fill alone, in turn with the fill and on a
worker during it (``apply_beside_rows`` is the row count from which the worker wins).

    PYTHONPATH=. python benchmarks/structured.py --model llama3.2-1b --grammar-host
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from replaylm import LLM, SamplingParams
from replaylm.sampling_params import StructuredOutputsParams

#: Characters merged into multi-byte tokens: text, digits, JSON punctuation, spaces.
ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 _-.,:;\"{}[]"


def byte_level_tokenizer(vocab_size: int, out: Path, seed: int = 0) -> Path:
    """Write a byte-level BPE tokenizer with exactly ``vocab_size`` entries (the last two are
    the bos and eos special tokens) to ``out`` and return it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges: list[tuple[str, str]] = []
    rng = random.Random(seed)
    # ByteLevel maps a space to "Ġ"; merge over the mapped forms so every token round-trips.
    mapped = [("Ġ" if ch == " " else ch) for ch in ALPHABET]
    pieces = [m for m in mapped if m in vocab]
    target = vocab_size - 2
    while len(vocab) < target:
        a = rng.choice(pieces)
        b = rng.choice(pieces)
        new = a + b
        if len(new) > 16 or new in vocab:
            continue
        vocab[new] = len(vocab)
        merges.append((a, b))
        pieces.append(new)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|bos|>", "<|eos|>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>",
                                   eos_token="<|eos|>")
    fast.save_pretrained(str(out))
    return out


#: Objects with enums, numbers, patterned strings and arrays; at least 1,000 of them, so a
#: stream of a few hundred tokens never completes the document.
SCHEMA = {
    "type": "array",
    "minItems": 1000,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "kind": {"enum": ["alpha", "beta", "gamma"]},
            "score": {"type": "number"},
            "tag": {"type": "string", "pattern": "^[a-z]{2,8}$"},
            "values": {"type": "array", "items": {"type": "integer"}, "maxItems": 4},
        },
        "required": ["id", "kind", "score", "tag", "values"],
        "additionalProperties": False,
    },
}


def run_batch(llm: LLM, n: int, max_tokens: int, schema: dict | None, seed: int,
              temperature: float = 1.0) -> float:
    """Output tok/s of ``n`` requests started together."""
    so = StructuredOutputsParams(json=schema) if schema is not None else None
    params = [SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=temperature,
                             seed=seed + i, ignore_eos=schema is None, structured_outputs=so)
              for i in range(n)]
    prompts = [f"Request {seed + i}: write the records as JSON." for i in range(n)]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    if schema is not None and tokens != n * max_tokens:
        raise RuntimeError(f"constrained requests stopped early: {tokens} of {n * max_tokens}")
    return tokens / dt


def ttft(llm: LLM, schema: dict | None) -> float:
    so = StructuredOutputsParams(json=schema) if schema is not None else None
    params = SamplingParams(max_tokens=1, temperature=1.0, seed=1, structured_outputs=so)
    t0 = time.perf_counter()
    llm.generate(["Time to first token."], params, use_tqdm=False)
    return time.perf_counter() - t0


def compile_stall(llm: LLM, streams: int) -> dict:
    """The longest step of ``streams`` unconstrained requests while a never-seen schema
    compiles on a thread of its own (as the server compiles it, off the engine thread) and
    its request then joins them and runs to its end, against their steady step."""
    engine = llm.engine
    params = SamplingParams(max_tokens=100_000, temperature=1.0, ignore_eos=True, seed=3)
    for i in range(streams):
        engine.add_request(f"stall-{i}", f"stream {i}", params)
    fresh = SamplingParams(max_tokens=8, temperature=1.0, structured_outputs=(
        StructuredOutputsParams(json=dict(SCHEMA, description=f"fresh {time.time_ns()}"))))
    compiling = threading.Thread(target=engine.compile_structured, args=(fresh,))
    gaps: list[float] = []
    compile_s = None
    new_done = False
    last = t0 = time.perf_counter()
    while not new_done:
        for delta in engine.step():
            new_done |= delta.request_id == "stall-new" and delta.finished
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
        if len(gaps) == 16:
            t0 = time.perf_counter()
            compiling.start()
        if len(gaps) > 16 and compile_s is None and not compiling.is_alive():
            compile_s = time.perf_counter() - t0
            engine.add_request("stall-new", "new schema", fresh)
    for i in range(streams):
        engine.abort(f"stall-{i}")
    steady = statistics.median(gaps[4:16])
    after = gaps[16:]
    return {"steady_step_ms": steady * 1e3, "max_step_after_ms": max(after) * 1e3,
            "stall_ms": (max(after) - steady) * 1e3, "compile_s": compile_s}


def grammar_host(vocab_size: int, sizes: list[int], steps: int) -> list[dict]:
    """Per step, the ms to fill ``n`` mask rows together and to let ``n`` matchers take one
    allowed token each (a random one, seeded), median over ``steps`` steps."""
    import numpy as np
    import xgrammar
    from transformers import AutoTokenizer

    tok_dir = byte_level_tokenizer(vocab_size, Path(tempfile.mkdtemp(prefix="so_tok_")))
    info = xgrammar.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(str(tok_dir)),
                                                   vocab_size=vocab_size)
    grammar = xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA),
                                                                 any_whitespace=False)
    rng = np.random.default_rng(0)
    rows = []
    worker = ThreadPoolExecutor(1)
    for n in sizes:
        matchers = [xgrammar.GrammarMatcher(grammar) for _ in range(n)]
        mask = xgrammar.allocate_token_bitmask(n, vocab_size)
        batch = xgrammar.BatchGrammarMatcher("auto")
        fill, accept, in_turn, beside = [], [], [], []

        for _ in range(steps):
            t0 = time.perf_counter()
            _fill_rows(batch, matchers, mask)
            fill.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            _fill_rows(batch, matchers, mask)
            _python_work(fill[-1])
            in_turn.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            applying = worker.submit(_python_work, fill[-1])
            _fill_rows(batch, matchers, mask)
            applying.result()
            beside.append(time.perf_counter() - t0)
            bits = np.unpackbits(mask.numpy().view(np.uint8), axis=1, bitorder="little")
            picks = [int(rng.choice(np.flatnonzero(bits[i, :vocab_size - 2])))
                     for i in range(n)]
            t0 = time.perf_counter()
            for m, token in zip(matchers, picks, strict=True):
                if not m.accept_token(token):
                    raise RuntimeError(f"the matcher refused token {token} its mask allowed")
            accept.append(time.perf_counter() - t0)
        rows.append({"rows": n, "fill_ms": statistics.median(fill) * 1e3,
                     "accept_ms": statistics.median(accept) * 1e3,
                     "fill_then_apply_ms": statistics.median(in_turn) * 1e3,
                     "apply_beside_ms": statistics.median(beside) * 1e3})
        r = rows[-1]
        print(f"{n} rows: mask fill {r['fill_ms']:.3f} ms, accept {r['accept_ms']:.3f} ms per "
              f"step; with as much Python work: in turn {r['fill_then_apply_ms']:.3f} ms, on a "
              f"worker beside the fill {r['apply_beside_ms']:.3f} ms", flush=True)
    worker.shutdown()
    return rows


def _fill_rows(batch, matchers: list, mask) -> None:
    """Every matcher's row of ``mask``, as ``structured.masks`` fills them."""
    if len(matchers) == 1:
        matchers[0].fill_next_token_bitmask(mask, 0)
    else:
        batch.batch_fill_next_token_bitmask(matchers, mask, list(range(len(matchers))))


def _python_work(seconds: float) -> None:
    """Pure Python for ``seconds`` (an apply's share of the GIL)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def fallbacks(llm: LLM) -> dict[str, int]:
    """The engine's graph fallbacks so far, by reason."""
    graphs = llm.engine.live_stats.graphs
    return dict(graphs.fallbacks) if graphs is not None else {}


def new_fallbacks(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama3.2-1b")
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--temperature", type=float, default=1.0,
                   help="of every request (0: greedy, the argmax inside the graphs alone)")
    p.add_argument("--tiny", action="store_true", help="CPU check: built-in default model")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--data-parallel-size", type=int, default=1)
    p.add_argument("--grammar-host", action="store_true",
                   help="only the host's grammar work per step (no model, no GPU)")
    p.add_argument("--json", default=None)
    ns = p.parse_args()
    if ns.grammar_host:
        from replaylm.engine.loading import load_model_config

        vocab = load_model_config("default" if ns.tiny else ns.model)[0].vocab_size
        sizes = [int(b) for b in ns.batch_sizes.split(",")]
        rows = grammar_host(vocab, sizes, ns.max_tokens)
        if ns.json:
            Path(ns.json).write_text(json.dumps({"model": ns.model, "vocab_size": vocab,
                                                 "grammar_host": rows}, indent=2))
        return
    kw: dict = {}
    if ns.tiny:
        model, kw = "default", {}
    else:
        model = ns.model
        from replaylm.engine.loading import load_model_config

        cfg, _ = load_model_config(model)
        tok_dir = Path(tempfile.mkdtemp(prefix="so_tok_"))
        byte_level_tokenizer(cfg.vocab_size, tok_dir)
        kw = {"tokenizer": str(tok_dir)}
    kw |= {"tensor_parallel_size": ns.tensor_parallel_size,
           "data_parallel_size": ns.data_parallel_size}
    llm = LLM(model, **kw)
    rows = []
    sizes = [int(b) for b in ns.batch_sizes.split(",")]
    for b in sizes:
        run_batch(llm, b, 16, SCHEMA, 0)  # compile the schema, warm every tier
        run_batch(llm, b, 16, None, 0)
        plain, constrained = [], []
        falls: dict[str, dict[str, int]] = {"plain": {}, "constrained": {}}
        for r in range(ns.repeats):
            order = [("plain", None, plain), ("constrained", SCHEMA, constrained)]
            for name, schema, into in (order if r % 2 == 0 else order[::-1]):
                before = fallbacks(llm)
                into.append(run_batch(llm, b, ns.max_tokens, schema, 100 * r, ns.temperature))
                for k, n in new_fallbacks(before, fallbacks(llm)).items():
                    falls[name][k] = falls[name].get(k, 0) + n
        row = {"batch": b, "plain_tok_s": statistics.median(plain),
               "constrained_tok_s": statistics.median(constrained),
               "plain_runs": plain, "constrained_runs": constrained,
               "fallbacks": falls}
        row["loss"] = 1 - row["constrained_tok_s"] / row["plain_tok_s"]
        rows.append(row)
        print(f"batch {b}: plain {row['plain_tok_s']:.1f} tok/s, constrained "
              f"{row['constrained_tok_s']:.1f} tok/s, loss {100 * row['loss']:.1f}%, "
              f"fallbacks {falls}", flush=True)
    t_plain = statistics.median(ttft(llm, None) for _ in range(5))
    t_cached = statistics.median(ttft(llm, SCHEMA) for _ in range(5))
    print(f"TTFT: plain {t_plain * 1e3:.2f} ms, cached schema {t_cached * 1e3:.2f} ms "
          f"(+{(t_cached - t_plain) * 1e3:.2f} ms)", flush=True)
    stall = compile_stall(llm, 8)
    print(f"new schema compiled ({stall['compile_s']} s) beside 8 streams: steady step "
          f"{stall['steady_step_ms']:.2f} ms, longest step meanwhile "
          f"{stall['max_step_after_ms']:.2f} ms", flush=True)
    if ns.json:
        Path(ns.json).write_text(json.dumps({
            "model": model, "max_tokens": ns.max_tokens, "temperature": ns.temperature,
            "rows": rows, "tensor_parallel_size": ns.tensor_parallel_size,
            "data_parallel_size": ns.data_parallel_size,
            "ttft_plain_s": t_plain, "ttft_cached_schema_s": t_cached, "stall": stall,
        }, indent=2))
    llm.shutdown()


if __name__ == "__main__":
    main()
