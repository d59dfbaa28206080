"""Engine behaviour on CPU: chunked prefill, preemption, seeded sampling, abort."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from replaylm import LLM, SamplingParams


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from tests.conftest import make_checkpoint

    path = tmp_path_factory.mktemp("engine-llama")
    make_checkpoint("llama", path, seed=3)
    return path


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (int(torch.randint(1, 60, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


def _run_stepwise(llm: LLM, prompts, params) -> dict[str, list[int]]:
    core = llm.engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        core.add_request(str(i), p, sp)
    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while core.has_unfinished():
        for d in core.step():
            got[d.request_id].extend(d.new_token_ids)
        core.scheduler.check_integrity()
    assert core.block_manager.num_used_blocks == 0
    return got


def test_chunked_prefill_and_preemption_match_unconstrained(llama_dir):
    prompts = _prompts(10)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=20,
                             ignore_eos=True) for i in range(10)]
    big = LLM(str(llama_dir), num_kv_blocks=512, max_num_seqs=16, skip_tokenizer_init=True)
    expected = _run_stepwise(big, prompts, params)
    # 9 usable blocks (144 tokens) for 10 requests of up to 79 tokens, 16-token steps:
    # prompts are chunked and requests are preempted and recomputed over and over.
    small = LLM(str(llama_dir), num_kv_blocks=10, max_num_seqs=6, max_num_batched_tokens=16,
                max_model_len=144, skip_tokenizer_init=True)
    got = _run_stepwise(small, prompts, params)
    assert small.stats().preemptions > 0
    assert got == expected


def test_seeded_sampling_is_independent_of_batch(llama_dir):
    llm = LLM(str(llama_dir), num_kv_blocks=256, skip_tokenizer_init=True)
    target = [5, 6, 7, 8, 9]
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16,
                        ignore_eos=True)
    alone = llm.generate([target], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = _prompts(5, seed=9)
    mixed_params = [SamplingParams(temperature=0.7, max_tokens=8, ignore_eos=True)] * 5 + [sp]
    mixed = llm.generate(others + [target], mixed_params, use_tqdm=False)
    assert mixed[-1].outputs[0].token_ids == alone
    unseeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    a, b = llm.generate([target, target], unseeded, use_tqdm=False)
    assert a.outputs[0].token_ids != b.outputs[0].token_ids  # engine seeds differ per request


def test_stop_tokens_max_tokens_and_eos(llama_dir):
    llm = LLM(str(llama_dir), num_kv_blocks=128, skip_tokenizer_init=True)
    base = llm.generate([[10, 11, 12]], SamplingParams(temperature=0.0, max_tokens=12,
                                                      ignore_eos=True), use_tqdm=False)[0]
    toks = base.outputs[0].token_ids
    assert len(toks) == 12 and base.outputs[0].finish_reason == "length"
    stop_at = toks[4]
    out = llm.generate([[10, 11, 12]], SamplingParams(temperature=0.0, max_tokens=12,
                                                     stop_token_ids=[stop_at]), use_tqdm=False)[0]
    first = toks.index(stop_at)
    assert out.outputs[0].token_ids == toks[: first + 1]
    assert out.outputs[0].finish_reason == "stop"


def test_abort_frees_blocks_and_others_continue(llama_dir):
    llm = LLM(str(llama_dir), num_kv_blocks=64, skip_tokenizer_init=True)
    core = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    core.add_request("a", [1, 2, 3, 4], sp)
    core.add_request("b", list(range(3, 40)), sp)
    tokens = [t for d in core.step() for t in d.new_token_ids]
    assert core.block_manager.num_used_blocks > 0
    assert core.abort("b")
    assert not core.abort("b")
    core.scheduler.check_integrity()
    while core.has_unfinished():
        for d in core.step():
            assert d.request_id == "a"
            tokens += d.new_token_ids
    assert len(tokens) == 10
    assert core.block_manager.num_used_blocks == 0
    assert llm.stats().requests_aborted == 1


@pytest.mark.parametrize("threshold", [12_345, 0])
def test_start_up_sets_the_young_gc_threshold(llama_dir, threshold):
    """``gc_gen0_threshold``: set for the process once the engine has started; 0 leaves
    Python's thresholds alone."""
    import gc

    before = gc.get_threshold()
    try:
        gc.set_threshold(700, *before[1:])
        LLM(str(llama_dir), num_kv_blocks=64, skip_tokenizer_init=True,
            gc_gen0_threshold=threshold)
        assert gc.get_threshold() == (threshold or 700, *before[1:])
    finally:
        gc.set_threshold(*before)


def test_token_only_deltas_equal_the_full_path(llama_dir, monkeypatch):
    """A request with no tokenizer, stop strings or logprobs gets its deltas without the
    detokenizer and stop buffer (``OutputState.tokens_only``): every delta field the same as
    the full path gives, for requests ended by length, by a stop token and by n > 1."""
    from replaylm.engine import output_processor

    prompts = _prompts(6, seed=4)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=5 + 3 * i,
                             n=2 if i == 4 else 1) for i in range(6)]
    # Request 3 (greedy) stops at its own third token, a stop token id.
    probe = LLM(str(llama_dir), num_kv_blocks=128, skip_tokenizer_init=True).generate(
        [prompts[3]], params[3], use_tqdm=False)[0].outputs[0].token_ids
    params[3] = SamplingParams(temperature=0.0, max_tokens=14, stop_token_ids=[probe[2]])

    def deltas() -> list[dict]:
        llm = LLM(str(llama_dir), num_kv_blocks=128, skip_tokenizer_init=True)
        core = llm.engine
        for i, (p, sp) in enumerate(zip(prompts, params)):
            core.add_request(str(i), p, sp)
        got = []
        while core.has_unfinished():
            got += [dataclasses.asdict(d) for d in core.step()]
        return got

    fast = deltas()
    made = []
    real_init = output_processor.OutputState.__init__

    def full_path(self, req, tokenizer):
        real_init(self, req, tokenizer)
        made.append(self.tokens_only)
        self.tokens_only = False

    monkeypatch.setattr(output_processor.OutputState, "__init__", full_path)
    full = deltas()
    assert made and all(made)  # every request took the short path in the first run
    assert fast == full
    assert {d["finish_reason"] for d in fast if d["finished"]} == {"length", "stop"}
    assert [d["stop_reason"] for d in fast if d["finished"] and d["request_id"] == "3"] == \
        [probe[2]]
