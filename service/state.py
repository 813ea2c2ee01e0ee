"""`Service`: the state every handler shares (config, the engine bridge, connections, metrics), and the
graceful-shutdown sequence. The app, the WebSocket and the OpenAI handlers all read it; it imports none of them.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Protocol

from starlette.applications import Starlette
from starlette.status import WS_1001_GOING_AWAY

from engine import LLMEngine
from service.auth import PendingAuth
from service.bridge import EngineBridge
from service.budget import PeerBudgets
from service.config import ServerConfig
from service.metrics import Metrics
from service.response_store import ResponseStore

log = logging.getLogger("sluice.app")


class Closable(Protocol):
    """A WebSocket connection, as the shutdown sequence sees it."""

    def shutdown(self, code: int = ...) -> None: ...


class Connections:
    """The authenticated WebSocket connections: `--max-connections` counts them, and `--max-connections-per-client`
    (default half of that) each client's (`client_of`), so one client cannot take every slot."""

    def __init__(self, limit: int | None, per_client: int | None = None) -> None:
        self.limit = limit
        self.per_client = per_client if per_client is not None else None if limit is None else max(1, limit // 2)
        self._clients: dict[Closable, str] = {}
        self._held: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._clients)

    def __iter__(self) -> Iterator[Closable]:
        return iter(list(self._clients))

    def refusal(self, client: str) -> tuple[int, str] | None:
        """Why `client` may not open one more now, as an HTTP status and a message (503: the server is full; 429:
        the client holds its share); None: it may."""
        if self.limit is not None and len(self) >= self.limit:
            return 503, f"all {self.limit} connections are in use (--max-connections); retry later"
        if self.per_client is not None and self._held[client] >= self.per_client:
            return 429, (f"this client holds {self._held[client]} connections, as many as one client may "
                         "(--max-connections-per-client); close one, or retry later")
        return None

    def add(self, conn: Closable, client: str) -> None:
        if conn not in self._clients:
            self._clients[conn] = client
            self._held[client] += 1

    def discard(self, conn: Closable) -> None:
        if (client := self._clients.pop(conn, None)) is not None:
            self._held[client] -= 1
            if not self._held[client]:
                del self._held[client]


class Service:
    def __init__(self, config: ServerConfig, engine_factory: Callable[[], LLMEngine]) -> None:
        self.config = config
        pinned = [Path(p).read_text(encoding="utf-8") for p in config.pin_system_prompt]
        self.metrics = Metrics(lambda: self.bridge.stats)
        self.bridge = EngineBridge(engine_factory, max_queued=config.max_queued_requests,
                                   max_queued_per_client=config.max_queued_requests_per_client,
                                   pinned_system_prompts=pinned, metrics=self.metrics,
                                   step_timeout=config.engine_iteration_timeout_s,
                                   rebuildable=(config.tensor_parallel_size or 1) == 1,
                                   engine_process=config.engine_process)
        self.connections = Connections(config.max_connections, config.max_connections_per_client)  # authenticated
        self.pending_auth = PendingAuth(config.max_pending_auth)  # open, still waiting to send `hello`
        self.loop_budgets = PeerBudgets()  # each client's share of the event loop (service/budget.py)
        self.responses = ResponseStore(int(config.responses_store_mb * (1 << 20)))  # the Responses API's
        self.draining = False
        self.started_at = int(time.time())

    @property
    def model_name(self) -> str:
        return self.config.served_model_name or self.bridge.model_name

    @property
    def accepting(self) -> bool:
        return self.bridge.ready and not self.draining

    @asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.bridge.start()
        try:
            yield
        finally:
            await self.bridge.stop()

    async def drain(self, timeout: float, give_up: Callable[[], bool] = lambda: False) -> None:
        """Refuse new chats, let those in flight finish (then cancel the rest), close sockets with 1001.

        The listener stays open meanwhile, so load balancers see `/health` answer 503 `draining`.
        `give_up()` turning true (a second Ctrl+C) skips the rest of the wait."""
        self.draining = True
        self.pending_auth.evict_all()  # sockets that never authenticated have nothing to finish
        log.info("shutting down: %d requests in flight, %d websockets", self.bridge.num_in_flight,
                 len(self.connections))
        if not await _wait_until(lambda: not self.bridge.num_in_flight or give_up(), timeout):
            log.warning("cancelling %d requests still running after %.0f s", self.bridge.num_in_flight, timeout)
            self.bridge.abort_all()
            await _wait_until(lambda: not self.bridge.num_in_flight or give_up(), 5.0)
        for conn in self.connections:
            conn.shutdown(WS_1001_GOING_AWAY)
        # a client that never reads its close frame gets no longer than this
        await _wait_until(lambda: not self.connections or give_up(), 2.0)


async def _wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.02)
    return True
