"""Shared fixtures: the embedded tiny model (built once under $SLUICE_HOME)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("SLUICE_QUIET", "1")


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from engine.tiny import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="session")
def main_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The `sluice serve` that tests/service and tests/hostile share (flags: tests/service/conftest.py)."""
    from tests.server import start_server
    from tests.service.conftest import MAIN_FLAGS

    server = start_server(tmp_path_factory.mktemp("main-server"), *MAIN_FLAGS)
    yield server
    code = server.stop()
    assert code == 0, f"server exited with {code}:\n{server.log_text()[-4000:]}"
