"""Compiling structured-output specs with xgrammar, off the engine thread, cached, time-limited.

Why xgrammar: it is the default structured-output backend of vLLM and SGLang (so grammars,
schemas and their corner cases behave as users of those engines expect), its compiler is
tokenizer-aware (it precomputes, per grammar state, which vocabulary entries can follow, so
filling a step's token mask is a fast CPU operation rather than a scan of the vocabulary), and
the mask it fills is a plain int32 bitmask we can copy into a static device buffer and apply
inside a CUDA graph.

Compilation runs on a small process-wide thread pool. Each spec's compilation is a future kept
in a cache keyed by ``(kind, spec, whitespace rule, tokenizer id)``; a caller waits for it at
most ``timeout_s`` seconds. A spec that fails to compile, or takes longer than the limit, is a
``ValueError`` naming the field (``SamplingParams.structured_outputs.json`` ...), which the
server answers with a 400; the future stays cached, so the same spec answers the same way
(and a spec that was slow once is ready for the next caller if it did finish).
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from replaylm.sampling_params import StructuredOutputsParams

#: Most compiled specs kept per process (oldest dropped first).
MAX_CACHED = 1024


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as e:  # a ValueError: the request is refused, the engine goes on
        raise ValueError("SamplingParams.structured_outputs needs the xgrammar package "
                         "(pip install 'replaylm[structured]')") from e
    return xgrammar


def tokenizer_key(tokenizer: Any, vocab_size: int, stop_ids: tuple[int, ...]) -> tuple:
    """What identifies a tokenizer for compiled grammars: thread-local copies of one tokenizer
    (``server.prompts``) share it."""
    return (type(tokenizer).__name__, getattr(tokenizer, "name_or_path", ""), len(tokenizer),
            vocab_size, tuple(stop_ids))


def spec_key(so: StructuredOutputsParams, any_whitespace: bool) -> tuple:
    kind = so.kind
    value = getattr(so, kind)
    if kind in ("json", "structural_tag") and isinstance(value, dict):
        value = json.dumps(value, sort_keys=True)
    json_kinds = ("json", "json_object", "structural_tag")
    return (kind, value, any_whitespace if kind in json_kinds else None)


def _choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (JSON string escapes are also
    EBNF string escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def compact_structural_tag(tag: Any, xgr: Any) -> Any:
    """``tag`` (a structural tag's JSON value) with every JSON-schema part replaced by the
    grammar of its compact JSON (no free whitespace), the rule ``json`` specs follow by
    default; xgrammar's own JSON-schema parts allow any whitespace."""
    if isinstance(tag, list):
        return [compact_structural_tag(t, xgr) for t in tag]
    if not isinstance(tag, dict):
        return tag
    if tag.get("type") == "json_schema" and tag.get("style", "json") == "json":
        schema = tag.get("json_schema", True)
        schema = {} if schema is True else schema
        ebnf = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
        return {"type": "grammar", "grammar": ebnf}
    return {k: compact_structural_tag(v, xgr) for k, v in tag.items()}


class _Compilers:
    """Per tokenizer: xgrammar's ``TokenizerInfo`` and ``GrammarCompiler``; one pool and one
    future cache for the process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._compilers: dict[tuple, Any] = {}
        self._futures: dict[tuple, Future] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._threads = 0

    def pool(self, threads: int) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None or threads > self._threads:
                old = self._pool
                self._pool = ThreadPoolExecutor(max(1, threads),
                                                thread_name_prefix="replaylm-grammar")
                self._threads = max(1, threads)
                if old is not None:
                    old.shutdown(wait=False)
            return self._pool

    def compiler(self, tokenizer: Any, vocab_size: int, stop_ids: tuple[int, ...]) -> Any:
        key = tokenizer_key(tokenizer, vocab_size, stop_ids)
        with self._lock:
            c = self._compilers.get(key)
        if c is None:
            xgr = _xgrammar()
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                      stop_token_ids=list(stop_ids))
            c = xgr.GrammarCompiler(info, max_threads=1)
            with self._lock:
                c = self._compilers.setdefault(key, c)
        return c

    def future(self, key: tuple, start: Any, threads: int) -> Future:
        with self._lock:
            f = self._futures.get(key)
            if f is not None:
                return f
        f = self.pool(threads).submit(start)
        with self._lock:
            f = self._futures.setdefault(key, f)
            while len(self._futures) > MAX_CACHED:
                self._futures.pop(next(iter(self._futures)))
        return f


_COMPILERS = _Compilers()


def compile_structured(so: StructuredOutputsParams, tokenizer: Any, vocab_size: int,
                       stop_ids: tuple[int, ...], *, any_whitespace: bool = False,
                       timeout_s: float = 10.0, threads: int = 2) -> Any:
    """The xgrammar ``CompiledGrammar`` of ``so``, compiled on the pool (or found in the
    cache); waits at most ``timeout_s`` seconds. ``ValueError`` naming the field when it does
    not compile or takes longer. ``any_whitespace``: JSON may carry free whitespace (default:
    compact JSON, no whitespace outside strings)."""
    kind = so.kind
    field = f"SamplingParams.structured_outputs.{kind}"
    if tokenizer is None:
        raise ValueError(f"{field} needs a tokenizer (this engine runs on token ids)")
    compiler = _COMPILERS.compiler(tokenizer, vocab_size, tuple(stop_ids))
    key = spec_key(so, any_whitespace) + (tokenizer_key(tokenizer, vocab_size, tuple(stop_ids)),)
    value = getattr(so, kind)

    def start() -> Any:
        if kind == "json":
            schema = value if isinstance(value, str) else json.dumps(value)
            json.loads(schema)  # a clear message for text that is not JSON at all
            return compiler.compile_json_schema(schema, any_whitespace=any_whitespace)
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}',
                                                any_whitespace=any_whitespace)
        if kind == "structural_tag":
            tag = json.loads(value) if isinstance(value, str) else value
            if not any_whitespace:
                tag = compact_structural_tag(tag, _xgrammar())
            return compiler.compile_structural_tag(json.dumps(tag))
        if kind == "regex":
            return compiler.compile_regex(value)
        if kind == "choice":
            return compiler.compile_grammar(_choice_grammar(value))
        return compiler.compile_grammar(value)

    fut = _COMPILERS.future(key, start, threads)
    try:
        return fut.result(timeout=timeout_s)
    except FutureTimeout:
        raise ValueError(f"{field}: compiling it took longer than "
                         f"EngineArgs.structured_outputs_compile_timeout_s={timeout_s:g} s"
                         ) from None
    except Exception as e:  # xgrammar raises RuntimeError for a spec it cannot compile
        text = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise ValueError(f"{field}={_short(value)} is invalid: {text}") from e


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def compile_for(so: StructuredOutputsParams, args: Any, model_config: Any, tokenizer: Any) -> Any:
    """``compile_structured`` with an engine's settings (``EngineArgs``) and model config."""
    return compile_structured(
        so, tokenizer, model_config.vocab_size, tuple(model_config.eos_token_ids),
        any_whitespace=args.structured_outputs_any_whitespace,
        timeout_s=args.structured_outputs_compile_timeout_s,
        threads=args.structured_outputs_compile_threads)
