"""The multi-process engines built in this folder start their ranks from a forkserver that
imported the worker module once, instead of by ``spawn`` (the driver's method), which imports
torch and replaylm again in every rank: a few seconds of CPU per rank, most of this folder's
time (two n-gram TP tests and a DP test: 64 s wall with spawn, 27 s with the forkserver).

A forkserver child is, like a spawned one, a fresh process (not a fork of the test process)
that unpickles its target and arguments. The ``spawn`` start itself stays covered end to end
where a separate Python process builds the engine: ``test_data_parallel.py``'s
``test_interpreter_exit_ends_the_workers`` and ``tests/server/test_server_distributed.py``.
"""

from __future__ import annotations

import multiprocessing

import pytest

from replaylm.distributed import driver

_FORKSERVER = multiprocessing.get_context("forkserver")
_FORKSERVER.set_forkserver_preload(["replaylm.distributed.worker"])


class _StartFromForkserver:
    """Stands in for ``torch.multiprocessing`` in the driver (its only use: ``get_context``)."""

    @staticmethod
    def get_context(method: str | None = None):
        return _FORKSERVER if method == "spawn" else multiprocessing.get_context(method)


@pytest.fixture(autouse=True)
def _ranks_from_a_forkserver(monkeypatch):
    monkeypatch.setattr(driver, "tmp", _StartFromForkserver)
