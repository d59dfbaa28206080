"""``EngineArgs.speculative_config``: parsed and validated once, at start-up.

The field is a dict (JSON on the CLI), as vLLM users write it:
``{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}`` or
``{"method": "draft_model", "model": "llama3.2-1b", "num_speculative_tokens": 4}``. Every
error names the field and the key.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model")
#: Keys that belong to one method only.
METHOD_KEYS = {"ngram": ("prompt_lookup_min", "prompt_lookup_max"),
               "draft_model": ("model", "draft_confidence", "num_draft_kv_blocks")}
BUDGETS = ("fixed", "adaptive")
#: How a verify step is laid out and run (``SpecConfig.verify``).
VERIFY_LAYOUTS = ("ragged", "padded", "eager")
#: Whether verify steps run as two alternating cohorts (``SpecConfig.pipeline``).
PIPELINE_MODES = ("auto", "on", "off")

FIELD = "EngineArgs.speculative_config"


@dataclass(frozen=True)
class SpecConfig:
    """``method``: the drafter. ``num_speculative_tokens``: most draft tokens a request
    verifies per step. ``prompt_lookup_min`` / ``prompt_lookup_max``: the n-gram sizes the
    ``ngram`` drafter matches. ``budget``: ``fixed`` drafts up to ``num_speculative_tokens``
    whenever the drafter has them; ``adaptive`` chooses per step from measured step costs
    and acceptance estimates (``speculative.adaptive``). ``verify``: how a step with drafts runs:
    ``ragged`` front-packs every request's real tokens and dispatches the total like any
    step (a token tier's graph); ``padded`` lays every decoding request out as
    ``num_speculative_tokens + 1`` query tokens (the uniform layout, keyed by request count
    × (k + 1)), its padding rows writing the scratch block and sampling nothing; ``eager``
    runs verify steps without graphs. The three emit the same tokens. ``pipeline``: with
    overlap scheduling and a host drafter, whether the decoding requests verify in two
    cohorts that take turns, one cohort's step on the GPU while the host prepares the
    other's (``speculative.pipeline``): ``auto`` on a GPU while the host's time per step
    exceeds its wait for the device, ``on`` always, ``off`` never.

    ``draft_model`` only (``engine.draft_model``): ``model``, the draft model (a checkpoint
    directory or a named shape) sharing the target's vocabulary; ``draft_confidence``, the
    top-token probability below which a request stops drafting (None: always draft up to
    ``num_speculative_tokens``); ``num_draft_kv_blocks``, the draft KV pool's blocks (None:
    as many as the target's pool plus room for the drafts of every slot, its memory taken
    from the same budget)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    budget: str = "fixed"
    verify: str = "ragged"
    pipeline: str = "auto"
    model: str | None = None
    draft_confidence: float | None = None
    num_draft_kv_blocks: int | None = None

    @classmethod
    def from_dict(cls, d: Any) -> SpecConfig:
        if isinstance(d, SpecConfig):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"{FIELD}={d!r} is invalid: must be a dict such as "
                             '{"method": "ngram", "num_speculative_tokens": 4}')
        method = d.get("method")
        if method not in METHODS:
            raise ValueError(f"{FIELD}['method']={method!r} is invalid: choose one of "
                             f"{list(METHODS)}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{FIELD} has unknown key {unknown[0]!r}: known keys are "
                             f"{sorted(known)}")
        if "num_speculative_tokens" not in d:
            raise ValueError(f"{FIELD} needs 'num_speculative_tokens' (an integer >= 1)")
        for other, keys in METHOD_KEYS.items():
            given = [k for k in keys if k in d] if other != method else []
            if given:
                raise ValueError(f"{FIELD}['{given[0]}'] is only for method {other!r}, not "
                                 f"{method!r}")
        cfg = cls(**d)
        _int_at_least("num_speculative_tokens", cfg.num_speculative_tokens, 1)
        if method == "draft_model":
            cfg._check_draft_keys()
        _int_at_least("prompt_lookup_min", cfg.prompt_lookup_min, 1)
        _int_at_least("prompt_lookup_max", cfg.prompt_lookup_max, 1)
        if cfg.prompt_lookup_min > cfg.prompt_lookup_max:
            raise ValueError(f"{FIELD}['prompt_lookup_min']={cfg.prompt_lookup_min} is invalid: "
                             f"must be <= prompt_lookup_max={cfg.prompt_lookup_max}")
        if cfg.budget not in BUDGETS:
            raise ValueError(f"{FIELD}['budget']={cfg.budget!r} is invalid: choose one of "
                             f"{list(BUDGETS)}")
        if cfg.verify not in VERIFY_LAYOUTS:
            raise ValueError(f"{FIELD}['verify']={cfg.verify!r} is invalid: choose one of "
                             f"{list(VERIFY_LAYOUTS)}")
        if cfg.pipeline not in PIPELINE_MODES:
            raise ValueError(f"{FIELD}['pipeline']={cfg.pipeline!r} is invalid: choose one of "
                             f"{list(PIPELINE_MODES)}")
        return cfg

    def _check_draft_keys(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"{FIELD} with method 'draft_model' needs 'model': a checkpoint "
                             "directory or a named shape sharing the target's vocabulary")
        from replaylm.model.shapes import resolve_model

        try:
            resolve_model(self.model)
        except FileNotFoundError as e:
            raise ValueError(f"{FIELD}['model']={self.model!r} is invalid: {e}") from e
        c = self.draft_confidence
        if c is not None and (isinstance(c, bool) or not isinstance(c, int | float)
                              or not 0.0 < c < 1.0):
            raise ValueError(f"{FIELD}['draft_confidence']={c!r} is invalid: must be a number "
                             "in (0, 1), or null to always draft num_speculative_tokens")
        if self.num_draft_kv_blocks is not None:
            _int_at_least("num_draft_kv_blocks", self.num_draft_kv_blocks, 2)

    def check_fits(self, max_num_batched_tokens: int, top_tier: int) -> None:
        """A request's verify (k + 1 tokens) must fit one step and, with graphs, the top tier."""
        k = self.num_speculative_tokens
        limit = min(max_num_batched_tokens, top_tier) if top_tier else max_num_batched_tokens
        if k + 1 > limit:
            raise ValueError(
                f"{FIELD}['num_speculative_tokens']={k} is invalid: a verify of k + 1 = {k + 1} "
                f"tokens exceeds the largest step the engine runs ({limit} tokens: "
                "max_num_batched_tokens and the top graph tier)")


def _int_at_least(key: str, value: Any, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{FIELD}['{key}']={value!r} is invalid: must be an integer >= {lo}")
