"""The Starlette app: routes, middleware, `/health`, `/metrics` and the chat UI's files.

Every handler shares one `service.state.Service`; its lifespan starts the engine thread and returns at once, so
`/health` answers 503 while the model loads and 200 once it is ready.
"""
from __future__ import annotations

import logging
import sys
import sysconfig
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles

from service import openai_api, openai_responses, ws
from service.auth import AccessMiddleware
from service.config import ServerConfig
from service.openai_errors import error_response
from service.state import Service

log = logging.getLogger("sluice.app")


def web_dir_candidates() -> list[Path]:
    """Where the UI may be: beside the source tree (checkout, editable install), or where the wheel's
    data-files went (`pip install .`, the Docker image), under this interpreter's install scheme or the
    user scheme (`pip install --user`)."""
    dirs = [Path(__file__).resolve().parent.parent / "web"]
    schemes = [sysconfig.get_default_scheme(), sysconfig.get_preferred_scheme("user")]
    for data in [sysconfig.get_path("data", s) for s in schemes] + [sys.prefix]:
        d = Path(data) / "share" / "sluice" / "web"
        if d not in dirs:
            dirs.append(d)
    return dirs


def web_dir() -> Path | None:
    return next((d for d in web_dir_candidates() if (d / "index.html").is_file()), None)


async def health(request: Request) -> Response:
    svc: Service = request.app.state.service
    if svc.bridge.fatal is not None:
        return JSONResponse({"status": "failed", "error": svc.bridge.fatal}, status_code=503)
    if not svc.accepting:
        return JSONResponse({"status": "draining" if svc.draining else "starting"}, status_code=503)
    if svc.bridge.recovering:  # requests are still taken (they wait); a load balancer may send new ones elsewhere
        return JSONResponse({"status": "recovering"}, status_code=503)
    return JSONResponse({"status": "ok", "model": svc.model_name})


async def metrics(request: Request) -> Response:
    body, content_type = request.app.state.service.metrics.exposition()
    return Response(body, media_type=content_type)


async def http_error(request: Request, exc: Exception) -> Response:
    """OpenAI's error shape under /v1, plain text elsewhere (404 for an unknown route, 405 with `Allow`, ...)."""
    assert isinstance(exc, HTTPException)
    if request.url.path.startswith("/v1/"):
        return error_response(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}",
                                         headers=exc.headers)
    return PlainTextResponse(exc.detail, status_code=exc.status_code, headers=exc.headers)


async def internal_error(request: Request, exc: Exception) -> Response:
    """A bug (Starlette's ServerErrorMiddleware logs its traceback): 500 in OpenAI's error shape under /v1, so a
    client's SDK reads it as one, plain text elsewhere."""
    if request.url.path.startswith("/v1/"):
        return error_response(500, "the server failed to answer this request (an internal error; it is logged)")
    return PlainTextResponse("Internal Server Error", status_code=500)


def build_app(config: ServerConfig, engine_factory: Callable[[], Any] | None = None) -> Starlette:
    """The ASGI app. `engine_factory` runs on the engine thread (and must pickle for `--engine-process`); default:
    `LLMEngine(EngineConfig(...))`."""
    if engine_factory is None:
        from engine import EngineConfig, LLMEngine

        engine_factory = partial(LLMEngine, EngineConfig(**config.engine_kwargs()))  # bad values fail here

    svc = Service(config, engine_factory)
    # NOTE: /v1 is one Mount, so its own router answers every /v1/* path: 405 with `Allow` for a wrong method
    # (the static Mount below would otherwise take a GET as a missing file), 404 for an unknown path.
    api = Mount("/v1", routes=[
        WebSocketRoute("/ws", ws.websocket_endpoint),
        Route("/chat/completions", openai_api.chat_completions, methods=["POST"]),
        Route("/completions", openai_api.completions, methods=["POST"]),
        Route("/responses", openai_responses.create_response, methods=["POST"]),
        Route("/responses/{response_id}", openai_responses.get_response, methods=["GET"]),
        Route("/responses/{response_id}", openai_responses.delete_response, methods=["DELETE"]),
        Route("/responses/{response_id}/input_items", openai_responses.list_input_items, methods=["GET"]),
        Route("/models", openai_api.models, methods=["GET"]),
        Route("/models/{model:path}", openai_api.model, methods=["GET"]),
    ])
    routes: list[Any] = [Route("/health", health), Route("/metrics", metrics), api,
                         Route("/tokenize", openai_api.tokenize, methods=["POST"]),  # (vLLM's routes)
                         Route("/detokenize", openai_api.detokenize, methods=["POST"])]
    web = web_dir()
    if web is not None:
        routes.append(Mount("/", StaticFiles(directory=web, html=True)))
    else:  # the API still works; say why `/` will 404
        log.error("no chat UI: index.html is in none of %s; GET / answers 404",
                  ", ".join(map(str, web_dir_candidates())))
    middleware = [Middleware(AccessMiddleware, api_key=config.api_key, allowed_origins=config.allowed_origins)]
    if config.allowed_origins:  # browsers calling the HTTP API obey the same list as WebSocket upgrades
        middleware.insert(0, Middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                                        allow_methods=["GET", "POST"], allow_headers=["authorization", "content-type"]))
    app = Starlette(routes=routes, middleware=middleware, lifespan=svc.lifespan,
                    exception_handlers={HTTPException: http_error, Exception: internal_error})
    app.state.service = svc
    return app
