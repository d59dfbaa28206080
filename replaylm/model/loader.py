"""Build a model and fill its weights from a Hugging Face directory or from a seed.

Loading is declared per parameter: ``weight_map.WeightMap`` turns a checkpoint name into its
``Placement`` in a built model (the view it fills, the shape it expects, the rank's part);
loading and in-place updates (``model.weight_update``) both go through it.

With tensor parallelism (``model.parallel``) each rank reads only its slices of the
checkpoint: ``iter_checkpoint_slices`` yields safetensors' lazy slices and ``load_weights``
reads from each the rows (column-parallel, vocabulary) or columns (row-parallel) the rank
holds, after checking the tensor's full shape. With data-parallel attention a rank reads its
slice of gate | up and down only (``dp_attention_slice``) and everything else whole.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from replaylm.env import cache_dir
from replaylm.kernels.ref import FP8_DTYPE, quantize_fp8
from replaylm.model.config import ModelConfig
from replaylm.model.llama import CausalLM
from replaylm.model.parallel import DataParallelAttention, TensorParallel
from replaylm.model.quant import Fp8Scheme, is_scale, quantize_model, scale_name
from replaylm.model.weight_map import (
    PACKED,
    WeightMap,
    dtype_of,
    is_fp8,
    packed_module,
    pieces_of,
    shard_sizes,
    weight_of,
)

log = logging.getLogger(__name__)

def build_empty(cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                tp: TensorParallel | None = None,
                dp: DataParallelAttention | None = None,
                fp8: Fp8Scheme | None = None) -> CausalLM:
    """The model with unset weights in ``dtype``; with ``fp8`` the weights it names in FP8
    beside their scales (``model.quant``)."""
    with torch.device("meta"):
        model = CausalLM(cfg, tp, dp)
    model = model.to_empty(device=device).to(dtype)
    if fp8 is not None:
        quantize_model(model, fp8)
    return model


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


def iter_checkpoint_slices(files: list[Path]) -> Iterator[tuple[str, Any]]:
    """Like ``iter_checkpoint``, but each tensor as safetensors' lazy slice (nothing is read
    until it is indexed): what a tensor-parallel rank loads its slices from."""
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as st:
                for name in st.keys():  # noqa: SIM118 - safe_open is not a dict
                    yield name, st.get_slice(name)
        except Exception as e:  # as in iter_checkpoint: reading errors only
            raise ValueError(f"unreadable safetensors file {f}: {e}") from e


def load_weights(model: CausalLM, tensors: Iterator[tuple[str, Any]],
                 full_cfg: ModelConfig | None = None) -> None:
    """Copy checkpoint tensors into the model, checking every shape; all parameters must load.

    Tensors are ``torch.Tensor``s or safetensors slices. A tensor-parallel model
    (``model.tp``) or a data-parallel-attention one (``model.dp``) takes its rank's part of
    each; ``full_cfg`` is then the whole model's config, whose shapes the checkpoint must
    have.
    """
    cfg = model.cfg
    weights = WeightMap(model, full_cfg)
    params = weights.params
    # An FP8 weight's scales load with it: quantized from a float weight, or as a tensor of
    # their own beside an FP8 one (``fp8_pieces`` then waits for it).
    pending = {n: pieces_of(cfg, n, p) for n, p in params.items() if not is_scale(n)}
    fp8_pieces: set[tuple[str, int | None, int | None]] = set()
    for name in ("embed_tokens.weight", "lm_head.weight") if model.tp is not None else ():
        if name in params:
            params[name].data.zero_()  # the vocabulary padding rows stay zero
    for name, tensor in tensors:
        place = weights.place(name)
        if place is None:
            continue
        place.check(tensor)
        place.write(tensor)
        expert, shard = place.expert, place.shard
        if is_scale(place.pname):
            fp8_pieces.discard((weight_of(place.pname), expert, shard))
            continue
        if is_fp8(dtype_of(tensor)):
            fp8_pieces.add((place.pname, expert, shard))
        pending[place.pname] = {(e, s) for e, s in pending[place.pname]
                                if not ((expert is None or e == expert)
                                        and (shard is None or s == shard))}
    if fp8_pieces:
        names = sorted({n for n, _, _ in fp8_pieces})
        raise ValueError(f"checkpoint has FP8 weights without their weight_scale: "
                         f"{', '.join(names[:8])}")
    missing = sorted(n for n, left in pending.items() if left)
    if missing:
        raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:8])}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))


@torch.no_grad()
def init_dummy(model: CausalLM, seed: int) -> None:
    """Deterministic random weights made on the model's device (norms 1, biases 0). An FP8
    weight gets the model-dtype weight of the same seed, quantized (``ref.quantize_fp8``)."""
    dtype = model.embed_tokens.weight.dtype
    gen = torch.Generator(device=model.embed_tokens.weight.device).manual_seed(seed)
    params = dict(model.named_parameters())
    for name, p in params.items():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        elif is_scale(name):
            continue  # set with its weight
        elif p.dtype == FP8_DTYPE:
            full = torch.empty(p.shape, dtype=dtype, device=p.device)
            full.uniform_(-0.0346, 0.0346, generator=gen)
            q, scale = quantize_fp8(full)
            p.copy_(q)
            params[scale_name(name)].copy_(scale)
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
    tp: TensorParallel | None = None,
    full_cfg: ModelConfig | None = None,
    dp: DataParallelAttention | None = None,
    fp8: Fp8Scheme | None = None,
) -> CausalLM:
    """The model with its weights; with ``tp`` or ``dp``, ``cfg`` is this rank's shard of
    ``full_cfg`` and only the rank's slices are read (dummy weights are then random per
    shard). ``fp8``: which weights are held in FP8 (``model.quant``; each rank quantizes
    its own slices)."""
    model = build_empty(cfg, dtype, device, tp, dp, fp8)
    use_dummy = load_format == "dummy" or model_dir is None
    if use_dummy:
        init_dummy(model, seed)
    elif tp is None and dp is None:
        load_weights(model, iter_checkpoint(checkpoint_files(model_dir)))
    else:
        load_weights(model, iter_checkpoint_slices(checkpoint_files(model_dir)), full_cfg)
    return model.eval()


def default_model_weights(cfg: ModelConfig, seed: int = 0) -> Path:
    """The built-in default model's weights: made once from ``seed`` and cached as safetensors."""
    path = cache_dir() / f"default-model-seed{seed}" / "model.safetensors"
    if not path.exists():
        model = build_empty(cfg, torch.float32, torch.device("cpu"))
        init_dummy(model, seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file(to_hf_names(model), str(tmp))
        tmp.replace(path)  # atomic: a concurrent reader never sees half a file
    return path.parent


def to_hf_names(model: CausalLM) -> dict[str, torch.Tensor]:
    """Our parameters under transformers' names, unpacking qkv and gate/up (a dense model:
    the default model's cached checkpoint, and benchmarks that need a state dict)."""
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
        if packed_module(name):
            for s, chunk in enumerate(p.detach().split(shard_sizes(cfg, module), dim=0)):
                hf = inverse[(module, s)]
                out[f"model.layers.{parts[1]}.{group}.{hf}.{parts[3]}"] = chunk.contiguous()
        else:
            out[f"model.layers.{parts[1]}.{group}.{module}.{parts[3]}"] = p.detach().contiguous()
    return out
