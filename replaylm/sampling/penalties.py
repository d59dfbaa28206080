"""Logit processing before sampling: min_tokens, logit_bias, penalties and min_p.

Everything is batched over the rows of one step and reads per-slot device tensors gathered by
slot (like ``SamplingState``), so there is no per-request Python loop and no host sync in
``apply``. Per-slot token statistics (output-token counts, prompt-token presence) are kept on
the device and advanced after each sample by one scatter, so nothing is rebuilt per step; they
are (re)written from the host only when a request takes a slot (admission, or re-admission
after a preemption, whose outputs are then recounted).

Order, as in vLLM: min_tokens mask, logit_bias, repetition penalty, frequency and presence
penalties, then min_p (on the temperature-scaled distribution; expressed on unscaled logits as
``logit >= max_logit + T * log(min_p)`` so the sampler's temperature step is unchanged).

The ``[max_num_seqs, V]`` statistics are allocated on first use by a request that needs them,
so engines whose traffic never uses penalties pay no memory. Sparse per-slot lists (stop ids
for min_tokens, logit_bias) live in ``[max_num_seqs, W]`` tables whose width grows (doubling)
when a request needs more; growth happens at admission, never inside a step.
"""

from __future__ import annotations

import math

import torch

from replaylm.sampling.slots import SlotColumns
from replaylm.sampling_params import SamplingParams


class SparseTable:
    """Per-slot lists of (token id, value), padded to a common width with (0, 0.0).

    Applied with ``scatter_add_``: padding adds exactly 0.0 to token 0, so it is a no-op even
    when token 0 is also listed.
    """

    def __init__(self, max_num_seqs: int, device: torch.device) -> None:
        self.max_num_seqs = max_num_seqs
        self.device = device
        self.ids = torch.zeros((max_num_seqs, 1), dtype=torch.int64, device=device)
        self.values = torch.zeros((max_num_seqs, 1), dtype=torch.float32, device=device)

    def set(self, slot: int, items: list[tuple[int, float]]) -> None:
        width = self.ids.shape[1]
        if len(items) > width:
            while width < len(items):
                width *= 2
            ids = torch.zeros((self.max_num_seqs, width), dtype=torch.int64, device=self.device)
            values = torch.zeros((self.max_num_seqs, width), dtype=torch.float32,
                                 device=self.device)
            ids[:, : self.ids.shape[1]] = self.ids
            values[:, : self.values.shape[1]] = self.values
            self.ids, self.values = ids, values
        row_ids = torch.zeros(width, dtype=torch.int64)
        row_values = torch.zeros(width, dtype=torch.float32)
        if items:
            row_ids[: len(items)] = torch.tensor([i for i, _ in items], dtype=torch.int64)
            row_values[: len(items)] = torch.tensor([v for _, v in items], dtype=torch.float32)
        self.ids[slot] = row_ids.to(self.device, non_blocking=True)
        self.values[slot] = row_values.to(self.device, non_blocking=True)


class LogitsProcessorState:
    """Per-slot settings and token statistics for the optional logit processing.

    Host mirrors of "does slot s use X" let the runner skip every part nobody in the step uses,
    so a batch without these settings runs exactly the code it ran before they existed.
    """

    def __init__(self, max_num_seqs: int, vocab_size: int, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.max_num_seqs = max_num_seqs
        self.vocab_size = vocab_size
        f32 = torch.float32
        self.slots = SlotColumns(max_num_seqs, self.device, {
            "presence": (f32, 0.0), "frequency": (f32, 0.0), "repetition": (f32, 1.0),
            "log_min_p": (f32, -math.inf), "min_tokens": (torch.int64, 0),
        })
        cols = self.slots.columns
        self.presence, self.frequency = cols["presence"], cols["frequency"]
        self.repetition, self.log_min_p = cols["repetition"], cols["log_min_p"]
        self.min_tokens = cols["min_tokens"]
        self.bias = SparseTable(max_num_seqs, self.device)
        # min_tokens: the ids to mask (EOS and stop_token_ids), value 1.0 for a listed id.
        self.stop_ids = SparseTable(max_num_seqs, self.device)
        # Allocated on first use (see the module docstring).
        self.output_counts: torch.Tensor | None = None  # [S, V] int32
        self.prompt_mask: torch.Tensor | None = None  # [S, V] bool
        self._penalty = [False] * max_num_seqs
        self._min_p = [False] * max_num_seqs
        self._bias = [False] * max_num_seqs
        self._min_tokens = [False] * max_num_seqs
        self._bias_dirty = [False] * max_num_seqs
        self._stops_dirty = [False] * max_num_seqs

    # Host side -------------------------------------------------------------------------------

    def set(self, slot: int, params: SamplingParams, prompt_ids: list[int],
            output_ids: list[int], eos_token_ids: tuple[int, ...]) -> None:
        """Write one slot's settings and statistics (at admission, outside any graph)."""
        if not 0 <= slot < self.max_num_seqs:
            raise IndexError(f"slot {slot} out of range [0, {self.max_num_seqs})")
        self._penalty[slot] = params.uses_penalties
        self._min_p[slot] = params.min_p > 0.0
        self._bias[slot] = bool(params.logit_bias)
        self._min_tokens[slot] = params.min_tokens > 0
        self.slots.set(
            slot, presence=params.presence_penalty, frequency=params.frequency_penalty,
            repetition=params.repetition_penalty, min_tokens=params.min_tokens,
            log_min_p=math.log(params.min_p) if params.min_p > 0.0 else -math.inf,
        )
        # Rewrite a sparse row only when the old or the new request has entries: admission of
        # plain requests into clean slots then costs no copies.
        bias = [(t, b) for t, b in (params.logit_bias or {}).items() if t < self.vocab_size]
        if bias or self._bias_dirty[slot]:
            self.bias.set(slot, bias)
            self._bias_dirty[slot] = bool(bias)
        stops = [] if not self._min_tokens[slot] else sorted(
            {t for t in (*eos_token_ids, *params.stop_token_ids) if t < self.vocab_size})
        if stops or self._stops_dirty[slot]:
            self.stop_ids.set(slot, [(t, 1.0) for t in stops])
            self._stops_dirty[slot] = bool(stops)
        if params.uses_penalties and self.output_counts is None:
            shape = (self.max_num_seqs, self.vocab_size)
            self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        if self.output_counts is not None:
            self._write_stats(slot, prompt_ids, output_ids, params.uses_penalties)

    def flush(self) -> None:
        """Send the settings written since the last flush to the device."""
        self.slots.flush()

    def _write_stats(self, slot: int, prompt_ids: list[int], output_ids: list[int],
                     used: bool) -> None:
        assert self.output_counts is not None and self.prompt_mask is not None
        self.output_counts[slot].zero_()
        self.prompt_mask[slot].zero_()
        if not used:
            return  # rows of slots without penalties are never read meaningfully
        ids = torch.tensor(prompt_ids, dtype=torch.int64).to(self.device, non_blocking=True)
        self.prompt_mask[slot].index_fill_(0, ids, True)
        if output_ids:
            out = torch.tensor(output_ids, dtype=torch.int64).to(self.device, non_blocking=True)
            ones = torch.ones(len(output_ids), dtype=torch.int32, device=self.device)
            self.output_counts[slot].index_put_((out,), ones, accumulate=True)

    def active(self, slots: list[int]) -> bool:
        """Whether any of ``slots`` needs ``apply`` at all (host-side)."""
        return any(self._penalty[s] or self._min_p[s] or self._bias[s] or self._min_tokens[s]
                   for s in slots)

    # Device side -----------------------------------------------------------------------------

    def apply(self, logits: torch.Tensor, slots: torch.Tensor, out_pos: torch.Tensor,
              temperature: torch.Tensor, slots_cpu: list[int],
              draft_counts: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Processed fp32 logits ``[L, V]`` (a new tensor; ``logits`` is left as it was).

        ``temperature`` is ``SamplingState.temperature`` (per slot). Host flags from
        ``slots_cpu`` only choose which parts run; the per-row math never reads the host.
        ``draft_counts`` ``(rows, tokens)``: in a verify, row ``rows[i]`` also counts
        ``tokens[i]`` (a draft before it) as an output, so each row is penalised as plain
        decoding penalises its output position.
        """
        x = logits.float().clone()
        if any(self._min_tokens[s] for s in slots_cpu):
            # Only listed ids are masked: padding entries (id 0, value 0) add 0.0.
            ids = self.stop_ids.ids.index_select(0, slots)
            listed = self.stop_ids.values.index_select(0, slots) > 0.0
            under = (out_pos < self.min_tokens.index_select(0, slots))[:, None]
            x.scatter_add_(1, ids, torch.where(under & listed, -math.inf, 0.0))
        if any(self._bias[s] for s in slots_cpu):
            x.scatter_add_(1, self.bias.ids.index_select(0, slots),
                           self.bias.values.index_select(0, slots))
        if any(self._penalty[s] for s in slots_cpu):
            assert self.output_counts is not None and self.prompt_mask is not None
            counts = self.output_counts.index_select(0, slots)
            if draft_counts is not None:
                rows, toks = draft_counts
                counts.index_put_((rows, toks), torch.ones_like(rows, dtype=counts.dtype),
                                  accumulate=True)
            seen_out = counts > 0
            seen = seen_out | self.prompt_mask.index_select(0, slots)
            rep = self.repetition.index_select(0, slots)[:, None]
            x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
            x -= self.frequency.index_select(0, slots)[:, None] * counts
            x -= self.presence.index_select(0, slots)[:, None] * seen_out
        if any(self._min_p[s] for s in slots_cpu):
            t = temperature.index_select(0, slots)
            # Greedy rows (T = 0) keep only the maximum, which argmax picks anyway.
            floor = x.amax(dim=-1) + t * self.log_min_p.index_select(0, slots)
            x.masked_fill_(x < floor[:, None], -math.inf)
        return x

    def record(self, slots: torch.Tensor, tokens: torch.Tensor, slots_cpu: list[int],
               emitted: torch.Tensor | None = None) -> None:
        """Count the step's sampled tokens into the slots' output statistics (device only);
        ``emitted`` (a verify): only the rows it marks become outputs."""
        if self.output_counts is None or not slots_cpu:
            return
        ones = (torch.ones(tokens.shape, dtype=torch.int32, device=self.device)
                if emitted is None else emitted.to(torch.int32))
        self.output_counts.index_put_((slots, tokens), ones, accumulate=True)
