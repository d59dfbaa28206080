"""replaylm's models against transformers on tiny random Llama, Qwen2 and Qwen3 checkpoints."""

from __future__ import annotations

import torch

from replaylm import LLM, SamplingParams
from replaylm.attention.torch_ref import TorchAttentionBackend
from tests.model_helpers import bound_model, one_request_meta


@torch.no_grad()
def test_logits_match_prefill_and_32_decode_steps(tiny_checkpoint):
    kind, path, ref = tiny_checkpoint
    model = bound_model(path, TorchAttentionBackend())
    blocks = [3, 7, 1, 9, 4, 5]  # scattered, non-monotonic blocks exercise the block table
    prompt = torch.randint(3, 256, (19,), generator=torch.Generator().manual_seed(1))
    hidden = model(prompt, torch.arange(19), one_request_meta(0, 19, blocks))
    ours = model.compute_logits(hidden)
    theirs = ref(prompt[None]).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    seq = prompt.tolist()
    for step in range(32):
        nxt = int(ours[-1].argmax())
        seq.append(nxt)
        pos = len(seq) - 1
        hidden = model(torch.tensor([nxt]), torch.tensor([pos]), one_request_meta(pos, 1, blocks))
        ours = model.compute_logits(hidden)
        theirs = ref(torch.tensor(seq)[None]).logits[0, -1:]
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4, msg=f"{kind} step {step}")


def _hf_greedy(ref, prompt: list[int], n: int) -> list[int]:
    out = ref.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def test_greedy_generation_matches_with_staggered_arrivals(tiny_checkpoint):
    kind, path, ref = tiny_checkpoint
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 17, 33, 2, 40, 11)]
    n_new = 12
    expected = [_hf_greedy(ref, p, n_new) for p in prompts]

    llm = LLM(str(path), dtype="float32", max_num_seqs=4, max_num_batched_tokens=24,
              num_kv_blocks=64, skip_tokenizer_init=True)
    sp = SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True)
    core = llm.engine
    got: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    # Two requests start; the rest arrive one per step while the first ones are mid-decode.
    for _ in range(2):
        i, p = pending.pop(0)
        core.add_request(str(i), p, sp)
    while core.has_unfinished() or pending:
        if pending:
            i, p = pending.pop(0)
            core.add_request(str(i), p, sp)
        for d in core.step():
            got.setdefault(d.request_id, []).extend(d.new_token_ids)
        core.scheduler.check_integrity()
    for i, exp in enumerate(expected):
        assert got[str(i)] == exp, f"{kind} prompt {i}"
    assert core.block_manager.num_used_blocks == 0
