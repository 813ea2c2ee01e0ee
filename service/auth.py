"""API-key and Origin checks. Keys are compared in constant time; `/`, `/health` and `/metrics` stay open.

`AccessMiddleware` guards HTTP `/v1/*`, `/tokenize` and `/detokenize`; the WebSocket checks its own key (header or
`hello`) in ws.py, and `PendingAuth` bounds the sockets still waiting to send `hello` (docs/protocol.md §2).
"""
from __future__ import annotations

import asyncio
import hmac
from collections.abc import Hashable

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from service.openai_errors import error_response


def key_matches(presented: str | None, expected: str) -> bool:
    if presented is None:
        return False
    return hmac.compare_digest(presented.encode(), expected.encode())


def bearer_token(headers: Headers) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` header, or None. Its bytes are read as UTF-8 (a header's
    text comes decoded as Latin-1), so a key that is not ASCII matches in the header as it does in `hello`."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    try:
        return token.encode("latin-1").decode("utf-8")
    except UnicodeError:  # (not UTF-8: taken as Latin-1, as it came)
        return token


def origin_allowed(headers: Headers, allowed: tuple[str, ...]) -> bool:
    """Browsers always send Origin on WebSocket upgrades; clients without one are not browsers, so
    there is no cross-site request to forge and they pass."""
    origin = headers.get("origin")
    return not allowed or origin is None or origin in allowed or "*" in allowed


GUARDED = frozenset({"/tokenize", "/detokenize"})  # (vLLM's routes, outside /v1: they run the tokenizer)


class AccessMiddleware:
    """HTTP `/v1/*` and `GUARDED`, in OpenAI's error shape: 403 for an Origin outside `--allowed-origins` (CORS alone
    would let a browser's "simple" cross-site POST run, only hiding the answer), then 401 without the right Bearer key."""

    def __init__(self, app: ASGIApp, api_key: str | None, allowed_origins: tuple[str, ...]) -> None:
        self.app = app
        self.api_key = api_key
        self.allowed_origins = allowed_origins

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not (scope["path"].startswith("/v1/") or scope["path"] in GUARDED):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if not origin_allowed(headers, self.allowed_origins):
            response = error_response(403, f"Origin {headers['origin']!r} is not allowed (--allowed-origins).",
                                      "permission_error", code="origin_not_allowed")
        elif self.api_key is not None and not key_matches(bearer_token(headers), self.api_key):
            response = error_response(401, "Missing or invalid API key: send `Authorization: Bearer KEY`.",
                                      "authentication_error", code="invalid_api_key")
        else:
            await self.app(scope, receive, send)
            return
        await response(scope, receive, send)


class PendingAuth:
    """WebSockets open but not yet authenticated, oldest first, at most `limit` of them.

    Admitting one more when full evicts the oldest, so sockets without the key can only push each other
    out: they never hold a `--max-connections` slot, and a client that sends `hello` at once is evicted
    only if `limit` newer sockets arrive before its `hello` does.
    """

    def __init__(self, limit: int) -> None:
        assert limit >= 1
        self.limit = limit
        self._waiting: dict[Hashable, asyncio.Event] = {}  # insertion order is age

    def __len__(self) -> int:
        return len(self._waiting)

    def admit(self, who: Hashable) -> asyncio.Event:
        """Start waiting; the event is set if `who` is evicted before it `leave`s."""
        assert who not in self._waiting
        if len(self._waiting) >= self.limit:
            self._waiting.pop(next(iter(self._waiting))).set()
        evicted = self._waiting[who] = asyncio.Event()
        return evicted

    def leave(self, who: Hashable) -> None:
        self._waiting.pop(who, None)

    def evict_all(self) -> None:
        for evicted in self._waiting.values():
            evicted.set()
        self._waiting.clear()
