"""LoRA adapters in the engine against PEFT on transformers: greedy output token for token,
one adapter at a time and one batch mixing the base model with three adapters, eagerly and
through the CPU stand-in's graphs (one graph set for every mix)."""

from __future__ import annotations

import pytest

from replaylm import LLM
from replaylm.kernels import ref
from tests.lora.helpers import GREEDY, PROMPTS


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request, lora_setup):
    return lora_setup(request.param)


def engine(base, mode: str, **kw) -> LLM:
    args = dict(enable_lora=True, max_loras=4, max_lora_rank=16, num_kv_blocks=40,
                max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                skip_tokenizer_init=True, attention_backend="torch_dense") | kw
    if mode == "eager":
        return LLM(str(base), enforce_eager=True, **args)
    return LLM(str(base), cuda_graph_mode=mode, graph_tiers="4,16", max_graph_tokens=16,
               graph_check=3, poison_padding=True, **args)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_each_adapter_alone(setup):
    base, loras, expected = setup
    llm = engine(base, "eager")
    for lora in [None, *loras]:
        assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False,
                                   lora_request=lora)) == expected[lora], lora


@pytest.mark.parametrize("mode", ["eager", "full_and_piecewise", "ragged"])
def test_mixed_batch(setup, mode):
    """Base and three adapters in one batch (every prompt under each): the same tokens as
    each alone under PEFT, through one graph set."""
    base, loras, expected = setup
    llm = engine(base, mode)
    choices = [None, *loras]
    prompts, reqs, want = [], [], []
    for i, p in enumerate(PROMPTS):
        for j in range(len(choices)):
            lora = choices[(i + j) % len(choices)]
            prompts.append(p)
            reqs.append(lora)
            want.append(expected[lora][i])
    got = tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=reqs))
    assert got == want
    if mode != "eager":
        hits = llm.graph_stats()["hits"]
        assert sum(hits.values()) > 0, hits


@pytest.mark.parametrize("mode", ["eager", "full_and_piecewise"])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding(setup, mode, method):
    """Drafts come without the adapter (the base model as draft model, or n-grams); the
    verify runs with each request's adapter, so greedy output is still PEFT's."""
    base, loras, expected = setup
    spec = {"method": method, "num_speculative_tokens": 3}
    spec |= {"model": str(base)} if method == "draft_model" else {"prompt_lookup_max": 2}
    llm = engine(base, mode, speculative_config=spec)
    choices = [None, *loras]
    reqs = [choices[i % len(choices)] for i in range(len(PROMPTS))]
    got = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=reqs))
    assert got == [expected[lora][i] for i, lora in enumerate(reqs)]
    if method == "draft_model":  # the base drafts: the adapters' requests reject some
        stats = llm.spec_stats()
        assert stats["draft_tokens"] > 0 and 0 < stats["acceptance_rate"] < 1, stats


def test_over_fp8_weights(setup):
    """Over FP8 projection weights (the adapters stay in the model dtype): base-model
    requests give the FP8 engine's tokens without LoRA, adapter requests their own."""
    base, loras, _ = setup
    plain = engine(base, "eager", quantization="fp8", enable_lora=False)
    want = tokens(plain.generate(PROMPTS, GREEDY, use_tqdm=False))
    llm = engine(base, "eager", quantization="fp8")
    reqs = [None, loras[0], None, loras[1]]
    got = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=reqs))
    assert got[0] == want[0] and got[2] == want[2]
    assert got[1] != want[1] and got[3] != want[3]


class _Recorder:
    """A layer's ``kernels``: the torch references, each call noted as ``(op name, whether it
    got adapters (lora=), silu_out)``."""

    def __init__(self, calls: list[tuple[str, bool, bool]]) -> None:
        self.calls = calls

    def __getattr__(self, name: str):
        op = getattr(ref, name)

        def call(*args, **kw):
            self.calls.append((name, kw.get("lora") is not None, kw.get("silu_out", False)))
            return op(*args, **kw)

        return call


def test_projections_keep_fused_prologues(setup):
    """With LoRA on, every layer runs norm + qkv and norm + gate_up + SiLU·mul as the fused op
    (``norm_linear``: one skinny kernel each at a few rows on CUDA), o and down as plain
    projections, never the separate norm or SiLU·mul; every projection gets its group's
    adapters, which it shrinks itself; the tokens stay PEFT's."""
    base, loras, expected = setup
    llm = engine(base, "eager")
    model = llm.engine.runner.model
    ops: list[tuple[str, bool, bool]] = []
    hooks: list[str] = []
    for layer in model.layers:
        layer.kernels = _Recorder(ops)
        real = layer.lora

        def hook(group, _real=real):
            hooks.append(group)
            return _real(group)

        layer.lora = hook
    reqs = [None, loras[0], loras[1], loras[2]]
    got = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=reqs))
    assert got == [expected[lora][i] for i, lora in enumerate(reqs)]
    projections = [op for op in ops if op[0].endswith("linear")]
    assert {name for name, _, _ in projections} == {"norm_linear", "linear"}
    assert not {"add_rms_norm", "silu_and_mul"} & {name for name, _, _ in ops}
    assert projections and all(with_lora for _, with_lora, _ in projections), ops
    # Per layer and forward: qkv and gate_up (SiLU·mul in its epilogue) fused, o and down.
    assert ops.count(("norm_linear", True, True)) == ops.count(("norm_linear", True, False))
    assert ops.count(("linear", True, False)) == 2 * ops.count(("norm_linear", True, True))
    assert {g: hooks.count(g) for g in set(hooks)} == dict.fromkeys(
        ("qkv", "o", "gate_up", "down"), hooks.count("qkv"))
