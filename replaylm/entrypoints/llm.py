"""The offline API: ``LLM(...).generate(prompts, sampling_params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from replaylm.config import EngineArgs
from replaylm.engine.kv_sizing import KVResize
from replaylm.engine.outputs import CompletionOutput, RequestOutput
from replaylm.engine.protocol import Engine
from replaylm.engine.stats import EngineStats
from replaylm.entrypoints.factory import make_engine
from replaylm.graphs.audit import AuditReport
from replaylm.lora.request import LoRARequest
from replaylm.memory.sleep import SleepReport, WakeReport
from replaylm.model.weight_update import Source, WeightUpdate
from replaylm.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """vLLM-style entry point. Keyword arguments are ``EngineArgs`` fields.

    With ``data_parallel_size`` or ``tensor_parallel_size`` > 1 the engines run in worker
    processes (``replaylm.distributed``); ``shutdown()``, leaving a ``with`` block or the
    interpreter's exit ends them.
    """

    def __init__(self, model: str = "default", **kwargs: Any) -> None:
        self.engine_args = EngineArgs(model=model, **kwargs)
        self.engine: Engine = make_engine(self.engine_args)
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        self = cls.__new__(cls)
        self.engine_args = args
        self.engine = make_engine(args)
        self._ids = itertools.count()
        return self

    def shutdown(self) -> None:
        """End the worker processes, if any (a single engine holds no process)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def model_config(self):
        return self.engine.model_config

    @property
    def device(self):
        return self.engine.device

    @property
    def dtype(self):
        return self.engine.dtype

    @property
    def graph_mode(self) -> str:
        return self.engine.graph_mode

    def get_tokenizer(self):
        return self.engine.tokenizer

    def stats(self) -> EngineStats:
        return self.engine.stats

    def graph_stats(self) -> dict:
        """Graph hits per mode and tier, real vs padded tokens, fallbacks and their reasons,
        capture seconds and graph memory; with data parallelism the ranks' sums, each rank's
        under ``ranks``, and the tier agreement's steps, seconds, padding and dummy steps."""
        return self.engine.graph_stats()

    def spec_stats(self) -> dict:
        """Speculative decoding: ``mean_accepted_length`` (accepted drafts per request per
        verify), ``acceptance_rate``, draft and verify tokens per verify step, the padded
        share of verify steps (``padded_waste``) and the budget; ``{}`` when it is off."""
        s = self.engine.spec_stats
        return s.as_dict() if s is not None else {}

    def update_weights(self, source: Source, target: str = "model") -> WeightUpdate:
        """Copy new weights into the model's buffers in place, without a restart or a graph
        recapture. ``source``: a checkpoint directory (safetensors, as the model loads) or
        ``(name, tensor)`` pairs (or a dict) in Hugging Face names, CPU or CUDA tensors in any
        order, covering the whole model or any part of it (an update may come in several
        calls). Every tensor is checked first: a name the model has no place for, a wrong
        shape or a non-float dtype raises ``ValueError`` naming it and changes nothing (a
        float of another dtype is cast). The prefix cache is dropped (its KV came from the
        old weights). ``target="draft"``: the draft model of ``speculative_config``'s
        ``draft_model`` method instead. Returns the tensors and bytes copied and the
        seconds it took (``WeightUpdate``)."""
        return self.engine.update_weights(source, target=target)

    def sleep(self, level: int = 1) -> SleepReport:
        """Free the device memory of the weights and the KV pool, keeping their addresses
        (needs ``enable_sleep_mode=True`` and no request running). ``level=1``: the weights
        are copied to host memory first and ``wake_up`` restores them; ``level=2``: they are
        discarded (call ``update_weights`` after ``wake_up``). The prefix cache is dropped.
        Until ``wake_up``, ``generate`` and ``add_request`` raise ``RuntimeError``. Returns
        the bytes the device reports freed (``freed_bytes``) and what was released."""
        return self.engine.sleep(level)

    def wake_up(self) -> WakeReport:
        """Map device memory back at the same addresses: the captured graphs replay
        unchanged (never recaptured); level 1's weights come back, the KV pool starts empty.
        With ``graph_check`` on, the graphs are audited first (``audit_graphs``)."""
        return self.engine.wake_up()

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    def audit_graphs(self) -> AuditReport:
        """Read every kernel parameter of every captured CUDA graph and check that each
        address inside the engine's memory lies in memory mapped or allocated now; raises
        ``GraphAuditError`` naming the mode, tier, kernel and parameter of a dangling one."""
        return self.engine.audit_graphs()

    def reset_prefix_cache(self) -> int:
        """Forget every cached KV block; returns the blocks freed."""
        return self.engine.reset_prefix_cache()

    def resize_kv_cache(self, num_blocks: int) -> KVResize:
        """Grow or shrink the KV pool to ``num_blocks`` 16-token blocks (the scratch block 0
        included) without touching a captured graph: the pool's addresses are reserved for
        ``max_num_kv_blocks`` at start-up and physical memory is mapped or unmapped at the end
        of each layer's range. Shrinking evicts prefix-cached blocks above the new size and
        refuses (``RuntimeError``) while a request holds one. Needs ``max_num_kv_blocks`` (or
        ``enable_sleep_mode``: then up to the start-up size); returns ``KVResize``."""
        return self.engine.resize_kv_cache(num_blocks)

    def chat(
        self,
        messages: list[dict[str, str]] | Sequence[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}`` dicts) or
        to a list of conversations, through the tokenizer's chat template.

        The rendered template is encoded without adding special tokens: templates begin with
        BOS themselves, and the tokenizer's own BOS would double it.
        """
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("chat needs a tokenizer (this engine runs on token ids alone)")
        conversations = [messages] if _is_conversation(messages) else list(messages)
        prompts: list[Prompt] = []
        for i, conv in enumerate(conversations):
            if not _is_conversation(conv):
                raise ValueError(f"conversation {i} must be a non-empty list of message dicts")
            text = tok.apply_chat_template(
                list(conv), tokenize=False, add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
            )
            prompts.append(self.engine.tokenize(text, add_special_tokens=False))
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the prompts' order.

        ``lora_request``: the LoRA adapter every prompt runs with, or a list of one per
        prompt (None: the base model); needs ``enable_lora=True``. Every prompt (and
        adapter) is validated before any is queued, and a structured-output spec that does
        not compile unqueues those before it, so one bad prompt raises ``ValueError``
        without leaving the others half-run.
        """
        if self.engine.is_sleeping():
            raise RuntimeError("generate: the engine is asleep: call wake_up() first")
        prompt_list = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompt_list))
        loras = _as_lora_list(lora_request, len(prompt_list))
        token_ids = [self.engine.tokenize(p) for p in prompt_list]
        for i, (ids, sp, lora) in enumerate(zip(token_ids, params, loras)):
            try:
                self.engine.validate(ids, sp)
                if lora is not None:
                    self.engine.add_lora(lora)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from e
        outputs: dict[str, RequestOutput] = {}
        order = []
        for i, (prompt, ids, sp, lora) in enumerate(zip(prompt_list, token_ids, params, loras)):
            rid = str(next(self._ids))
            try:  # a structured-output spec compiles here: it may still be refused
                self.engine.add_request(rid, ids, sp, lora_request=lora)
            except ValueError as e:
                for queued in order:
                    self.engine.abort(queued)
                raise ValueError(f"prompt {i}: {e}") from e
            outputs[rid] = RequestOutput(
                rid, prompt if isinstance(prompt, str) else None, ids,
                [CompletionOutput(i, "", [], None, logprobs=[] if sp.logprobs is not None
                                  else None) for i in range(sp.n)],
            )
            order.append(rid)
        bar = tqdm(total=len(order), desc="generate", disable=not use_tqdm, unit="req")
        try:
            while self.engine.has_unfinished():
                for d in self.engine.step():
                    out = outputs[d.request_id]
                    comp = out.outputs[d.index]
                    comp.token_ids.extend(d.new_token_ids)
                    comp.text += d.new_text
                    if d.logprobs is not None and comp.logprobs is not None:
                        comp.logprobs.extend(d.logprobs)
                    if d.prompt_logprobs is not None:
                        out.prompt_logprobs = d.prompt_logprobs
                    if d.finished:
                        comp.finish_reason = d.finish_reason
                        comp.stop_reason = d.stop_reason
                        comp.error = d.error
                        if all(c.finish_reason is not None for c in out.outputs):
                            out.finished = True
                            bar.update(1)
        except BaseException:
            for rid in order:  # leave nothing running (and no blocks held) behind
                self.engine.abort(rid)
            raise
        finally:
            bar.close()
        return [outputs[rid] for rid in order]


def _is_conversation(x: Any) -> bool:
    return isinstance(x, Sequence) and not isinstance(x, str) and bool(x) \
        and all(isinstance(m, dict) for m in x)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    for i, p in enumerate(prompts):
        if not isinstance(p, str | list | tuple):
            raise ValueError(f"prompt {i} must be a string or a list of token ids, "
                             f"not {type(p).__name__}")
    return [p if isinstance(p, str) else list(p) for p in prompts]


def _as_lora_list(lora, n: int) -> list[LoRARequest | None]:
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * n
    if isinstance(lora, str) or not isinstance(lora, Sequence):
        raise ValueError(f"lora_request must be a LoRARequest, a list of them or None, not "
                         f"{type(lora).__name__}")
    lora = list(lora)
    if len(lora) != n:
        raise ValueError(f"got {len(lora)} lora_requests for {n} prompts")
    for i, item in enumerate(lora):
        if item is not None and not isinstance(item, LoRARequest):
            raise ValueError(f"lora_request {i} must be a LoRARequest or None, not "
                             f"{type(item).__name__}")
    return lora


def _as_params_list(sp, n: int) -> list[SamplingParams]:
    if sp is None:
        return [SamplingParams()] * n
    if isinstance(sp, SamplingParams):
        return [sp] * n
    sp = list(sp)
    if len(sp) != n:
        raise ValueError(f"got {len(sp)} sampling_params for {n} prompts")
    return sp
