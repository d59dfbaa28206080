"""``RankChannel``: Python objects between two ranks of a torch.distributed gloo group.

What crosses a pipe on one host (the driver's messages, the leader's ``StepInput``) crosses
hosts this way when torchrun starts the ranks. A message is pickled into a uint8 CPU tensor
and sent as two point-to-point operations (its length, then its bytes) on the channel's tag;
the receiver posts the length's receive ahead, so a peer that exits is seen at once (gloo
fails the pending receive when the connection closes).

Every wait has a deadline except a worker's wait for its next command (``recv()`` with no
timeout), which waits for as long as the group's timeout allows (``WAIT_FOREVER``): a
server may sit idle for hours. Gloo closes the connection of an operation that timed out,
so a channel that timed out is not used again.
"""

from __future__ import annotations

import pickle
from datetime import timedelta

import torch
import torch.distributed as dist

#: The control group's timeout: how long a worker waits for its next command.
WAIT_FOREVER = timedelta(days=365)

#: Tags of the three message streams between two ranks.
TO_WORKER, TO_DRIVER, TO_FOLLOWER = 1, 2, 3


class PeerTimeout(RuntimeError):
    """The peer (``peer``, its global rank) did not take part in a send or a receive within
    the deadline."""

    def __init__(self, peer: int, text: str) -> None:
        super().__init__(f"rank {peer}: {text}")
        self.peer = peer


class PeerLost(EOFError):
    """The peer's (``peer``) connection closed: its process exited (or cannot be reached)."""

    def __init__(self, peer: int, text: str) -> None:
        super().__init__(f"rank {peer}: {text}")
        self.peer = peer


class RankChannel:
    """One direction's sends to, and the other direction's receives from, rank ``peer``:
    ``send(obj)`` and ``recv()`` as on a ``multiprocessing`` pipe."""

    def __init__(self, peer: int, group: dist.ProcessGroup, send_tag: int, recv_tag: int,
                 timeout_s: float) -> None:
        self.peer = peer
        self.group = group
        self.send_tag, self.recv_tag = send_tag, recv_tag
        self.timeout = timedelta(seconds=timeout_s)  # a send's deadline
        self._size = torch.zeros(1, dtype=torch.int64)
        self._pending: dist.Work | None = None

    def send(self, obj: object, timeout_s: float | None = None) -> None:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        timeout = self.timeout if timeout_s is None else timedelta(seconds=timeout_s)
        for t in (size, data):
            self._wait(self._call(dist.isend, t, self.peer, self.group, self.send_tag), timeout)

    def post(self) -> None:
        """Post the next message's length receive (``recv`` does when none is posted)."""
        if self._pending is None:
            self._pending = self._call(dist.irecv, self._size, self.peer, self.group,
                                       self.recv_tag)

    def recv(self, timeout_s: float | None = None) -> object:
        """The next message; ``timeout_s`` None: wait for as long as the group allows."""
        timeout = WAIT_FOREVER if timeout_s is None else timedelta(seconds=max(timeout_s, 1e-3))
        self.post()
        pending, self._pending = self._pending, None
        self._wait(pending, timeout)
        data = torch.empty(int(self._size[0]), dtype=torch.uint8)
        self._wait(self._call(dist.irecv, data, self.peer, self.group, self.recv_tag),
                   max(timeout, self.timeout))
        self.post()  # the next message's length: a peer that exits fails it at once
        return pickle.loads(data.numpy().tobytes())

    def _wait(self, work: dist.Work, timeout: timedelta) -> None:
        self._call(work.wait, timeout)

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except RuntimeError as e:
            if "Timed out" in str(e):
                raise PeerTimeout(self.peer, str(e)) from e
            raise PeerLost(self.peer, str(e)) from e
