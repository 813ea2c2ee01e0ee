"""API-key and Origin checks. Keys are compared in constant time; `/`, `/health` and `/metrics` stay open.

`ApiKeyMiddleware` guards HTTP `/v1/*`; the WebSocket checks its own key (header or `hello`) in ws.py.
"""
from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from service.openai_api import error_response


def key_matches(presented: str | None, expected: str) -> bool:
    if presented is None:
        return False
    return hmac.compare_digest(presented.encode(), expected.encode())


def bearer_token(headers: Headers) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` header, or None."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def origin_allowed(headers: Headers, allowed: tuple[str, ...]) -> bool:
    """Browsers always send Origin on WebSocket upgrades; clients without one are not browsers, so
    there is no cross-site request to forge and they pass."""
    origin = headers.get("origin")
    return not allowed or origin is None or origin in allowed or "*" in allowed


class ApiKeyMiddleware:
    """401 in OpenAI's error shape for HTTP `/v1/*` requests without the right Bearer key."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (self.api_key is not None and scope["type"] == "http" and scope["path"].startswith("/v1/")
                and not key_matches(bearer_token(Headers(scope=scope)), self.api_key)):
            response = error_response(401, "Missing or invalid API key: send `Authorization: Bearer KEY`.",
                                      "authentication_error", code="invalid_api_key")
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
