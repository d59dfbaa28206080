"""Persistent device batch state: every step's inputs live in tensors allocated once.

Graphs capture these addresses; eager steps that fit read prefixes of the same tensors, so
both paths share one layout and one copy routine.

Per step the host writes one pinned staging row and makes **one** host-to-device copy of it.
The row packs, at fixed offsets: host-known token ids, the token gather index, positions,
slot mapping, logits rows, sampled slots and output positions (int64), then
``cu_seqlens_q``, ``kv_lens`` and request slots (int32, in the same bytes). Two staging rows
alternate, so the host fills step N+1's while step N's copy may still be queued.

Inputs that stay on the device:

- ``last_token`` ``[S+1]``: each slot's newest sample, written by the step that sampled it.
  It sits right before the host ids in one tensor, so a step's ``input_ids`` are one gather:
  row ``t`` reads ``host_ids[t]`` (index ``S+1+t``) or ``last_token[slot]`` (index ``slot``).
- ``slot_tables`` ``[S+1, max_blocks]``: each slot's block table, updated incrementally (only
  the blocks a request gained since its last step are copied). A step's block table is a
  gather of its requests' rows. Row ``S`` is all zeros: padded requests point at it.
- ``token_bitmask`` ``[S+1, ceil(V/32)]`` int32 and ``bitmask_on`` ``[S+1]`` int32 (with
  ``vocab_size``): each slot's structured-output token mask and whether it applies
  (``sampling.bitmask``), written by ``replaylm.structured`` before a step that samples a
  constrained request. Row ``S`` (the scratch slot) is never on.
- ``sampling`` (``sampling.SamplingState``, the runner's): each slot's temperature and seed,
  by which the step's tail samples. Its row ``S`` is greedy.

Padding (``replaylm.batch``): padded tokens write scratch block 0 and belong to no request
(``cu_seqlens_q[B..] = T``), padded requests have ``kv_lens = 0`` and the zero table row,
padded logits rows read row 0 and write their sample to the scratch slot ``S``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from replaylm.batch import AttentionMetadata, ForwardBatch, HostBatch
from replaylm.sampling.bitmask import bitmask_words
from replaylm.sampling.sampler import SamplingState


@dataclass(frozen=True)
class _Region:
    start: int  # offset in elements of the region's dtype
    size: int
    int32: bool  # int32 (packed two per int64 element) or int64


class StaticBuffers:
    """Device inputs for steps of up to ``max_tokens`` tokens and ``max_reqs`` requests.

    ``max_num_seqs`` (S) is the number of request slots of the engine; ``max_logits`` the
    most sampled rows of a step (``max_reqs`` unless a verify step samples several rows per
    request).
    """

    def __init__(self, max_tokens: int, max_reqs: int, max_num_seqs: int, max_blocks: int,
                 device: torch.device, max_kv_len: int, max_logits: int | None = None,
                 vocab_size: int | None = None) -> None:
        self.max_tokens, self.max_reqs, self.max_kv_len = max_tokens, max_reqs, max_kv_len
        self.max_logits = max_reqs if max_logits is None else max_logits
        n_l = self.max_logits
        self.num_slots = max_num_seqs
        self.scratch_slot = max_num_seqs
        self.max_blocks = max_blocks
        self.device = device
        pin = device.type == "cuda"
        t, r, s1 = max_tokens, max_reqs, max_num_seqs + 1

        # int64 layout of the device tensor; the staging row covers everything after
        # last_token. int32 arrays are packed two per int64 element at the end.
        offset = s1
        regions: dict[str, _Region] = {}
        for name, size in (("host_ids", t), ("gather", t), ("positions", t),
                           ("slot_mapping", t), ("logits_indices", n_l), ("sample_slots", n_l),
                           ("sample_out_pos", n_l)):
            regions[name] = _Region(offset, size, int32=False)
            offset += size
        i32_start = 2 * offset
        for name, size in (("cu_seqlens_q", r + 1), ("kv_lens", r), ("req_slots", r)):
            regions[name] = _Region(i32_start, size, int32=True)
            i32_start += size
        total = (i32_start + 1) // 2
        self._regions = regions
        self._copy_start, self._copy_end = s1, total

        self._dev = torch.zeros(total, dtype=torch.int64, device=device)
        self._stages = [torch.zeros(total, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._flip = 0
        dev32 = self._dev.view(torch.int32)

        def dev(name: str) -> torch.Tensor:
            reg = regions[name]
            base = dev32 if reg.int32 else self._dev
            return base[reg.start: reg.start + reg.size]

        self.last_token = self._dev[:s1]
        self.token_source = self._dev[: s1 + t]  # last_token ++ host_ids: the ids gather table
        self.gather = dev("gather")
        self.positions = dev("positions")
        self.slot_mapping = dev("slot_mapping")
        self.logits_indices = dev("logits_indices")
        self.sample_slots = dev("sample_slots")
        self.sample_out_pos = dev("sample_out_pos")
        self.cu_seqlens_q = dev("cu_seqlens_q")
        self.kv_lens = dev("kv_lens")
        self.req_slots = dev("req_slots")
        # Gather outputs, written on the device at the start of every step.
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=device)
        self.block_table = torch.zeros(r, max_blocks, dtype=torch.int32, device=device)
        self.slot_tables = torch.zeros(s1, max_blocks, dtype=torch.int32, device=device)
        # Block-table updates: flat index then block id, int32, in one staging row per flip.
        cap = max_num_seqs * max_blocks
        self._upd_dev = torch.zeros(2 * cap, dtype=torch.int32, device=device)
        self._upd_stages = [torch.zeros(2 * cap, dtype=torch.int32, pin_memory=pin)
                            for _ in range(2)]
        words = bitmask_words(vocab_size) if vocab_size is not None else 1
        self.token_bitmask = torch.zeros(s1, words, dtype=torch.int32, device=device)
        self.bitmask_on = torch.zeros(s1, dtype=torch.int32, device=device)
        # The sampling settings the tail draws by (``whole.step_tail``); None: argmax only.
        # Set by the runner before capture.
        self.sampling: SamplingState | None = None
        # Host mirror: whether any slot's flag is on. Eager steps skip the mask op while it
        # is False (graphs always run it: a flag-0 row is left as it is).
        self.bitmask_any = False

    def getters(self) -> dict[str, object]:
        """Name -> getter of every static buffer (for the stand-in's address checks)."""
        names = ("input_ids", "token_source", "gather", "positions", "slot_mapping",
                 "cu_seqlens_q", "kv_lens", "req_slots", "block_table", "slot_tables",
                 "logits_indices", "sample_slots", "sample_out_pos", "token_bitmask",
                 "bitmask_on")
        return {n: (lambda n=n: getattr(self, n)) for n in names}

    def fill_padding(self) -> None:
        """An all-padding batch (what a capture records): every token writes block 0, reads
        token 0, and samples into the scratch slot."""
        for t in (self.input_ids, self.positions, self.slot_mapping, self.kv_lens,
                  self.cu_seqlens_q, self.block_table, self.logits_indices, self.sample_out_pos):
            t.zero_()
        self.gather.fill_(self.num_slots + 1)
        self.req_slots.fill_(self.scratch_slot)
        self.sample_slots.fill_(self.scratch_slot)

    def fits(self, host: HostBatch) -> bool:
        return host.num_tokens <= self.max_tokens and host.num_reqs <= self.max_reqs \
            and host.num_sampled <= self.max_logits

    def view(self, num_tokens: int, num_reqs: int, num_logits: int, max_q_len: int,
             max_kv_len: int | None = None) -> ForwardBatch:
        """Fixed-shape views of the buffers (one graph tier, or an unpadded eager step)."""
        meta = AttentionMetadata(
            cu_seqlens_q=self.cu_seqlens_q[: num_reqs + 1],
            kv_lens=self.kv_lens[:num_reqs],
            block_table=self.block_table[:num_reqs],
            slot_mapping=self.slot_mapping[:num_tokens],
            num_tokens=num_tokens,
            num_reqs=num_reqs,
            max_q_len=max_q_len,
            max_kv_len=self.max_kv_len if max_kv_len is None else max_kv_len,
        )
        return ForwardBatch(
            input_ids=self.input_ids[:num_tokens],
            positions=self.positions[:num_tokens],
            meta=meta,
            logits_indices=self.logits_indices[:num_logits],
            sample_slots=self.sample_slots[:num_logits],
            sample_out_pos=self.sample_out_pos[:num_logits],
            gather=self.gather[:num_tokens],
            req_slots=self.req_slots[:num_reqs],
        )

    def gather_inputs(self, b: ForwardBatch, embedding: torch.Tensor | None = None,
                      fused: bool = False) -> torch.Tensor | None:
        """On the device: input ids (host ids or previous samples) and the step's block table;
        with ``embedding`` (the model's token embedding) also the ids' embedding rows, which
        are returned. ``fused``: all three in one Triton launch (``kernels.step_inputs``),
        the first node of a graph; else two index_selects (and the lookup).
        """
        if fused and embedding is not None:
            from replaylm.kernels.step_inputs import gather_step_inputs

            return gather_step_inputs(self.token_source, b.gather, b.input_ids,
                                      self.slot_tables, b.req_slots, b.meta.block_table,
                                      embedding)
        torch.index_select(self.token_source, 0, b.gather, out=b.input_ids)
        torch.index_select(self.slot_tables, 0, b.req_slots, out=b.meta.block_table)
        return None if embedding is None else torch.nn.functional.embedding(b.input_ids,
                                                                             embedding)

    def update_block_tables(self, host: HostBatch) -> None:
        """Copy the blocks requests gained since their last step into ``slot_tables``."""
        u = len(host.table_index)
        if u == 0:
            return
        stage = self._upd_stages[self._flip]
        a = stage.numpy()
        a[:u] = host.table_index
        a[u: 2 * u] = host.table_value
        self._upd_dev[: 2 * u].copy_(stage[: 2 * u], non_blocking=True)
        self.slot_tables.view(-1).index_put_((self._upd_dev[:u],), self._upd_dev[u: 2 * u])

    def load(self, host: HostBatch, num_tokens: int, num_reqs: int, num_logits: int) -> None:
        """Stage a real batch, padded up to the given sizes, and copy it to the device."""
        t, b, n_l = host.num_tokens, host.num_reqs, host.num_sampled
        assert t <= num_tokens <= self.max_tokens and b <= num_reqs <= self.max_reqs
        assert n_l <= num_logits <= self.max_logits
        stage = self._stages[self._flip]
        self._flip ^= 1
        a64 = stage.numpy()
        a32 = a64.view(np.int32)
        reg = self._regions

        def put(name: str, src: np.ndarray, n: int, pad: int) -> None:
            r = reg[name]
            arr = a32 if r.int32 else a64
            _fill(name, arr[r.start: r.start + r.size], src, n, pad)

        put("host_ids", host.input_ids, num_tokens, 0)
        g = np.arange(self.num_slots + 1, self.num_slots + 1 + num_tokens, dtype=np.int64)
        g[host.from_device_rows] = host.from_device_slots
        put("gather", g, num_tokens, 0)
        put("positions", host.positions, num_tokens, 0)
        put("slot_mapping", host.slot_mapping, num_tokens, 0)  # padding -> scratch block 0
        put("logits_indices", host.logits_indices, num_logits, 0)
        put("sample_slots", host.sample_slots, num_logits, self.scratch_slot)
        put("sample_out_pos", host.sample_out_pos, num_logits, 0)
        # Every slot past the real ones is empty, up to the largest view's: any view (and the
        # piecewise links, which see all slots) then ends at the real token count.
        put("cu_seqlens_q", host.cu_seqlens_q, self.max_reqs + 1, t)
        put("kv_lens", host.kv_lens, num_reqs, 0)
        put("req_slots", host.req_slots, num_reqs, self.scratch_slot)
        lo, hi = self._copy_start, self._copy_end
        self._dev[lo:hi].copy_(stage[lo:hi], non_blocking=True)


def _fill(name: str, dst: np.ndarray, src: np.ndarray, n: int, pad: int) -> None:
    """Write ``src`` into staging region ``name`` and pad it up to ``n`` entries."""
    k = len(src)
    dst[:k] = src
    dst[k:n] = pad


class StepUploads:
    """A step's small per-row arrays (a verify's drafts and segment starts, its penalty
    counts) copied to the device from pinned memory. A copy from pageable memory is staged
    by the CUDA driver, which may first wait for the stream: verify steps copying these rows
    from pageable memory measured slower, and pipelined ones barely overlapped
    (``docs/benchmarks.md``). Two pinned staging rows alternate like ``StaticBuffers``'; all
    of a step's arrays travel in one copy into one device row, which the next step's copy
    overwrites only after this step's kernels in stream order. A step whose arrays exceed
    ``capacity`` elements copies them from pageable memory."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.device = device
        self._stages = [torch.zeros(capacity, dtype=torch.int64, pin_memory=pin)
                        for _ in range(2)]
        self._dev = torch.zeros(capacity, dtype=torch.int64, device=device)
        self._flip = 0

    def upload(self, *arrays: np.ndarray | None) -> list[torch.Tensor | None]:
        """Device int64 copies of ``arrays`` (None stays None), valid for this step only."""
        total = sum(len(a) for a in arrays if a is not None)
        if total > len(self._dev):
            return [None if a is None else torch.from_numpy(a).to(self.device, non_blocking=True)
                    for a in arrays]
        stage = self._stages[self._flip]
        self._flip ^= 1
        staged = stage.numpy()
        spans: list[tuple[int, int] | None] = []
        at = 0
        for a in arrays:
            if a is None:
                spans.append(None)
                continue
            staged[at: at + len(a)] = a
            spans.append((at, at + len(a)))
            at += len(a)
        if at:
            self._dev[:at].copy_(stage[:at], non_blocking=True)
        return [None if s is None else self._dev[s[0]: s[1]] for s in spans]
