"""The device side of LoRA: ``max_loras`` adapter slots and the per-token slot index.

Static buffers, allocated once before the KV pool (so the KV sizing counts them) and never
reallocated (graphs bake their addresses in):

* per group (qkv, o, gate_up, down; ``peft.groups``) ``a`` ``[layers, L, S*R, in]`` and ``b``
  ``[layers, L, out, R]``, ``L`` = ``max_loras``, ``R`` = ``max_lora_rank``: an adapter of
  rank ``r`` fills segment ``j``'s rows ``j*R .. j*R + r`` of ``a`` and columns ``..r`` of
  ``b``, zeros elsewhere;
* ``ranks`` ``[groups, layers, L]`` int32 (0: that slot adds nothing to that projection) and
  ``scales`` ``[L]`` fp32;
* ``token_slots`` ``[max_tokens]`` int32: each packed token's slot, -1 for base-model tokens
  and padding. The model runner writes it before every step (``set_step``); the layers read
  its first ``T`` entries, so every graph tier reads the same tensor.

Each decoder layer gets a ``LayerLoRA`` hook (``DecoderLayer.lora``) that returns a group's
adapters for the step (``kernels.ref.LoRAGroup``: that layer's ``a`` and ``b``, the ranks,
scales and token slots) for the projection op, which launches the shrink right before the
projection (``kernels.lora.lora_shrink`` on CUDA, ``kernels.ref.lora_shrink`` elsewhere)
and folds the delta into its epilogue or adds it after it (``kernels.ops`` /
``kernels.ref``).
"""

from __future__ import annotations

import numpy as np
import torch

from replaylm.kernels import ref
from replaylm.kernels.ref import LoRAGroup
from replaylm.lora.peft import GROUP_NAMES, HostAdapter, groups
from replaylm.model.config import ModelConfig


class LoRASlots:
    def __init__(self, cfg: ModelConfig, max_loras: int, max_rank: int, max_tokens: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.cfg, self.max_loras, self.max_rank = cfg, max_loras, max_rank
        self.device, self.dtype = device, dtype
        self.groups = groups(cfg)
        layers, n, r = cfg.num_layers, max_loras, max_rank
        self.a = {g.name: torch.zeros(layers, n, len(g.segments) * r, g.in_dim, dtype=dtype,
                                      device=device) for g in self.groups.values()}
        self.b = {g.name: torch.zeros(layers, n, g.out_dim, r, dtype=dtype, device=device)
                  for g in self.groups.values()}
        self.ranks = torch.zeros(len(GROUP_NAMES), layers, n, dtype=torch.int32, device=device)
        self.scales = torch.zeros(n, dtype=torch.float32, device=device)
        self.token_slots = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        pin = device.type == "cuda"
        self._stages = [torch.full((max_tokens,), -1, dtype=torch.int32, pin_memory=pin)
                        for _ in range(2)]
        self._flip = 0
        self._dirty = 0  # leading token_slots entries that may hold a slot (not -1)
        self._index = {name: i for i, name in enumerate(GROUP_NAMES)}

    @staticmethod
    def nbytes(cfg: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype) -> int:
        """Device bytes of the adapter buffers for these settings."""
        size = torch.empty((), dtype=dtype).element_size()
        per_slot = sum((len(g.segments) * g.in_dim + g.out_dim) * max_rank
                       for g in groups(cfg).values())
        return cfg.num_layers * max_loras * per_slot * size

    def hooks(self) -> list[LayerLoRA]:
        """One hook per decoder layer (``DecoderLayer.lora``)."""
        return [LayerLoRA(self, i) for i in range(self.cfg.num_layers)]

    # Slots ---------------------------------------------------------------------------------

    def load(self, slot: int, adapter: HostAdapter) -> None:
        """Write ``adapter`` into ``slot`` on the current stream (non-blocking copies from
        pinned memory on CUDA); the slot must be in no running step's use."""
        r, big = adapter.rank, self.max_rank
        for name, g in self.groups.items():
            a, b = self.a[name][:, slot], self.b[name][:, slot]
            a.zero_()
            b.zero_()
            for j in range(len(g.segments)):
                a[:, j * big:j * big + r].copy_(adapter.a[name][:, j * r:(j + 1) * r],
                                                non_blocking=True)
            b[:, :, :r].copy_(adapter.b[name], non_blocking=True)
        self.ranks[:, :, slot].copy_(adapter.ranks, non_blocking=True)
        self.scales[slot].fill_(adapter.scale)

    def clear(self, slot: int) -> None:
        """Empty ``slot``: its rows add nothing (rank 0)."""
        self.ranks[:, :, slot].zero_()

    # Steps ---------------------------------------------------------------------------------

    def set_step(self, req_slots: np.ndarray | None, cu_seqlens_q: np.ndarray) -> None:
        """Write each packed token's adapter slot (``req_slots``: one per request, -1 for
        the base model; None: no adapter in the step) into ``token_slots``, and -1 past the
        real tokens. One copy of what changed since the last step; none for a step of
        base-model requests after another."""
        num = 0 if req_slots is None else int(cu_seqlens_q[-1])
        width = max(num, self._dirty)
        if width == 0:
            return
        if width > len(self.token_slots):
            raise ValueError(f"a step of {width} tokens is above the LoRA token buffer "
                             f"({len(self.token_slots)})")
        stage = self._stages[self._flip]
        self._flip ^= 1
        host = stage.numpy()
        if num:
            host[:num] = np.repeat(req_slots.astype(np.int32), np.diff(cu_seqlens_q))
        host[num:width] = -1
        self.token_slots[:width].copy_(stage[:width], non_blocking=True)
        self._dirty = num

    def group(self, layer: int, name: str) -> LoRAGroup:
        """Group ``name``'s adapters in ``layer`` for the step, for the projection op."""
        g = self.groups[name]
        shrink_op = ref.lora_shrink
        if self.device.type == "cuda":
            from replaylm.kernels.lora import lora_shrink as shrink_op
        return LoRAGroup(self.a[name][layer], self.b[name][layer], self.token_slots,
                         self.ranks[self._index[name], layer], self.scales, g.segments,
                         shrink_op)


class LayerLoRA:
    """A decoder layer's LoRA hook: ``hook(group)`` is that group's adapters for the step
    (``LoRASlots.group``)."""

    def __init__(self, slots: LoRASlots, layer: int) -> None:
        self.slots, self.layer = slots, layer

    def __call__(self, group: str) -> LoRAGroup:
        return self.slots.group(self.layer, group)
