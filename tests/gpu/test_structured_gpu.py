"""Structured outputs on CUDA: the Triton bitmask kernel against the torch reference, and
constrained requests in every graph mode (real graphs, graph_check on): a constrained step
replays its forward, then its tail graph once the masks are filled, bit-identical to the
eager run of the same padded batch, padding poisoned."""

from __future__ import annotations

import json
import re

import pytest
import torch

from replaylm import LLM, SamplingParams, StructuredOutputsParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitmask_kernel_matches_reference(dtype):
    from replaylm.sampling.bitmask import apply_token_bitmask, bitmask_words

    g = torch.Generator().manual_seed(0)
    vocab, rows = 151_936, 40
    mask = torch.randint(-2**31, 2**31 - 1, (9, bitmask_words(vocab)), generator=g,
                         dtype=torch.int64).to(torch.int32)
    flags = torch.tensor([1, 0, 1, 0, 1, 0, 1, 1, 0], dtype=torch.int32)
    slots = torch.randint(0, 9, (rows,), generator=g)
    logits = torch.randn(rows, vocab, generator=g).to(dtype)
    want = apply_token_bitmask(logits.clone(), mask, flags, slots)  # the CPU reference
    got = apply_token_bitmask(logits.cuda(), mask.cuda(), flags.cuda(), slots.cuda())
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("mode", ["full", "ragged", "piecewise"])
def test_constrained_requests_replay_graphs(mode):
    llm = LLM("default", cuda_graph_mode=mode, max_num_seqs=16, max_model_len=128,
              max_graph_tokens=64, graph_check=3)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 99}}, "required": ["n"]}
    so = [StructuredOutputsParams(json=schema), StructuredOutputsParams(regex="[a-z]{3}"),
          StructuredOutputsParams(choice=["yes", "no"])]
    free = [SamplingParams(temperature=1.0, seed=i, max_tokens=16, ignore_eos=True)
            for i in range(4)]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=24, structured_outputs=k)
              for k in so for s in range(4)]
    outs = llm.generate(["hi"] * (len(free) + len(params)), free + params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs[len(free):]]
    for t in texts[:4]:
        assert 0 <= json.loads(t)["n"] <= 99
    assert all(re.fullmatch("[a-z]{3}", t) for t in texts[4:8])
    assert all(t in ("yes", "no") for t in texts[8:])
    # Token identity of the free requests against a run without the constrained ones is the
    # CPU suite's (tests/structured): on the GPU another batch shape may pick other kernels.
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs[: len(free)])
    stats = llm.graph_stats()
    assert stats["hits"] and not any("structured" in r for r in stats["fallbacks"])


@pytest.mark.parametrize("mode", ["full", "ragged", "piecewise", "full_and_piecewise"])
def test_split_constrained_steps_are_bit_identical_to_eager(mode):
    """graph_check=1: every replayed step, constrained or not, is re-run eagerly on the same
    padded batch and must match bit for bit (the step graph, then the tail graph after the
    masks were filled); poison_padding: no padding reaches a real row. Greedy constrained
    requests beside greedy and sampled free ones; the tail graphs replay for constrained
    steps only."""
    llm = LLM("default", cuda_graph_mode=mode, max_num_seqs=16, max_model_len=128,
              max_graph_tokens=64, graph_check=1, poison_padding=True)
    whole = llm.engine.runner.graphs.whole
    tails = list(whole.tails.values()) if whole is not None else []
    replays: list[str] = []
    for g in tails:
        g.replay = (lambda g=g, real=g.replay: (replays.append(g.name), real())[1])
    so = [StructuredOutputsParams(regex="[a-z]{3}-[0-9]{2}"),
          StructuredOutputsParams(choice=["yes", "no"]),
          StructuredOutputsParams(grammar='root ::= "(" [0-9] ("+" [0-9]){0,3} ")"')]
    free = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
            SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True)]
    params = [SamplingParams(temperature=t, seed=s, max_tokens=16, structured_outputs=k)
              for k in so for t, s in ((0.0, 0), (1.0, 1))]
    outs = llm.generate(["hi", "yo"] + ["go"] * len(params), free + params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs[len(free):]]
    assert all(re.fullmatch("[a-z]{3}-[0-9]{2}", t) for t in texts[:2]), texts
    assert all(t in ("yes", "no") for t in texts[2:4]), texts
    assert all(re.fullmatch(r"\([0-9](\+[0-9]){0,3}\)", t) for t in texts[4:]), texts
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs[: len(free)])
    stats = llm.graph_stats()
    assert stats["hits"] and stats["checks"] > 0, stats
    assert stats["num_graphs"] == len(llm.engine.runner.graphs.captured())
    if whole is not None:
        assert replays, "no constrained step replayed a tail graph"
        assert all(n == 2 for n in stats["tail_nodes"].values()), stats["tail_nodes"]
        seen = len(replays)
        llm.generate(["free"], free[:1], use_tqdm=False)  # no constrained row: no tail
        assert len(replays) == seen
