"""Dockerfile and compose.yaml agree with each other and with the CLI (docker itself is not run here)."""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml  # a dependency of transformers

from service.config import ServerConfig, parse_config

REPO = Path(__file__).resolve().parents[2]


def _dockerfile() -> dict[str, list[str]]:
    """Instruction -> arguments, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", (REPO / "Dockerfile").read_text())
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            word, _, rest = line.strip().partition(" ")
            out.setdefault(word.upper(), []).append(rest.strip())
    return out


def _exec_form(arg: str) -> list[str]:
    return json.loads(arg) if arg.startswith("[") else shlex.split(arg)


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO / "compose.yaml").read_text())["services"]["sluice"]


def test_dockerfile_installs_cpu_torch_before_the_project() -> None:
    d = _dockerfile()
    assert d["FROM"] == ["python:3.11-slim"]
    runs = d["RUN"]
    torch_at = next(i for i, r in enumerate(runs) if "torch" in r and "pip install" in r)
    project_at = next(i for i, r in enumerate(runs) if re.search(r"pip install \.(\s|$)", r))
    assert torch_at < project_at and "download.pytorch.org/whl/cpu" in runs[torch_at]


def test_command_port_healthcheck_and_volume_agree(compose: dict) -> None:
    d = _dockerfile()
    (entrypoint,), (cmd,) = d["ENTRYPOINT"], d["CMD"]
    assert _exec_form(entrypoint) == ["sluice"]
    docker_cmd = _exec_form(cmd)
    assert docker_cmd == compose["command"]
    config = parse_config(docker_cmd, {})  # the command is valid for our CLI
    assert config.host == "0.0.0.0"
    port = config.port
    assert d["EXPOSE"] == [str(port)]
    assert [p.split(":")[-1] for p in compose["ports"]] == [str(port)]
    assert f"127.0.0.1:{port}/health" in d["HEALTHCHECK"][0]
    assert any(f"127.0.0.1:{port}/health" in part for part in compose["healthcheck"]["test"])

    home = compose["environment"]["SLUICE_HOME"]
    assert f"SLUICE_HOME={home}" in " ".join(d["ENV"])
    assert any(v.split(":")[1] == home for v in compose["volumes"])
    assert home in d["VOLUME"][0]


def test_stop_grace_outlasts_the_drain(compose: dict) -> None:
    grace = compose["stop_grace_period"]
    seconds = int(grace.rstrip("s"))
    assert seconds > ServerConfig().timeout_graceful_shutdown
    assert _dockerfile()["STOPSIGNAL"] == ["SIGTERM"]
