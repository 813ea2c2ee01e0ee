"""OpenAI's error shape, `{"error": {message, type, param, code}}`, for every HTTP answer under /v1 (the API,
the access checks, unknown routes). Every 400 carries a `code` (docs/protocol.md §10)."""
from __future__ import annotations

from typing import Any

import msgspec
from starlette.responses import Response

_TYPE = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 413: "invalid_request_error", 429: "server_overloaded", 500: "server_error",
         503: "service_unavailable"}
# Retry-After: a full queue drains within seconds; a loading model or a restarting server takes longer.
RETRY_AFTER_S = {429: 1, 503: 5}


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, type_: str | None, param: str | None, code: str | None) -> dict[str, Any]:
    if status == 400 and code is None:
        code = "invalid_message"  # NOTE: the one default of the 400 scheme (docs/protocol.md §10)
    return {"error": {"message": message, "type": type_ or _TYPE.get(status, "server_error"), "param": param,
                      "code": code}}


def error_response(status: int, message: str, type_: str | None = None, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> Response:
    headers = dict(headers or {})
    if status in RETRY_AFTER_S:
        headers.setdefault("Retry-After", str(RETRY_AFTER_S[status]))
    return Response(msgspec.json.encode(error_body(status, message, type_, param, code)), status_code=status,
                    media_type="application/json", headers=headers)
