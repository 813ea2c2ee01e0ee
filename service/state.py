"""`Service`: the state every handler shares (config, the engine bridge, connections, metrics), and the
graceful-shutdown sequence. The app, the WebSocket and the OpenAI handlers all read it; it imports none of them.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
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
        self.connections: set[Closable] = set()  # authenticated; --max-connections counts these
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
        for conn in list(self.connections):
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
