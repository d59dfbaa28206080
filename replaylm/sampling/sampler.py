"""Device-side token sampling with no host sync, safe to capture in a CUDA graph.

Per-request settings live in persistent per-slot tensors (``SamplingState``); ``sample`` gathers
them by slot, so a captured graph reads whatever requests occupy the slots at replay time.

Randomness is counter-based: the uniform draw for vocab entry ``v`` of the token at output
index ``out_pos`` of a request with seed ``seed`` is a pure integer hash of
``(seed, out_pos, v)``. Sampling uses the exponential race (Gumbel-max): the token is
``argmax_v log p_v - log E_v`` with ``E_v = -log u_v``, which draws exactly from ``p``. A seeded
request therefore picks the same tokens whatever batch, row, batch size or graph mode runs it.

Everything here uses fixed shapes and no data-dependent control flow: no ``.item()``,
``nonzero``, boolean-mask indexing, ``torch.multinomial`` or device->host copies.
"""

from __future__ import annotations

import torch

from replaylm.sampling.slots import SlotColumns
from replaylm.sampling_params import SamplingParams

_MASK32 = 0xFFFFFFFF
# Multipliers of a two-round xorshift-multiply 32-bit mixer. Both are odd (so each round is a
# bijection on 32-bit words) and below 2**31, so a 32-bit value times either stays below 2**63:
# the int64 products never overflow on any backend, and masking after each multiply keeps
# every intermediate a plain 32-bit word.
_MUL1 = 0x2C1B3C6D
_MUL2 = 0x297A2D39
_VOCAB_SALT = 0x68E31DA4  # separates the vocab-index stream from the seed/position stream
_SEED_SALT = 0x3C6EF372
# After the last multiply keep bits 9..31 (the best mixed ones) and set bit 8: the word is then
# (k + 0.5) * 2**9 with k < 2**23, so u = word * 2**-32 is exact in fp32 and lies strictly
# inside (0, 1): log(u) and log(-log(u)) are always finite.
_KEEP_HIGH23 = 0xFFFFFE00
_HALF_STEP = 0x100
_INV_2_32 = 2.0**-32


def _mix32(x):
    """Bijective 32-bit mixer; ``x`` is an int or an int64 tensor holding values in [0, 2**32).

    The same code runs on Python ints (host-side seed keys) and tensors (device-side keys), so
    the two always agree. The first line builds a new tensor, so the caller's input is never
    modified; the rest works in place to avoid temporaries.
    """
    x = x ^ (x >> 15)
    x *= _MUL1
    x &= _MASK32
    x ^= x >> 12
    x *= _MUL2
    x &= _MASK32
    x ^= x >> 15
    return x


def _pre_shift(x):
    """The mixer's first step, ``x ^ (x >> 15)``, on its own.

    It distributes over XOR, so applying it to a row key and to the vocab table separately and
    XOR-ing the results equals applying it to their XOR: two fewer ops on the [L, V] tensor.
    """
    return x ^ (x >> 15)


def seed_key(seed: int) -> int:
    """The 32-bit per-request key derived from a 64-bit seed (both halves count)."""
    seed &= (1 << 64) - 1
    lo, hi = seed & _MASK32, seed >> 32
    return _mix32(_mix32(lo ^ _SEED_SALT) ^ hi)


def vocab_hash(vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """Per-vocab-index keys ``[V]`` int64, pre-shifted for the fused per-element mixer."""
    v = torch.arange(vocab_size, dtype=torch.int64, device=device)
    return _pre_shift(_mix32(v ^ _VOCAB_SALT))


def row_keys(seed_keys: torch.Tensor, out_pos: torch.Tensor) -> torch.Tensor:
    """Per-row keys ``[L]`` int64 from per-row seed keys and output positions, pre-shifted.

    One multiply round suffices here: the seed key is already fully mixed, and the per-element
    rounds in ``uniforms`` follow, so a position passes through three multiply rounds before it
    reaches a uniform. Each op here is a separate tiny launch on every decode step.
    """
    x = (seed_keys ^ out_pos) & _MASK32
    x *= _MUL1
    x &= _MASK32
    return _pre_shift(x)


def uniforms(rkeys: torch.Tensor, vhash: torch.Tensor) -> torch.Tensor:
    """Uniforms ``[L, V]`` fp32 in (0, 1) for every (row, vocab index) pair.

    This is the mixer applied to ``row_key ^ vocab_key`` (its first step already done on both
    inputs), ending in the exact fp32 conversion described at ``_KEEP_HIGH23``.
    """
    x = rkeys[:, None] ^ vhash[None, :]
    x *= _MUL1
    x &= _MASK32
    x ^= x >> 12
    x *= _MUL2
    x &= _KEEP_HIGH23
    x |= _HALF_STEP
    return torch.mul(x, _INV_2_32)


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
    """Persistent per-slot device tensors (one row per request slot, ``max_num_seqs`` rows).

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
        self.slots = SlotColumns(max_num_seqs, self.device, {
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
    greedy_ids = argmax_rows(logits)  # argmax is dtype-monotone: no fp32 copy needed
    if all_greedy:
        return greedy_ids

    temperature = state.temperature.index_select(0, slots)
    is_greedy = temperature == 0.0
    # Greedy rows still run the random path (their result is discarded by the final where);
    # a unit temperature keeps their arithmetic finite.
    temperature = torch.where(is_greedy, 1.0, temperature)[:, None]

    rkeys = row_keys(state.seed_key.index_select(0, slots), out_pos)
    # log E with E = -log(u) ~ Exp(1); the race winner is argmin(log E - logits / T).
    log_e = uniforms(rkeys, state.vocab_hash(logits.shape[-1])).log_().neg_().log_()

    if need_filter:
        scaled = torch.div(logits, temperature)  # fp32 whatever the logits dtype
        log_e.masked_fill_(scaled < _filter_threshold(scaled, slots, state), float("inf"))
    # addcdiv fuses the fp32 cast, the temperature division and the subtraction.
    random_ids = torch.addcdiv(log_e, logits, temperature, value=-1.0).argmin(dim=-1)
    return torch.where(is_greedy, greedy_ids, random_ids)


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
