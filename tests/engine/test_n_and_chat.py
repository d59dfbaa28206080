"""n > 1 siblings (shared prompt blocks, own seed streams) and ``LLM.chat``."""

from __future__ import annotations

import pytest
import torch

from replaylm import LLM, SamplingParams
from replaylm.sampling_params import sibling_seed


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tests.conftest import make_checkpoint

    path = tmp_path_factory.mktemp("n-llama")
    make_checkpoint("llama", path, seed=8)
    return path


PROMPT = list(range(40, 90))  # 50 tokens: 3 full blocks to share


@pytest.mark.parametrize("caching", [True, False])
def test_siblings_share_blocks_and_differ(ckpt, caching) -> None:
    llm = LLM(str(ckpt), num_kv_blocks=64, skip_tokenizer_init=True,
              enable_prefix_caching=caching)
    core = llm.engine
    sp = SamplingParams(n=3, temperature=1.0, seed=99, max_tokens=12, ignore_eos=True)
    core.add_request("r", PROMPT, sp)
    outs: dict[int, list[int]] = {0: [], 1: [], 2: []}
    max_shared = 0
    while core.has_unfinished():
        for d in core.step():
            assert d.request_id == "r"
            outs[d.index] += d.new_token_ids
        core.scheduler.check_integrity()
        leader_blocks = core.requests["r"][0].block_ids if "r" in core.requests else []
        if leader_blocks:
            max_shared = max(max_shared, core.block_manager._refcount[leader_blocks[0]])
    assert max_shared == 3  # all three siblings hold the prompt's first block
    assert core.block_manager.num_used_blocks == 0
    assert len({tuple(v) for v in outs.values()}) == 3
    # Each sibling is the request it would be alone with its derived seed.
    for i in range(3):
        alone = SamplingParams(temperature=1.0, seed=sibling_seed(99, i), max_tokens=12,
                               ignore_eos=True)
        assert llm.generate([PROMPT], alone, use_tqdm=False)[0].outputs[0].token_ids == outs[i]
    res = llm.generate([PROMPT, [5, 6]], sp, use_tqdm=False)
    assert [c.index for c in res[0].outputs] == [0, 1, 2]
    assert [c.token_ids for c in res[0].outputs] == [outs[0], outs[1], outs[2]]


def test_abort_parent_aborts_all_siblings(ckpt) -> None:
    llm = LLM(str(ckpt), num_kv_blocks=64, skip_tokenizer_init=True)
    core = llm.engine
    core.add_request("r", PROMPT, SamplingParams(n=4, max_tokens=20, ignore_eos=True))
    for _ in range(3):
        core.step()
    assert core.abort("r") and not core.abort("r")
    core.scheduler.check_integrity()
    while core.has_unfinished():  # a launched step still holds the blocks (overlap)
        assert core.step() == []
    assert core.block_manager.num_used_blocks == 0
    core.scheduler.check_integrity()
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=2, best_of=4)
    core.add_request("x#1", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        core.add_request("x", [1, 2], SamplingParams(n=2, max_tokens=2))


@pytest.fixture(scope="module")
def default_llm():
    return LLM("default", num_kv_blocks=64, max_num_seqs=4, max_model_len=256)


CONV = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."}]


def test_chat_equals_generate_on_the_rendered_template(default_llm) -> None:
    tok = default_llm.get_tokenizer()
    text = tok.apply_chat_template(CONV, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id  # one BOS, not two
    assert text.endswith("<|im_start|>assistant\n")
    sp = SamplingParams(temperature=0.0, max_tokens=10)
    want = default_llm.generate([ids], sp, use_tqdm=False)[0]
    got = default_llm.chat(CONV, sp, use_tqdm=False)
    assert len(got) == 1 and got[0].prompt_token_ids == ids
    assert got[0].outputs[0].token_ids == want.outputs[0].token_ids
    two = default_llm.chat([CONV, CONV[1:]], sp, use_tqdm=False)
    assert len(two) == 2 and two[0].outputs[0].token_ids == want.outputs[0].token_ids
    no_prompt = default_llm.chat(CONV, sp, use_tqdm=False, add_generation_prompt=False)
    assert len(no_prompt[0].prompt_token_ids) < len(ids)
    custom = default_llm.chat(CONV, sp, use_tqdm=False,
                              chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert custom[0].prompt_token_ids == tok.encode("You are terse.Name a colour.",
                                                    add_special_tokens=False)
    with pytest.raises(ValueError, match="conversation 0"):
        default_llm.chat([[]], sp, use_tqdm=False)


def test_all_features_under_a_tiny_pool(ckpt) -> None:
    """Every feature at once, with chunked prefill, preemption and eviction, matches a roomy
    engine token for token."""
    g = torch.Generator().manual_seed(5)
    base = torch.randint(3, 256, (30,), generator=g).tolist()
    prompts = [base + torch.randint(3, 256, (k,), generator=g).tolist() for k in (3, 9, 17, 2)]
    params = [
        SamplingParams(n=2, temperature=0.9, seed=1, max_tokens=16, ignore_eos=True,
                       presence_penalty=0.5, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.4,
                       prompt_logprobs=1, min_p=0.05),
        SamplingParams(temperature=0.7, seed=3, max_tokens=16, min_tokens=6,
                       logit_bias={7: 2.0}, frequency_penalty=0.4),
        SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=10, ignore_eos=True),
    ]

    def run(**kw):
        llm = LLM(str(ckpt), skip_tokenizer_init=True, **kw)
        outs = llm.generate(prompts, params, use_tqdm=False)
        llm.engine.scheduler.check_integrity()
        assert llm.engine.block_manager.num_used_blocks == 0
        return llm, [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs], outs

    _, want, want_outs = run(num_kv_blocks=256)
    tiny, got, got_outs = run(num_kv_blocks=8, max_num_seqs=4, max_num_batched_tokens=16,
                              max_model_len=112)
    assert tiny.stats().preemptions > 0
    assert got == want
    for a, b in zip(got_outs[0].outputs[0].logprobs, want_outs[0].outputs[0].logprobs):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
    assert len(got_outs[1].prompt_logprobs) == len(prompts[1])


@pytest.mark.parametrize("mode", ["full", "piecewise", "ragged"])
def test_features_under_graph_modes_match_eager(ckpt, mode) -> None:
    """Logit processing, logprobs, prompt logprobs (an eager fallback), n > 1 and prefix
    caching behave the same when the forward runs as (stand-in) graph replays."""
    g = torch.Generator().manual_seed(6)
    base = torch.randint(3, 256, (20,), generator=g).tolist()
    prompts = [base + [9], base + [10, 11], base]
    params = [
        SamplingParams(n=2, temperature=0.8, seed=2, max_tokens=10, ignore_eos=True,
                       frequency_penalty=0.6, logprobs=1),
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, prompt_logprobs=1,
                       repetition_penalty=1.2, logit_bias={4: 1.0}),
        SamplingParams(temperature=0.6, seed=9, max_tokens=10, min_p=0.1, min_tokens=3),
    ]
    args = dict(num_kv_blocks=24, max_num_seqs=6, max_num_batched_tokens=40, max_model_len=128,
                max_graph_tokens=32, skip_tokenizer_init=True, attention_backend="torch_dense")

    def run(**kw):
        llm = LLM(str(ckpt), **(args | kw))
        outs = llm.generate(prompts, params, use_tqdm=False)
        return llm, [[c.token_ids for c in o.outputs] for o in outs]

    _, want = run(enforce_eager=True)
    llm, got = run(cuda_graph_mode=mode, graph_check=1, poison_padding=True)
    assert got == want
    assert sum(llm.graph_stats()["hits"].values()) > 0
