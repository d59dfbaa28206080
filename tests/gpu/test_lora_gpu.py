"""LoRA on the GPU: the Triton shrink/expand kernels and ``lora_add`` (plain and with the
RMSNorm prologue, at the 1B and 8B shapes) and the skinny projection with its LoRA epilogue
against the torch references in bf16; a model with an adapter in a slot against the same
model with the adapter merged into its weights (bf16 logits); and the engine's graphs
replaying batches that mix adapters bit-identically to the eager runs of the same padded
batches (``graph_check=1``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replaylm import LLM, LoRARequest, SamplingParams
from replaylm.engine.loading import load_model_config
from replaylm.engine.runner_setup import make_attention_backend
from replaylm.kernels import ref
from replaylm.lora.peft import load_adapter
from replaylm.lora.slots import LoRASlots
from tests.conftest import make_checkpoint
from tests.lora.helpers import ALL, make_adapter
from tests.model_helpers import bound_model, one_request_meta

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEV = torch.device("cuda")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """The tiny llama, three adapters over it, and the first one merged into a checkpoint."""
    base = tmp_path_factory.mktemp("lora-gpu-base")
    make_checkpoint("llama", base, seed=3)
    paths = []
    for i, (r, targets) in enumerate([(16, ALL), (8, ALL), (16, ["q_proj", "v_proj"])]):
        path = tmp_path_factory.mktemp(f"lora-gpu-a{i}")
        peft_model = make_adapter(base, path, r, seed=10 + i, targets=targets)
        if i == 0:
            merged = tmp_path_factory.mktemp("lora-gpu-merged")
            peft_model.merge_and_unload().save_pretrained(str(merged))
        paths.append(path)
    return base, paths, merged


@pytest.mark.parametrize("segments,in_dim", [((2048, 512, 512), 2048), ((8192,), 2048),
                                             ((2048,), 8192)])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_kernels_match_reference_bf16(segments, in_dim, rows):
    from replaylm.kernels import lora

    g = torch.Generator(device=DEV).manual_seed(rows)
    slots_n, rank = 4, 16
    a = torch.randn(slots_n, len(segments) * rank, in_dim, device=DEV, generator=g,
                    dtype=torch.bfloat16) * 0.05
    b = torch.randn(slots_n, sum(segments), rank, device=DEV, generator=g,
                    dtype=torch.bfloat16) * 0.05
    ranks = torch.tensor([16, 8, 0, 16], dtype=torch.int32, device=DEV)
    a[1, :, :][torch.arange(a.shape[1], device=DEV) % rank >= 8] = 0  # rank 8: padded
    b[1, :, 8:] = 0
    scales = torch.tensor([2.0, 0.5, 1.0, 1.0], device=DEV)
    x = torch.randn(rows, in_dim, device=DEV, generator=g, dtype=torch.bfloat16)
    y = torch.randn(rows, sum(segments), device=DEV, generator=g, dtype=torch.bfloat16)
    tokens = torch.randint(-1, slots_n, (rows,), device=DEV, generator=g, dtype=torch.int32)
    want = ref.lora_expand(y.clone(), ref.lora_shrink(x, a, tokens, ranks), b, tokens, ranks,
                           scales, segments)
    got = lora.lora_expand(y.clone(), lora.lora_shrink(x, a, tokens, ranks, len(segments)), b,
                           tokens, ranks, scales, segments)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    untouched = (tokens < 0) | (tokens == 2)
    assert torch.equal(got[untouched], y[untouched])


# (segments, in_dim, prologue) of each group at Llama-3.2-1B's and Llama-3-8B's shapes: down
# shrinks the activated rows gate_up's epilogue stored, as a plain projection.
GROUP_SHAPES = {
    "1b-qkv": ((2048, 512, 512), 2048, "norm"), "1b-o": ((2048,), 2048, "plain"),
    "1b-gate_up": ((8192, 8192), 2048, "norm"), "1b-down": ((2048,), 8192, "plain"),
    "8b-qkv": ((4096, 1024, 1024), 4096, "norm"), "8b-o": ((4096,), 4096, "plain"),
    "8b-gate_up": ((14336, 14336), 4096, "norm"), "8b-down": ((4096,), 14336, "plain"),
}


# Every group at one row and rank 16 (decode), then ranks 8 and 16 at more rows.
LORA_CASES = ([(g, 16, 1) for g in GROUP_SHAPES]
              + [("1b-qkv", 8, 5), ("8b-down", 8, 40), ("1b-gate_up", 16, 40)])


@pytest.mark.parametrize("group,max_rank,rows", LORA_CASES)
def test_lora_add_with_prologues_bf16(group, max_rank, rows):
    """``lora_add`` (shrink over K ranges, then expand) with each group's prologue against
    ``ref.lora_add`` in bf16: four slots (full rank, half rank, empty, full rank) and base
    rows (-1) mixed; base and empty-slot rows untouched to the bit."""
    from replaylm.kernels import lora

    segments, in_dim, prologue = GROUP_SHAPES[group]
    g = torch.Generator(device=DEV).manual_seed(rows * 31 + max_rank)
    bf16 = torch.bfloat16
    slots_n, half = 4, max_rank // 2
    a = torch.randn(slots_n, len(segments) * max_rank, in_dim, device=DEV, generator=g,
                    dtype=bf16) * in_dim**-0.5
    b = torch.randn(slots_n, sum(segments), max_rank, device=DEV, generator=g, dtype=bf16) * 0.1
    a[1, torch.arange(a.shape[1], device=DEV) % max_rank >= half] = 0  # slot 1: rank/2
    b[1, :, half:] = 0
    ranks = torch.tensor([max_rank, half, 0, max_rank], dtype=torch.int32, device=DEV)
    scales = torch.tensor([2.0, 0.5, 1.0, 1.0], device=DEV)
    x = torch.randn(rows, in_dim, device=DEV, generator=g, dtype=bf16)
    kw = {}
    if prologue == "norm":
        kw = {"norm_weight": torch.rand(in_dim, device=DEV, generator=g).to(bf16) + 0.5,
              "eps": 1e-5}
    y = torch.randn(rows, sum(segments), device=DEV, generator=g, dtype=bf16)
    tokens = torch.randint(-1, slots_n, (rows,), device=DEV, generator=g, dtype=torch.int32)
    tokens[0] = 0 if rows > 1 else 3
    if rows > 1:
        tokens[1] = -1
    want = ref.lora_add(y.clone(), x, a, b, tokens, ranks, scales, segments, **kw)
    got = lora.lora_add(y.clone(), x, a, b, tokens, ranks, scales, segments, **kw)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    untouched = (tokens < 0) | (tokens == 2)
    assert torch.equal(got[untouched], y[untouched])
    assert not torch.equal(got[~untouched], y[~untouched])  # the adapters changed something


# (group, rows): every prologue; one row (decode), and three rows on a live slot, slot -1
# and an empty slot in one tile.
FOLD_CASES = [("1b-qkv", 1), ("1b-o", 1), ("1b-down", 1), ("1b-gate_up", 3)]


@pytest.mark.parametrize("rows", [1, 3])
def test_folded_gate_up_with_silu_pairs_bf16(rows):
    """gate_up with its delta folded and SiLU·mul of its paired rows in the epilogue, at the
    1B's shape in bf16: bit for bit ``silu_and_mul`` of the folded projection."""
    from replaylm.kernels import elementwise, lora, skinny, skinny_lora

    segments, in_dim, _ = GROUP_SHAPES["1b-gate_up"]
    g = torch.Generator(device=DEV).manual_seed(rows)
    bf16, rank, n = torch.bfloat16, 16, sum(segments)
    a = torch.randn(4, 2 * rank, in_dim, device=DEV, generator=g, dtype=bf16) * in_dim**-0.5
    b = torch.randn(4, n, rank, device=DEV, generator=g, dtype=bf16) * 0.1
    ranks = torch.tensor([rank, rank, 0, rank], dtype=torch.int32, device=DEV)
    scales = torch.tensor([2.0, 0.5, 1.0, 1.0], device=DEV)
    w = torch.randn(n, in_dim, device=DEV, generator=g, dtype=bf16) * in_dim**-0.5
    x = torch.randn(rows, in_dim, device=DEV, generator=g, dtype=bf16)
    res = torch.randn(rows, in_dim, device=DEV, generator=g, dtype=bf16)
    nw = torch.rand(in_dim, device=DEV, generator=g).to(bf16) + 0.5
    tokens = torch.tensor([3, -1, 2][:rows], dtype=torch.int32, device=DEV)
    config = skinny.pick_config(rows, n, in_dim)
    parts = lora.lora_shrink(x, a, tokens, ranks, 2, norm_weight=nw, eps=1e-5, residual=res)
    delta = ref.LoRADelta(parts, b, tokens, ranks, scales, segments)
    y, _ = skinny_lora.lora_norm_linear(x, res, nw, 1e-5, w, None, delta, config)
    got, _ = skinny_lora.lora_norm_linear(x, res, nw, 1e-5, w, None, delta, config,
                                          silu_pairs=True)
    assert torch.equal(got, elementwise.silu_and_mul(y))


@pytest.mark.parametrize("group,rows", FOLD_CASES)
def test_folded_projection_bf16(group, rows):
    """The skinny projection with its LoRA epilogue (``kernels.skinny_lora``) against the
    folded reference (``ref.lora_linear``) in bf16, on the tile ``pick_config`` gives; rows
    without an adapter, and a step of base rows only, bit-identical to the plain skinny
    kernel's."""
    from replaylm.kernels import lora, skinny, skinny_lora

    segments, in_dim, prologue = GROUP_SHAPES[group]
    g = torch.Generator(device=DEV).manual_seed(rows * 7 + len(segments))
    bf16, rank, n = torch.bfloat16, 16, sum(segments)
    a = torch.randn(4, len(segments) * rank, in_dim, device=DEV, generator=g,
                    dtype=bf16) * in_dim**-0.5
    b = torch.randn(4, n, rank, device=DEV, generator=g, dtype=bf16) * 0.1
    ranks = torch.tensor([rank, rank, 0, rank], dtype=torch.int32, device=DEV)
    scales = torch.tensor([2.0, 0.5, 1.0, 1.0], device=DEV)
    w = torch.randn(n, in_dim, device=DEV, generator=g, dtype=bf16) * in_dim**-0.5
    x = torch.randn(rows, in_dim, device=DEV, generator=g, dtype=bf16)
    res = torch.randn(rows, in_dim, device=DEV, generator=g, dtype=bf16)
    nw = torch.rand(in_dim, device=DEV, generator=g).to(bf16) + 0.5
    shrink_kw = {}
    if prologue == "norm":
        shrink_kw = {"norm_weight": nw, "eps": 1e-5, "residual": res}
    config = skinny.pick_config(rows, n, in_dim)

    def project(tokens, folded: bool):
        parts = lora.lora_shrink(x, a, tokens, ranks, len(segments), **shrink_kw)
        delta = ref.LoRADelta(parts, b, tokens, ranks, scales, segments)
        if prologue == "norm":
            if folded:
                return skinny_lora.lora_norm_linear(x, res, nw, 1e-5, w, None, delta, config)[0]
            return skinny.skinny_norm_linear(x, res, nw, 1e-5, w, config=config)[0]
        return (skinny_lora.lora_linear(x, w, None, delta, config) if folded
                else skinny.skinny_linear(x, w, config=config))

    tokens = torch.tensor([3, -1, 2][:rows], dtype=torch.int32, device=DEV)
    got, plain = project(tokens, True), project(tokens, False)
    delta = ref.LoRAGroup(a, b, tokens, ranks, scales, segments, ref.lora_shrink)
    if prologue == "norm":
        want = ref.norm_linear(x, res, nw, 1e-5, w, lora=delta)[0]
    else:
        want = ref.linear(x, w, lora=delta)
    torch.testing.assert_close(got[:1], want[:1], rtol=2e-2, atol=2e-2)
    assert not torch.equal(got[:1], plain[:1])
    assert torch.equal(got[1:], plain[1:])
    base = torch.full((rows,), -1, dtype=torch.int32, device=DEV)
    assert torch.equal(project(base, True), plain)


@torch.no_grad()
def test_bf16_logits_against_merged_weights(adapters):
    base, paths, merged = adapters
    cfg, _ = load_model_config(str(base))
    backend = make_attention_backend("triton", DEV, "eager")
    model = bound_model(base, backend, torch.bfloat16, DEV)
    model.use_fused_kernels(True)
    slots = LoRASlots(cfg, 2, 16, 256, torch.bfloat16, DEV)
    for layer, hook in zip(model.layers, slots.hooks()):
        layer.lora = hook
    slots.load(1, load_adapter(LoRARequest("a", 1, str(paths[0])), cfg, 16, torch.bfloat16))
    reference = bound_model(merged, backend, torch.bfloat16, DEV)
    reference.use_fused_kernels(True)
    plain = bound_model(base, backend, torch.bfloat16, DEV)
    plain.use_fused_kernels(True)
    blocks = [3, 7, 1, 9]
    for n in (21, 1, 4):  # a prefill, then few-row steps (the skinny paths)
        prompt = torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n))
        slots.set_step(np.array([1], np.int32), np.array([0, n], np.int32))
        meta = one_request_meta(0, n, blocks, DEV)
        pos = torch.arange(n, device=DEV)
        ours = model.compute_logits(model(prompt.to(DEV), pos, meta)).float()
        theirs = reference.compute_logits(reference(prompt.to(DEV), pos, meta)).float()
        assert (ours - theirs).abs().max() < 0.03 * theirs.abs().max() + 0.02
        # Slot -1: the base model's logits, to the bit (the same fused projections run, and
        # the LoRA kernels leave the rows of slot -1 as they are).
        slots.set_step(np.array([-1], np.int32), np.array([0, n], np.int32))
        base_ours = model.compute_logits(model(prompt.to(DEV), pos, meta)).float()
        base_theirs = plain.compute_logits(plain(prompt.to(DEV), pos, meta)).float()
        assert torch.equal(base_ours, base_theirs)


@pytest.mark.parametrize("mode", ["full_and_piecewise", "ragged", "piecewise"])
def test_graphs_replay_mixed_adapters_bit_identically(adapters, mode):
    """Every graph step is re-run eagerly on the same padded batch and compared bit for bit
    (``graph_check=1``), with the base and three adapters mixed, over two slots (swaps)."""
    base, paths, _ = adapters
    loras = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=16, num_kv_blocks=128,
              max_model_len=128, skip_tokenizer_init=True, max_num_seqs=16,
              max_graph_tokens=64, cuda_graph_mode=mode, graph_check=1, poison_padding=True)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[5 + i, 6, 7 + 2 * i, 9] * (1 + i % 3) for i in range(16)]
    choices = [None, *loras]
    reqs = [choices[i % 4] for i in range(16)]
    outs = llm.generate(prompts, sp, use_tqdm=False, lora_request=reqs)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    stats = llm.graph_stats()
    assert stats["checks"] > 0 and sum(stats["hits"].values()) > 0, stats
    assert llm.engine.lora.loads >= 3  # three adapters through two slots


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tensor_parallel_graphs_with_mixed_adapters(adapters):
    """Two ranks, adapters sharded, slots changing mid-run: every graph step checked bit for
    bit against its eager run on each rank's shard."""
    base, paths, _ = adapters
    loras = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    with LLM(str(base), tensor_parallel_size=2, enable_lora=True, max_loras=2,
             max_lora_rank=16, num_kv_blocks=128, max_model_len=128, skip_tokenizer_init=True,
             max_num_seqs=16, max_graph_tokens=64, graph_check=1) as llm:
        sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        prompts = [[5 + i, 6, 7 + 2 * i, 9] * (1 + i % 3) for i in range(16)]
        reqs = [[None, *loras][i % 4] for i in range(16)]
        outs = llm.generate(prompts, sp, use_tqdm=False, lora_request=reqs)
        assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
        assert llm.graph_stats()["checks"] > 0
