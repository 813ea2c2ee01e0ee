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
