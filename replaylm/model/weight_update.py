"""In-place weight updates: new weights written into the buffers a model already has.

``update_weights(model, source)`` takes a checkpoint directory (safetensors, the names and
sharding the loader reads) or ``(name, tensor)`` pairs in Hugging Face names (a mapping too;
CPU or CUDA tensors, in any order; one call may cover any part of the model, so an update
may come in several buckets). Each tensor goes where loading would put it (``loader.
WeightMap``: the fused qkv and gate | up shards, each expert's slice of the packed expert
tensors, this rank's tensor-parallel or data-parallel-attention part, the embedding that
is also the tied LM head), copied with ``copy_`` into the view of the existing parameter:
no parameter is replaced or reallocated, so CUDA graphs captured against these buffers
replay with the new weights.

Every tensor of a call is checked before any is copied: a name the model has no place for,
a shape other than the checkpoint's, or a dtype that is not floating point raises
``ValueError`` naming the tensor, and the model keeps its old weights. A float of another
dtype is cast on copy, as loading casts it.

Across processes (``distributed``) the source travels as ``wire_source`` makes it: a
directory as its path (every rank reads its own slices), tensors as one pickled blob of CPU
tensors (``pack_tensors``), which each rank unpacks (``from_wire``).
"""

from __future__ import annotations

import io
import pickle
import time
from collections.abc import Iterable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from replaylm.model.config import ModelConfig
from replaylm.model.llama import CausalLM
from replaylm.model.loader import checkpoint_files
from replaylm.model.weight_map import Placement, WeightMap

#: What ``update_weights`` takes: a checkpoint directory, or ``(name, tensor)`` pairs.
Source = str | Path | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class WeightUpdate:
    """What one ``update_weights`` call copied: checkpoint ``tensors`` written (those the
    model reads nowhere, as a tied LM head, are not counted), their ``bytes`` as given (the
    whole checkpoint tensors; a tensor-parallel rank copies its part of each), and the
    call's wall ``seconds``; ``audit``: the graph audit's summary when ``graph_check`` ran
    one after the update."""

    tensors: int
    bytes: int
    seconds: float
    audit: dict | None = None


@torch.no_grad()
def update_weights(model: CausalLM, source: Source,
                   full_cfg: ModelConfig | None = None) -> WeightUpdate:
    """Write ``source``'s tensors into ``model``'s parameters in place, all checked first.
    ``full_cfg``: the whole model's config for a tensor-parallel or data-parallel-attention
    shard (``weight_map.WeightMap``)."""
    t0 = time.perf_counter()
    weights = WeightMap(model, full_cfg)
    with ExitStack() as files:
        tensors = _tensors_of(source, files)
        plan: list[tuple[Placement, Any]] = []
        for name, tensor in tensors:
            try:
                place = weights.place(name)
                if place is not None:
                    place.check(tensor)
            except ValueError as e:
                raise ValueError(f"update_weights: {e}") from None
            if place is not None:
                plan.append((place, tensor))
        nbytes = 0
        for place, tensor in plan:
            place.write(tensor)
            nbytes += _nbytes(tensor)
    device = model.embed_tokens.weight.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the caller may reuse its source tensors now
    return WeightUpdate(len(plan), nbytes, time.perf_counter() - t0)


def _tensors_of(source: Source, files: ExitStack) -> list[tuple[str, Any]]:
    """``source``'s ``(name, tensor)`` pairs; a directory's as safetensors slices (shapes and
    dtypes known before any data is read), its files kept open by ``files``."""
    if isinstance(source, str | Path):
        path = Path(source)
        if not path.is_dir():
            raise ValueError(f"update_weights: {source} is not a checkpoint directory")
        try:
            paths = checkpoint_files(path)
        except FileNotFoundError as e:
            raise ValueError(f"update_weights: {e}") from e
        out = []
        for f in paths:
            try:
                st = files.enter_context(safe_open(str(f), framework="pt", device="cpu"))
                out += [(name, st.get_slice(name)) for name in st.keys()]  # noqa: SIM118
            except Exception as e:  # safetensors raises its own error type for corrupt files
                raise ValueError(f"unreadable safetensors file {f}: {e}") from e
        return out
    return [(name, tensor.detach()) for name, tensor in _pairs(source)]


def _pairs(source: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
           ) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs of an iterable or a mapping, checked to be such."""
    pairs = list(source.items() if isinstance(source, Mapping) else source)
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, tuple | list) and len(pair) == 2 and isinstance(pair[0], str)
                and isinstance(pair[1], torch.Tensor)):
            raise ValueError(f"update_weights: item {i} ({type(pair).__name__}) is not a "
                             "(name, tensor) pair of a str and a torch.Tensor")
    return [(name, tensor) for name, tensor in pairs]


def _nbytes(tensor: Any) -> int:
    if isinstance(tensor, torch.Tensor):
        return tensor.numel() * tensor.element_size()
    shape = tensor.get_shape()
    numel = 1
    for d in shape:
        numel *= d
    dtype = tensor.get_dtype()
    return numel * (1 if dtype.startswith("F8") else _SAFETENSORS_BYTES.get(dtype, 1))


_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


# Across processes -----------------------------------------------------------------------------


def wire_source(source: Source) -> str | bytes:
    """``source`` as it crosses to worker processes: a directory's path, or the tensors as
    one blob of CPU tensors (``pack_tensors``)."""
    if isinstance(source, str | Path):
        return str(source)
    return pack_tensors(source)


def from_wire(source: str | bytes) -> Source:
    """What a worker passes to ``update_weights`` for a ``wire_source``."""
    return unpack_tensors(source) if isinstance(source, bytes) else source


def pack_tensors(source: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
                 ) -> bytes:
    """The pairs pickled with their tensors on the CPU, each holding its own data only (a
    view of a larger buffer would pickle the whole buffer)."""
    out = []
    for name, t in _pairs(source):
        t = t.detach().to("cpu").contiguous()
        if t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()
        out.append((name, t))
    buf = io.BytesIO()
    pickle.dump(out, buf, protocol=pickle.HIGHEST_PROTOCOL)
    return buf.getvalue()


def unpack_tensors(blob: bytes) -> list[tuple[str, torch.Tensor]]:
    return pickle.loads(blob)
