"""Compile plans: the Triton kernel variants a start compiled, so that a later start with a
cold Triton cache compiles them all at once, on a thread pool, before the model needs them.

Without a plan a start compiles its kernels one at a time, as the model first launches each
(most of a first start's time: docs/benchmarks.md, "Capture and cold start"). With one, ``preload``
submits every variant to ``triton.AsyncCompileMode`` on a thread pool (ptxas runs as a
subprocess and Triton's native passes release the GIL, so compiles overlap), and each
compiled kernel lands in its ``JITFunction``'s in-memory cache under the key the model's
launch computes, where the launch finds it.

Recording: ``install`` sets Triton's ``jit_post_compile_hook``; every replaylm kernel this
process compiles (or loads from Triton's disk cache) is noted with Triton's own serialized
specialization (signature, constexprs, attributes, options). ``save`` writes the notes to
``cache_dir()/compile_plans/<key>.json``. A plan is what one start compiled: after a start
that tuned projection shapes it holds every candidate the tuner timed (what the next start
with an empty tuning cache needs too); after one whose decisions came from a tuning table,
only the chosen kernels.

A plan is keyed (``plan_key``) by the GPU model, the torch and Triton versions, the model's
shapes (not its name, path or special tokens: a checkpoint, its instruct variant and its
named shape share plans) and the engine settings that reach the kernels;
``replaylm/kernels/tuned/compile_plans/`` ships plans made on lab GPUs, read when the user
has none. An entry whose kernel source has changed since
(``JITFunction.cache_key``) is skipped, and one that fails to compile is dropped: the
launch compiles it again and fails as it would have without the plan.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import logging
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from replaylm.env import cache_dir

log = logging.getLogger(__name__)

#: Plans shipped with replaylm (package data).
SHIPPED_DIR = Path(__file__).resolve().parent / "tuned" / "compile_plans"
#: Engine settings that never reach a kernel's specialization: a plan made under one value
#: serves every other. (A plan entry that no launch uses costs one compile on the pool.)
UNRELATED_ARGS = frozenset({
    "model", "tokenizer", "seed", "load_format", "skip_tokenizer_init", "compile_ahead",
    "shipped_tuning_table", "tuning_compile_threads", "gpu_memory_utilization",
    "num_kv_blocks", "max_num_kv_blocks", "cpu_kv_cache_gib", "max_logprobs",
    "max_stop_strings", "max_stop_string_length", "distributed_timeout_s", "graph_check",
    "enable_sleep_mode", "sleep_pin_ahead",
    "structured_outputs_any_whitespace", "structured_outputs_compile_timeout_s",
    "structured_outputs_compile_threads", "max_mixed_prefill_tokens", "max_cpu_loras",
    "gc_gen0_threshold"})

#: LoRA's settings: part of the key only with LoRA on (its kernels then compile), so a start
#: without LoRA keys as it would without these settings at all.
LORA_ARGS = ("enable_lora", "max_loras", "max_lora_rank")

#: Model config fields no kernel sees: a checkpoint, its instruct variant and its named shape
#: share plans.
UNRELATED_MODEL_FIELDS = frozenset({"name", "bos_token_id", "eos_token_ids"})

_lock = threading.Lock()
_recorded: dict[str, dict[str, str]] = {}  # specialization data -> entry
_installed = False


@dataclasses.dataclass
class PreloadStats:
    """What ``preload`` did: variants submitted, skipped (kernel source changed or gone),
    refused (``preload`` raised before compiling), and the seconds until every compile had finished."""

    submitted: int = 0
    skipped: int = 0
    refused: int = 0
    seconds: float = 0.0
    source: str | None = None  # the plan file read


def plan_key(gpu: str, model: dict[str, Any], args: dict[str, Any], graph_mode: str) -> str:
    """The file name (without ``.json``) of the plan for this GPU, model shapes and engine
    settings under this process's torch and Triton; the graph mode is the one that runs
    (``graph_mode``), so the default mode and the same mode named share plans."""
    import torch
    import triton

    shapes = {k: v for k, v in model.items() if k not in UNRELATED_MODEL_FIELDS}
    settings = {k: v for k, v in args.items() if k not in UNRELATED_ARGS}
    if not settings.get("enable_lora"):
        settings = {k: v for k, v in settings.items() if k not in LORA_ARGS}
    settings |= {"cuda_graph_mode": graph_mode, "enforce_eager": graph_mode == "eager"}
    text = json.dumps({"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
                       "model": shapes, "args": settings}, sort_keys=True, default=repr)
    slug = "".join(c if c.isalnum() else "-" for c in gpu.lower()).strip("-") or "gpu"
    return f"{slug}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def _note(*, key: Any, repr: Any, fn: Any, compile: dict[str, Any], is_manual_warmup: bool,
          already_compiled: bool) -> None:
    """Triton's post-compile hook: note a replaylm kernel's specialization."""
    module = str(getattr(fn.module, "__name__", fn.module))
    if not module.startswith("replaylm."):
        return
    jit_fn = getattr(fn, "jit_function", None)
    data = compile.get("specialization_data")
    if jit_fn is None or not data:
        return
    with _lock:
        _recorded[data] = {"fn": f"{module}:{fn.name}", "fn_key": jit_fn.cache_key, "data": data}


def install() -> None:
    """Note the replaylm kernels compiled from now on (once per process; chained after any
    hook already set; a no-op without Triton)."""
    global _installed
    if _installed:
        return
    try:
        import triton
    except ImportError:
        return
    runtime = triton.knobs.runtime
    previous = runtime.jit_post_compile_hook

    def hook(**kwargs: Any) -> Any:
        try:
            _note(**kwargs)
        except Exception as e:  # noqa: BLE001 - a plan is an optimisation, the compile is not
            log.debug("compile plan: a compile not noted: %s", e)
        return previous(**kwargs) if previous is not None else None

    runtime.jit_post_compile_hook = hook
    _installed = True


def recorded() -> list[dict[str, str]]:
    """The entries noted so far."""
    with _lock:
        return list(_recorded.values())


def user_path(key: str) -> Path:
    return cache_dir() / "compile_plans" / f"{key}.json"


def save(key: str, directory: Path | None = None) -> Path | None:
    """Write the entries noted so far as the plan ``key`` (atomically: ranks of one job may
    write the same plan); returns the file, or None with nothing noted."""
    entries = recorded()
    if not entries:
        return None
    path = (directory / f"{key}.json") if directory is not None else user_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump({"kernels": entries}, f, indent=1)
    os.replace(tmp, path)
    return path


def read(key: str, shipped_dir: Path | None = None) -> tuple[list[dict[str, str]], Path | None]:
    """The plan ``key``: the user's, else a shipped one; empty when neither exists or the
    file is unreadable."""
    for path in (user_path(key), (shipped_dir or SHIPPED_DIR) / f"{key}.json"):
        try:
            entries = json.loads(path.read_text())["kernels"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(entries, list):
            return [e for e in entries if isinstance(e, dict)], path
    return [], None


def resolve(path: str) -> Any:
    """The ``JITFunction`` named ``module:qualname`` (through wrappers that hold it as
    ``fn``), or None."""
    module_name, _, name = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return None
    while obj is not None and not hasattr(obj, "preload"):
        obj = getattr(obj, "fn", None)
    return obj


def preload(entries: list[dict[str, str]], threads: int) -> PreloadStats:
    """Compile ``entries`` on ``threads`` threads; returns when every compile has ended."""
    import triton

    stats = PreloadStats()
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="replaylm-plan") as pool, \
            triton.AsyncCompileMode(pool, ignore_errors=True):
        for entry in entries:
            fn = resolve(str(entry.get("fn", "")))
            if fn is None or getattr(fn, "cache_key", None) != entry.get("fn_key"):
                stats.skipped += 1
                continue
            try:
                fn.preload(entry["data"])
            except Exception as e:  # noqa: BLE001 - the launch compiles it as it would have
                log.debug("compile plan: %s not preloaded: %s", entry.get("fn"), e)
                stats.refused += 1
                continue
            stats.submitted += 1
    stats.seconds = time.perf_counter() - start
    return stats
