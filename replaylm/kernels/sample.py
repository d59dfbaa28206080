"""Token sampling in one launch: each row's argmax or its exponential race.

A row whose slot's temperature is 0 takes the argmax of its logits; any other row takes
``argmax_v logits_v / T - log(-log u_v)``, with the uniforms ``u`` of the counter-based
stream (``kernels.counter_rng``: a hash of the slot's seed key, the row's output position
and ``v``), computed here in uint32 on the fly: no ``[L, V]`` tensor is written. With a
threshold per row (top-k / top-p, found by ``sampling.sampler``), entries whose scaled logit
is below it never win. The torch reference is ``counter_rng.race``; the result is the same
token except where two entries' keys differ in the last bit (the device's ``log`` against
torch's).

The launch and the row reduction are the argmax's (``kernels.argmax``): programs over chunks
of a row, the row's last arrival reducing their partials, the answer also stored into a
per-slot table. The settings are per-slot device tensors read by slot, so a captured graph
samples whatever requests hold the slots when it replays; a greedy row never computes a
uniform. Rows must point at slots inside the tables (padded rows at a greedy scratch slot).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replaylm.kernels import counter_rng as rng
from replaylm.kernels import pdl
from replaylm.kernels.argmax import (
    _NO_INDEX,
    CHUNK,
    MAX_ROWS,
    _counters,
    _finish_row,
    _first_max,
    row_outputs,
)
from replaylm.kernels.pdl import wait_for_previous

_MASK32 = tl.constexpr(rng.MASK32)
_MUL1 = tl.constexpr(rng.MUL1)
_MUL2 = tl.constexpr(rng.MUL2)
_VOCAB_SALT = tl.constexpr(rng.VOCAB_SALT)
_KEEP_HIGH23 = tl.constexpr(rng.KEEP_HIGH23)
_HALF_STEP = tl.constexpr(rng.HALF_STEP)
_INV_2_32 = tl.constexpr(rng.INV_2_32)


@triton.jit
def _uniforms(seed_key, out_pos, offs):
    """``counter_rng.uniforms`` of one row (int64 seed key and position) at vocab ``offs``:
    the same words, in uint32 arithmetic (a product wraps where torch masks it)."""
    r = ((seed_key ^ out_pos) & _MASK32).to(tl.uint32)
    r = r * _MUL1
    r = r ^ (r >> 15)
    v = offs.to(tl.uint32) ^ _VOCAB_SALT  # counter_rng.vocab_hash, inline
    v = v ^ (v >> 15)
    v = v * _MUL1
    v = v ^ (v >> 12)
    v = v * _MUL2
    v = v ^ (v >> 15)
    v = v ^ (v >> 15)
    x = r ^ v
    x = x * _MUL1
    x = x ^ (x >> 12)
    x = x * _MUL2
    x = (x & _KEEP_HIGH23) | _HALF_STEP
    return x.to(tl.float32) * _INV_2_32


@triton.jit
def _sample_kernel(x_ptr, out_ptr, part_v_ptr, part_i_ptr, counter_ptr, dest_ptr, slots_ptr,
                   temp_ptr, seed_key_ptr, out_pos_ptr, thr_ptr, vocab, stride_x,
                   CHUNK: tl.constexpr, C_PAD: tl.constexpr, NO_INDEX: tl.constexpr,
                   HAS_DEST: tl.constexpr, HAS_THRESHOLD: tl.constexpr,
                   USE_PDL: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    chunks = tl.num_programs(1)
    wait_for_previous(USE_PDL)
    slot = tl.load(slots_ptr + row)
    t = tl.load(temp_ptr + slot)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=offs < vocab,
                other=float("-inf")).to(tl.float32)
    score = x
    if t > 0.0:
        u = _uniforms(tl.load(seed_key_ptr + slot), tl.load(out_pos_ptr + row), offs)
        scaled = x / t
        # -(log E - x / T), E = -log u: the race's winner is the largest (counter_rng.race).
        score = scaled - tl.log(-tl.log(u))
        if HAS_THRESHOLD:
            score = tl.where(scaled < tl.load(thr_ptr + row), float("-inf"), score)
    score = tl.where(score != score, float("inf"), score)  # NaN wins, as in torch.argmax
    best, idx = _first_max(score, offs, NO_INDEX)
    _finish_row(best, idx, row, chunk, chunks, out_ptr, part_v_ptr, part_i_ptr, counter_ptr,
                dest_ptr, slots_ptr, C_PAD, NO_INDEX, HAS_DEST)


def sample(logits: torch.Tensor, slots: torch.Tensor, out_pos: torch.Tensor,
           temperature: torch.Tensor, seed_keys: torch.Tensor,
           threshold: torch.Tensor | None = None, dest: torch.Tensor | None = None,
           ) -> torch.Tensor:
    """``counter_rng.race`` of ``[L, V]`` rows (contiguous last dim) as int64 ``[L]``, each
    row reading ``temperature`` (float32) and ``seed_keys`` (int64) at its slot and its
    ``out_pos`` (int64); ``threshold``: float32 ``[L]``. With ``dest`` (int64) also
    ``dest[slots] = `` the answers."""
    rows, vocab = logits.shape
    assert logits.stride(-1) == 1 and 0 < rows <= MAX_ROWS
    assert slots.shape == out_pos.shape == (rows,) and slots.is_contiguous()
    assert temperature.dtype == torch.float32 and seed_keys.dtype == torch.int64
    if threshold is not None:
        threshold = threshold.reshape(rows).float().contiguous()
    if dest is not None:
        assert dest.dtype == torch.int64 and dest.is_contiguous()
    out, part_v, part_i, chunks = row_outputs(logits)
    _sample_kernel[(rows, chunks)](
        logits, out, part_v, part_i, _counters(logits.device),
        out if dest is None else dest, slots, temperature, seed_keys,
        out_pos.contiguous(), out if threshold is None else threshold, vocab, logits.stride(0),
        CHUNK=CHUNK, C_PAD=triton.next_power_of_2(chunks), NO_INDEX=_NO_INDEX,
        HAS_DEST=dest is not None, HAS_THRESHOLD=threshold is not None,
        USE_PDL=pdl.ENABLED, num_warps=4, **pdl.LAUNCH,
    )
    return out
