"""Prompt preparation off the engine thread: tokenization, chat templates, request checks.

Tokenizing a long prompt or rendering a large conversation takes as long as many engine
steps; on the engine thread it would stall every stream. Here it runs on a small pool of
worker threads, each with its own copy of the tokenizer (a fast tokenizer must not be used
from two threads at once while one of them may change its settings), and the engine thread
receives token ids it only has to check for length and vocabulary. What can be checked
without the engine (its limits on a request's settings) is checked here too, and a request's
stop-string automaton and structured-output grammar are built here, so the engine finds them
cached (a grammar that does not compile in time is a 400, and never reaches the engine).
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from replaylm.engine.protocol import Engine
from replaylm.engine.stop_strings import stop_automaton
from replaylm.engine.validation import validate_features
from replaylm.sampling_params import SamplingParams
from replaylm.server.protocol import APIError
from replaylm.structured.compiler import compile_for

T = TypeVar("T")


class PromptWorkers:
    """``workers`` threads that turn prompts and conversations into token ids."""

    def __init__(self, core: Engine, workers: int = 2) -> None:
        self.core = core
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="replaylm-prompts")
        self._local = threading.local()
        # One tokenizer copy per worker, made now: copying a large tokenizer holds the
        # interpreter lock, which no request should wait on.
        tok = core.tokenizer
        self._spares = [copy.deepcopy(tok) for _ in range(workers)] if tok is not None else []

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _tokenizer(self) -> Any:
        """This thread's copy of the engine's tokenizer (None without one)."""
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:  # a worker's first task: take its copy (the pool has one per worker)
            tok = self._spares.pop() if self._spares else self.core.tokenizer
            self._local.tokenizer = tok
        return tok

    async def _run(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a completion prompt (ids pass through); ``ValueError`` if refused."""
        if not isinstance(prompt, str):
            return list(prompt)
        return await self._run(lambda: self.core.tokenize(prompt, tokenizer=self._tokenizer()))

    async def prompt_text(self, token_ids: list[int]) -> str:
        """The text of a token-id prompt, special tokens included (what ``echo`` returns for
        it); empty without a tokenizer."""
        def decode() -> str:
            tok = self._tokenizer()
            return "" if tok is None else tok.decode(token_ids, skip_special_tokens=False)

        return await self._run(decode)

    async def chat_ids(self, messages: list[dict[str, Any]],
                       tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The chat template applied to ``messages`` (and ``tools``, which the template
        renders) and tokenized (the rendered template carries its own special tokens, so none
        are added)."""
        return await self._run(lambda: self._chat_ids(messages, tools))

    def _chat_ids(self, messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]] | None = None) -> list[int]:
        tok = self._tokenizer()
        if tok is None:
            raise APIError("this engine has no tokenizer, so it cannot apply a chat template",
                           param="messages")
        if not getattr(tok, "chat_template", None):
            raise APIError("this model's tokenizer has no chat template: use /v1/completions",
                           param="messages")
        try:
            text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                           tokenize=False)
        except Exception as e:  # jinja raises its own types for templates that refuse a message
            raise APIError(f"messages rejected by the chat template: {e}",
                           param="messages") from e
        if isinstance(text, Mapping):  # defensive: some versions wrap the text
            text = text["text"]
        return self.core.tokenize(text, add_special_tokens=False, tokenizer=tok)

    async def check(self, params: list[SamplingParams]) -> None:
        """The engine's limits on each request's settings (``ValueError`` naming the field),
        then the stop-string automata, built here rather than on the engine thread."""
        core = self.core

        def check() -> None:
            for sp in params:
                validate_features(sp, core.args, core.model_config.vocab_size,
                                  has_tokenizer=core.tokenizer is not None)
                if sp.stop:
                    stop_automaton(tuple(sp.stop))
                if sp.structured_outputs is not None:  # compiled now, cached for the engine
                    compile_for(sp.structured_outputs, core.args, core.model_config,
                                self._tokenizer())

        await self._run(check)
