"""A real ``replaylm serve`` process on a free loopback port, for tests that need one."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve_process(log_path: Path, *flags: str, timeout: float = 90.0
                  ) -> Iterator[tuple[subprocess.Popen, str]]:
    """Start ``replaylm serve`` on 127.0.0.1 (the built-in model on CPU, plus ``flags``),
    wait until ``/health`` answers, yield the process and its URL; terminate it at the end if
    it is still running (kill it if it does not stop within 30 s)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "replaylm", "serve", "--host", "127.0.0.1", "--port",
             str(port), "--device", "cpu", *flags],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + timeout
            while True:
                assert proc.poll() is None, Path(log_path).read_text()
                try:
                    if httpx.get(url + "/health", timeout=1, trust_env=False).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "server did not come up"
                time.sleep(0.2)
            yield proc, url
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
