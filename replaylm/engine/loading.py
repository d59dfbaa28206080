"""Loading what a model needs besides its weights: the config (a checkpoint's or a named
shape's), the tokenizer, and prompt tokenization that refuses a text far too long early."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from replaylm.config import EngineArgs
from replaylm.model.config import ModelConfig
from replaylm.model.loader import default_model_weights
from replaylm.model.shapes import DEFAULT_MODEL_DIR, hf_fields, plain_config, resolve_model


def load_model_config(model: str) -> tuple[ModelConfig, Path | None]:
    """Read a directory's config.json, or a named shape's built-in config (``shapes.
    plain_config`` where it names every field, else through transformers' config class)."""
    model_dir, shape = resolve_model(model)
    if shape is not None:
        return ModelConfig.from_hf(hf_fields(shape), model), None
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in model directory {path}")
    try:
        raw = json.loads((path / "config.json").read_text())
    except ValueError as e:
        raise ValueError(f"unreadable config.json in {path}: {e}") from e
    hf = plain_config(raw) if isinstance(raw, dict) else None
    if hf is None:
        from transformers import AutoConfig

        try:
            hf = AutoConfig.from_pretrained(str(path))
        except Exception as e:  # transformers raises several types for bad configs
            raise ValueError(f"unreadable config.json in {path}: {e}") from e
    cfg = ModelConfig.from_hf(hf, model)
    gen = path / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except ValueError as e:
            raise ValueError(f"unreadable generation_config.json in {path}: {e}") from e
        if eos is not None:
            ids = tuple(eos) if isinstance(eos, list) else (eos,)
            cfg = _replace(cfg, eos_token_ids=tuple(dict.fromkeys(ids + cfg.eos_token_ids)))
    return cfg, path


def resolve_weights_dir(model_dir: Path | None, cfg: ModelConfig, load_format: str
                        ) -> Path | None:
    """Where the weights of ``model_dir`` are: the directory itself, or for the built-in
    default model its cached weights (None: random weights)."""
    if model_dir is not None and model_dir.resolve() == Path(DEFAULT_MODEL_DIR).resolve():
        return default_model_weights(cfg) if load_format != "dummy" else None
    return model_dir


def _replace(cfg: ModelConfig, **kw: Any) -> ModelConfig:
    import dataclasses

    return dataclasses.replace(cfg, **kw)


#: ``tokenizer_class`` values of tokenizer_config.json for which ``AutoTokenizer`` builds
#: transformers' generic fast tokenizer (Llama 3's among them).
GENERIC_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def load_tokenizer(args: EngineArgs, model_dir: Path | None) -> Any:
    """The tokenizer of ``args.tokenizer`` or the model directory (None for a named shape or
    with ``skip_tokenizer_init``). A directory whose tokenizer_config.json names the generic
    fast tokenizer gets that class directly: what ``AutoTokenizer`` builds for it, without
    importing ``AutoTokenizer``, whose module imports transformers' modeling and generation
    code (and ``torch._dynamo``: seconds of every start)."""
    if args.skip_tokenizer_init:
        return None
    where = args.tokenizer or (str(model_dir) if model_dir is not None else None)
    if where is None:
        return None  # a named shape ships no tokenizer: token-id prompts only
    try:
        if _tokenizer_class(where) in GENERIC_TOKENIZER_CLASSES:
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(where)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(where)
    except Exception as e:
        raise ValueError(f"cannot load a tokenizer from {where}: {e}") from e


def _tokenizer_class(where: str) -> str | None:
    """The ``tokenizer_class`` a local tokenizer_config.json names, or None."""
    try:
        config = json.loads((Path(where) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    return config.get("tokenizer_class") if isinstance(config, dict) else None


#: Texts longer than this many characters per ``max_model_len`` token are counted first.
_LONG_TEXT_CHARS_PER_TOKEN = 4
#: Characters counted per backend call when a long text is counted (at most; fewer for a
#: small ``max_model_len``, whose limit a piece of a few times its size already shows).
_COUNT_CHUNK_CHARS = 1 << 16
#: Counting piece by piece may see a few more tokens than the whole text has, around each
#: cut; the count must pass the limit by this much, plus this much per cut, to refuse.
_COUNT_SLACK = 16
_CUT_SLACK = 8


def too_long_message(n: int, max_model_len: int, at_least: bool = False) -> str:
    """The error for a prompt of ``n`` tokens (``at_least``: or more) that leaves no room for
    output."""
    return (f"prompt has {'more than ' if at_least else ''}{n} tokens but "
            f"max_model_len={max_model_len} leaves no room for output (prompt must be shorter "
            "than max_model_len)")


def tokenize_text(tokenizer: Any, text: str, max_model_len: int,
                  add_special_tokens: bool = True) -> list[int]:
    """``tokenizer.encode(text)``, refusing a text far too long for ``max_model_len`` cheaply.

    Encoding megabytes of text at once builds (and frees) a million-token encoding while
    holding the interpreter lock for a tenth of a second or more, stalling every other thread
    (the engine loop, the event loop), and takes seconds. A long text is counted instead, a
    piece at a time by the fast tokenizer's backend (which releases the lock while it works),
    and refused as soon as the count cannot fit; pieces are cut where a whitespace run begins,
    so they tokenize as they do inside the whole text.
    """
    backend = getattr(tokenizer, "_tokenizer", None)
    if len(text) > _LONG_TEXT_CHARS_PER_TOKEN * max_model_len \
            and hasattr(backend, "encode_batch"):
        counted, start, cuts = 0, 0, 0
        chunk = min(_COUNT_CHUNK_CHARS, max(4096, 2 * _LONG_TEXT_CHARS_PER_TOKEN * max_model_len))
        while start < len(text):
            end = _cut(text, start, start + chunk)
            piece = backend.encode_batch([text[start:end]], add_special_tokens=False)[0]
            counted += len(piece)
            if counted >= max_model_len + _COUNT_SLACK + _CUT_SLACK * cuts:
                raise ValueError(too_long_message(counted - _CUT_SLACK * cuts, max_model_len,
                                                  at_least=True))
            start, cuts = end, cuts + 1
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _cut(text: str, start: int, end: int) -> int:
    """Where to end the piece ``text[start:end]``: where its last whitespace run begins, if
    that leaves at least half the piece; else ``end`` itself (also at the text's end)."""
    if end >= len(text):
        return len(text)
    half = start + (end - start) // 2
    i = max(text.rfind(" ", half, end), text.rfind("\n", half, end))
    while i > half and text[i - 1].isspace():
        i -= 1
    return i if i > half else end
