"""What a request must satisfy before it is queued: shared by ``EngineCore`` and the
multi-process engine's driver, which checks prompts before any worker sees them."""

from __future__ import annotations

from typing import Any

from replaylm.config import EngineArgs
from replaylm.engine.loading import tokenize_text, too_long_message
from replaylm.model.config import ModelConfig
from replaylm.sampling_params import SamplingParams
from replaylm.structured.compiler import compile_for

#: ``max_model_len`` when neither the settings nor a shorter model limit it.
MAX_DEFAULT_MODEL_LEN = 8192


def resolve_max_model_len(args: EngineArgs, cfg: ModelConfig) -> int:
    limit = cfg.max_position_embeddings
    if args.max_model_len is None:
        return min(limit, MAX_DEFAULT_MODEL_LEN)
    if args.max_model_len > limit:
        raise ValueError(
            f"EngineArgs.max_model_len={args.max_model_len} exceeds the model's "
            f"max_position_embeddings={limit}"
        )
    return args.max_model_len


class RequestChecks:
    """Tokenizing and validating prompts and compiling their structured-output specs: reads
    only the settings, the model's config and the tokenizer, none of which a step changes, so
    any thread may call it."""

    args: EngineArgs
    model_config: ModelConfig
    tokenizer: Any
    max_model_len: int

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True,
                 tokenizer: Any = None) -> list[int]:
        """Token ids of ``prompt`` (ids pass through); ``tokenizer`` (default: the engine's)
        lets a thread use its own copy."""
        if isinstance(prompt, str):
            tok = tokenizer if tokenizer is not None else self.tokenizer
            if tok is None:
                raise ValueError(
                    "this engine has no tokenizer (skip_tokenizer_init, or a named shape): "
                    "pass prompts as lists of token ids"
                )
            return tokenize_text(tok, prompt, self.max_model_len, add_special_tokens)
        return list(prompt)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` for a request the engine cannot run; changes nothing.

        The length is checked before any per-token work, so an oversized prompt costs O(1).
        """
        if not prompt_ids:
            raise ValueError("prompt is empty: a request needs at least one prompt token")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(too_long_message(len(prompt_ids), self.max_model_len))
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, not {type(params).__name__}")
        validate_features(params, self.args, vocab, has_tokenizer=self.tokenizer is not None)


    def compile_structured(self, params: SamplingParams) -> Any:
        """The compiled grammar of ``params.structured_outputs`` (None without one), from the
        process-wide cache or compiled on its thread pool, waiting at most
        ``EngineArgs.structured_outputs_compile_timeout_s``; ``ValueError`` naming the field.
        The server calls it off the engine thread first (``server.prompts``), so the engine
        thread finds the grammar compiled."""
        so = params.structured_outputs
        if so is None:
            return None
        return compile_for(so, self.args, self.model_config, self.tokenizer)


def validate_features(params: SamplingParams, args: EngineArgs, vocab_size: int,
                      has_tokenizer: bool) -> None:
    """Engine-dependent limits of a request's sampling settings."""
    if params.stop and not has_tokenizer:
        raise ValueError("SamplingParams.stop needs a tokenizer (this engine runs on token ids): "
                         "use stop_token_ids")
    if len(params.stop) > args.max_stop_strings:
        raise ValueError(f"SamplingParams.stop=<{len(params.stop)} strings> is invalid: at most "
                         f"EngineArgs.max_stop_strings={args.max_stop_strings} stop strings")
    longest = max(params.stop, key=len, default="")
    if len(longest) > args.max_stop_string_length:
        raise ValueError(f"SamplingParams.stop=<a string of {len(longest)} characters> is "
                         f"invalid: stop strings may have at most "
                         f"EngineArgs.max_stop_string_length={args.max_stop_string_length} "
                         "characters")
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and k > args.max_logprobs:
            raise ValueError(f"SamplingParams.{name}={k} is invalid: must be <= "
                             f"EngineArgs.max_logprobs={args.max_logprobs}")
    bad = [t for t in (params.logit_bias or {}) if t >= vocab_size]
    if bad:
        raise ValueError(f"SamplingParams.logit_bias={params.logit_bias!r} is invalid: token id "
                         f"{bad[0]} is outside the vocabulary [0, {vocab_size})")
