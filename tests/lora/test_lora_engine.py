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
    """A layer's ``kernels``: the torch references, each call's op name noted with whether
    it got an adapter delta (``lora=``)."""

    def __init__(self, calls: list[tuple[str, bool]]) -> None:
        self.calls = calls

    def __getattr__(self, name: str):
        op = getattr(ref, name)

        def call(*args, **kw):
            self.calls.append((name, kw.get("lora") is not None))
            return op(*args, **kw)

        return call


def test_projections_keep_fused_prologues(setup):
    """With LoRA on, every layer runs its norm + qkv, norm + gate_up and SiLU·mul + down as
    the fused ops (``norm_linear``, ``silu_linear``: one skinny kernel each at a few rows on
    CUDA), never the separate norm or SiLU·mul; each adapter hook gets the raw rows with its
    prologue (RMSNorm of the residual add for qkv and gate_up, SiLU·mul for down), and every
    projection gets its group's delta; the tokens stay PEFT's."""
    base, loras, expected = setup
    llm = engine(base, "eager")
    model = llm.engine.runner.model
    ops: list[tuple[str, bool]] = []
    hooks: list[tuple[str, bool, bool, bool]] = []
    for layer in model.layers:
        layer.kernels = _Recorder(ops)
        real = layer.lora

        def hook(group, x, residual=None, norm_weight=None, eps=0.0, silu=False, _real=real):
            hooks.append((group, residual is not None, norm_weight is not None, silu))
            return _real(group, x, residual, norm_weight, eps, silu)

        layer.lora = hook
    reqs = [None, loras[0], loras[1], loras[2]]
    got = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=reqs))
    assert got == [expected[lora][i] for i, lora in enumerate(reqs)]
    names = [name for name, _ in ops]
    assert {"norm_linear", "silu_linear"} <= set(names)
    assert not {"add_rms_norm", "silu_and_mul"} & set(names), set(names)
    assert names.count("norm_linear") == 2 * names.count("silu_linear")
    projections = [with_lora for name, with_lora in ops if name.endswith("linear")]
    assert projections and all(projections), ops
    # Layer 0's qkv has no residual yet; every later norm has one.
    assert set(hooks) == {("qkv", False, True, False), ("qkv", True, True, False),
                          ("o", False, False, False), ("gate_up", True, True, False),
                          ("down", False, False, True)}
