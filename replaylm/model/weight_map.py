"""Where each checkpoint tensor goes in a built model: the one name map that loading
(``loader.load_weights``) and in-place updates (``weight_update``) share.

``PACKED`` and ``MOE_NAMES`` say where each checkpoint tensor goes, including the packed
``qkv_proj`` (q | k | v) and ``gate_up_proj`` (gate | up) shards and, in MoE layers, each
expert's slice of the packed expert tensors. ``WeightMap`` turns a checkpoint name into its
``Placement`` in a built model (the view it fills, the shape it expects, the rank's part:
rows or columns under tensor parallelism, ``tp_slice``; gate | up and down slices under
data-parallel attention, ``dp_attention_slice``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from replaylm.kernels.ref import FP8_DTYPE, quantize_fp8
from replaylm.model.config import ModelConfig
from replaylm.model.llama import CausalLM
from replaylm.model.parallel import DataParallelAttention, TensorParallel
from replaylm.model.quant import is_scale, scale_name

# checkpoint module name -> (our module, shard index); unlisted names map one to one.
PACKED: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# MoE layers (``mlp.`` dropped): the router, the shared expert, and each routed expert's
# projections, packed per layer into [E, 2I, H] (gate | up) and [E, H, I] tensors.
MOE_NAMES: dict[str, tuple[str, int | None]] = {
    "gate.weight": ("moe.gate.weight", None),
    "shared_expert_gate.weight": ("moe.shared_expert_gate.weight", None),
    "shared_expert.gate_proj.weight": ("moe.shared_gate_up.weight", 0),
    "shared_expert.up_proj.weight": ("moe.shared_gate_up.weight", 1),
    "shared_expert.down_proj.weight": ("moe.shared_down.weight", None),
    "gate_proj.weight": ("moe.experts_gate_up", 0),
    "up_proj.weight": ("moe.experts_gate_up", 1),
    "down_proj.weight": ("moe.experts_down", None),
    # transformers' in-memory layout, already packed per layer
    "experts.gate_up_proj": ("moe.experts_gate_up", None),
    "experts.down_proj": ("moe.experts_down", None),
    # the per-row scales of FP8 checkpoints (compressed-tensors ``*.weight_scale``)
    "shared_expert.gate_proj.weight_scale": ("moe.shared_gate_up.weight_scale", 0),
    "shared_expert.up_proj.weight_scale": ("moe.shared_gate_up.weight_scale", 1),
    "shared_expert.down_proj.weight_scale": ("moe.shared_down.weight_scale", None),
    "gate_proj.weight_scale": ("moe.experts_gate_up_scale", 0),
    "up_proj.weight_scale": ("moe.experts_gate_up_scale", 1),
    "down_proj.weight_scale": ("moe.experts_down_scale", None),
}
#: The MoE names that are one routed expert's (``experts.{e}.<name>``).
PER_EXPERT = ("gate_proj.weight", "up_proj.weight", "down_proj.weight",
              "gate_proj.weight_scale", "up_proj.weight_scale", "down_proj.weight_scale")
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
PACKED_MODULES = ("qkv_proj", "gate_up_proj", "experts_gate_up", "shared_gate_up")


def shard_sizes(cfg: ModelConfig, module: str) -> list[int]:
    if module == "qkv_proj":
        return [cfg.q_size, cfg.kv_size, cfg.kv_size]
    size = {"experts_gate_up": cfg.moe_intermediate_size,
            "shared_gate_up": cfg.shared_expert_intermediate_size}.get(module,
                                                                      cfg.intermediate_size)
    return [size, size]


# (our parameter name, expert index or None, shard index or None)
Target = tuple[str, int | None, int | None]
Part = tuple[int, int, int]  # (dim, start, size) of a checkpoint tensor


def target_of(name: str, cfg: ModelConfig) -> Target | None:
    """Map a checkpoint tensor name to our parameter, its expert and its shard."""
    if name.endswith(IGNORED_SUFFIXES):
        return None
    parts = name.removeprefix("model.").split(".")
    if len(parts) > 3 and parts[0] == "layers" and parts[2] == "mlp" \
            and parts[1].isdigit() and cfg.is_moe_layer(int(parts[1])):
        rest, expert = parts[3:], None
        if len(rest) == 4 and rest[0] == "experts" and rest[1].isdigit():
            rest, expert = rest[2:], int(rest[1])
        key = ".".join(rest)
        mapped = MOE_NAMES.get(key)
        per_expert = key in PER_EXPERT
        if mapped is None or per_expert != (expert is not None):
            return ".".join(parts), None, None  # no place in the model: the caller refuses
        return f"layers.{parts[1]}.{mapped[0]}", expert, mapped[1]
    # layers.{i}.self_attn.q_proj.weight / layers.{i}.mlp.gate_proj.weight -> drop the group
    if len(parts) == 5 and parts[0] == "layers" and parts[2] in ("self_attn", "mlp"):
        parts = [parts[0], parts[1], parts[3], parts[4]]
    if len(parts) == 4 and parts[2] in PACKED:
        module, shard = PACKED[parts[2]]
        return ".".join([parts[0], parts[1], module, parts[3]]), None, shard
    return ".".join(parts), None, None



@dataclass(frozen=True)
class Placement:
    """Where one checkpoint tensor goes in a model: the parameter (``pname``), its expert and
    shard, ``dst`` (the view of the parameter's data this rank fills from it), ``shape`` (the
    checkpoint tensor's shape in the whole model) and ``part`` (what of the tensor this rank
    copies: ``tp_slice``, ``dp_attention_slice``; None: all of it)."""

    name: str
    pname: str
    expert: int | None
    shard: int | None
    dst: torch.Tensor
    shape: tuple[int, ...]
    part: list[Part] | str | None
    rank: int = 0
    #: An FP8 parameter's: the view of its scales for ``dst``'s rows (``model.quant``).
    scale: torch.Tensor | None = None

    def check(self, tensor: Any) -> None:
        """Raise ``ValueError`` naming the tensor unless its shape is ``shape`` and its dtype
        floating point (a float of another dtype is cast on copy; FP8 ``float8_e4m3fn``
        only into an FP8 parameter). A scale (``*.weight_scale``) may also come as
        ``[N, 1]`` (per channel) or one value (per tensor)."""
        shape = shape_of(tensor)
        if is_scale(self.pname) and (shape == (*self.shape, 1) or _numel(shape) == 1):
            shape = self.shape
        if shape != self.shape:
            where = "".join(f" {k} {v}" for k, v in (("expert", self.expert),
                                                      ("shard", self.shard)) if v is not None)
            raise ValueError(
                f"checkpoint tensor {self.name} has shape {list(shape)} but the model expects "
                f"{list(self.shape)} (for {self.pname}{where})"
            )
        dtype = dtype_of(tensor)
        if dtype is not None and not is_float(dtype):
            raise ValueError(f"checkpoint tensor {self.name} has dtype {dtype}: weights must be "
                             f"floating point (another float dtype is cast to the model's "
                             f"{self.dst.dtype})")
        if dtype is not None and is_fp8(dtype):
            if not is_e4m3(dtype):
                raise ValueError(f"checkpoint tensor {self.name} has dtype {dtype}: the FP8 "
                                 "weights replaylm reads are float8_e4m3fn")
            if self.dst.dtype != FP8_DTYPE:
                raise ValueError(f"checkpoint tensor {self.name} is FP8 ({dtype}) but this "
                                 f"model holds {self.pname} in {self.dst.dtype} (FP8 weights "
                                 "go into the projections, with their weight_scale, only)")

    def write(self, tensor: Any) -> None:
        """Copy this rank's part of ``tensor`` into ``dst`` (in place). Into an FP8
        parameter, a tensor of another dtype is quantized on the way (``quantize_fp8``: the
        rank's part, so a row-parallel rank's scales are those of its own columns) and its
        scales go to ``scale``; an FP8 tensor is copied as it is (its ``weight_scale``
        comes as a tensor of its own). A per-tensor scale fills every row."""
        if is_scale(self.pname) and _numel(shape_of(tensor)) == 1:
            self.dst.copy_(read_part(tensor).reshape(()).expand(self.dst.shape))
        elif is_scale(self.pname):
            load_rank_part(self.dst, _rows(tensor, self.shape), self.part, self.rank)
        elif self.scale is None or is_fp8(dtype_of(tensor)):
            load_rank_part(self.dst, tensor, self.part, self.rank)
        else:
            # Zeros: rows the rank's part leaves unwritten (the LM head's vocabulary padding
            # on the last rank) stay zero, as they do unquantized.
            full = torch.zeros(self.dst.shape, dtype=torch.float32, device=self.dst.device)
            load_rank_part(full, tensor, self.part, self.rank)
            q, scale = quantize_fp8(full)
            self.dst.copy_(q)
            self.scale.copy_(scale)

    @property
    def nbytes(self) -> int:
        """Bytes ``write`` copies into the model."""
        return self.dst.numel() * self.dst.element_size()


class WeightMap:
    """Where each checkpoint tensor (Hugging Face name) goes in ``model``: the one mapping
    that loading (``load_weights``) and in-place updates (``model.weight_update``) share.
    A tensor-parallel (``model.tp``) or data-parallel-attention (``model.dp``) model takes
    its rank's part of each; ``full_cfg`` is then the whole model's config, whose shapes
    the checkpoint has."""

    def __init__(self, model: CausalLM, full_cfg: ModelConfig | None = None) -> None:
        self.model = model
        self.cfg = model.cfg
        self.full_cfg = full_cfg or self.cfg
        self.params = dict(model.named_parameters())
        self.full_shapes: dict[str, tuple[int, ...]] | None = None
        if model.tp is not None or model.dp is not None:
            with torch.device("meta"):
                self.full_shapes = {n: tuple(p.shape)
                                    for n, p in CausalLM(self.full_cfg).named_parameters()}
            # An FP8 weight's scales: one per row of the whole weight.
            self.full_shapes |= {n: self.full_shapes[weight_of(n)][:-1]
                                 for n in self.params if is_scale(n)}

    def place(self, name: str) -> Placement | None:
        """Where checkpoint tensor ``name`` goes; None for a tensor the model reads nowhere
        (rotary tables, the LM head of tied embeddings: the embedding is the head). Raises
        ``ValueError`` naming a tensor that has no place in the model."""
        cfg, full_cfg, tp, dp = self.cfg, self.full_cfg, self.model.tp, self.model.dp
        target = target_of(name, cfg)
        if target is None:
            return None
        pname, expert, shard = target
        if pname == "lm_head.weight" and cfg.tie_word_embeddings:
            return None  # tied: the embedding serves as the head
        p = self.params.get(pname)
        if p is None or (expert is not None and expert >= p.shape[0]):
            # Dropping it would run a different network than the checkpoint's.
            raise ValueError(f"checkpoint tensor {name} has no place in this model "
                             f"({cfg.architecture}): refusing to load without it")
        dst = self._view(p.data, pname, expert, shard)
        scale = None
        if p.dtype == FP8_DTYPE:
            scale = self._view(self.params[scale_name(pname)].data, pname, expert, shard)
        shape = tuple(dst.shape)
        if self.full_shapes is not None:
            shape = self.full_shapes[pname][1:] if expert is not None else self.full_shapes[pname]
            if shard is not None:
                shape = (shard_sizes(full_cfg, packed_module(pname))[shard], *shape[1:])
        part, rank = None, 0
        weight = weight_of(pname) if is_scale(pname) else pname
        if tp is not None:
            part = tp_slice(weight, shard, tp, full_cfg, cfg, stacked=expert is None)
            rank = tp.rank
        elif dp is not None:
            part, rank = dp_attention_slice(weight, dp, cfg), dp.rank
        if is_scale(pname):
            part = scale_part(part, len(shape) + 1)
        return Placement(name, pname, expert, shard, dst, shape, part, rank, scale)

    def _view(self, data: torch.Tensor, pname: str, expert: int | None, shard: int | None,
              ) -> torch.Tensor:
        """The view of parameter data ``data`` that one expert's shard fills (its rows)."""
        if expert is not None:
            data = data[expert]
        if shard is not None:
            sizes = shard_sizes(self.cfg, packed_module(pname))
            data = data.narrow(0, sum(sizes[:shard]), sizes[shard])
        return data


def weight_of(scale_pname: str) -> str:
    """The FP8 weight a scale parameter belongs to (``model.quant.scale_name`` inverted)."""
    return scale_pname.removesuffix("_scale")


def scale_part(part: list[Part] | str | None, weight_dims: int) -> list[Part] | None:
    """The part of a scale tensor (one entry per weight row) that goes with a weight's
    ``part``: its pieces along the rows; a weight split along its columns (row-parallel)
    keeps every row's scale."""
    if not isinstance(part, list):
        return None
    rows = [p for p in part if p[0] != weight_dims - 1]
    return rows or None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _rows(tensor: Any, shape: tuple[int, ...]) -> Any:
    """A scale tensor as one entry per row (a ``[N, 1]`` checkpoint tensor as ``[N]``); a
    safetensors slice is read first."""
    if not isinstance(tensor, torch.Tensor):
        tensor = read_part(tensor)
    return tensor.reshape(shape) if tuple(tensor.shape) != shape else tensor


def is_fp8(dtype: torch.dtype | str | None) -> bool:
    """Whether a tensor's dtype (``dtype_of``) is an FP8 one."""
    if isinstance(dtype, torch.dtype):
        return dtype.itemsize == 1 and dtype.is_floating_point
    return isinstance(dtype, str) and dtype.startswith("F8")


def is_e4m3(dtype: torch.dtype | str) -> bool:
    return dtype == FP8_DTYPE or dtype == "F8_E4M3"


def shape_of(tensor: Any) -> tuple[int, ...]:
    return tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else tuple(tensor.get_shape())


def dtype_of(tensor: Any) -> torch.dtype | str | None:
    """A tensor's dtype, or a safetensors slice's (its name: ``"BF16"``); None if unknown."""
    if isinstance(tensor, torch.Tensor):
        return tensor.dtype
    get = getattr(tensor, "get_dtype", None)
    return get() if get is not None else None


def is_float(dtype: torch.dtype | str) -> bool:
    if isinstance(dtype, torch.dtype):
        return dtype.is_floating_point
    return dtype.startswith(("F", "BF"))  # safetensors: F16, BF16, F32, F8_E4M3, ...


def read_part(tensor: Any, dim: int = 0, start: int = 0, size: int | None = None) -> torch.Tensor:
    """``tensor`` (or a safetensors slice, read only now), or its ``size`` entries from
    ``start`` along ``dim``."""
    if isinstance(tensor, torch.Tensor):
        return tensor if size is None else tensor.narrow(dim, start, size)
    index = [slice(None)] * len(tensor.get_shape())
    if size is not None:
        index[dim] = slice(start, start + size)
    return tensor[tuple(index)]


def tp_slice(pname: str, shard: int | None, tp: TensorParallel, full: ModelConfig,
             local: ModelConfig, stacked: bool = False) -> list[Part] | str | None:
    """Which part of a checkpoint tensor a tensor-parallel rank loads into ``pname`` (its
    ``shard``): the ``(dim, start, size)`` pieces that, concatenated in order along their
    dim, make the rank's part; ``"rank0"`` for a row-parallel bias (rank 0 holds it, the
    others zeros); or None when every rank holds all of it (norms, the MoE router and the
    shared expert's gate). A routed expert's tensor is one expert's (``[I, H]`` / ``[H, I]``)
    or, ``stacked``, every expert's (``[E, 2I, H]`` / ``[E, H, I]``: the rank's gate and up
    rows are two pieces)."""
    parts = pname.split(".")
    module, leaf = (parts[-2] if len(parts) > 1 else ""), parts[-1]
    if pname in ("embed_tokens.weight", "lm_head.weight"):
        rows = tp.vocab_rows(full.vocab_size)
        start = tp.rank * rows
        return [(0, start, max(0, min(rows, full.vocab_size - start)))]
    if module == "qkv_proj":
        if shard == 0:
            return [(0, tp.rank * local.q_size, local.q_size)]
        return [(0, tp.kv_head_start() * full.head_dim, local.kv_size)]
    column = {"gate_up_proj": (local.intermediate_size, full.intermediate_size),
              "shared_gate_up": (local.shared_expert_intermediate_size,
                                 full.shared_expert_intermediate_size),
              "experts_gate_up": (local.moe_intermediate_size, full.moe_intermediate_size)}
    packed = module if module in column else leaf
    if packed in column:  # column-parallel gate | up: this rank's rows of each
        width, whole = column[packed]
        dim = 1 if stacked and leaf.startswith("experts_") else 0
        if shard is not None:  # gate or up alone
            return [(dim, tp.rank * width, width)]
        return [(dim, s * whole + tp.rank * width, width) for s in (0, 1)]  # gate | up
    row = {"o_proj": local.q_size, "down_proj": local.intermediate_size,
           "shared_down": local.shared_expert_intermediate_size,
           "experts_down": local.moe_intermediate_size}
    if module in row:  # row-parallel: this rank's columns; the bias on rank 0
        return [(1, tp.rank * row[module], row[module])] if leaf == "weight" else "rank0"
    if leaf == "experts_down":
        return [(2 if stacked else 1, tp.rank * row[leaf], row[leaf])]
    return None


def dp_attention_slice(pname: str, dp: DataParallelAttention, local: ModelConfig
                       ) -> list[Part] | str | None:
    """Which part of a checkpoint tensor a data-parallel-attention rank loads into ``pname``
    (as ``tp_slice``): its rows of gate | up, its columns of down (the bias on rank 0 alone),
    everything else whole."""
    parts = pname.split(".")
    module = parts[-2] if len(parts) > 1 else ""
    width = local.intermediate_size
    if module == "gate_up_proj":
        return [(0, dp.rank * width, width)]
    if module == "down_proj":
        return [(1, dp.rank * width, width)] if parts[-1] == "weight" else "rank0"
    return None


def load_rank_part(dst: torch.Tensor, tensor: Any, part: list[Part] | str | None,
                    rank: int) -> None:
    """Copy ``part`` of ``tensor`` (``tp_slice``, ``dp_attention_slice``) into ``dst``."""
    if part is None:
        dst.copy_(read_part(tensor))
    elif part == "rank0":
        if rank == 0:
            dst.copy_(read_part(tensor))
        else:
            dst.zero_()
    else:
        offset = 0
        for dim, start, size in part:
            # narrow: the last vocabulary slice has fewer rows than the padding
            dst.narrow(dim, offset, size).copy_(read_part(tensor, dim, start, size))
            offset += size


def pieces_of(cfg: ModelConfig, pname: str, p: torch.Tensor) -> set[tuple[int | None, int | None]]:
    """The (expert, shard) pieces a parameter loads from: experts and shards it packs."""
    experts = range(p.shape[0]) if pname.split(".")[-1].startswith("experts_") else [None]
    packed = packed_module(pname)
    shards = range(len(shard_sizes(cfg, packed))) if packed else [None]
    return {(e, s) for e in experts for s in shards}


def packed_module(pname: str) -> str | None:
    """The packed module a parameter belongs to (an expert scale's too), or None."""
    return next((m.removesuffix("_scale") for m in pname.split(".")
                 if m.removesuffix("_scale") in PACKED_MODULES), None)
