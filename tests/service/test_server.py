"""service/server.py without a server: uvicorn's log lines lose their query strings; health probes make none."""
from __future__ import annotations

import logging

from service.server import QuietHealth, RedactQueries


def _record(msg: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, msg, args, None)


def test_query_strings_are_redacted() -> None:
    access = _record('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5", "GET", "/v1/models?api_key=s3cret&x=1", "1.1", 200)
    assert RedactQueries().filter(access)
    assert access.getMessage() == '127.0.0.1:5 - "GET /v1/models?<redacted> HTTP/1.1" 200'
    upgrade = _record('%s - "WebSocket %s" [accepted]', "127.0.0.1:5", "/v1/ws?key=s3cret")
    assert RedactQueries().filter(upgrade) and "s3cret" not in upgrade.getMessage()


def test_lines_without_a_query_are_left_alone() -> None:
    plain = _record('%s - "WebSocket %s" %d', "127.0.0.1:5", "/v1/ws", 403)
    assert RedactQueries().filter(plain) and plain.getMessage() == '127.0.0.1:5 - "WebSocket /v1/ws" 403'
    no_args = _record("Started server process [7]")
    assert RedactQueries().filter(no_args) and no_args.getMessage() == "Started server process [7]"


def test_successful_health_probes_are_not_logged() -> None:
    line = '%s - "%s %s HTTP/%s" %d'
    assert not QuietHealth().filter(_record(line, "127.0.0.1:5", "GET", "/health", "1.1", 200))
    assert QuietHealth().filter(_record(line, "127.0.0.1:5", "GET", "/health", "1.1", 503))  # failures stay
    assert QuietHealth().filter(_record(line, "127.0.0.1:5", "GET", "/metrics", "1.1", 200))
    assert QuietHealth().filter(_record("Started server process [7]"))
