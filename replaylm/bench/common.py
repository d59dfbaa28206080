"""What the bench commands share: engines per graph mode, flag parsing, JSON and PNG output."""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from replaylm.config import EngineArgs

Log = Callable[[str], None]


def engine_args_for_mode(base: EngineArgs, mode: str | None) -> EngineArgs:
    """``eager`` means ``enforce_eager``; ``None`` keeps the engine's default mode."""
    if mode is None:
        return base
    if mode == "eager":
        return base.replace(enforce_eager=True, cuda_graph_mode="eager")
    return base.replace(enforce_eager=False, cuda_graph_mode=mode)


def release_memory() -> None:
    """Collect the dropped engine and return its GPU memory before the next one is built.
    The caller must have deleted its own reference first."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def device_name_of(device: torch.device) -> str:
    """The GPU's name, or ``cpu (processor)``."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def graph_summary(stats: dict[str, Any]) -> dict[str, Any]:
    """The capture figures of an engine's graph stats (what every command reports per mode)."""
    return {k: stats[k] for k in ("num_graphs", "capture_seconds", "graph_mib")}


def padding_between(before: dict[str, Any], after: dict[str, Any]) -> float:
    """Padded share of the tokens graphs ran between two graph-stats snapshots (0 without
    graphed steps: eager steps are never padded)."""
    padded = after["padded_tokens"] - before["padded_tokens"]
    real = after["real_tokens"] - before["real_tokens"]
    return round(1 - real / padded, 4) if padded > 0 else 0.0


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (linear interpolation, as numpy), rounded; None when empty."""
    import numpy as np

    return round(float(np.percentile(values, q)), 4) if values else None


def random_prompts(n: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``n`` different token-id prompts drawn from a seeded RNG, independent of the device."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n, length), generator=gen).tolist()


def int_list(text: str) -> list[int]:
    """``"1,4,16"`` -> ``[1, 4, 16]`` (argparse type; every value >= 1)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def parse_modes(text: str | None) -> list[str | None]:
    """``--modes``: comma-separated graph modes; ``None`` (the engine's default) when empty.
    Raises ``ValueError`` naming unknown modes."""
    from replaylm.config import GRAPH_MODES

    if not text:
        return [None]
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in GRAPH_MODES]
    if bad:
        raise ValueError(f"unknown mode(s) {bad}; choose from {list(GRAPH_MODES)}")
    return list(modes)


def add_modes_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--modes", type=str, default=None,
                        help="comma-separated graph modes, e.g. eager,full,piecewise "
                        "(default: the engine's default mode)")


def resolve_model_defaults(ns: argparse.Namespace) -> None:
    """Engine flags a bench command leaves unset (``None``) by default: ``--load-format``
    becomes dummy (random weights) for named shapes and the built-in default, auto for a
    model directory; ``--skip-tokenizer-init`` becomes on for named shapes (they ship no
    tokenizer) and off for the rest."""
    from replaylm.model.shapes import resolve_model

    directory, _ = resolve_model(ns.model)
    if ns.load_format is None:
        ns.load_format = "dummy" if directory is None or ns.model == "default" else "auto"
    if ns.skip_tokenizer_init is None:
        ns.skip_tokenizer_init = directory is None


def each_engine(base: EngineArgs, modes: list[str | None], log: Log = print
                ) -> Iterator[tuple[Any, float]]:
    """Build one ``LLM`` per mode in turn (the previous one freed first); yields it with
    the seconds its start took."""
    from replaylm import LLM

    for mode in modes:
        start = time.perf_counter()
        llm = LLM.from_engine_args(engine_args_for_mode(base, mode))
        ready = time.perf_counter() - start
        g = llm.graph_stats()
        log(f"[bench] mode={llm.graph_mode} engine ready in {ready:.1f} s on {llm.device}; "
            f"captured {g['num_graphs']} graphs in {g['capture_seconds']} s, "
            f"{g['graph_mib']} MiB; kernel tuning {_tune_seconds(llm.engine):.1f} s")
        if "all_reduce" in g:
            log(f"[bench] tensor-parallel all-reduce ({g['all_reduce']['setting']}): "
                f"{g['all_reduce']['summary']}; {g['all_reduce']['reason']}")
        yield llm, ready
        del llm
        release_memory()


def _tune_seconds(engine: Any) -> float:
    """Start-up kernel tuning seconds of an engine core, or of a driver's rank 0."""
    runner = getattr(engine, "runner", None)
    return runner.tune_seconds if runner is not None else engine.tune_seconds


def command_line(argv: list[str] | None) -> str:
    return "replaylm " + " ".join(sys.argv[1:] if argv is None else argv)


def write_json(path: str, record: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
    print(f"wrote {path}")


def png_path(json_path: str | Path, suffix: str) -> str:
    """``out/run.json`` + ``latency`` -> ``out/run_latency.png``."""
    p = Path(json_path)
    return str(p.with_name(f"{p.stem}_{suffix}.png"))


def draw(figures: list[tuple[str, tuple[Any, ...]]]) -> list[str]:
    """Draw each ``(function of replaylm.bench.plots, its arguments)``; returns the paths
    written. Without matplotlib, says so on stderr and draws nothing."""
    try:
        from replaylm.bench import plots
    except ImportError as e:
        print(f"PNG plots skipped: {e.name} is not installed (pip install 'replaylm[bench]')",
              file=sys.stderr)
        return []
    written = []
    for name, args in figures:
        written.append(getattr(plots, name)(*args))
        print(f"wrote {written[-1]}")
    return written
