"""A real `sluice serve` subprocess on a free loopback port, for the service and browser tests.

Servers run with OMP_NUM_THREADS=1: on a small shared CPU box torch's spinning worker threads
slow every step several-fold.
"""
from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    port: int
    proc: subprocess.Popen[bytes]
    log: Path
    tls: ssl.SSLContext | None = None  # a server started with --ssl-*: a client context that trusts its certificate

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"{'wss' if self.tls else 'ws'}://127.0.0.1:{self.port}/v1/ws"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def stop(self) -> int:
        """SIGTERM (graceful drain), then the exit status; killed if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def spawn_server(tmp: Path, *flags: str, env: dict[str, str] | None = None, tiny: bool = True,
                 tls: ssl.SSLContext | None = None) -> Server:
    """Starts a server without waiting for it (start several, then `wait_healthy` each). Without a `--model` flag
    it serves engine/tiny.py's test model (random weights: outputs far from ties, no early end), unless `tiny` is
    False: then the embedded default. With `--ssl-*` flags, `tls` is the client's context for it."""
    if tiny and not any(f == "--model" or f.startswith("--model=") for f in flags) and "SLUICE_MODEL" not in (env or {}):
        from engine.tiny import default_model_dir

        flags = ("--model", str(default_model_dir()), *flags)
    port = free_port()
    log = tmp / f"serve-{port}.log"
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "service", "serve", "--port", str(port), *flags],
                            cwd=REPO, env=full_env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    return Server(port, proc, log, tls)


def wait_healthy(server: Server) -> Server:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            pytest.fail(f"sluice serve exited with {server.proc.returncode}:\n{server.log_tail(80)}")
        try:
            with urllib.request.urlopen(f"{server.url}/health", timeout=2, context=server.tls) as r:
                if r.status == 200:
                    return server
        except OSError:
            pass
        time.sleep(0.2)
    server.stop()
    pytest.fail(f"server not healthy after {STARTUP_TIMEOUT_S}s:\n{server.log_tail(80)}")


def start_server(tmp: Path, *flags: str, env: dict[str, str] | None = None, tiny: bool = True) -> Server:
    return wait_healthy(spawn_server(tmp, *flags, env=env, tiny=tiny))


async def wait_websockets(server: Server, n: int, timeout: float = 10.0) -> None:
    """Until the server has `n` WebSockets open (its metrics say): a socket's slot frees a moment after its close
    handshake."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(base_url=server.url, verify=server.tls or True) as http:
        while True:
            text = (await http.get("/metrics")).text
            if float(re.search(r"^sluice_websocket_connections (\S+)$", text, re.MULTILINE)[1]) == n:
                return
            assert time.monotonic() < deadline, f"not {n} websockets open:\n{text}"
            await asyncio.sleep(0.05)
