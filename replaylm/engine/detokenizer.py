"""Incremental detokenization: text is released only once later tokens cannot change it."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

#: Prompt tokens decoded as context before the first output token (vLLM's choice).
PROMPT_CONTEXT_TOKENS = 5

#: Text that the wrapper's ``clean_up_tokenization_spaces`` pass changes when it runs.
_CLEANUP_PROBE = "a . b , c ! d ? e n't f 's g 'm h 've i 're"

Decode = Callable[[list[int], bool], str]
_decoders: weakref.WeakKeyDictionary[Any, Decode] = weakref.WeakKeyDictionary()


def decoder_for(tokenizer: Any) -> Decode:
    """``tokenizer``'s decode as ``(ids, skip_special_tokens) -> text``. A fast tokenizer's
    Rust backend is called directly when it gives the wrapper's text (the wrapper's space
    cleanup is off, or skipped for its model: probed once per tokenizer); the wrapper's
    argument handling costs several times the decode itself, twice per token of every
    request. Otherwise ``tokenizer.decode``."""
    try:
        return _decoders[tokenizer]
    except (KeyError, TypeError):
        pass

    def wrapped(ids: list[int], skip: bool) -> str:
        return tokenizer.decode(ids, skip_special_tokens=skip)

    decode: Decode = wrapped
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and hasattr(backend, "decode"):
        def direct(ids: list[int], skip: bool) -> str:
            return backend.decode(ids, skip_special_tokens=skip)

        try:
            probe = tokenizer.encode(_CLEANUP_PROBE, add_special_tokens=False)
            if all(direct(probe, skip) == wrapped(probe, skip) for skip in (True, False)):
                decode = direct
        except Exception:  # an unusual tokenizer: keep its own decode
            pass
    try:
        _decoders[tokenizer] = decode
    except TypeError:  # not weakly referenceable: probe again next time
        pass
    return decode


class IncrementalDetokenizer:
    """Decodes a growing list of ids; ``step`` returns only the newly final text.

    A byte-level BPE token may hold part of a multi-byte character; decoding it alone yields
    U+FFFD. Such text is held back until the character completes. Decoding a short window of
    earlier tokens (``prefix``) keeps tokenizer-specific spacing right without re-decoding the
    whole output every step. The window starts on the prompt's last tokens, so the output
    reads as the continuation of the prompt: with a SentencePiece (Metaspace) tokenizer a
    first token ``"▁the"`` is ``" the"``, as in ``decode(prompt + output)``, not ``"the"``.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True,
                 prompt_token_ids: list[int] | None = None) -> None:
        self.tok = tokenizer
        self.decode = decoder_for(tokenizer) if tokenizer is not None else None
        self.skip = skip_special_tokens
        context = list(prompt_token_ids or [])[-PROMPT_CONTEXT_TOKENS:]
        self.ids: list[int] = context  # the prompt's context, then the output
        self.prefix = 0  # start of the window decoded for context
        self.read = len(context)  # ids up to here have been turned into released text
        self.text = ""

    def step(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        if self.tok is None:
            return ""
        decode, skip = self.decode, self.skip
        before = decode(self.ids[self.prefix : self.read], skip)
        after = decode(self.ids[self.prefix :], skip)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        new = after[len(before) :]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += new
        return new

    def flush(self) -> str:
        """At the end of a request, release whatever is left (even an incomplete character)."""
        if self.tok is None or self.read == len(self.ids):
            return ""
        before = self.decode(self.ids[self.prefix : self.read], self.skip)
        after = self.decode(self.ids[self.prefix :], self.skip)
        new = after[len(before) :]
        self.read = len(self.ids)
        self.text += new
        return new
