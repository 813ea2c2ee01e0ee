"""The app before and after its engine: 503 everywhere while loading, and after the engine fails
to start (no engine is ever built here: the factory blocks, then raises)."""
from __future__ import annotations

import threading
import time

import pytest
from starlette.testclient import TestClient, WebSocketDenialResponse

from service.app import build_app
from service.config import ServerConfig


def _wait(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_loading_then_failed_engine() -> None:
    release = threading.Event()

    def factory() -> object:
        release.wait(10)
        raise RuntimeError("no such model: /models/missing")

    app = build_app(ServerConfig(served_model_name="m", engine_process=False), engine_factory=factory)
    with TestClient(app) as client:
        r = client.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "starting"
        r = client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        with pytest.raises(WebSocketDenialResponse) as denied:
            with client.websocket_connect("/v1/ws"):
                pass
        assert denied.value.status_code == 503
        assert client.get("/metrics").status_code == 200  # scrapable while loading

        release.set()
        _wait(lambda: app.state.service.bridge.fatal is not None)
        r = client.get("/health")
        assert r.status_code == 503 and "no such model" in r.json()["error"]


def test_a_missing_ui_is_logged_and_the_api_still_serves(monkeypatch, tmp_path, caplog) -> None:
    """Installed with another layout, `/` 404s: the log says where the UI was looked for (it was silent)."""
    import service.app

    assert service.app.web_dir() is not None  # this checkout has it
    monkeypatch.setattr(service.app, "web_dir_candidates", lambda: [tmp_path / "web"])
    def no_engine() -> object:
        raise RuntimeError("no engine in this test")

    with caplog.at_level("ERROR", logger="sluice.app"):
        app = build_app(ServerConfig(served_model_name="m", engine_process=False), engine_factory=no_engine)
    assert f"no chat UI: index.html is in none of {tmp_path / 'web'}" in caplog.text
    with TestClient(app) as client:
        assert client.get("/").status_code == 404 and client.get("/health").status_code == 503
