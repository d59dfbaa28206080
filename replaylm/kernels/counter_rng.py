"""The counter-based random stream of sampling, in torch (the Triton kernels of
``kernels.sample`` compute the same words in uint32).

The uniform draw for vocab entry ``v`` of the token at output index ``out_pos`` of a request
with seed ``seed`` is a pure integer hash of ``(seed, out_pos, v)``, so a seeded request draws
the same uniforms whatever batch, row, batch size or graph mode runs it. Sampling uses them in
the exponential race (Gumbel-max): the token is ``argmax_v logits_v / T - log E_v`` with
``E_v = -log u_v``, which draws exactly from ``softmax(logits / T)``. :func:`race` is the
torch reference of that draw, greedy rows and top-k/top-p thresholds included. This module
imports only torch: it works without Triton.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
# Multipliers of a two-round xorshift-multiply 32-bit mixer. Both are odd (so each round is a
# bijection on 32-bit words) and below 2**31, so a 32-bit value times either stays below 2**63:
# the int64 products never overflow on any backend, and masking after each multiply keeps
# every intermediate a plain 32-bit word.
MUL1 = 0x2C1B3C6D
MUL2 = 0x297A2D39
VOCAB_SALT = 0x68E31DA4  # separates the vocab-index stream from the seed/position stream
SEED_SALT = 0x3C6EF372
# After the last multiply keep bits 9..31 (the best mixed ones) and set bit 8: the word is then
# (k + 0.5) * 2**9 with k < 2**23, so u = word * 2**-32 is exact in fp32 and lies strictly
# inside (0, 1): log(u) and log(-log(u)) are always finite.
KEEP_HIGH23 = 0xFFFFFE00
HALF_STEP = 0x100
INV_2_32 = 2.0**-32


def mix32(x):
    """Bijective 32-bit mixer; ``x`` is an int or an int64 tensor holding values in [0, 2**32).

    The same code runs on Python ints (host-side seed keys) and tensors (device-side keys), so
    the two always agree. The first line builds a new tensor, so the caller's input is never
    modified; the rest works in place to avoid temporaries.
    """
    x = x ^ (x >> 15)
    x *= MUL1
    x &= MASK32
    x ^= x >> 12
    x *= MUL2
    x &= MASK32
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
    lo, hi = seed & MASK32, seed >> 32
    return mix32(mix32(lo ^ SEED_SALT) ^ hi)


def vocab_hash(vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """Per-vocab-index keys ``[V]`` int64, pre-shifted for the fused per-element mixer."""
    v = torch.arange(vocab_size, dtype=torch.int64, device=device)
    return _pre_shift(mix32(v ^ VOCAB_SALT))


def row_keys(seed_keys: torch.Tensor, out_pos: torch.Tensor) -> torch.Tensor:
    """Per-row keys ``[L]`` int64 from per-row seed keys and output positions, pre-shifted.

    One multiply round suffices here: the seed key is already fully mixed, and the per-element
    rounds in ``uniforms`` follow, so a position passes through three multiply rounds before it
    reaches a uniform. Each op here is a separate tiny launch on every decode step.
    """
    x = (seed_keys ^ out_pos) & MASK32
    x *= MUL1
    x &= MASK32
    return _pre_shift(x)


def uniforms(rkeys: torch.Tensor, vhash: torch.Tensor) -> torch.Tensor:
    """Uniforms ``[L, V]`` fp32 in (0, 1) for every (row, vocab index) pair.

    This is the mixer applied to ``row_key ^ vocab_key`` (its first step already done on both
    inputs), ending in the exact fp32 conversion described at ``KEEP_HIGH23``.
    """
    x = rkeys[:, None] ^ vhash[None, :]
    x *= MUL1
    x &= MASK32
    x ^= x >> 12
    x *= MUL2
    x &= KEEP_HIGH23
    x |= HALF_STEP
    return torch.mul(x, INV_2_32)


def race(logits: torch.Tensor, temperature: torch.Tensor, seed_keys: torch.Tensor,
         out_pos: torch.Tensor, vhash: torch.Tensor,
         threshold: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of ``logits`` ``[L, V]`` (int64 ``[L]``): the argmax where the row's
    ``temperature`` is 0, else the exponential race on ``logits / temperature`` with the
    uniforms of ``(seed_keys, out_pos)`` (``vhash``: :func:`vocab_hash` of ``V``). With
    ``threshold`` ``[L]``, entries whose scaled logit is below the row's threshold (top-k /
    top-p, ``sampling.sampler``) never win a race. Ties go to the first index; a NaN logit
    wins (as in ``torch.argmax``)."""
    greedy_ids = logits.argmax(dim=-1)  # argmax is dtype-monotone: no fp32 copy needed
    is_greedy = temperature == 0.0
    # Greedy rows still run the race (their result is discarded by the final where); a unit
    # temperature keeps their arithmetic finite.
    t = torch.where(is_greedy, 1.0, temperature)[:, None]
    # log E with E = -log(u) ~ Exp(1); the race winner is argmin(log E - logits / T).
    log_e = uniforms(row_keys(seed_keys, out_pos), vhash).log_().neg_().log_()
    if threshold is not None:
        log_e.masked_fill_(torch.div(logits, t) < threshold[:, None], float("inf"))
    # addcdiv fuses the fp32 cast, the temperature division and the subtraction.
    random_ids = torch.addcdiv(log_e, logits, t, value=-1.0).argmin(dim=-1)
    return torch.where(is_greedy, greedy_ids, random_ids)
