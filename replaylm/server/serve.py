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
from replaylm.server.tool_calls import PARSERS

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
                     "them; each cancelled one still gets a final answer, a 503 error JSON or, "
                     "streaming, an error event and [DONE] (default: 30)")
    srv.add_argument("--request-timeout", type=float, default=30.0,
                     help="seconds a client has to send a request's headers and body; past "
                     "it the server answers 408 and closes the connection (default: 30)")
    srv.add_argument("--max-request-bytes", type=int, default=8 * 2**20,
                     help="largest request body accepted; beyond it the server answers 413 "
                     "(default: 8388608, 8 MiB)")
    srv.add_argument("--admin-api-key", default=None,
                     help="serve the admin routes (POST /admin/update_weights, /admin/sleep, "
                     "/admin/wake_up, /admin/reset_prefix_cache, GET /admin/is_sleeping) to "
                     "requests carrying 'Authorization: Bearer KEY' (default: no admin "
                     "routes)")
    srv.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                     help="LoRA adapters (PEFT directories) to serve, each under its NAME: a "
                     "request's model picks one (needs --enable-lora)")
    srv.add_argument("--enable-lora-updates", action="store_true",
                     help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                     "without an admin key (with --admin-api-key they are served behind it)")
    srv.add_argument("--admin-drain-timeout", type=float, default=30.0,
                     help="seconds an update or sleep waits for in-flight requests before "
                     "aborting them (default: 30)")
    srv.add_argument("--tool-call-parser", default=None, choices=PARSERS,
                     help="how chat outputs are read for tool calls: hermes "
                     "(<tool_call>{json}</tool_call>, Hermes and Qwen models) or llama3_json "
                     "(Llama 3.x JSON calls); needed for tool_choice=auto; \"required\" and "
                     "named-function calls are forced in its format (default: none, forced "
                     "calls in the hermes format)")
    srv.add_argument("--log-level", default="info",
                     choices=["critical", "error", "warning", "info", "debug"],
                     help="server log level (default: info)")
    EngineArgs.add_cli_args(parser)
    return parser


def run_cli(ns: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Serve until SIGTERM/SIGINT; 0 after a graceful shutdown."""
    try:
        import fastapi  # noqa: F401  (the server extra)
        import uvicorn  # noqa: F401
    except ImportError as e:
        print(f"replaylm serve needs the server extra ({e.name} is missing): "
              "pip install 'replaylm[server]'", file=sys.stderr)
        return 1
    from replaylm.entrypoints import make_engine

    for flag, value in (("--max-queue", ns.max_queue), ("--max-request-bytes",
                                                         ns.max_request_bytes)):
        if value < 1:
            print(f"{flag}={value} is invalid: must be >= 1", file=sys.stderr)
            return 2
    if not ns.admin_drain_timeout >= 0:
        print(f"--admin-drain-timeout={ns.admin_drain_timeout} is invalid: must be >= 0",
              file=sys.stderr)
        return 2
    if not ns.request_timeout > 0 or not ns.shutdown_timeout >= 0:
        print(f"--request-timeout={ns.request_timeout} / --shutdown-timeout="
              f"{ns.shutdown_timeout} is invalid: must be > 0 / >= 0", file=sys.stderr)
        return 2
    from replaylm.server.lora import parse_lora_modules

    try:
        ns.lora_modules = parse_lora_modules(ns.lora_modules)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    logging.basicConfig(level=ns.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    core = make_engine(EngineArgs.from_cli_args(ns))
    try:
        return _serve(ns, core)
    finally:
        core.shutdown()  # worker processes, if any, end with the server


def _serve(ns: argparse.Namespace, core: Any) -> int:
    from replaylm.server.app import build_app
    from replaylm.server.graceful import GracefulServer

    app = build_app(core, max_queue=ns.max_queue, served_model_name=ns.served_model_name,
                    max_request_bytes=ns.max_request_bytes,
                    admin_api_key=ns.admin_api_key, admin_drain_timeout=ns.admin_drain_timeout,
                    tool_call_parser=ns.tool_call_parser, lora_modules=ns.lora_modules,
                    enable_lora_updates=ns.enable_lora_updates)
    config = uvicorn_config(app, ns.host, ns.port, ns.log_level, ns.request_timeout,
                            ns.shutdown_timeout)
    reason = (f"server shutting down: the request was cancelled after --shutdown-timeout "
              f"({ns.shutdown_timeout:g} s)")
    server = GracefulServer(config, on_exit=lambda: _stop_accepting(app),
                            on_deadline=lambda: app.state.engine.cancel_all(reason),
                            deadline_s=ns.shutdown_timeout)
    server.run()
    if not server.started:
        return 1  # e.g. the port is taken: uvicorn has logged why
    log.info("replaylm serve stopped cleanly")
    return 0


def uvicorn_config(app: Any, host: str, port: int, log_level: str = "info",
                   request_timeout: float = 30.0, shutdown_timeout: float = 30.0) -> Any:
    """uvicorn's settings for ``app``: the h11 protocol with a receive deadline
    (``connections.TimedH11Protocol``), no access log, and a drain that outlasts
    ``shutdown_timeout`` by ``graceful.SHUTDOWN_GRACE_S`` (the app cancels its requests at
    ``shutdown_timeout`` itself, ``GracefulServer``)."""
    import uvicorn

    from replaylm.server.connections import timed_h11_protocol
    from replaylm.server.graceful import SHUTDOWN_GRACE_S

    metrics = app.state.metrics
    protocol = timed_h11_protocol(request_timeout, on_timeout=lambda: metrics.http_error(408))
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol,
                          timeout_graceful_shutdown=shutdown_timeout + SHUTDOWN_GRACE_S,
                          access_log=False)


def _stop_accepting(app: Any) -> None:
    # New requests on kept-alive connections get 503 while uvicorn drains the open ones.
    app.state.engine.accepting = False
