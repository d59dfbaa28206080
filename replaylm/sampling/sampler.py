"""Device-side token sampling with no host sync, safe to capture in a CUDA graph.

Per-request settings live in persistent per-slot tensors (``SamplingState``); the sampler
reads them by slot, so a captured graph reads whatever requests occupy the slots at replay
time.

Randomness is counter-based (``kernels.counter_rng``): a token's uniforms are a hash of the
request's seed, the token's output index and the vocab index, drawn in the exponential race
(Gumbel-max), so a seeded request picks the same tokens whatever batch, row, batch size or
graph mode runs it. On CUDA one launch (``kernels.sample``) samples every row, greedy or not;
top-k and top-p first find each row's threshold with one sort.

Everything here uses fixed shapes and no data-dependent control flow: no ``.item()``,
``nonzero``, boolean-mask indexing, ``torch.multinomial`` or device->host copies.
"""

from __future__ import annotations

import torch

from replaylm.kernels.counter_rng import race, row_keys, seed_key, uniforms, vocab_hash
from replaylm.sampling.slots import SlotColumns
from replaylm.sampling_params import SamplingParams


def argmax_rows(logits: torch.Tensor, dest: torch.Tensor | None = None,
                slots: torch.Tensor | None = None) -> torch.Tensor:
    """``logits.argmax(-1)`` (first index on ties) for ``[L, V]`` rows: on CUDA one Triton
    launch (``replaylm.kernels.argmax``; torch's reduction takes one thread block per row
    and ~36 µs for a 128k vocab row), elsewhere torch's. With ``dest`` and ``slots``, also
    ``dest[slots] = `` the answers (inside the same launch on CUDA)."""
    if logits.is_cuda and logits.stride(-1) == 1 and logits.shape[0] > 0:
        from replaylm.kernels.argmax import MAX_ROWS, argmax

        if logits.shape[0] <= MAX_ROWS:
            return argmax(logits, dest, slots)
    tokens = logits.argmax(dim=-1)
    if dest is not None:
        dest.index_copy_(0, slots, tokens)
    return tokens


class SamplingState:
    """Persistent per-slot device tensors: one row per request slot (``max_num_seqs``), and a
    last row for the scratch slot that padded rows of a graph read, which stays greedy.

    ``set`` is the only writer (host side; ``flush`` sends it, ``SlotColumns``): it also fills
    a derived key tensor and host-side mirrors, so the runner can decide the fast paths
    without reading the device. Tensors are allocated once and updated in place, so CUDA
    graphs that captured their addresses stay valid.
    """

    def __init__(self, max_num_seqs: int, device: torch.device | str,
                 vocab_size: int | None = None) -> None:
        self.device = torch.device(device)
        self.max_num_seqs = max_num_seqs
        # A top-k at least this large keeps every token: stored as 0 (off), as in
        # transformers and vLLM, so it costs no filtering (and fits the int64 column).
        self.top_k_off_from = vocab_size if vocab_size is not None else 2**63
        # Slots start greedy and unfiltered: a padded row pointing at an unused slot is cheap
        # and harmless. seed_key: the seed's 32-bit key, precomputed on the host so each step
        # skips two mixer rounds.
        f32, i64 = torch.float32, torch.int64
        self.slots = SlotColumns(max_num_seqs + 1, self.device, {
            "temperature": (f32, 0.0), "top_p": (f32, 1.0), "top_k": (i64, 0),
            "seed": (i64, 0), "seed_key": (i64, seed_key(0)),
        })
        cols = self.slots.columns
        self.temperature, self.top_p, self.top_k = cols["temperature"], cols["top_p"], cols["top_k"]
        self.seed, self.seed_key = cols["seed"], cols["seed_key"]
        self._temperature_host = [0.0] * max_num_seqs
        self._top_k_host = [0] * max_num_seqs
        self._top_p_host = [1.0] * max_num_seqs
        self._vocab_hash: dict[int, torch.Tensor] = {}

    def set(self, slot: int, params: SamplingParams, seed: int) -> None:
        """Write one slot's settings (runs on admission, outside any graph); they reach the
        device at the next ``flush``. Greedy requests (``params.greedy``: temperatures below
        ``GREEDY_BELOW`` too) are stored with temperature 0."""
        if not 0 <= slot < self.max_num_seqs:
            raise IndexError(f"slot {slot} out of range [0, {self.max_num_seqs})")
        top_k = params.top_k if 0 < params.top_k < self.top_k_off_from else 0
        temperature = 0.0 if params.greedy else params.temperature
        # Wrap into int64's range: SamplingParams allows [0, 2**63), a runner may pass more.
        seed64 = seed & ((1 << 64) - 1)
        seed_i64 = seed64 - (1 << 64) if seed64 >= 1 << 63 else seed64
        self.slots.set(slot, temperature=temperature, top_k=top_k, top_p=params.top_p,
                       seed=seed_i64, seed_key=seed_key(seed64))
        self._temperature_host[slot] = temperature
        self._top_k_host[slot] = top_k
        self._top_p_host[slot] = params.top_p

    def flush(self) -> None:
        """Send the settings written since the last flush to the device."""
        self.slots.flush()

    def needs_filter(self, slots: list[int]) -> bool:
        """Whether any non-greedy slot among ``slots`` uses top-k or top-p (host-side)."""
        return any(
            self._temperature_host[s] > 0.0
            and (self._top_k_host[s] > 0 or self._top_p_host[s] < 1.0)
            for s in slots
        )

    def all_greedy(self, slots: list[int]) -> bool:
        """Whether every slot among ``slots`` is greedy (host-side)."""
        return all(self._temperature_host[s] == 0.0 for s in slots)

    def vocab_hash(self, vocab_size: int) -> torch.Tensor:
        """The vocab key table for ``vocab_size``, cached once built outside a graph capture.

        A table first built during capture would hold whatever the capture left (kernels do
        not run while capturing), so it is rebuilt inline there and cached only when eager.
        Warm-up runs before capture fill the cache, so graphs read the cached table.
        """
        table = self._vocab_hash.get(vocab_size)
        if table is None:
            table = vocab_hash(vocab_size, self.device)
            capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
            if not capturing:
                self._vocab_hash[vocab_size] = table
        return table


def race_rows(logits: torch.Tensor, slots: torch.Tensor, out_pos: torch.Tensor,
              state: SamplingState, threshold: torch.Tensor | None = None,
              dest: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of ``logits`` ``[L, V]`` by each row's slot settings: the argmax for
    a greedy slot, else the exponential race (``counter_rng.race``; ``threshold`` ``[L]``:
    top-k / top-p). On CUDA one launch (``kernels.sample``), elsewhere the torch reference.
    With ``dest``, also ``dest[slots] = `` the answers. ``slots`` may name the scratch slot
    (a padded row): it is greedy."""
    if logits.is_cuda and logits.stride(-1) == 1 and logits.shape[0] > 0:
        from replaylm.kernels.sample import MAX_ROWS
        from replaylm.kernels.sample import sample as sample_kernel

        if logits.shape[0] <= MAX_ROWS:
            return sample_kernel(logits, slots, out_pos, state.temperature, state.seed_key,
                                 threshold, dest)
    tokens = race(logits, state.temperature.index_select(0, slots),
                  state.seed_key.index_select(0, slots), out_pos,
                  state.vocab_hash(logits.shape[-1]), threshold)
    if dest is not None:
        dest.index_copy_(0, slots, tokens)
    return tokens


def sample(
    logits: torch.Tensor,
    slots: torch.Tensor,
    out_pos: torch.Tensor,
    state: SamplingState,
    *,
    all_greedy: bool = False,
    need_filter: bool = True,
) -> torch.Tensor:
    """Sample one token per row of ``logits`` ``[L, V]``; returns ``[L]`` int64 on the device.

    ``slots`` ``[L]`` maps rows to state slots; ``out_pos`` ``[L]`` is the output index of the
    token being sampled (0 for the first generated token). ``all_greedy`` and ``need_filter``
    are host-known promises (``SamplingState.all_greedy`` / ``needs_filter``) that select
    cheaper paths; they never change a result, given the promise holds.
    """
    if all_greedy:
        return argmax_rows(logits)
    threshold = None
    if need_filter:
        temperature = state.temperature.index_select(0, slots)
        # fp32 whatever the logits dtype; greedy rows divide by 1 (they ignore the threshold)
        scaled = torch.div(logits, torch.where(temperature == 0.0, 1.0, temperature)[:, None])
        threshold = _filter_threshold(scaled, slots, state)[:, 0]
    return race_rows(logits, slots, out_pos, state, threshold)


def draw(probs: torch.Tensor, seed_keys: torch.Tensor, out_pos: torch.Tensor,
         vocab_hash: torch.Tensor) -> torch.Tensor:
    """One token per row of the probability table ``probs`` ``[L, V]``, by the same
    counter-based exponential race as ``sample`` (randomness from ``(seed key, out_pos)``)."""
    log_e = uniforms(row_keys(seed_keys, out_pos), vocab_hash).log_().neg_().log_()
    return (log_e - probs.log()).argmin(dim=-1)


def sampling_probs(logits: torch.Tensor, slots: torch.Tensor, state: SamplingState,
                   need_filter: bool = True) -> torch.Tensor:
    """The distribution ``sample`` draws each row from: ``[L, V]`` fp32 probabilities of
    ``logits / temperature`` after top-k then top-p. Greedy rows get the unfiltered softmax
    of their logits (temperature 1): ``sample`` takes their argmax, and speculative drafting
    reads its top probability as the draft's confidence."""
    temperature = state.temperature.index_select(0, slots)
    is_greedy = temperature == 0.0
    scaled = torch.div(logits, torch.where(is_greedy, 1.0, temperature)[:, None])
    if need_filter:
        threshold = _filter_threshold(scaled, slots, state).masked_fill_(is_greedy[:, None],
                                                                         float("-inf"))
        scaled = scaled.masked_fill(scaled < threshold, float("-inf"))
    return scaled.softmax(dim=-1)


def _filter_threshold(
    scaled: torch.Tensor, slots: torch.Tensor, state: SamplingState
) -> torch.Tensor:
    """Per-row smallest kept scaled logit ``[L, 1]`` after top-k then top-p.

    One descending sort serves both filters. Top-k keeps sorted positions ``<= k - 1``. Top-p,
    on the distribution renormalised over the top-k set, keeps the shortest prefix whose mass
    reaches ``p * mass(top-k)``: ``searchsorted`` on the cumulative sum finds its last index.
    The smaller of the two indices gives the threshold value; comparing values (not positions)
    keeps boundary ties, which may keep a few extra tokens but never drops one.
    """
    vocab_size = scaled.shape[-1]
    sorted_scaled = scaled.sort(dim=-1, descending=True).values

    top_k = state.top_k.index_select(0, slots)
    # k == 0 (off) wraps to INT64_MAX under the mask, then clamps to the last index like k >= V.
    last_k = ((top_k - 1) & (2**63 - 1)).clamp_(max=vocab_size - 1)[:, None]

    cum_probs = sorted_scaled.softmax(dim=-1).cumsum_(dim=-1)
    top_p = state.top_p.index_select(0, slots)
    # p == 1 is off: aim above any reachable mass, so the search ends past the top-k set.
    top_p = torch.where(top_p >= 1.0, 2.0, top_p)[:, None]
    target = cum_probs.gather(1, last_k).mul_(top_p)
    last_p = torch.searchsorted(cum_probs, target)
    last = torch.minimum(last_p, last_k)
    return sorted_scaled.gather(1, last)
