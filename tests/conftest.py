"""Shared fixtures: tiny random transformers checkpoints written with ``save_pretrained``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# Property tests draw the same examples on every run (CI must not turn red by chance);
# HYPOTHESIS_PROFILE=explore draws fresh ones, to hunt for new failures locally.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Under pytest-xdist (``pytest -n auto``), the name of this worker process ("gw0", ...).
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")

# Keep the built-in default model's weight cache (and the tuning and compile-plan caches
# beside it) inside the test session: one directory per xdist worker, so two workers never
# write the same file at once.
_CACHE = Path(__file__).parent / ".." / ".cache" / "test"
os.environ.setdefault("REPLAYLM_CACHE", str(_CACHE / WORKER if WORKER else _CACHE))

# The models here are tiny: one intra-op thread per process under xdist. With two threads a
# worker, the workers (and the servers and ranks they start, which read OMP_NUM_THREADS)
# oversubscribe the cores, and each small matmul then waits for a descheduled OpenMP thread
# (a MoE graph test took 10 s with two threads, 4 s with one, on a busy 2-core machine).
THREADS = 1 if WORKER else max(1, min(2, os.cpu_count() or 1))
if WORKER:
    os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(THREADS)



def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: two workers per core. Much of this suite waits on processes it starts
    (servers, ranks, bench runs), and a second worker per core keeps the core busy then."""
    return 2 * (os.cpu_count() or 1)


TINY = {
    "llama": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        rope_theta=500000.0, bos_token_id=1, eos_token_id=2,
    ),
    "qwen2": dict(
        model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=256, hidden_size=64,
        intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
    ),
    "qwen3": dict(
        model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=256, hidden_size=64,
        intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_theta=1000000.0, bos_token_id=1, eos_token_id=2,
    ),
    # 8 experts, top 2 without renormalising, a shared expert, and a dense middle layer.
    "qwen2_moe": dict(
        model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], vocab_size=256,
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=80, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=False, mlp_only_layers=[1], num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
        tie_word_embeddings=False, rope_theta=1000000.0, bos_token_id=1, eos_token_id=2,
    ),
    # Routed experts only, top 3 renormalised, q/k norm.
    "qwen3_moe": dict(
        model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=256,
        hidden_size=64, intermediate_size=96, moe_intermediate_size=48, num_experts=8,
        num_experts_per_tok=3, norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6,
        tie_word_embeddings=False, rope_theta=1000000.0, bos_token_id=1, eos_token_id=2,
    ),
}


def make_checkpoint(kind: str, path: Path, seed: int = 0, dtype=torch.float32, **overrides):
    """Write a random-weight HF checkpoint; returns the transformers model (eval, fp32)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg_kwargs = dict(TINY[kind], **overrides)
    model_type = cfg_kwargs.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **cfg_kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)  # non-trivial norms catch a missing weight
            else:
                p.normal_(0.0, 0.08)
    model.save_pretrained(str(path))
    return model.eval()


def perturbed_checkpoint(src, dst) -> None:
    """Save at ``dst`` the checkpoint at ``src`` with every non-norm weight perturbed: a draft
    model that agrees with the original often, not always."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.02)
    model.save_pretrained(str(dst))


@pytest.fixture(scope="session", params=sorted(TINY))
def tiny_checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    model = make_checkpoint(request.param, path)
    return request.param, path, model
