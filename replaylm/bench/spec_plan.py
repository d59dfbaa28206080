"""The plan of ``bench spec``: its options, and which engines it builds with which
measurements on each (:func:`engine_plan`)."""

from __future__ import annotations

import dataclasses
from typing import Any

PARTS = ("verify", "acceptance", "ngram", "draft")
LAYOUTS = ("ragged", "padded", "eager")
DISTRIBUTIONS = ("uniform", "skewed")


@dataclasses.dataclass
class Options:
    parts: tuple[str, ...] = PARTS
    verify_batches: tuple[int, ...] = (1, 4, 16, 64)
    distributions: tuple[str, ...] = DISTRIBUTIONS
    layouts: tuple[str, ...] = LAYOUTS
    verify_k: int = 8
    verify_steps: int = 20
    verify_warmup: int = 3
    e2e_batches: tuple[int, ...] = (1, 64)
    acceptance: tuple[float, ...] = (0.0, 0.3, 0.6, 0.8, 0.95)
    ks: tuple[int, ...] = (1, 2, 4, 8)
    adaptive: bool = True
    pipelines: tuple[str, ...] = ("auto",)  # (b): fixed K with each ``pipeline`` setting
    prompt_len: int = 32
    new_tokens: int = 128
    warmup_tokens: int = 64
    draft_model: str = "llama3.2-1b"
    draft_k: int = 4
    seed: int = 0


def _ngram(k: int, budget: str = "fixed", verify: str = "ragged",
           pipeline: str = "auto") -> dict[str, Any]:
    return {"method": "ngram", "num_speculative_tokens": k, "budget": budget, "verify": verify,
            "pipeline": pipeline}


def engine_plan(opts: Options, target_model: str
                ) -> list[tuple[str, dict[str, Any] | None, set[str]]]:
    """``(label, speculative_config, roles)`` per engine, plain first (its outputs are the
    controlled drafter's references). Roles: ``plain``, ``layout``, ``controlled``,
    ``ngram``, ``draft``."""
    plan: dict[str, tuple[dict[str, Any] | None, set[str]]] = {}

    def add(label: str, spec: dict[str, Any] | None, role: str) -> None:
        plan.setdefault(label, (spec, set()))[1].add(role)

    parts, kmax = set(opts.parts), max(opts.ks)
    if parts & {"acceptance", "ngram", "draft"}:
        add("plain", None, "plain")
    if "verify" in parts:
        for layout in opts.layouts:
            label = (f"fixed-k{opts.verify_k}" if layout == "ragged"
                     else f"verify-{layout}-k{opts.verify_k}")
            add(label, _ngram(opts.verify_k, verify=layout), "layout")
    for role in ("acceptance", "ngram"):
        if role not in parts:
            continue
        for k in opts.ks if role == "acceptance" else (kmax,):
            for pipe in opts.pipelines if role == "acceptance" else ("auto",):
                label = f"fixed-k{k}" if pipe == "auto" else f"fixed-k{k}-pipeline-{pipe}"
                add(label, _ngram(k, pipeline=pipe),
                    "controlled" if role == "acceptance" else role)
        if opts.adaptive:
            add(f"adaptive-k{kmax}", _ngram(kmax, "adaptive"),
                "controlled" if role == "acceptance" else role)
    if "draft" in parts:
        for label, model in (("draft-model", opts.draft_model), ("self-draft", target_model)):
            add(label, {"method": "draft_model", "model": model,
                        "num_speculative_tokens": opts.draft_k}, "draft")
    return [(label, spec, roles) for label, (spec, roles) in plan.items()]


def config_of(label: str, spec: dict[str, Any] | None) -> dict[str, Any]:
    if spec is None:
        return {"config": "plain", "k": 0, "budget": None}
    return {"config": label, "k": spec["num_speculative_tokens"],
            "budget": spec.get("budget", "fixed"), "pipeline": spec.get("pipeline", "auto")}
