"""``MultiProcessEngine``: the driver of ``data_parallel_size × tensor_parallel_size``
worker processes.

It offers what ``LLM`` uses of ``EngineCore`` (tokenize, validate, add_request, abort, step,
has_unfinished, stats, graph_stats). It talks to the leader (tensor-parallel rank 0) of each
data-parallel rank, whose engine drives its tensor-parallel followers (``worker``).
Requests go to the data-parallel rank with the least load (tokens of its running and waiting
requests); every step the driver sends each leader one ``("step",)`` and gathers the
replies, so all ranks step together and meet in the tier agreement.

A worker (leader or follower) that exits, faults or does not answer within
``distributed_timeout_s`` makes the driver end every worker and raise ``WorkerError``
naming the rank.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import threading
import weakref
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from time import monotonic
from types import SimpleNamespace

import torch
import torch.multiprocessing as tmp

from replaylm.config import EngineArgs
from replaylm.distributed.rank_stats import summed_graphs, summed_stats
from replaylm.distributed.weights_and_sleep import RanksWeightsAndSleep
from replaylm.distributed.worker import worker_main
from replaylm.engine.loading import load_model_config, load_tokenizer
from replaylm.engine.observer import NO_OBSERVER, StepObserver
from replaylm.engine.outputs import RequestDelta
from replaylm.engine.runner_setup import resolve_device
from replaylm.engine.stats import EngineStats
from replaylm.engine.validation import RequestChecks, resolve_max_model_len
from replaylm.lora.request import LoRARequest
from replaylm.model.parallel import check_dp_attention, check_tensor_parallel
from replaylm.sampling_params import SamplingParams
from replaylm.speculative.stats import SpecStats


@dataclass(frozen=True)
class AddedRequest:
    """What ``add_request`` tells the caller: the prompt's length and the owning rank."""

    request_id: str
    num_prompt_tokens: int
    rank: int


class WorkerError(RuntimeError):
    """A worker (data- or tensor-parallel) died, failed or stopped answering."""


class MultiProcessEngine(RequestChecks, RanksWeightsAndSleep):
    """The ``Engine`` of worker processes. Prompt handling needs only the model's config,
    the tokenizer and the settings, which the driver loads itself (``RequestChecks``, as a
    single engine's)."""

    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.size = args.data_parallel_size
        self.tp = args.tensor_parallel_size
        self.world = self.size * self.tp
        self.leaders = [d * self.tp for d in range(self.size)]  # global rank of each DP rank
        self.timeout_s = args.distributed_timeout_s
        self.model_config, model_dir = load_model_config(args.model)
        check_tensor_parallel(self.model_config, self.tp)
        if args.enable_dp_attention:
            check_dp_attention(self.model_config, self.size)
        self.max_model_len = resolve_max_model_len(args, self.model_config)
        self.tokenizer = load_tokenizer(args, model_dir)
        # One exchange with the workers at a time, whichever thread asks.
        self._lock = threading.RLock()
        self._closed = False
        self._grace_s = [5.0]  # how long workers get to exit when asked (shortened on a fault)
        infos = self._start_workers()
        info = infos[0]
        self.device, self.dtype = info["device"], info["dtype"]
        self.graph_mode = info["graph_mode"]
        self.tune_seconds = info["tune_seconds"]  # rank 0's kernel tuning at start-up
        self.step_observer: StepObserver = NO_OBSERVER
        # The ranks' latest statistics, as their step replies bring them (``live_stats``).
        self._snapshots = [infos[g]["stats"] for g in self.leaders]
        self.rejected = 0  # requests the driver refused before any rank saw them
        self.live_stats = EngineStats(graph_mode=self.graph_mode)
        self._refresh_live()
        self.load = [0] * self.size  # tokens of each rank's running + waiting requests
        self.busy = [False] * self.size  # whether each rank has unfinished work
        self.owner: dict[str, list[int]] = {}  # request id -> [rank, siblings unfinished]
        self.sleep_level = 0  # 0: awake (``sleep``)

    def _start_workers(self) -> list[dict]:
        """Start one worker process per rank on this host; each one's start-up reply."""
        args = self.args
        if resolve_device(args.device).type == "cuda" and self.world > torch.cuda.device_count():
            raise ValueError(
                f"EngineArgs.data_parallel_size={self.size} × tensor_parallel_size={self.tp} "
                f"needs {self.world} GPUs (one per rank), but {torch.cuda.device_count()} are "
                "visible")
        ctx = tmp.get_context("spawn")
        store_dir = tempfile.mkdtemp(prefix="replaylm-dp-")
        init_method = (Path(store_dir) / "store").as_uri()
        self.procs, self.conns = [], []  # every rank's, by global rank
        self._finalizer = weakref.finalize(self, _stop_workers, self.procs, self.conns,
                                           store_dir, self._grace_s)
        # Each leader's pipes to its followers (one message per follower per step).
        tp_pipes = {g: ctx.Pipe(duplex=False) for g in range(self.world) if g % self.tp}
        for rank in range(self.world):
            if rank % self.tp == 0:
                ends = [tp_pipes[f][1] for f in range(rank + 1, rank + self.tp)]
            else:
                ends = [tp_pipes[rank][0]]
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, name=f"replaylm-rank{rank}", daemon=True,
                               args=(rank, init_method, args, child, ends))
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        for recv_end, send_end in tp_pipes.values():
            recv_end.close()
            send_end.close()
        return self._gather(range(self.world), "start")

    # Requests ------------------------------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest | None) -> None:
        """Every data-parallel rank's engine knows ``lora_request``'s adapter (each checks
        it: ``EngineCore.add_lora``)."""
        if lora_request is None:
            return
        for leader in self.leaders:
            status, value = self._call(leader, "add_lora", lora_request)
            if status == "invalid":
                raise ValueError(value)

    def remove_lora(self, name: str) -> bool:
        """Every data-parallel rank forgets the adapter called ``name``."""
        return any([self._call(leader, "remove_lora", name)[1] for leader in self.leaders])

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None,
                    lora_request: LoRARequest | None = None) -> AddedRequest:
        """Queue a request on the least loaded rank (``lora_request``: its LoRA adapter,
        checked by that rank's engine)."""
        params = params or SamplingParams()
        if self.is_sleeping():
            raise RuntimeError("add_request: the engine is asleep: call wake_up() first")
        try:
            if request_id in self.owner:
                raise ValueError(f"request_id {request_id!r} is already in use")
            ids = self.tokenize(prompt)
            self.validate(ids, params)
        except ValueError:
            self.rejected += 1
            self.live_stats.requests_rejected += 1
            raise
        rank = min(range(self.size), key=lambda r: (self.load[r], r))
        status, value = self._call(self.leaders[rank], "add", request_id, ids, params,
                                   lora_request)
        if status == "invalid":
            raise ValueError(value)
        self.load[rank] = value
        self.busy[rank] = True
        self.owner[request_id] = [rank, params.n]
        self.live_stats.requests_added += 1
        self.live_stats.prompt_tokens += len(ids)
        return AddedRequest(request_id, len(ids), rank)

    def abort(self, request_id: str) -> bool:
        """Stop a request on the rank that owns it; False if unknown or done."""
        entry = self.owner.pop(request_id, None)
        if entry is None or self._closed:  # after shutdown nothing runs any more
            return False
        return bool(self._call(self.leaders[entry[0]], "abort", request_id)[1])

    def has_unfinished(self) -> bool:
        return any(self.busy)

    def step(self) -> list[RequestDelta]:
        """One step of every rank (ranks with no work take part in the tier agreement).
        A ``step_observer`` (``bench.observer``) sees its begin and end only: the launch and
        the wait happen in the workers."""
        obs = self.step_observer
        obs.begin()
        replies = self._gather(self.leaders, "step")
        deltas: list[RequestDelta] = []
        fresh = False
        for rank, (rank_deltas, busy, load, snapshot) in enumerate(replies):
            self.busy[rank], self.load[rank] = busy, load
            if snapshot is not None:
                self._snapshots[rank], fresh = snapshot, True
            for d in rank_deltas:
                entry = self.owner.get(d.request_id)
                if d.finished and entry is not None:
                    entry[1] -= 1
                    if entry[1] == 0:
                        del self.owner[d.request_id]
            deltas += rank_deltas
        if fresh:
            self._refresh_live()
        obs.end(bool(deltas))
        return deltas

    # Statistics ----------------------------------------------------------------------------

    def rank_stats(self) -> list[tuple[EngineStats, dict]]:
        """Each rank's engine counters and graph statistics."""
        return self._gather(self.leaders, "stats")

    @property
    def stats(self) -> EngineStats:
        """The ranks' engine counters, summed (gauges too: running, waiting, KV blocks)."""
        return summed_stats([s for s, _ in self.rank_stats()], self.graph_mode, self.rejected)

    def _refresh_live(self) -> None:
        """Update ``live_stats`` in place from the ranks' latest snapshots: what a reader on
        another thread (the server's ``/metrics``) sees, without a message to any rank. Its
        counters lag the ranks by at most ``worker.SNAPSHOT_EVERY_S`` while they run and are
        exact once they are idle."""
        total = summed_stats([s for s, _ in self._snapshots], self.graph_mode, self.rejected)
        for f in dataclasses.fields(EngineStats):
            setattr(self.live_stats, f.name, getattr(total, f.name))
        self.live_stats.graphs = SimpleNamespace(**summed_graphs(
            [g for _, g in self._snapshots]))

    @property
    def spec_stats(self) -> SpecStats | None:
        """The ranks' speculative decoding counters, summed (None when it is off)."""
        return self.stats.spec

    def graph_stats(self) -> dict:
        """The ranks' graph statistics summed, and each rank's under ``ranks``."""
        return summed_graphs([g for _, g in self.rank_stats()])

    # Workers -------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """End every worker (idempotent); no process is left behind."""
        self._closed = True
        self._finalizer()

    def _call(self, rank: int, op: str, *args) -> tuple[str, object]:
        with self._lock:
            self._send(rank, (op, *args))
            return self._receive([rank], op)[rank]

    def _gather(self, ranks, op: str) -> list:
        ranks = list(ranks)
        with self._lock:
            if op != "start":
                for r in ranks:
                    self._send(r, (op,))
            replies = self._receive(ranks, op)
        return [replies[r][1] for r in ranks]

    def _send(self, rank: int, msg: tuple) -> None:
        if self._closed:
            raise WorkerError("the multi-process engine is shut down")
        try:
            self.conns[rank].send(msg)
        except OSError as e:
            self._fail(rank, f"cannot be reached ({e})")

    def _receive(self, ranks: list[int], op: str) -> dict[int, tuple[str, object]]:
        """One reply from each of ``ranks``, within ``distributed_timeout_s``; a worker (of
        these ranks or any other) that exits or faults meanwhile is named at once."""
        deadline = monotonic() + self.timeout_s
        pending = {r for r in ranks}
        replies: dict[int, tuple[str, object]] = {}
        # Followers speak only at start-up or to report a fault; watch them too.
        watched = sorted(pending | {r for r in range(self.world) if r not in self.leaders})
        while pending:
            left = deadline - monotonic()
            if left <= 0:
                late = sorted(pending)
                self._fail(late, f"did not answer {op!r} within distributed_timeout_s="
                           f"{self.timeout_s:g} s (one rank that hangs holds the others in "
                           "their collectives)")
            waitables = [self.conns[r] for r in watched] + [self.procs[r].sentinel
                                                           for r in watched]
            wait(waitables, timeout=min(left, 1.0))
            # A rank that died silently is named first: the faults it causes in the ranks
            # sharing its collectives or pipes are consequences.
            arrived: dict[int, tuple] = {}
            for r in watched:
                conn = self.conns[r]
                if conn.poll():
                    try:
                        arrived[r] = conn.recv()
                    except (EOFError, OSError):
                        self._fail(r, self._exit_text(r))
                elif not self.procs[r].is_alive():
                    self._fail(r, self._exit_text(r))
            for r, msg in arrived.items():
                if msg[0] == "fault":
                    self._fail(r, f"failed during {op!r}:\n{msg[1]}")
                if r not in pending:
                    self._fail(r, f"sent {msg[0]!r} unasked during {op!r}")
                replies[r] = msg
                pending.discard(r)
        return replies

    def _exit_text(self, rank: int) -> str:
        proc = self.procs[rank]
        proc.join(timeout=1.0)
        return f"exited (exit code {proc.exitcode})"

    def _fail(self, rank: int | list[int], what: str) -> None:
        """End every worker and raise, naming the rank (or ranks) at fault."""
        self._grace_s[0] = 0.5  # the others may be stuck in a collective with the failed rank
        self.shutdown()
        ranks = rank if isinstance(rank, list) else [rank]
        if self.tp == 1:
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
            raise WorkerError(f"data-parallel {who} {what}")
        where = ", ".join(f"{g} (data-parallel rank {g // self.tp}, tensor-parallel rank "
                          f"{g % self.tp})" for g in ranks)
        raise WorkerError(f"{'rank' if len(ranks) == 1 else 'ranks'} {where} {what}")


def _stop_workers(procs: list, conns: list, store_dir: str, grace_s: list[float]) -> None:
    """Ask every worker to exit, then terminate and kill the ones still running."""
    for proc, conn in zip(procs, conns):
        if proc.is_alive():
            try:
                conn.send(("shutdown",))
            except OSError:
                pass
    deadline = monotonic() + grace_s[0]
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=0.5)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()
    shutil.rmtree(store_dir, ignore_errors=True)
