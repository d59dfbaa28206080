"""Qwen2-MoE and Qwen3-MoE: the routed-experts reference, loading, and every graph mode."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from replaylm.attention.torch_ref import TorchAttentionBackend
from replaylm.engine.loading import load_model_config
from replaylm.graphs.stand_in import no_host_sync
from replaylm.kernels import ref
from replaylm.model.loader import build_empty, checkpoint_files, iter_checkpoint, load_weights
from tests.graphs.test_graphs import MODES, matches_eager
from tests.model_helpers import bound_model

MOE_KINDS = ["qwen2_moe", "qwen3_moe"]


@pytest.fixture(scope="module", params=MOE_KINDS)
def moe_checkpoint(request, tmp_path_factory):
    from tests.conftest import make_checkpoint

    path = tmp_path_factory.mktemp(f"moe-{request.param}")
    return request.param, path, make_checkpoint(request.param, path, seed=5)


def _per_token_moe(x, w_gate_up, w_down, weights, ids):
    """The routed experts one token and one choice at a time (the test's own oracle)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate, up = F.linear(x[t], w_gate_up[e]).chunk(2)
            out[t] += weights[t, k] * F.linear(F.silu(gate) * up, w_down[e])
    return out


def _experts(num_experts, hidden, inter, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.1,
            torch.randn(num_experts, hidden, inter, generator=g) * 0.1)


@pytest.mark.parametrize("case", ["random", "one_expert", "unused_experts"])
def test_fused_moe_reference_matches_per_token_loop_without_host_sync(case):
    t, e, k, h, i = 13, 6, 2, 16, 8
    g = torch.Generator().manual_seed(3)
    x = torch.randn(t, h, generator=g)
    logits = torch.randn(t, e, generator=g)
    if case == "one_expert":
        logits[:, 4] += 100.0  # every token's first choice is expert 4
    if case == "unused_experts":
        logits[:, :3] -= 100.0  # experts 0..2 get no tokens
    w_gate_up, w_down = _experts(e, h, i)
    with no_host_sync("moe reference"):
        weights, ids = ref.route_topk(logits, k, normalize=True)
        got = ref.fused_moe(x, w_gate_up, w_down, weights, ids)
    if case == "one_expert":
        assert (ids[:, 0] == 4).all()
    if case == "unused_experts":
        assert (ids >= 3).all()
    torch.testing.assert_close(weights.sum(-1), torch.ones(t))
    torch.testing.assert_close(got, _per_token_moe(x, w_gate_up, w_down, weights, ids),
                               rtol=1e-5, atol=1e-5)


def test_route_topk_follows_softmax_order_and_normalisation():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    probs = torch.softmax(logits, -1)
    w, ids = ref.route_topk(logits, 2, normalize=False)
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(w, probs[:, [1, 2]])
    w, _ = ref.route_topk(logits.bfloat16(), 2, normalize=True)
    assert w.dtype == torch.bfloat16
    torch.testing.assert_close(w.float(), (probs[:, [1, 2]] / probs[:, [1, 2]].sum()),
                               rtol=1e-2, atol=1e-2)


def test_experts_are_packed_at_load(moe_checkpoint):
    kind, path, hf = moe_checkpoint
    model = bound_model(path, TorchAttentionBackend())
    cfg = model.cfg
    assert cfg.num_experts == 8 and cfg.architecture.lower().startswith(kind.split("_")[0])
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params
    sparse = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
    assert sparse == ([0, 2] if kind == "qwen2_moe" else [0, 1])
    for i in sparse:
        ours, theirs = model.layers[i].moe, hf.model.layers[i].mlp
        assert torch.equal(ours.experts_gate_up, theirs.experts.gate_up_proj)
        assert torch.equal(ours.experts_down, theirs.experts.down_proj)
        assert torch.equal(ours.gate.weight, theirs.gate.weight)
        assert (ours.shared_gate_up is not None) == (kind == "qwen2_moe")
    dense = [layer for layer in model.layers if layer.moe is None]
    assert len(dense) == (1 if kind == "qwen2_moe" else 0)  # mlp_only_layers=[1]


def test_a_missing_expert_is_named_and_packed_names_load(moe_checkpoint, tmp_path):
    _, path, _ = moe_checkpoint
    cfg, _ = load_model_config(str(path))
    loaded = bound_model(path, TorchAttentionBackend())
    tensors = dict(iter_checkpoint(checkpoint_files(path)))
    fresh = build_empty(cfg, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="layers.0.moe.experts_gate_up"):
        load_weights(fresh, ((n, t) for n, t in tensors.items()
                             if n != "model.layers.0.mlp.experts.5.up_proj.weight"))
    # transformers' packed in-memory names ([E, 2I, H] and [E, H, I] per layer) load too
    packed = {n: t for n, t in tensors.items() if ".mlp.experts." not in n}
    for i, layer in enumerate(loaded.layers):
        if layer.moe is not None:
            packed[f"model.layers.{i}.mlp.experts.gate_up_proj"] = layer.moe.experts_gate_up
            packed[f"model.layers.{i}.mlp.experts.down_proj"] = layer.moe.experts_down
    save_file({n: t.detach().contiguous() for n, t in packed.items()},
              str(tmp_path / "m.safetensors"))
    fresh = build_empty(cfg, torch.float32, torch.device("cpu"))
    load_weights(fresh, iter(load_file(str(tmp_path / "m.safetensors")).items()))
    for (name, a), b in zip(fresh.named_parameters(), loaded.parameters(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("mode", MODES)
def test_moe_mode_matches_eager_tokens(moe_checkpoint, mode):
    stats = matches_eager(moe_checkpoint[1], mode).graph_stats()
    # No CUDA: the shared expert stays on the one stream, and every graph says so.
    assert set(stats["streams"]) == set(stats["forks"]) and set(stats["streams"].values()) == {1}
    assert not any(stats["forks"].values())


def test_side_stream_setting_is_validated_and_needs_cuda(moe_checkpoint):
    from replaylm.config import EngineArgs

    assert EngineArgs().moe_side_stream_max_tokens == 64
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="moe_side_stream_max_tokens"):
            EngineArgs(moe_side_stream_max_tokens=bad)
    model = bound_model(moe_checkpoint[1], TorchAttentionBackend())
    model.use_side_stream(256)
    sparse = [layer.moe for layer in model.layers if layer.moe is not None]
    assert sparse and all(m.side_stream is None and m.side_stream_max_tokens == 0 for m in sparse)


@pytest.mark.parametrize("name, total, active, arch", [
    ("qwen1.5-moe-a2.7b", 14.3e9, 2.7e9, "Qwen2MoeForCausalLM"),
    ("qwen3-30b-a3b", 30.5e9, 3.3e9, "Qwen3MoeForCausalLM"),
])
def test_named_moe_shapes_have_the_published_sizes(name, total, active, arch):
    cfg, path = load_model_config(name)
    assert path is None and cfg.architecture == arch
    assert abs(cfg.num_params - total) < 0.05e9
    assert abs(cfg.num_active_params - active) < 0.06e9
    assert all(cfg.is_moe_layer(i) for i in range(cfg.num_layers))


def test_batch_1_floor_counts_the_bytes_one_token_reads():
    from types import SimpleNamespace

    from replaylm.bench.floor import weight_bytes_of

    dense, _ = load_model_config("llama3.2-1b")
    moe, _ = load_model_config("qwen1.5-moe-a2.7b")
    cpu = torch.device("cpu")
    for cfg in (dense, moe):
        llm = SimpleNamespace(model_config=cfg, dtype=torch.bfloat16, device=cpu)
        assert weight_bytes_of(llm) == 2 * cfg.num_active_params
    assert dense.num_active_params == dense.num_params
    assert moe.num_active_params < moe.num_params / 5


class _FakeStream:
    """Stands in for a CUDA stream on the CPU: records waits and which stream ran each op."""

    def __init__(self, name, log, current):
        self.name, self.log, self.current = name, log, current

    def wait_stream(self, other):
        self.log.append(f"{self.name} waits {other.name}")

    def __enter__(self):
        self.current.append(self)

    def __exit__(self, *exc):
        self.current.pop()


def test_shared_expert_forks_onto_the_side_stream_only_while_capturing(monkeypatch):
    """The block's capture-time schedule: fork after x is ready, the routed experts issued
    first on the main stream, the shared expert on the side stream, join before the add;
    same result as inline; nothing forks outside capture or above the row limit."""
    from types import SimpleNamespace

    from replaylm.model.config import ModelConfig
    from replaylm.model.loader import init_dummy
    from replaylm.model.moe import SparseMoe

    log: list[str] = []
    current: list[_FakeStream] = []
    main = _FakeStream("main", log, current)
    current.append(main)
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: current[-1])
    monkeypatch.setattr(torch.cuda, "stream", lambda s: s)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])

    def logged(name):
        def op(*args, **kw):
            log.append(f"{name} on {current[-1].name}")
            return getattr(ref, name)(*args, **kw)
        return op

    kernels = SimpleNamespace(linear=ref.linear, route_topk=ref.route_topk,
                              fused_moe=logged("fused_moe"), silu_linear=logged("silu_linear"),
                              shared_combine=logged("shared_combine"))
    cfg, _ = load_model_config("qwen1.5-moe-a2.7b")
    cfg = ModelConfig(**{**cfg.__dict__, "hidden_size": 32, "num_experts": 6,
                         "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24})
    block = SparseMoe(cfg)
    holder = SimpleNamespace(named_parameters=block.named_parameters,
                             embed_tokens=SimpleNamespace(weight=torch.zeros(1)))
    init_dummy(holder, seed=1)
    block.side_stream, block.side_stream_max_tokens = _FakeStream("side", log, current), 8
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    inline = block(x, kernels)
    assert log == ["fused_moe on main", "silu_linear on main", "shared_combine on main"]
    assert block.forks == 0
    log.clear()
    capturing[0] = True
    forked = block(x, kernels)
    assert log == ["side waits main", "fused_moe on main", "silu_linear on side",
                   "main waits side", "shared_combine on main"]
    assert block.forks == 1 and torch.equal(forked, inline)
    log.clear()
    block(torch.randn(9, 32), kernels)  # above the row limit: inline even while capturing
    assert log == ["fused_moe on main", "silu_linear on main", "shared_combine on main"]
    assert block.forks == 1
