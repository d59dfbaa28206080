"""Ranks that torchrun started, on one host or many: the same entry points, one rank each.

When torchrun (or any launcher that sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT``) starts ``replaylm serve``, ``replaylm generate`` or a
script that builds ``LLM(...)``, every process reaches ``make_engine`` and becomes one rank:

- global rank 0 returns a ``TorchrunEngine``: the driver (``MultiProcessEngine``: placement,
  lockstep steps, statistics) with data-parallel rank 0's leader engine in the same process;
  it alone goes on to serve users;
- every other rank runs the worker loop of ``worker`` (a leader's engine or a follower's
  shard) and, once rank 0 shuts down, exits (``SystemExit(0)``) without returning.

Rank layout, process groups, tier agreement and step messages are those of the
multiprocessing path; only the transport differs. The messages that cross pipes there
(driver and leaders, leader and followers) cross a dedicated gloo group here as pickled
objects (``channel.RankChannel``), so they reach other hosts; the engine's collectives keep
their own group. Rank 0 waits for each reply within ``distributed_timeout_s``; a rank whose
process exits is named at once (gloo fails the receive posted for it), before the faults it
causes in the ranks that shared a collective with it.
"""

from __future__ import annotations

import signal
import sys
import traceback
import weakref
from time import monotonic
from typing import NoReturn

import torch
import torch.distributed as dist

from replaylm.config import EngineArgs
from replaylm.distributed.channel import (
    TO_DRIVER,
    TO_FOLLOWER,
    TO_WORKER,
    WAIT_FOREVER,
    PeerLost,
    PeerTimeout,
    RankChannel,
)
from replaylm.distributed.driver import MultiProcessEngine, WorkerError
from replaylm.distributed.worker import (
    _follow,
    _handle,
    _lead,
    join_groups,
    leader_core,
    start_info,
)
from replaylm.engine.core import EngineCore
from replaylm.engine.loading import load_model_config
from replaylm.engine.runner_setup import resolve_device
from replaylm.env import LaunchedRank
from replaylm.model.parallel import check_tensor_parallel

#: Seconds rank 0 gives each other rank, after a failure, to show it exited or faulted.
PROBE_S = 0.2


def start_rank(args: EngineArgs, launch: LaunchedRank) -> EngineCore | MultiProcessEngine:
    """``make_engine`` under torchrun: rank 0's engine; other ranks serve as workers until
    rank 0 shuts down, then end the process."""
    check_launch(args, launch)
    if launch.world_size == 1:
        return EngineCore(args)
    if launch.rank == 0:
        return TorchrunEngine(args, launch)
    raise SystemExit(serve_rank(args, launch))


def check_launch(args: EngineArgs, launch: LaunchedRank) -> None:
    """Refuse, on every rank before any rendezvous, a world the settings do not describe."""
    dp, tp = args.data_parallel_size, args.tensor_parallel_size
    if launch.world_size != dp * tp:
        raise ValueError(
            f"torchrun started WORLD_SIZE={launch.world_size} ranks, but EngineArgs."
            f"data_parallel_size={dp} × tensor_parallel_size={tp} = {dp * tp}: start "
            "data_parallel_size × tensor_parallel_size ranks in all (nnodes × nproc-per-node)")
    check_tensor_parallel(load_model_config(args.model)[0], tp)
    if resolve_device(args.device).type == "cuda" and \
            launch.local_world_size > torch.cuda.device_count():
        raise ValueError(
            f"torchrun started {launch.local_world_size} ranks on this host (nproc-per-node) "
            f"but {torch.cuda.device_count()} GPUs are visible: EngineArgs.data_parallel_size"
            f"={dp} × tensor_parallel_size={tp} needs one GPU per rank")


def _join(args: EngineArgs, launch: LaunchedRank
          ) -> tuple[EngineArgs, object, object, object, dist.ProcessGroup]:
    """The engine's groups (``worker.join_groups`` over ``env://``) and the control group
    the messages cross (gloo, waiting for as long as a server may idle)."""
    args, tpc, agree, dpa = join_groups(launch.rank, launch.local_rank, "env://", args)
    control = dist.new_group(backend="gloo", timeout=WAIT_FOREVER)
    return args, tpc, agree, dpa, control


def _followers(leader: int, tp: int, group: dist.ProcessGroup, timeout_s: float
               ) -> list[RankChannel]:
    return [RankChannel(f, group, TO_FOLLOWER, TO_FOLLOWER, timeout_s)
            for f in range(leader + 1, leader + tp)]


def serve_rank(args: EngineArgs, launch: LaunchedRank) -> int:
    """A rank other than 0: join the groups, run the leader's or the follower's loop until
    rank 0 (or the leader) says stop; the process's exit code (0: stopped when asked)."""
    # Rank 0 owns every rank's lifetime: a server there drains its requests through the
    # workers on Ctrl-C or SIGTERM (which torchrun passes to every rank), then stops them.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    rank, tp, timeout_s = launch.rank, args.tensor_parallel_size, args.distributed_timeout_s
    leader = rank - rank % tp
    driver = None
    try:
        args, tpc, agree, dpa, control = _join(args, launch)
        driver = RankChannel(0, control, TO_DRIVER, TO_WORKER, timeout_s)
        if rank == leader:
            _lead(args, tpc, agree, driver, _followers(leader, tp, control, timeout_s), dpa)
        else:
            _follow(args, tpc, agree, driver,
                    RankChannel(leader, control, TO_FOLLOWER, TO_FOLLOWER, timeout_s))
        return 0
    except BaseException as e:
        if isinstance(e, PeerLost) and e.peer in (0, leader):
            print(f"replaylm rank {rank}: rank {e.peer} is gone ({e}); exiting",
                  file=sys.stderr)
            return 1
        # Anything else, a lost follower included, is this rank's fault to report.
        text = traceback.format_exc()
        print(f"replaylm rank {rank} failed:\n{text}", file=sys.stderr)
        if driver is not None:
            try:
                driver.send(("fault", text), timeout_s=5.0)
            except (PeerLost, PeerTimeout):
                pass
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class TorchrunEngine(MultiProcessEngine):
    """Rank 0 of a torchrun job: the driver, with data-parallel rank 0's leader engine in
    this process (``core``) and the other leaders reached over ``RankChannel``s."""

    def __init__(self, args: EngineArgs, launch: LaunchedRank) -> None:
        self.launch = launch
        super().__init__(args)

    def _start_workers(self) -> list[dict]:
        args, tpc, agree, dpa, control = _join(self.args, self.launch)
        timeout_s = self.timeout_s
        self.chans = {r: RankChannel(r, control, TO_WORKER, TO_DRIVER, timeout_s)
                      for r in range(1, self.world)}
        followers = _followers(0, self.tp, control, timeout_s)
        self._finalizer = weakref.finalize(
            self, _stop_ranks, [self.chans[g] for g in self.leaders[1:]], followers,
            self._grace_s)
        try:
            self.core = leader_core(args, tpc, agree, followers, dpa)
            local = start_info(self.core)
        except Exception:
            self._fail_root(0, f"failed during 'start':\n{traceback.format_exc()}")
        remote = self._receive(list(self.chans), "start")
        return [local] + [remote[r][1] for r in range(1, self.world)]

    def _call(self, rank: int, op: str, *args) -> tuple[str, object]:
        with self._lock:
            if rank == 0:
                return self._local(op, args)
            self._send(rank, (op, *args))
            return self._receive([rank], op)[rank]

    def _gather(self, ranks, op: str) -> list:
        ranks = list(ranks)
        with self._lock:
            remote = [r for r in ranks if r != 0]
            for r in remote:  # first, so the other leaders step while this one does
                self._send(r, (op,))
            local = self._local(op, ()) if 0 in ranks else None
            replies = self._receive(remote, op)
        return [local[1] if r == 0 else replies[r][1] for r in ranks]

    def _local(self, op: str, args: tuple) -> tuple[str, object]:
        if self._closed:
            raise WorkerError("the multi-process engine is shut down")
        try:
            return _handle(self.core, op, list(args))
        except PeerLost as e:  # sending the step to one of this rank's followers
            self._fail_root(e.peer, f"exited or cannot be reached ({e})", lost=True)
        except PeerTimeout as e:
            self._fail_root(e.peer, f"did not take {op!r} from rank 0 within "
                            f"distributed_timeout_s={self.timeout_s:g} s")
        except Exception:
            text = traceback.format_exc()
            if _is_consequence(text):
                self._fail_root(0, f"failed during {op!r}: a collective with the other ranks "
                                "broke or timed out (a rank that died or hangs; "
                                f"distributed_timeout_s={self.timeout_s:g} s):\n{text}")
            self._fail_root(0, f"failed during {op!r}:\n{text}")

    def _send(self, rank: int, msg: tuple) -> None:
        if self._closed:
            raise WorkerError("the multi-process engine is shut down")
        try:
            self.chans[rank].send(msg)
        except PeerLost as e:
            self._fail_root(rank, f"exited or cannot be reached ({e})", lost=True)
        except PeerTimeout:
            self._fail_root(rank, f"did not take {msg[0]!r} within distributed_timeout_s="
                            f"{self.timeout_s:g} s")

    def _receive(self, ranks: list[int], op: str) -> dict[int, tuple[str, object]]:
        """One reply from each of ``ranks``, all within ``distributed_timeout_s``."""
        deadline = monotonic() + self.timeout_s
        replies: dict[int, tuple[str, object]] = {}
        for r in ranks:
            try:
                msg = self.chans[r].recv(deadline - monotonic())
            except PeerLost as e:
                self._fail_root(r, f"exited or cannot be reached ({e})", lost=True)
            except PeerTimeout:
                self._fail_root(r, f"did not answer {op!r} within distributed_timeout_s="
                                f"{self.timeout_s:g} s (one rank that hangs holds the "
                                "others in their collectives)")
            if msg[0] == "fault":
                self._fail_root(r, f"failed during {op!r}:\n{msg[1]}")
            replies[r] = msg
        return replies

    def _fail_root(self, rank: int, what: str, lost: bool = False) -> NoReturn:
        """Raise for the failure's root cause: a rank whose process exited comes first,
        then a rank that raised on its own, then ``rank``'s failure (``what``). A dead rank
        breaks the collectives of the others, whose faults are consequences."""
        if not self._closed:
            dead, faults = self._probe(exclude=rank)
            if dead:
                ranks = sorted(set(dead) | ({rank} if lost else set()))
                self._fail(ranks if len(ranks) > 1 else ranks[0], "exited or cannot be reached")
            primary = [(r, t) for r, t in faults if not _is_consequence(t)]
            if primary and not lost and _is_consequence(what):
                self._fail(primary[0][0], f"failed:\n{primary[0][1]}")
        self._fail(rank, what)

    def _probe(self, exclude: int) -> tuple[list[int], list[tuple[int, str]]]:
        """Each other rank's state as its control channel shows it within ``PROBE_S``: the
        ranks whose connection closed, and the faults ranks sent."""
        dead, faults = [], []
        for r, chan in self.chans.items():
            if r == exclude:
                continue
            try:
                msg = chan.recv(PROBE_S)
            except PeerLost:
                dead.append(r)
            except PeerTimeout:
                continue
            else:
                if msg[0] == "fault":
                    faults.append((r, msg[1]))
        return dead, faults


def _is_consequence(text: str) -> bool:
    """Whether a fault reads as the effect of another rank's failure (a collective or a
    message whose peer closed its connection or did not take part in time)."""
    return any(s in text for s in ("Connection closed by peer", "Timed out", "pair closure",
                                   "PeerLost", "PeerTimeout", "Connection reset"))


def _stop_ranks(leaders: list[RankChannel], followers: list[RankChannel],
                grace_s: list[float]) -> None:
    """Stop rank 0's followers and every other leader (which stops its followers), wait
    for the leaders' acknowledgements, then leave the process groups."""
    grace = grace_s[0]
    for chan in followers:
        _quietly(chan.send, ("stop",), grace)
    for chan in leaders:
        _quietly(chan.send, ("shutdown",), grace)
    for chan in leaders:
        _quietly(chan.recv, grace)
    if dist.is_initialized():
        dist.destroy_process_group()


def _quietly(fn, *args) -> None:
    try:
        fn(*args)
    except (PeerLost, PeerTimeout):
        pass
