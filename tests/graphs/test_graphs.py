"""Every graph mode on CPU, through the stand-in graph: same tokens as eager, with teeth."""

from __future__ import annotations

import pytest
import torch

from replaylm import LLM, SamplingParams
from replaylm.graphs.stand_in import GraphBufferError, HostSyncError, StandInGraph, no_host_sync

MODES = ["full", "piecewise", "full_and_piecewise", "ragged"]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    from tests.conftest import make_checkpoint

    path = tmp_path_factory.mktemp("graphs-qwen3")
    make_checkpoint("qwen3", path, seed=11)
    return path


def _engine(path, mode, **kw):
    args = dict(num_kv_blocks=10, max_num_seqs=6, max_num_batched_tokens=40, max_model_len=128,
                max_graph_tokens=32, skip_tokenizer_init=True, attention_backend="torch_dense")
    if mode == "eager":
        return LLM(str(path), enforce_eager=True, **(args | kw))
    graph = dict(cuda_graph_mode=mode, graph_check=1, poison_padding=True)
    return LLM(str(path), **(args | graph | kw))


def _traffic(llm: LLM, seed: int = 0) -> dict[str, list[int]]:
    """Random arrivals over time: prefills chunked by the budget, decodes, preemptions."""
    g = torch.Generator().manual_seed(seed)
    core = llm.engine
    arrivals: dict[int, list[int]] = {}
    for i in range(9):
        step = int(torch.randint(0, 12, (1,), generator=g))
        arrivals.setdefault(step, []).append(i)
    got: dict[str, list[int]] = {}
    step = 0
    while step < 12 or core.has_unfinished():
        for i in arrivals.get(step, []):
            n = int(torch.randint(1, 50, (1,), generator=g))
            prompt = torch.randint(3, 256, (n,), generator=g).tolist()
            sp = SamplingParams(temperature=0.0 if i % 3 else 0.8, seed=i,
                                max_tokens=int(torch.randint(1, 24, (1,), generator=g)),
                                ignore_eos=True)
            core.add_request(str(i), prompt, sp)
            got[str(i)] = []
        for d in core.step():
            got[d.request_id].extend(d.new_token_ids)
        core.scheduler.check_integrity()
        step += 1
    assert core.block_manager.num_used_blocks == 0
    return got


def matches_eager(path, mode) -> LLM:
    """Run the same traffic eagerly and in ``mode`` (every step checked bit for bit, padding
    poisoned): the tokens must agree and graphs must have served steps."""
    expected = _traffic(_engine(path, "eager"))
    llm = _engine(path, mode)
    assert _traffic(llm) == expected
    stats = llm.graph_stats()
    assert stats["num_graphs"] > 0 and stats["checks"] > 0
    assert sum(stats["hits"].values()) > 0
    return llm


@pytest.mark.parametrize("mode", MODES)
def test_mode_matches_eager_tokens(qwen3_dir, mode):
    llm = matches_eager(qwen3_dir, mode)
    stats = llm.graph_stats()
    assert llm.stats().preemptions > 0  # the pool is tight enough to preempt
    if mode == "full":
        assert "not a uniform decode batch" in stats["fallbacks"]


def test_full_mode_falls_back_above_top_tier(qwen3_dir):
    llm = _engine(qwen3_dir, "full", graph_tiers="1,2")
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([[5, 6, 7]] * 3, sp, use_tqdm=False)
    fb = llm.graph_stats()["fallbacks"]
    assert any("above top full tier 2" in r for r in fb), fb


def test_ragged_serves_mixed_batches_with_one_graph_per_tier(qwen3_dir):
    llm = _engine(qwen3_dir, "ragged", graph_tiers="8,16,32")
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    llm.generate([list(range(3, 3 + n)) for n in (3, 9, 1, 14)], sp, use_tqdm=False)
    stats = llm.graph_stats()
    assert stats["num_graphs"] == 6  # a step graph and its tail graph per tier
    assert stats["padded_tokens"] > stats["real_tokens"] > 0
    assert set(k.split(":")[0] for k in stats["hits"]) == {"ragged"}


def test_bad_graph_tiers_are_named(qwen3_dir):
    with pytest.raises(ValueError, match="unsorted"):
        _engine(qwen3_dir, "ragged", graph_tiers="8,4")
    with pytest.raises(ValueError, match="above max_graph_tokens=32"):
        _engine(qwen3_dir, "ragged", graph_tiers="8,64")
    with pytest.raises(ValueError, match="torch"):
        _engine(qwen3_dir, "full", attention_backend="torch")


def test_guard_catches_planted_host_sync():
    x = torch.arange(4.0)
    with pytest.raises(HostSyncError, match="item|_local_scalar_dense"):
        with no_host_sync("test"):
            x.sum().item()
    with pytest.raises(HostSyncError, match="tolist"):
        with no_host_sync("test"):
            x.tolist()
    with pytest.raises(HostSyncError, match="nonzero"):
        with no_host_sync("test"):
            torch.nonzero(x)
    with pytest.raises(HostSyncError):
        with no_host_sync("test"):
            x[x > 1]
    with no_host_sync("test"):  # graph-safe ops pass
        torch.where(x > 1, x, 0.0).cumsum(0)


def test_stand_in_catches_reallocated_buffer():
    holder = {"buf": torch.zeros(4)}
    g = StandInGraph("t")
    g.capture(lambda: [holder["buf"] * 2], {"buf": lambda: holder["buf"]})
    g.replay()
    holder["buf"] = torch.ones(4)  # a fresh allocation replacing the static buffer
    with pytest.raises(GraphBufferError, match="buf"):
        g.replay()


def test_stand_in_outputs_land_in_captured_tensors():
    src = torch.zeros(3)
    g = StandInGraph("t")
    (out,) = g.capture(lambda: [src + 1], {"src": lambda: src})
    src.fill_(5)
    g.replay()
    assert torch.equal(out, torch.full((3,), 6.0))


def test_poisoned_padding_catches_a_planted_leak(qwen3_dir, monkeypatch):
    """Padded tokens must write scratch block 0; a bug pointing them at a real slot leaks."""
    from replaylm.graphs import buffers
    from replaylm.graphs.runtime import PaddingLeakError

    real_fill = buffers._fill

    def leaky_fill(name, dst, src, n, pad):
        # Planted bug: pad slot_mapping with the last real slot instead of the scratch block.
        if name == "slot_mapping" and n > len(src):
            return real_fill(name, dst, src, n, int(src[-1]))
        return real_fill(name, dst, src, n, pad)

    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm = _engine(qwen3_dir, "ragged", graph_tiers="8,32", graph_check=0)
    llm.generate([[5, 6, 7]], sp, use_tqdm=False)  # clean: no error
    monkeypatch.setattr(buffers, "_fill", leaky_fill)
    with pytest.raises(PaddingLeakError, match="ragged"):
        llm.generate([[5, 6, 7]], sp, use_tqdm=False)
    monkeypatch.undo()
    assert llm.engine.block_manager.num_used_blocks == 0  # the failed request was cleaned up


def test_capture_pauses_the_garbage_collector():
    """A cyclic collection inside a CUDA graph capture can destroy an unreachable graph,
    which invalidates the capture: the collector is off inside and restored after, also
    after an error."""
    import gc

    from replaylm.capture import gc_paused

    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # a collector that was off stays off
    finally:
        gc.enable()


def test_rope_in_attention_limit_is_graph_policy():
    """Decode steps of up to ``rope_in_attention_max_reqs`` request slots (default 1) do the
    rotary work inside attention where attention is graphed with the model (or eagerly);
    piecewise modes never do; the setting is validated with the other fields."""
    from replaylm.config import EngineArgs
    from replaylm.graphs.policy import GRAPH_MODES, GraphPolicy

    assert EngineArgs().rope_in_attention_max_reqs == 1
    limits = {m: GraphPolicy(m).rope_in_attention_max_reqs(16) for m in GRAPH_MODES}
    assert limits == {"eager": 16, "full": 16, "ragged": 16, "piecewise": 0,
                      "full_and_piecewise": 0}
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="rope_in_attention_max_reqs"):
            EngineArgs(rope_in_attention_max_reqs=bad)
    with pytest.raises(ValueError, match="pdl"):
        EngineArgs(pdl="sometimes")
    with pytest.raises(ValueError, match="pdl='on'"):
        LLM("default", pdl="on")  # the CPU has no PDL


def test_dispatch_depends_on_sizes_only():
    """The dispatch is a function of (tokens, requests, uniform decode): what ranks can agree
    on. Full graphs take uniform decode by request count, token tiers the rest, and above the
    top tier a step runs eagerly with the reason recorded."""
    from replaylm.graphs.policy import Dispatch, GraphPolicy

    p = GraphPolicy("full_and_piecewise", decode_tiers=[1, 2, 4], token_tiers=[8, 16])
    assert p.dispatch(3, 3, True) == Dispatch("full", 4)
    assert p.dispatch(3, 2, False) == Dispatch("piecewise", 8)
    assert p.dispatch(17, 2, False) == Dispatch(
        "eager", reason="17 tokens above top token tier 16")
    assert p.dispatch(5, 5, True) == Dispatch("piecewise", 8)  # above the top full tier
    assert p.capture_order() == [("piecewise", 16), ("piecewise", 8), ("full", 4), ("full", 2),
                                 ("full", 1)]
    ragged = GraphPolicy("ragged", token_tiers=[4, 8])
    assert ragged.dispatch(5, 3, False) == Dispatch("ragged", 8)
    assert GraphPolicy("eager").dispatch(1, 1, True) == Dispatch("eager")
