"""``replaylm serve``: build the engine, serve it with uvicorn, shut down cleanly on SIGTERM.

Imports of FastAPI/uvicorn happen inside :func:`run_cli`, so the CLI's ``--help`` (and every
other command) works without the ``server`` extra installed.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from replaylm.config import EngineArgs

log = logging.getLogger(__name__)


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Server flags plus every ``EngineArgs`` flag."""
    srv = parser.add_argument_group("server")
    srv.add_argument("--host", default="127.0.0.1",
                     help="address to listen on (default: 127.0.0.1, loopback only)")
    srv.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    srv.add_argument("--max-queue", type=int, default=1024,
                     help="most requests in flight (queued + running); beyond it the server "
                     "answers 503 with Retry-After (default: 1024)")
    srv.add_argument("--served-model-name", default=None,
                     help="model id clients use (default: the --model value)")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds SIGTERM waits for in-flight requests before cancelling "
                     "them (default: 30)")
    srv.add_argument("--log-level", default="info",
                     choices=["critical", "error", "warning", "info", "debug"],
                     help="server log level (default: info)")
    EngineArgs.add_cli_args(parser)
    return parser


def run_cli(ns: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Serve until SIGTERM/SIGINT; 0 after a graceful shutdown."""
    try:
        import uvicorn

        from replaylm.server.app import build_app
        from replaylm.server.graceful import GracefulServer
    except ImportError as e:
        print(f"replaylm serve needs the server extra ({e.name} is missing): "
              "pip install 'replaylm[server]'", file=sys.stderr)
        return 1
    from replaylm.engine.core import EngineCore

    if ns.max_queue < 1:
        print(f"--max-queue={ns.max_queue} is invalid: must be >= 1", file=sys.stderr)
        return 2
    logging.basicConfig(level=ns.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    core = EngineCore(EngineArgs.from_cli_args(ns))
    app = build_app(core, max_queue=ns.max_queue, served_model_name=ns.served_model_name)
    config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.log_level,
                            timeout_graceful_shutdown=ns.shutdown_timeout, access_log=False)
    server = GracefulServer(config, on_exit=lambda: _stop_accepting(app))
    server.run()
    if not server.started:
        return 1  # e.g. the port is taken: uvicorn has logged why
    log.info("replaylm serve stopped cleanly")
    return 0


def _stop_accepting(app: Any) -> None:
    # New requests on kept-alive connections get 503 while uvicorn drains the open ones.
    app.state.engine.accepting = False
