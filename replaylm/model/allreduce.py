"""How tensor-parallel ranks sum a tensor: torch.distributed (NCCL on CUDA, gloo on CPU) or
torch's symmetric-memory all-reduce (``torch.ops.symm_mem``), chosen per message size.

``EngineArgs.all_reduce_backend``:

- ``nccl``: every all-reduce is ``torch.distributed.all_reduce`` on the group.
- ``symm_mem``: messages up to ``max(MEASURED_TOKENS)`` rows of the hidden size run on
  symmetric memory, each size bucket with the faster of its two algorithms (measured: one-shot,
  where each rank reads every peer's buffer and sums, or two-shot, a reduce-scatter then an
  all-gather through the peers' buffers); larger messages run on NCCL. It must be able to work
  (CUDA, bfloat16 or float32, torch with the ops): otherwise start-up fails naming the setting.
- ``auto``: the same measurement with NCCL among the candidates, so each bucket takes the
  fastest of the three; where symmetric memory is unavailable, NCCL (gloo on CPU), with the
  reason in the report.

The measurement runs once at start-up, after the model is loaded and before any capture: for
each bucket (``hidden_size × tokens`` elements of the model dtype, ``tokens`` in
``MEASURED_TOKENS``) and each candidate, ``TIMED_CALLS`` all-reduces are captured in one CUDA
graph and replayed (launch overhead excluded, as inside a decode graph), best of ``TRIALS``.
The ranks take the largest latency any of them measured (an all-reduce costs what its slowest
rank sees), so every rank derives the same plan, which their collectives require: each
message's algorithm depends only on its size and the plan.

A message runs the algorithm of the smallest bucket at least its size (the latency measured
at that bucket's upper end), NCCL above the largest bucket. The symmetric buffer is allocated
once, at the largest bucket, before capture; the captured graphs read fixed addresses.

Every all-reduce of the group must be issued in the same order on every rank and never two at
once (they share one buffer and its signal pads), which the engine's single stream of model
calls guarantees. Multicast (``multimem``) ops are not used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from replaylm.capture import graph_replay_us

NCCL, ONE_SHOT, TWO_SHOT = "nccl", "one_shot", "two_shot"
#: Decode-sized messages measured at start-up, in rows of the hidden size; the largest is the
#: symmetric buffer's size and the largest message symmetric memory carries.
MEASURED_TOKENS = (1, 8, 64, 256)
TIMED_CALLS = 20  # all-reduces captured in one timed graph
TRIALS = 5  # timed replays; the best counts
SYMM_MEM_DTYPES = (torch.bfloat16, torch.float32)  # what torch's symm_mem kernels dispatch
TWO_SHOT_WORLD_SIZES = (2, 4, 8)  # two_shot_all_reduce_out's instantiated world sizes
ALIGN = 16  # the kernels store up to 16-byte vectors into the output


def symm_mem_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why torch's symmetric-memory all-reduce cannot run here, or None when it can."""
    if device.type != "cuda":
        return f"symmetric memory needs CUDA tensors (device {device.type})"
    if dtype not in SYMM_MEM_DTYPES:
        return (f"torch's symmetric-memory all-reduce supports bfloat16 and float32, not "
                f"{str(dtype).removeprefix('torch.')}")
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as e:
        return f"torch {torch.__version__} has no torch.distributed._symmetric_memory ({e})"
    missing = [name for name in ("one_shot_all_reduce_out", "two_shot_all_reduce_")
               if not hasattr(torch.ops.symm_mem, name)]
    if missing or not hasattr(symm_mem, "empty") or not hasattr(symm_mem, "rendezvous"):
        return (f"torch {torch.__version__} lacks torch.ops.symm_mem."
                f"{', '.join(missing) or 'empty/rendezvous'}")
    return None


def pick_plan(latency_us: dict[int, dict[str, float]], allowed: Sequence[str]
              ) -> tuple[tuple[int, str], ...]:
    """``(max_bytes, algorithm)`` per measured bucket, ascending: the fastest of ``allowed``
    measured at that bucket (``latency_us[bytes][algorithm]``); a tie goes to the earlier
    of ``allowed``. A bucket where none of ``allowed`` was measured runs NCCL."""
    plan = []
    for nbytes in sorted(latency_us):
        times = latency_us[nbytes]
        timed = [a for a in allowed if a in times]
        best = min(timed, key=lambda a: (times[a], allowed.index(a))) if timed else NCCL
        plan.append((nbytes, best))
    return tuple(plan)


def plan_summary(plan: Sequence[tuple[int, str]], row_bytes: int) -> str:
    """The plan in words, by rows of the hidden size: ``one_shot up to 64 tokens, nccl
    above``."""
    runs: list[tuple[int, str]] = []  # (last bucket, algorithm) of each run of one algorithm
    for nbytes, algo in plan:
        if runs and runs[-1][1] == algo:
            runs.pop()
        runs.append((nbytes, algo))
    while runs and runs[-1][1] == NCCL:  # NCCL at the top joins "above"
        runs.pop()
    if not runs:
        return f"{NCCL} for every size"
    parts = [f"{algo} up to {nbytes // row_bytes} tokens" for nbytes, algo in runs]
    return ", ".join(parts + [f"{NCCL} above"])


class AllReducer:
    """The sum behind ``TensorParallel.all_reduce``: ``torch.distributed.all_reduce`` until
    ``configure`` sets a plan, then per message the plan's algorithm. ``report`` (a JSON-ready
    dict: setting, plan, measured latencies, reason) is what the engine's stats show."""

    def __init__(self) -> None:
        self.plan: tuple[tuple[int, str], ...] = ()
        self.buffer: torch.Tensor | None = None  # the symmetric buffer (flat)
        self.group_name = ""
        self.report: dict | None = None

    def __call__(self, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        """Sum ``x`` across the group's ranks, in place; returns ``x``."""
        algo = self.algorithm(x)
        if algo == NCCL:
            dist.all_reduce(x, group=group)
            return x
        return symm_all_reduce(x, self.buffer, self.group_name, algo)

    def algorithm(self, x: torch.Tensor) -> str:
        """The algorithm the plan gives ``x`` (NCCL for what symmetric memory cannot take)."""
        if not self.plan:
            return NCCL
        nbytes = x.numel() * x.element_size()
        algo = next((a for limit, a in self.plan if nbytes <= limit), NCCL)
        if algo != NCCL and not self._fits(x):
            return NCCL
        return algo

    def _fits(self, x: torch.Tensor) -> bool:
        buf = self.buffer
        return (buf is not None and x.dtype == buf.dtype and x.device == buf.device
                and x.is_contiguous() and x.numel() <= buf.numel()
                and (x.numel() * x.element_size()) % 4 == 0 and x.data_ptr() % ALIGN == 0)

    # Start-up ----------------------------------------------------------------------------

    def configure(self, setting: str, group: dist.ProcessGroup, hidden_size: int,
                  dtype: torch.dtype, device: torch.device) -> dict:
        """Decide the plan for ``EngineArgs.all_reduce_backend`` = ``setting`` (a collective:
        every rank of ``group`` calls it with the same arguments); returns ``report``. A second
        call keeps the first plan. ``ValueError`` naming the setting when ``symm_mem`` cannot
        work here."""
        if self.report is not None:
            return self.report
        plain = NCCL if device.type == "cuda" else "gloo"
        report: dict = {"setting": setting, "summary": f"{plain} for every size",
                        "choice": {}, "latency_us": {}}
        self.report = report
        if setting == NCCL:
            report["reason"] = "EngineArgs.all_reduce_backend='nccl'"
            return report
        why = symm_mem_unavailable(device, dtype)
        if why is None:
            why = self._allocate(group, hidden_size * max(MEASURED_TOKENS), dtype, device)
        if why is not None:
            if setting == "symm_mem":
                raise ValueError(f"EngineArgs.all_reduce_backend='symm_mem' cannot work here: "
                                 f"{why}; use 'auto' or 'nccl'")
            report["reason"] = f"{why}: the all-reduce runs on {plain}"
            return report
        row_bytes = hidden_size * self.buffer.element_size()
        algos = [NCCL, ONE_SHOT] + ([TWO_SHOT] if group.size() in TWO_SHOT_WORLD_SIZES else [])
        latency = self._measure(group, hidden_size, algos)
        allowed = algos if setting == "auto" else [a for a in algos if a != NCCL]
        self.plan = pick_plan(latency, allowed)
        report["summary"] = plan_summary(self.plan, row_bytes)
        report["choice"] = {str(n // row_bytes): a for n, a in self.plan}
        report["latency_us"] = {str(n // row_bytes): {a: round(t, 2) for a, t in times.items()}
                                for n, times in sorted(latency.items())}
        report["reason"] = (f"measured at start-up: the fastest of {', '.join(allowed)} per "
                            f"message size (the largest latency over the {group.size()} ranks)")
        if not any(a != NCCL for _, a in self.plan):
            self._release()
        return report

    def _allocate(self, group: dist.ProcessGroup, numel: int, dtype: torch.dtype,
                  device: torch.device) -> str | None:
        """Allocate and rendezvous the symmetric buffer, and check each algorithm's sum
        once; every rank learns whether all ranks succeeded. None, or why not."""
        import torch.distributed._symmetric_memory as symm_mem

        why = None
        try:
            self.buffer = symm_mem.empty(numel, dtype=dtype, device=device)
            symm_mem.rendezvous(self.buffer, group.group_name)
            self.group_name = group.group_name
            why = self._check_sums(group)
        except Exception as e:  # a probe: whatever torch or the driver refuses, NCCL runs
            why = f"symmetric memory set-up failed ({type(e).__name__}: " \
                  f"{(str(e).splitlines() or [''])[0]})"
        failed = torch.tensor([int(why is not None)], dtype=torch.int64)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)  # CPU: gloo
        if failed.item() and why is None:
            why = "symmetric memory set-up failed on another rank"
        if why is not None:
            self._release()
        return why

    def _check_sums(self, group: dist.ProcessGroup) -> str | None:
        """One all-reduce of small integers (exact in any order) per algorithm, eagerly."""
        n, rank, size = self.buffer.numel(), group.rank(), group.size()
        values = torch.arange(n, device=self.buffer.device) % 7
        want = (values * size + sum(range(size))).to(self.buffer.dtype)
        algos = [ONE_SHOT] + ([TWO_SHOT] if size in TWO_SHOT_WORLD_SIZES else [])
        for algo in algos:
            x = (values + rank).to(self.buffer.dtype)
            symm_all_reduce(x, self.buffer, self.group_name, algo)
            if not torch.equal(x, want):
                return f"torch.ops.symm_mem {algo} all-reduce returned wrong sums"
        return None

    def _measure(self, group: dist.ProcessGroup, hidden_size: int, algos: Sequence[str]
                 ) -> dict[int, dict[str, float]]:
        """``latency_us[bytes][algorithm]`` per measured bucket, the ranks' largest."""
        buf = self.buffer
        sizes = [hidden_size * t for t in MEASURED_TOKENS]
        local = torch.zeros(len(sizes), len(algos), dtype=torch.float64)
        for i, numel in enumerate(sizes):
            x = torch.zeros(numel, dtype=buf.dtype, device=buf.device)
            for j, algo in enumerate(algos):
                if algo == NCCL:
                    def call(x=x) -> None:
                        dist.all_reduce(x, group=group)
                else:
                    def call(x=x, algo=algo) -> None:
                        symm_all_reduce(x, buf, self.group_name, algo)
                local[i, j] = graph_latency_us(call)
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)  # CPU: gloo
        row = buf.element_size()
        return {numel * row: {a: float(local[i, j]) for j, a in enumerate(algos)}
                for i, numel in enumerate(sizes)}

    def _release(self) -> None:
        self.buffer, self.group_name, self.plan = None, "", ()


def symm_all_reduce(x: torch.Tensor, buffer: torch.Tensor, group_name: str, algo: str
                    ) -> torch.Tensor:
    """Sum ``x`` (contiguous, 16-byte aligned, at most ``buffer``'s size, its dtype) across
    the group through the rendezvoused symmetric ``buffer``, in place; returns ``x``.

    ``x`` is copied into the head of the buffer by its own kernel (the ops read peers'
    buffers, never ``x`` itself), so the whole copy has finished before the all-reduce
    kernel's opening barrier tells the peers to read; the kernel writes the sum into ``x``.
    (``one_shot_all_reduce_copy_out`` would save that launch, but its kernel signals the
    peers without a block-wide ``__syncthreads`` after its copy, so a peer may read a
    slot another thread of the block has not written yet.) Each kernel ends with a barrier across
    the ranks, so the next call's copy cannot overwrite a buffer a peer still reads."""
    flat = x.view(-1)
    staged = buffer[: flat.numel()]  # offset 0: the alignment the kernels check
    staged.copy_(flat)
    ops = torch.ops.symm_mem
    if algo == ONE_SHOT:
        ops.one_shot_all_reduce_out(staged, "sum", group_name, flat)
    elif algo == TWO_SHOT:
        if hasattr(ops, "two_shot_all_reduce_out"):
            ops.two_shot_all_reduce_out(staged, "sum", group_name, flat)
        else:
            ops.two_shot_all_reduce_(staged, "sum", group_name)
            flat.copy_(staged)
    else:
        raise ValueError(f"unknown symmetric-memory all-reduce {algo!r}")
    return x


def graph_latency_us(call: Callable[[], None], calls: int = TIMED_CALLS,
                     trials: int = TRIALS) -> float:
    """Device time of one collective ``call``: ``calls`` of them captured in one CUDA graph,
    best of ``trials`` replays. Each timed replay follows an untimed one, enqueued back to
    back, so it starts when the ranks leave that replay's last collective together (not when
    each host happened to launch it). Every rank of the group must call this in step."""
    return graph_replay_us(lambda i: call(), calls, trials, settle=True)
