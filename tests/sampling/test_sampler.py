"""Tests for the device-side sampler: greedy, seeded reproducibility, the counter-based stream,
host mirrors, no host sync (distributions: test_sampler_distributions.py)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from replaylm.kernels import counter_rng as rng
from replaylm.sampling import SamplingState, sample
from replaylm.sampling_params import SamplingParams
from tests.sampling.sampler_helpers import CPU, chi_square, draws, make_state

# --- greedy -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("all_greedy", [True, False])
@pytest.mark.parametrize("need_filter", [True, False])
def test_greedy_equals_argmax(dtype: torch.dtype, all_greedy: bool, need_filter: bool) -> None:
    torch.manual_seed(0)
    logits = torch.randn(9, 50).to(dtype)
    logits[3, 7] = logits[3, 20] = logits[3].max() + 1  # a tie: the lowest index wins
    state = make_state([(SamplingParams(temperature=0.0, top_k=5, top_p=0.5), 0)] * 9)
    slots = torch.arange(9)
    got = sample(logits, slots, torch.arange(9), state, all_greedy=all_greedy,
                 need_filter=need_filter)
    assert got.dtype == torch.int64 and got.shape == (9,)
    assert torch.equal(got, logits.argmax(dim=-1))
    assert got[3] == 7


@pytest.mark.parametrize("need_filter", [True, False])
def test_mixed_greedy_and_random_batch(need_filter: bool) -> None:
    torch.manual_seed(1)
    vocab = 64
    logits = torch.randn(6, vocab)
    greedy = SamplingParams(temperature=0.0)
    hot = SamplingParams(temperature=5.0)  # flat enough that random rows rarely hit argmax
    rows = [(greedy, 0), (hot, 11), (greedy, 0), (hot, 12), (hot, 13), (greedy, 0)]
    state = make_state(rows)
    slots = torch.arange(6)
    out_pos = torch.tensor([0, 3, 1, 4, 2, 9])
    got = sample(logits, slots, out_pos, state, need_filter=need_filter)
    for row in (0, 2, 5):
        assert got[row] == logits[row].argmax()
    # Each random row gives what it gives alone: greedy neighbours do not perturb it.
    for row in (1, 3, 4):
        alone = sample(logits[row:row + 1], slots[row:row + 1], out_pos[row:row + 1], state)
        assert got[row] == alone[0]
    # Over many positions the random rows must leave the argmax (they really are random).
    many = draws(logits[1], hot, 200, seed=11)
    assert (many != logits[1].argmax()).float().mean() > 0.5


# --- reproducibility --------------------------------------------------------------------------


def test_seeded_row_is_batch_invariant() -> None:
    """The same (seed, out_pos) row picks the same token in any batch, row, L or slot."""
    torch.manual_seed(2)
    vocab = 97
    target = torch.randn(vocab)
    params = SamplingParams(temperature=1.3, top_k=40, top_p=0.95)
    seed, pos = 987654321987, 17

    state = SamplingState(16, CPU)
    state.set(0, params, seed)
    state.flush()
    alone = sample(target[None], torch.tensor([0]), torch.tensor([pos]), state)

    for trial in range(5):
        batch = 3 + 4 * trial
        row = (5 * trial + 1) % batch
        slot = 1 + trial  # a different slot holding the same request settings
        state.set(slot, params, seed)
        others = torch.randn(batch, vocab)
        others[row] = target
        slots = torch.randint(6, 16, (batch,))
        for s in range(6, 16):
            state.set(s, SamplingParams(temperature=0.5 + trial, top_p=0.8), 1000 + s + trial)
        state.flush()
        slots[row] = slot
        out_pos = torch.randint(0, 1000, (batch,))
        out_pos[row] = pos
        got = sample(others, slots, out_pos, state)
        assert got[row] == alone[0], (trial, batch, row)
        # and on replay
        assert torch.equal(sample(others, slots, out_pos, state), got)


def test_filter_path_with_filters_off_matches_fast_path() -> None:
    torch.manual_seed(3)
    logits = torch.randn(32, 200)
    state = make_state([(SamplingParams(temperature=0.7), 5 + i) for i in range(4)])
    slots = torch.arange(32) % 4
    out_pos = torch.arange(32) * 3
    fast = sample(logits, slots, out_pos, state, need_filter=False)
    full = sample(logits, slots, out_pos, state, need_filter=True)
    assert torch.equal(fast, full)


def test_dtype_does_not_change_seeded_draws_much() -> None:
    """bf16 logits are computed in fp32: same draws as the fp32 copy of the same values."""
    torch.manual_seed(4)
    logits = torch.randn(64, 100).to(torch.bfloat16)
    state = make_state([(SamplingParams(temperature=0.9, top_p=0.9), 77)])
    slots = torch.zeros(64, dtype=torch.int64)
    out_pos = torch.arange(64)
    assert torch.equal(sample(logits, slots, out_pos, state),
                       sample(logits.float(), slots, out_pos, state))


def test_positions_and_seeds_give_different_draws() -> None:
    vocab = 1000
    flat = torch.zeros(vocab)
    params = SamplingParams(temperature=1.0)
    a = draws(flat, params, 300, seed=1)
    b = draws(flat, params, 300, seed=2)
    # Different positions of one seed: nearly all distinct (birthday bound ~45 collisions).
    assert a.unique().numel() > 220
    # Two seeds at the same positions agree about 300 / 1000 times by chance, no more.
    assert (a == b).sum() <= 5
    # Seeds differing only in their high 32 bits are different streams too.
    c = draws(flat, params, 300, seed=1 + (1 << 40))
    assert (a == c).sum() <= 5


# --- the counter-based stream -----------------------------------------------------------------


def test_host_and_device_mixers_agree() -> None:
    values = [0, 1, 2, 0xDEADBEEF, 0xFFFFFFFF, 123456789]
    on_device = rng.mix32(torch.tensor(values, dtype=torch.int64))
    assert on_device.tolist() == [rng.mix32(v) for v in values]
    # A bijection on 32-bit words: distinct inputs, distinct outputs.
    block = rng.mix32(torch.arange(1 << 16, dtype=torch.int64) * 65537)
    assert block.unique().numel() == 1 << 16
    assert int(block.min()) >= 0 and int(block.max()) <= 0xFFFFFFFF


def test_uniforms_are_open_interval_and_uniform() -> None:
    keys = rng.row_keys(torch.tensor([rng.seed_key(9)] * 64), torch.arange(64))
    u = rng.uniforms(keys, rng.vocab_hash(4096, CPU)).double()
    assert u.dtype == torch.float64 and (u > 0).all() and (u < 1).all()
    flat = u.flatten().sort().values
    ecdf = torch.arange(1, flat.numel() + 1, dtype=torch.float64) / flat.numel()
    ks = float((ecdf - flat).abs().max())
    assert ks < 1.95 / math.sqrt(flat.numel())  # KS test at 0.1%
    # Extreme words map inside (0, 1) and stay finite through log(-log u).
    extremes = torch.tensor([[0x00000000, 0xFFFFFFFF]], dtype=torch.int64)
    x = (extremes & rng.KEEP_HIGH23) | rng.HALF_STEP
    u_ext = torch.mul(x, rng.INV_2_32)
    assert (u_ext > 0).all() and (u_ext < 1).all()
    assert torch.isfinite(u_ext.log().neg().log()).all()


def test_consecutive_positions_are_independent() -> None:
    """Pairs of draws at positions (n, n + 1) fill all 64 cells of an 8-token grid evenly."""
    tokens = draws(torch.zeros(8), SamplingParams(temperature=1.0), 64001, seed=42)
    pairs = tokens[:-1] * 8 + tokens[1:]
    # 63 degrees of freedom: the 99.99% quantile is about 111.
    assert chi_square(pairs, torch.full((64,), 1 / 64)) < 115.0


# --- host mirrors -----------------------------------------------------------------------------


def test_host_mirrors() -> None:
    state = SamplingState(6, CPU)
    assert state.all_greedy([0, 1]) and not state.needs_filter([0, 1])  # slots start greedy
    state.set(0, SamplingParams(temperature=0.0, top_k=5), 1)  # greedy: filters irrelevant
    state.set(1, SamplingParams(temperature=0.8), 2)
    state.set(2, SamplingParams(temperature=0.8, top_k=-1, top_p=0.9), 3)
    state.set(3, SamplingParams(temperature=0.8, top_k=20), 4)
    assert state.all_greedy([0]) and not state.all_greedy([0, 1])
    assert not state.needs_filter([0, 1])
    assert state.needs_filter([1, 2]) and state.needs_filter([3])
    # The device rows change only at the flush (one copy per settings matrix).
    assert state.top_k[3] == 0 and state.temperature[1] == 0
    state.flush()
    assert state.top_k[2] == 0 and state.top_k[3] == 20 and state.top_p[2] == pytest.approx(0.9)
    state.set(3, SamplingParams(temperature=0.0), 4)  # slot reuse overwrites the mirrors
    assert state.all_greedy([0, 3]) and not state.needs_filter([3])
    with pytest.raises(IndexError):
        state.set(6, SamplingParams(), 0)


# --- no host sync -----------------------------------------------------------------------------

_SYNCING_OPS = {
    "aten::item",
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::nonzero_static",
    "aten::masked_select",
    "aten::multinomial",
    "aten::unique",
    "aten::_unique2",
    "aten::equal",
    "aten::is_nonzero",
}


class _SyncRecorder(TorchDispatchMode):
    """Records every aten op and flags those that would make the host wait for the device."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.violations: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        self.ops.append(name)
        if name in _SYNCING_OPS:
            self.violations.append(name)
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        devices = {t.device for t in tensors if t.dim() > 0}
        if name in ("aten::index", "aten::index_put_", "aten::index_put"):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", [])
            if any(i is not None and i.dtype == torch.bool for i in indices):
                self.violations.append(f"{name} with a boolean mask")
        if name in ("aten::_to_copy", "aten::to", "aten::copy_"):
            target = kwargs.get("device")
            if target is not None and any(t.device != torch.device(target) for t in tensors):
                self.violations.append(f"{name} to {target}")
            if len(devices) > 1:
                self.violations.append(f"{name} across {devices}")
        return func(*args, **kwargs)


@pytest.mark.parametrize(("all_greedy", "need_filter"),
                         [(False, True), (False, False), (True, False)])
def test_sample_never_syncs_the_host(all_greedy: bool, need_filter: bool) -> None:
    torch.manual_seed(5)
    state = make_state([(SamplingParams(temperature=0.9, top_k=10, top_p=0.8), 3),
                    (SamplingParams(temperature=0.0), 4)])
    logits = torch.randn(8, 300, dtype=torch.bfloat16)
    slots = torch.tensor([0, 1] * 4)
    out_pos = torch.arange(8)
    state.vocab_hash(300)  # the warm-up a runner does before capture
    with _SyncRecorder() as rec:
        sample(logits, slots, out_pos, state, all_greedy=all_greedy, need_filter=need_filter)
    assert rec.ops, "the recorder saw nothing"
    assert rec.violations == []
    if not need_filter:
        assert "aten::sort" not in rec.ops  # the fast path skips the sort
    if all_greedy:
        assert rec.ops == ["aten::argmax"]


def test_sync_recorder_catches_syncs() -> None:
    """The detector itself must fire, or the test above proves nothing."""
    x = torch.randn(4, 5)
    with _SyncRecorder() as rec:
        x.max().item()
        x[x > 0].sum()
        x[x < 0] = 0.0
        torch.multinomial(x.softmax(-1), 1)
        x.to(torch.device("meta"))
    joined = " ".join(rec.violations)
    for needle in ("_local_scalar_dense", "boolean mask", "multinomial", "meta"):
        assert needle in joined, (needle, rec.violations)


# --- CUDA -------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replay_matches_eager_and_cpu() -> None:
    dev = torch.device("cuda")
    torch.manual_seed(6)
    rows = [(SamplingParams(temperature=0.8, top_k=50, top_p=0.9), 100 + i) for i in range(6)]
    rows += [(SamplingParams(temperature=0.0), 0), (SamplingParams(temperature=1.1), 7)]
    state_gpu, state_cpu = make_state(rows, dev), make_state(rows)
    batch, vocab = 8, 5000
    logits = torch.randn(batch, vocab, device=dev)
    slots = torch.arange(batch, device=dev)
    out_pos = torch.arange(batch, device=dev) * 5
    eager = sample(logits, slots, out_pos, state_gpu)  # also the warm-up that caches tables

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        sample(logits, slots, out_pos, state_gpu)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sample(logits, slots, out_pos, state_gpu)
    graph.replay()
    assert torch.equal(out, eager)

    # New inputs copied into the captured buffers, including a new request in a slot.
    state_gpu.set(0, SamplingParams(temperature=0.0), 1)
    state_gpu.flush()
    logits.copy_(torch.randn(batch, vocab, device=dev))
    out_pos.add_(1)
    graph.replay()
    again = sample(logits, slots, out_pos, state_gpu)
    assert torch.equal(out, again)
    assert out[0] == logits[0].argmax()

    # The hash is integer-exact, so CPU and CUDA agree up to rare fp near-ties.
    state_cpu.set(0, SamplingParams(temperature=0.0), 1)
    state_cpu.flush()
    on_cpu = sample(logits.cpu(), slots.cpu(), out_pos.cpu(), state_cpu)
    assert (on_cpu == again.cpu()).float().mean() >= 0.75


def test_argmax_rows_matches_argmax_with_ties():
    from replaylm.sampling.sampler import argmax_rows

    g = torch.Generator().manual_seed(3)
    for vocab in (128256, 151936, 4096, 1000):
        x = torch.randint(0, 30, (4, vocab), generator=g).float()  # many ties per row
        assert torch.equal(argmax_rows(x), x.argmax(-1))
        assert torch.equal(argmax_rows(x.bfloat16()), x.bfloat16().argmax(-1))


def test_slot_columns_reach_the_device_at_flush() -> None:
    """Per-slot settings are written on the host and copied at ``flush``, into rows whose
    storage never moves (graphs captured their addresses)."""
    from replaylm.sampling.slots import SlotColumns

    cols = SlotColumns(4, CPU, {"a": (torch.float32, 1.0), "b": (torch.int64, 7),
                                "c": (torch.float32, -1.0)})
    a, b = cols.columns["a"], cols.columns["b"]
    ptrs = (a.data_ptr(), b.data_ptr())
    assert a.tolist() == [1.0] * 4 and b.tolist() == [7] * 4
    cols.set(2, a=0.5, b=3)
    assert a[2] == 1.0 and b[2] == 7  # not yet on the device
    cols.flush()
    assert a.tolist() == [1.0, 1.0, 0.5, 1.0] and b.tolist() == [7, 7, 3, 7]
    assert cols.columns["c"].tolist() == [-1.0] * 4
    assert (a.data_ptr(), b.data_ptr()) == ptrs
    with pytest.raises(IndexError, match="slot 4"):
        cols.set(4, a=0.0)
