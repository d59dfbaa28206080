"""Row argmax of the logits (greedy sampling) in one launch.

torch reduces a 150k-entry vocab row with one thread block (~36 µs on an H200); split into
chunks it takes a max kernel, an argmax kernel and a gather (~20 µs at one row, ~60 µs at
256). Here each program reduces one chunk of one row to its maximum and first maximal index;
the last program of a row to finish (an atomic arrival count, as in split-KV attention)
reduces the row's chunk results and writes the answer, then resets the count. So greedy
sampling is one graph node, and the answer is torch's: the first index of the maximum (NaN
counts as the maximum, as in torch), whichever chunk finishes last. The program that writes a
row's answer can also store it into a per-slot table (``dest[slots[row]]``: the runtime's
``last_token``, which the next step reads its input ids from), which saves the scatter's own
graph node.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from replaylm.kernels import pdl
from replaylm.kernels.pdl import wait_for_previous

CHUNK = 4096  # vocab entries per program
MAX_ROWS = 16384  # arrival counters per device
_NO_INDEX = 2**31 - 1


@triton.jit
def _first_max(values, index, NO_INDEX: tl.constexpr):
    """The maximum of ``values`` and the smallest ``index`` holding it."""
    best = tl.max(values, axis=0)
    return best, tl.min(tl.where(values == best, index, NO_INDEX), axis=0)


@triton.jit
def _store_answer(out_ptr, dest_ptr, slots_ptr, row, idx, HAS_DEST: tl.constexpr):
    tl.store(out_ptr + row, idx.to(tl.int64))
    if HAS_DEST:
        tl.store(dest_ptr + tl.load(slots_ptr + row), idx.to(tl.int64))


@triton.jit
def _finish_row(best, idx, row, chunk, chunks, out_ptr, part_v_ptr, part_i_ptr, counter_ptr,
                dest_ptr, slots_ptr, C_PAD: tl.constexpr, NO_INDEX: tl.constexpr,
                HAS_DEST: tl.constexpr):
    """Bring one chunk's ``(best, idx)`` into its row's answer: a one-chunk row stores it;
    otherwise the chunk leaves its partial and the row's last arrival reduces them all."""
    if chunks == 1:
        _store_answer(out_ptr, dest_ptr, slots_ptr, row, idx, HAS_DEST)
    else:
        slot = row * chunks + chunk
        tl.store(part_v_ptr + slot, best)
        tl.store(part_i_ptr + slot, idx)
        tl.debug_barrier()  # the partials are written before the arrival is counted
        arrived = tl.atomic_add(counter_ptr + row, 1, sem="acq_rel", scope="gpu")
        if arrived == chunks - 1:
            tl.atomic_xchg(counter_ptr + row, 0, sem="relaxed", scope="gpu")  # for reuse
            c = tl.arange(0, C_PAD)
            ok = c < chunks
            vals = tl.load(part_v_ptr + row * chunks + c, mask=ok, other=float("-inf"),
                           cache_modifier=".cg")
            idxs = tl.load(part_i_ptr + row * chunks + c, mask=ok, other=NO_INDEX,
                           cache_modifier=".cg")
            _, win = _first_max(vals, idxs, NO_INDEX)
            _store_answer(out_ptr, dest_ptr, slots_ptr, row, win, HAS_DEST)


@triton.jit
def _argmax_kernel(x_ptr, out_ptr, part_v_ptr, part_i_ptr, counter_ptr, dest_ptr, slots_ptr,
                   vocab, stride_x, CHUNK: tl.constexpr, C_PAD: tl.constexpr,
                   NO_INDEX: tl.constexpr, HAS_DEST: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    chunks = tl.num_programs(1)
    wait_for_previous(USE_PDL)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=offs < vocab,
                other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)  # NaN wins, as in torch.argmax
    best, idx = _first_max(x, offs, NO_INDEX)
    _finish_row(best, idx, row, chunk, chunks, out_ptr, part_v_ptr, part_i_ptr, counter_ptr,
                dest_ptr, slots_ptr, C_PAD, NO_INDEX, HAS_DEST)


@cache
def _counters(device: torch.device) -> torch.Tensor:
    """Per-row arrival counts, zero between launches (the reducing program resets its row's).
    Allocated before any capture (``GraphRuntime`` warms greedy sampling up eagerly)."""
    return torch.zeros(MAX_ROWS, dtype=torch.int32, device=device)


def row_outputs(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """What a launch over ``logits``' rows in chunks writes: the answers (int64 ``[L]``), the
    chunks' partial maxima and indices, and the chunks per row."""
    rows, vocab = logits.shape
    chunks = triton.cdiv(vocab, CHUNK)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    part_v = torch.empty(rows * chunks, dtype=torch.float32, device=logits.device)
    part_i = torch.empty(rows * chunks, dtype=torch.int32, device=logits.device)
    return out, part_v, part_i, chunks


def argmax(logits: torch.Tensor, dest: torch.Tensor | None = None,
           slots: torch.Tensor | None = None) -> torch.Tensor:
    """``logits.argmax(-1)`` of ``[L, V]`` rows (contiguous last dim) as int64 ``[L]``; with
    ``dest`` (int64) and ``slots`` (``[L]``) also ``dest[slots] = `` the answers, as
    ``dest.index_copy_(0, slots, answers)`` would."""
    rows, vocab = logits.shape
    assert logits.stride(-1) == 1 and 0 < rows <= MAX_ROWS
    has_dest = dest is not None
    if has_dest:
        assert slots is not None and slots.shape == (rows,) and dest.dtype == torch.int64
        assert dest.is_contiguous() and slots.is_contiguous()
    out, part_v, part_i, chunks = row_outputs(logits)
    _argmax_kernel[(rows, chunks)](
        logits, out, part_v, part_i, _counters(logits.device),
        dest if has_dest else out, slots if has_dest else out, vocab, logits.stride(0),
        CHUNK=CHUNK, C_PAD=triton.next_power_of_2(chunks), NO_INDEX=_NO_INDEX,
        HAS_DEST=has_dest, USE_PDL=pdl.ENABLED, num_warps=4, **pdl.LAUNCH,
    )
    return out
