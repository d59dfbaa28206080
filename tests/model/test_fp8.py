"""FP8 weights end to end on the CPU (``quantization="fp8"``, compressed-tensors checkpoints):
what is quantized and how (per output row, per tensor-parallel slice), logits against the
unquantized model, greedy generation in every graph mode, in-place updates, draft models,
and the start-up errors for checkpoints replaylm does not read."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from replaylm import LLM, SamplingParams
from replaylm.engine.loading import load_model_config
from replaylm.graphs.policy import GRAPH_MODES
from replaylm.kernels import ref
from replaylm.model.compressed_tensors import fp8_scheme, parse
from replaylm.model.loader import checkpoint_files, load_model
from replaylm.model.parallel import TensorParallel, shard_config
from replaylm.model.quant import Fp8Scheme
from tests.conftest import make_checkpoint

FP8 = torch.float8_e4m3fn
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPTS = [[3, 17, 99, 4, 250, 31], [5, 9, 200]]
#: The checkpoint modules a compressed-tensors FP8 export quantizes (``Linear`` targets,
#: the LM head and MoE routers ignored).
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _ct_config(strategy: str = "channel", **weights) -> dict:
    """A compressed-tensors ``quantization_config`` as llm-compressor's FP8_DYNAMIC scheme
    writes it."""
    return {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "quantization_status": "compressed", "ignore": ["lm_head", "re:.*mlp.gate$",
                                                         "re:.*shared_expert_gate$"],
        "config_groups": {"group_0": {
            "targets": ["Linear"], "output_activations": None, "format": None,
            "weights": {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
                        "strategy": strategy, "dynamic": False} | weights,
            "input_activations": {"num_bits": 8, "type": "float", "symmetric": True,
                                  "group_size": None, "strategy": "token", "dynamic": True}}},
    }


def _write_ct(src, dst, strategy: str = "channel") -> None:
    """``src``'s checkpoint as a compressed-tensors FP8 one at ``dst``: each quantized
    projection's weight as e4m3 with its float32 ``weight_scale`` (per row ``[N, 1]``, the
    rule of ``quantization="fp8"``; or one per tensor)."""
    shutil.copytree(src, dst)
    for f in checkpoint_files(dst):
        tensors = load_file(str(f))
        out = {}
        for name, t in tensors.items():
            module = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
            if module not in QUANTIZED:
                out[name] = t
                continue
            if strategy == "channel":
                q, scale = ref.quantize_fp8(t)
                scale = scale[:, None]
            else:
                scale = (t.float().abs().amax() / 448).reshape(1)
                q = (t.float() / scale).clamp(-448, 448).to(FP8)
            out[name], out[name + "_scale"] = q, scale.float()
        save_file(out, str(f), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = _ct_config(strategy)
    (dst / "config.json").write_text(json.dumps(config))


def _load(path, fp8: Fp8Scheme | None, tp: TensorParallel | None = None):
    cfg, _ = load_model_config(str(path))
    local = shard_config(cfg, tp.size) if tp is not None else cfg
    return load_model(local, path, "auto", torch.float32, torch.device("cpu"), 0, tp, cfg,
                      fp8=fp8)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8-llama")
    make_checkpoint("llama", path)
    return path


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8-moe")
    make_checkpoint("qwen2_moe", path)
    return path


def _kw(mode: str) -> dict:
    kw = dict(num_kv_blocks=16, max_num_seqs=4, max_num_batched_tokens=48, max_model_len=48,
              skip_tokenizer_init=True, attention_backend="torch_dense")
    if mode == "eager":
        return kw | dict(enforce_eager=True)
    return kw | dict(cuda_graph_mode=mode, graph_tiers="4,16", max_graph_tokens=16,
                     graph_check=2, poison_padding=True)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("lm_head", [False, True])
def test_projections_quantized_per_row(llama, lm_head):
    """Every projection (not embedding, norms or, by default, the LM head) holds e4m3 with
    its float32 scales, and dequantizes to the checkpoint's weight within e4m3's step."""
    plain = _load(llama, None)
    model = _load(llama, Fp8Scheme(lm_head=lm_head))
    params = dict(model.named_parameters())
    fp8 = {n for n, p in params.items() if p.dtype == FP8}
    assert fp8 == {f"layers.{i}.{m}.weight" for i in range(2)
                   for m in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")} \
        | ({"lm_head.weight"} if lm_head else set())
    for name in fp8:
        w, scale = params[name], params[name + "_scale"]
        assert scale.dtype == torch.float32 and scale.shape == w.shape[:1]
        want = dict(plain.named_parameters())[name]
        assert torch.equal(w, ref.quantize_fp8(want)[0])
        torch.testing.assert_close(ref.dequantize(w, scale, torch.float32), want, rtol=0.07,
                                   atol=1e-3)
    assert model.embed_tokens.weight.dtype == torch.float32


@pytest.mark.parametrize("kind", ["llama", "moe"])
def test_logits_close_to_the_unquantized_model(llama, moe, kind):
    """Per-channel e4m3 keeps every position's logits at cosine >= 0.99 of the fp32
    model's (MoE: routed and shared experts quantized too)."""
    path = llama if kind == "llama" else moe
    ids = torch.tensor(PROMPTS[0])
    logits = []
    for fp8 in (None, Fp8Scheme()):
        model = _load(path, fp8)
        logits.append(_full_logits(model, ids))
    if kind == "moe":
        assert dict(model.named_parameters())["layers.0.moe.experts_gate_up"].dtype == FP8
    cos = torch.nn.functional.cosine_similarity(logits[0], logits[1], dim=-1)
    assert cos.min() >= 0.99, cos


def _full_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits of every position of one prompt (a fresh KV pool, the torch backend)."""
    from replaylm.attention.torch_ref import TorchAttentionBackend
    from tests.model_helpers import one_request_meta

    cfg = model.cfg
    pool = torch.zeros(cfg.num_layers, 2, 4, 16, cfg.num_kv_heads, cfg.head_dim)
    model.bind(TorchAttentionBackend(), [(pool[i, 0], pool[i, 1])
                                         for i in range(cfg.num_layers)], 64)
    n = ids.shape[0]
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(n),
                                          one_request_meta(0, n, [1, 2])))


@pytest.mark.parametrize("mode", ["eager", *[m for m in GRAPH_MODES if m != "eager"]])
def test_greedy_generation_in_every_graph_mode(llama, mode):
    """The FP8 engine generates the same tokens in every graph mode (CPU stand-in, with
    padding poisoned and graph replays checked bit for bit against eager runs)."""
    eager = _tokens(LLM(str(llama), quantization="fp8", **_kw("eager")))
    assert _tokens(LLM(str(llama), quantization="fp8", **_kw(mode))) == eager


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_compressed_tensors_checkpoint(llama, tmp_path, strategy):
    """A compressed-tensors FP8 checkpoint loads as stored: per channel, exactly the weights
    and scales ``quantization="fp8"`` makes of the original (so the same tokens); per
    tensor, the one scale on every row. Its ignored LM head stays in the model dtype."""
    ct = tmp_path / "ct"
    _write_ct(llama, ct, strategy)
    cfg, _ = load_model_config(str(ct))
    scheme = fp8_scheme(cfg, ct, None, False)
    assert scheme == Fp8Scheme(lm_head=False, checkpoint=True)
    loaded = dict(_load(ct, scheme).named_parameters())
    quantized = dict(_load(llama, Fp8Scheme()).named_parameters())
    assert loaded.keys() == quantized.keys()
    assert loaded["lm_head.weight"].dtype == torch.float32
    if strategy == "channel":
        for name, p in quantized.items():
            assert torch.equal(loaded[name].float(), p.float()), name
        assert _tokens(LLM(str(ct), **_kw("eager"))) \
            == _tokens(LLM(str(llama), quantization="fp8", **_kw("eager")))
    else:
        scale = loaded["layers.0.o_proj.weight_scale"]
        assert torch.all(scale == scale[0])


def test_compressed_tensors_moe_checkpoint(moe, tmp_path):
    """Per-expert FP8 tensors and scales pack into the experts' tensors; the routers stay
    in the model dtype (ignored)."""
    ct = tmp_path / "ct-moe"
    _write_ct(moe, ct)
    cfg, _ = load_model_config(str(ct))
    loaded = dict(_load(ct, fp8_scheme(cfg, ct, None, False)).named_parameters())
    quantized = dict(_load(moe, Fp8Scheme()).named_parameters())
    for name in ("layers.0.moe.experts_gate_up", "layers.0.moe.experts_down_scale",
                 "layers.0.moe.shared_gate_up.weight_scale"):
        assert torch.equal(loaded[name].float(), quantized[name].float()), name
    assert loaded["layers.0.moe.gate.weight"].dtype == torch.float32


def test_compressed_tensors_config_matches_the_package():
    """The config the tests write is what the compressed-tensors package reads as its
    FP8_DYNAMIC scheme (when the package is installed)."""
    ct = pytest.importorskip("compressed_tensors.quantization")
    config = ct.QuantizationConfig.model_validate(_ct_config())
    scheme = ct.preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])
    assert config.config_groups["group_0"].weights == scheme.weights
    assert config.config_groups["group_0"].input_activations == scheme.input_activations
    assert parse(json.loads(config.model_dump_json())) == _ct_config()["ignore"]


@pytest.mark.parametrize("change,field", [
    ({"quant_method": "fp8"}, "quant_method"),
    ({"format": "pack-quantized"}, "format"),
    ({"kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme"),
    ({"weights": {"num_bits": 4, "type": "int"}}, "weights.num_bits"),
    ({"weights": {"strategy": "block", "block_structure": [128, 128]}},
     "weights.block_structure"),
    ({"weights": {"strategy": "group", "group_size": 128}}, "weights.group_size"),
    ({"weights": {"strategy": "group"}}, "weights.strategy"),
    ({"acts": {"strategy": "tensor", "dynamic": False}}, "input_activations.strategy"),
    ({"ignore": ["model.layers.0.self_attn.q_proj"]}, "ignore"),
])
def test_unsupported_checkpoints_are_refused_at_start_up(llama, tmp_path, change, field):
    ct = tmp_path / "bad"
    _write_ct(llama, ct)
    config = json.loads((ct / "config.json").read_text())
    qc = config["quantization_config"]
    group = qc["config_groups"]["group_0"]
    for key, value in change.items():
        if key == "weights":
            group["weights"] |= value
        elif key == "acts":
            group["input_activations"] |= value
        else:
            qc[key] = value
    (ct / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"quantization_config.*{field.split('.')[-1]}"):
        LLM(str(ct), **_kw("eager"))


def test_fp8_tensor_into_an_unquantized_model_is_refused(llama, tmp_path):
    """An FP8 tensor for a module the model holds in its dtype (a router, an LM head the
    config ignores) is an error naming it, never a silent cast."""
    ct = tmp_path / "ct"
    _write_ct(llama, ct)
    f = checkpoint_files(ct)[0]
    tensors = load_file(str(f))
    tensors["lm_head.weight"] = tensors["lm_head.weight"].to(FP8)
    save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lm_head.weight is FP8"):
        LLM(str(ct), **_kw("eager"))


def test_settings_are_checked():
    from replaylm.config import EngineArgs

    with pytest.raises(ValueError, match="quantization='int4'"):
        EngineArgs(quantization="int4")
    with pytest.raises(ValueError, match="quantize_lm_head=True needs quantization"):
        EngineArgs(quantize_lm_head=True)


@pytest.mark.parametrize("size", [2])
def test_tensor_parallel_ranks_quantize_their_slices(llama, size):
    """Column-parallel ranks hold their rows of the whole weight's quantization (a row's
    scale is its own); a row-parallel rank's scales are those of its own columns."""
    whole = dict(_load(llama, None).named_parameters())
    for rank in range(size):
        shard = dict(_load(llama, Fp8Scheme(), TensorParallel(rank, size, num_kv_heads=2))
                     .named_parameters())
        gate_up = whole["layers.1.gate_up_proj.weight"]
        inter = gate_up.shape[0] // 2 // size
        rows = torch.cat([gate_up[rank * inter:(rank + 1) * inter],
                          gate_up[gate_up.shape[0] // 2 + rank * inter:][:inter]])
        q, scale = ref.quantize_fp8(rows)
        assert torch.equal(shard["layers.1.gate_up_proj.weight"].float(), q.float())
        assert torch.equal(shard["layers.1.gate_up_proj.weight_scale"], scale)
        o = whole["layers.0.o_proj.weight"]
        cols = o.shape[1] // size
        q, scale = ref.quantize_fp8(o[:, rank * cols:(rank + 1) * cols])
        assert torch.equal(shard["layers.0.o_proj.weight"].float(), q.float())
        assert torch.equal(shard["layers.0.o_proj.weight_scale"], scale)


def test_update_weights_quantizes_on_the_way_in(llama, tmp_path):
    """An FP8 engine updated in place with float weights generates what a fresh FP8 engine
    on them does (graphs kept, scales rewritten)."""
    other = tmp_path / "other"
    make_checkpoint("llama", other, seed=5)
    llm = LLM(str(llama), quantization="fp8", **_kw("full"))
    before = _tokens(llm)
    done = llm.update_weights(str(other))
    assert done.tensors > 0
    after = _tokens(llm)
    assert after == _tokens(LLM(str(other), quantization="fp8", **_kw("full")))
    assert after != before


def test_draft_model_is_quantized_too(llama):
    spec = {"method": "draft_model", "model": str(llama), "num_speculative_tokens": 2}
    llm = LLM(str(llama), quantization="fp8", speculative_config=spec, **_kw("eager"))
    draft = llm.engine.drafter.runner.model
    assert draft.layers[0].qkv_proj.weight.dtype == FP8
    plain = LLM(str(llama), quantization="fp8", **_kw("eager"))
    assert _tokens(llm) == _tokens(plain)  # greedy speculation emits the target's tokens


def test_sleep_keeps_fp8_weights_and_scales(llama, tmp_path):
    """Sleep mode holds the FP8 weights and their scales in its arena: level 1 wakes to the
    same tokens; after level 2 an update quantizes into the woken buffers."""
    other = tmp_path / "other"
    make_checkpoint("llama", other, seed=6)
    kw = _kw("full") | dict(quantization="fp8", enable_sleep_mode=True)
    llm = LLM(str(llama), **kw)
    before = _tokens(llm)
    llm.sleep(level=1)
    llm.wake_up()
    assert _tokens(llm) == before
    llm.sleep(level=2)
    llm.wake_up()
    llm.update_weights(str(other))
    assert _tokens(llm) == _tokens(LLM(str(other), quantization="fp8", **_kw("full")))


def test_tensor_parallel_engine(moe):
    """Two tensor-parallel ranks (gloo worker processes), each quantizing its slices of a
    MoE model (experts, shared expert, a dense layer), generate the single engine's FP8
    tokens (row-parallel scales differ from TP=1's by each rank's own column amax: too
    little to move these greedy tokens)."""
    path = moe
    kw = _kw("eager") | dict(quantization="fp8", distributed_timeout_s=120.0)
    want = _tokens(LLM(str(path), **kw))
    with LLM(str(path), tensor_parallel_size=2, **kw) as llm:
        assert _tokens(llm) == want


@pytest.mark.parametrize("lm_head", [False, True])
def test_weight_bytes_count_what_the_model_holds(llama, moe, lm_head):
    """The decode floor's weight bytes (``quant.weight_bytes``): exactly the bytes of the
    loaded FP8 model's parameters, scales included."""
    from replaylm.model.quant import weight_bytes

    for path in (llama, moe):
        cfg, _ = load_model_config(str(path))
        scheme = Fp8Scheme(lm_head=lm_head)
        model = _load(path, scheme)
        held = sum(p.numel() * p.element_size() for p in model.parameters())
        assert weight_bytes(cfg, torch.float32, scheme) == held
        assert weight_bytes(cfg, torch.float32, None) == cfg.weight_bytes(torch.float32)


def test_tensor_parallel_fp8_lm_head_keeps_vocabulary_padding_zero(tmp_path):
    """A quantized LM head under tensor parallelism: each rank's vocabulary rows are the
    whole head's quantized rows; the last rank's padding rows stay zero."""
    make_checkpoint("llama", tmp_path, vocab_size=255)
    whole = dict(_load(tmp_path, None).named_parameters())["lm_head.weight"]
    q, scale = ref.quantize_fp8(whole)
    for rank in range(2):
        shard = dict(_load(tmp_path, Fp8Scheme(lm_head=True),
                           TensorParallel(rank, 2, num_kv_heads=2)).named_parameters())
        head, head_scale = shard["lm_head.weight"], shard["lm_head.weight_scale"]
        rows = q[rank * 128:(rank + 1) * 128]
        assert torch.equal(head[:rows.shape[0]].float(), rows.float())
        assert torch.equal(head_scale[:rows.shape[0]], scale[rank * 128:(rank + 1) * 128])
        assert torch.all(head[rows.shape[0]:].float() == 0)
