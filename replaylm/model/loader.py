"""Build a model and fill its weights from a Hugging Face directory or from a seed.

Loading is declared per parameter: ``WEIGHT_MAP`` says where each checkpoint tensor goes,
including the packed ``qkv_proj`` (q | k | v) and ``gate_up_proj`` (gate | up) shards.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from replaylm.env import cache_dir
from replaylm.model.config import ModelConfig
from replaylm.model.llama import CausalLM

log = logging.getLogger(__name__)

# checkpoint module name -> (our module, shard index); unlisted names map one to one.
PACKED: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def shard_sizes(cfg: ModelConfig, module: str) -> list[int]:
    if module == "qkv_proj":
        return [cfg.q_size, cfg.kv_size, cfg.kv_size]
    return [cfg.intermediate_size, cfg.intermediate_size]


def target_of(name: str) -> tuple[str, int | None] | None:
    """Map a checkpoint tensor name to ``(our parameter name, shard index or None)``."""
    if name.endswith(IGNORED_SUFFIXES):
        return None
    parts = name.removeprefix("model.").split(".")
    # layers.{i}.self_attn.q_proj.weight / layers.{i}.mlp.gate_proj.weight -> drop the group
    if len(parts) == 5 and parts[0] == "layers" and parts[2] in ("self_attn", "mlp"):
        parts = [parts[0], parts[1], parts[3], parts[4]]
    if len(parts) == 4 and parts[2] in PACKED:
        module, shard = PACKED[parts[2]]
        return ".".join([parts[0], parts[1], module, parts[3]]), shard
    return ".".join(parts), None


def build_empty(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> CausalLM:
    with torch.device("meta"):
        model = CausalLM(cfg)
    return model.to_empty(device=device).to(dtype)


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"unreadable safetensors index {index}: {e}") from e
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise FileNotFoundError(f"{index} names shard files that do not exist: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors weights in {model_dir} (use load_format='dummy' for random weights)"
        )
    return files


def iter_checkpoint(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as st:
                for name in st.keys():  # noqa: SIM118 - safe_open is not a dict
                    yield name, st.get_tensor(name)
        except Exception as e:  # safetensors raises its own error type for corrupt files
            # Only reading errors land here: the consumer's errors are raised at its side of
            # the ``yield``, not inside this generator.
            raise ValueError(f"unreadable safetensors file {f}: {e}") from e


def load_weights(model: CausalLM, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy checkpoint tensors into the model, checking every shape; all parameters must load."""
    cfg = model.cfg
    params = dict(model.named_parameters())
    pending = {(n, None) for n in params if not _packed(n)}
    pending |= {(n, s) for n in params if _packed(n) for s in range(len(shard_sizes(cfg, _packed(n))))}
    for name, tensor in tensors:
        target = target_of(name)
        if target is None:
            continue
        pname, shard = target
        if pname == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: the embedding serves as the head
        if pname not in params:
            # Dropping it would run a different network than the checkpoint's.
            raise ValueError(f"checkpoint tensor {name} has no place in this model "
                             f"({cfg.architecture}): refusing to load without it")
        dst = params[pname].data
        if shard is not None:
            sizes = shard_sizes(cfg, _packed(pname))
            dst = dst.narrow(0, sum(sizes[:shard]), sizes[shard])
        if tuple(tensor.shape) != tuple(dst.shape):
            raise ValueError(
                f"checkpoint tensor {name} has shape {list(tensor.shape)} but the model expects "
                f"{list(dst.shape)} (for {pname}{'' if shard is None else f' shard {shard}'})"
            )
        dst.copy_(tensor)
        pending.discard((pname, shard))
    missing = sorted(n for n, _ in pending)
    if missing:
        raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:8])}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))


def _packed(pname: str) -> str | None:
    module = pname.split(".")[-2] if "." in pname else ""
    return module if module in ("qkv_proj", "gate_up_proj") else None


@torch.no_grad()
def init_dummy(model: CausalLM, seed: int) -> None:
    """Deterministic random weights made on the model's device (norms 1, biases 0)."""
    gen = torch.Generator(device=model.embed_tokens.weight.device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            # Uniform with std 0.02 keeps activations of random models finite at any depth.
            p.uniform_(-0.0346, 0.0346, generator=gen)


def load_model(
    cfg: ModelConfig,
    model_dir: Path | None,
    load_format: str,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
) -> CausalLM:
    model = build_empty(cfg, dtype, device)
    use_dummy = load_format == "dummy" or model_dir is None
    if use_dummy:
        init_dummy(model, seed)
    else:
        load_weights(model, iter_checkpoint(checkpoint_files(model_dir)))
    return model.eval()


def default_model_weights(cfg: ModelConfig, seed: int = 0) -> Path:
    """The built-in default model's weights: made once from ``seed`` and cached as safetensors."""
    path = cache_dir() / f"default-model-seed{seed}" / "model.safetensors"
    if not path.exists():
        model = build_empty(cfg, torch.float32, torch.device("cpu"))
        init_dummy(model, seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file(_to_hf_names(model), str(tmp))
        tmp.replace(path)  # atomic: a concurrent reader never sees half a file
    return path.parent


def _to_hf_names(model: CausalLM) -> dict[str, torch.Tensor]:
    """Our parameters under transformers' names, unpacking qkv and gate/up."""
    cfg = model.cfg
    inverse = {(m, s): n for n, (m, s) in PACKED.items()}
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        parts = name.split(".")
        if parts[0] != "layers":
            out[name if name.startswith("lm_head") else "model." + name] = p.detach().contiguous()
            continue
        module = parts[2]
        group = "mlp" if module in ("gate_up_proj", "down_proj") else "self_attn"
        if module in ("input_layernorm", "post_attention_layernorm"):
            out[f"model.{name}"] = p.detach().contiguous()
            continue
        if _packed(name):
            for s, chunk in enumerate(p.detach().split(shard_sizes(cfg, module), dim=0)):
                hf = inverse[(module, s)]
                out[f"model.layers.{parts[1]}.{group}.{hf}.{parts[3]}"] = chunk.contiguous()
        else:
            out[f"model.layers.{parts[1]}.{group}.{module}.{parts[3]}"] = p.detach().contiguous()
    return out
