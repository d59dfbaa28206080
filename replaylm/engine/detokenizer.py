"""Incremental detokenization: text is released only once later tokens cannot change it."""

from __future__ import annotations

from typing import Any

#: Prompt tokens decoded as context before the first output token (vLLM's choice).
PROMPT_CONTEXT_TOKENS = 5


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
        decode = self.tok.decode
        before = decode(self.ids[self.prefix : self.read], skip_special_tokens=self.skip)
        after = decode(self.ids[self.prefix :], skip_special_tokens=self.skip)
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
        before = self.tok.decode(self.ids[self.prefix : self.read], skip_special_tokens=self.skip)
        after = self.tok.decode(self.ids[self.prefix :], skip_special_tokens=self.skip)
        new = after[len(before) :]
        self.read = len(self.ids)
        self.text += new
        return new
