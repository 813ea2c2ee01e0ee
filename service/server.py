"""Runs the app under uvicorn (uvloop, h11 and websockets-sansio behind service/transport.py's guards)
with Sluice's shutdown order.

SIGTERM/SIGINT: refuse new chats and upgrades while still answering `/health` (503 `draining`), drain
(in-flight chats finish, bounded), close sockets 1001, then stop listening and exit 0. An engine that
dies makes the process exit 1, so a supervisor restarts it instead of serving 503s. Query strings never
reach the log: a key sent as `?api_key=` would otherwise sit in every access line; successful health probes
don't either.
"""
from __future__ import annotations

import logging
import signal
import socket
import warnings
from types import FrameType

import uvicorn

from service.app import build_app
from service.state import Service
from service.config import ServerConfig
from service.transport import HttpGuard, SluiceWebSocketProtocol

log = logging.getLogger("sluice.server")


class RedactQueries(logging.Filter):
    """For uvicorn's loggers: a logged path keeps `?` but not its query, which may hold a credential
    (`/v1/ws?api_key=s3cret` -> `/v1/ws?<redacted>`). No Sluice route reads a query string."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(a.partition("?")[0] + "?<redacted>" if isinstance(a, str) and a.startswith("/")
                                and "?" in a else a for a in record.args)
        return True


class QuietHealth(logging.Filter):
    """For uvicorn's access log: no line for a successful `GET /health`. Docker's healthcheck (and a load
    balancer) asks every few seconds, forever; a failed probe is still logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        return not (isinstance(args, tuple) and len(args) == 5 and args[2] == "/health" and args[4] == 200)


class SluiceServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, service: Service) -> None:
        super().__init__(config)
        self.service = service
        self.graceful_timeout = 0.0
        self.exit_code = 0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # NOTE: not recording the signal on purpose: uvicorn re-raises recorded signals once it has
        # shut down, which would turn a clean drain into "killed by SIGTERM" (exit status 143).
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.service.bridge.fatal is not None:
            self.exit_code = 1
            return True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # NOTE: the listener stays open through the drain, so a load balancer sees /health's 503 `draining`
        # (a closed port tells it nothing); uvicorn closes it after, in super().shutdown().
        if not self.force_exit and self.service.bridge.fatal is None:
            await self.service.drain(self.graceful_timeout, give_up=lambda: self.force_exit)
        await super().shutdown(sockets)


def serve(config: ServerConfig) -> int:
    """Build the app, serve until signalled; returns the process exit status."""
    try:
        app = build_app(config)
    except ValueError as e:  # e.g. an EngineConfig range
        log.error("invalid configuration: %s", e)
        return 2
    # uvicorn warns that its legacy `websockets` implementation is deprecated; Sluice runs `websockets-sansio`
    # (docs/architecture.md §9).
    warnings.filterwarnings("ignore", message=".*`websockets` implementation is deprecated.*")
    guard = HttpGuard(config.timeout_headers, config.timeout_body, config.timeout_send, config.max_http_connections,
                      app.state.service.loop_budgets)
    ucfg = uvicorn.Config(
        app, host=config.host, port=config.port, loop="uvloop", http=guard.protocol(), ws=SluiceWebSocketProtocol,
        ws_per_message_deflate=False,  # compression costs CPU per token frame and enables zip-bomb frames
        ws_max_size=config.max_message_bytes, lifespan="on", log_level=config.log_level,
        timeout_keep_alive=config.timeout_keep_alive,
        ws_ping_interval=config.ws_ping_interval, ws_ping_timeout=config.ws_ping_timeout,
        ssl_keyfile=config.ssl_keyfile, ssl_certfile=config.ssl_certfile, ssl_ca_certs=config.ssl_ca_certs,
        ssl_cert_reqs=config.ssl_cert_reqs,
        timeout_graceful_shutdown=2,  # after our own drain only the last bytes of HTTP responses remain
    )
    for name in ("uvicorn.access", "uvicorn.error"):  # after uvicorn.Config, which configures logging
        logging.getLogger(name).addFilter(RedactQueries())
    logging.getLogger("uvicorn.access").addFilter(QuietHealth())
    server = SluiceServer(ucfg, app.state.service)
    server.graceful_timeout = config.timeout_graceful_shutdown
    server.run()
    if server.exit_code:
        log.error("exiting: %s", app.state.service.bridge.fatal)
    return server.exit_code
