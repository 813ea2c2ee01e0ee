"""TLS (`--ssl-keyfile`, `--ssl-certfile`, `--ssl-ca-certs`, `--ssl-cert-reqs`; vLLM's flags): every route over
https:// and the WebSocket over wss://, client certificates when asked for, flags checked at start, and the
container's healthcheck (service/healthcheck.py) on a TLS server. Certificates from `trustme`'s throwaway CA."""
from __future__ import annotations

import dataclasses
import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import trustme

from service.config import ServerConfig, parse_config
from service.healthcheck import probe
from tests.server import Server, spawn_server, wait_healthy
from tests.service.conftest import collect, check_chat_frames, open_ws, send, user_chat


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A CA, the server's certificate (127.0.0.1) and a client's, all signed by it; and a second, unrelated CA."""
    d = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("client@example.com")
    files = {"ca": ca.cert_pem, "other_ca": other.cert_pem, "key": server.private_key_pem,
             "cert": server.cert_chain_pems[0], "client_key": client.private_key_pem,
             "client_cert": client.cert_chain_pems[0]}
    for name, blob in files.items():
        blob.write_to_path(str(d / f"{name}.pem"))
    return {name: d / f"{name}.pem" for name in files}


def client_context(pki: dict[str, Path], *, cert: bool = False) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki["ca"]))
    if cert:
        context.load_cert_chain(pki["client_cert"], pki["client_key"])
    return context


def tls_flags(pki: dict[str, Path]) -> list[str]:
    return ["--ssl-keyfile", str(pki["key"]), "--ssl-certfile", str(pki["cert"])]


@pytest.fixture(scope="module")
def servers(pki: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    """One server with TLS and one that also requires a client certificate (mutual TLS), started side by side."""
    tmp = tmp_path_factory.mktemp("tls")
    procs = {
        "tls": spawn_server(tmp, *tls_flags(pki), tls=client_context(pki)),
        "mutual": spawn_server(tmp, *tls_flags(pki), "--ssl-ca-certs", str(pki["ca"]), "--ssl-cert-reqs", "2",
                               tls=client_context(pki, cert=True)),
    }
    try:
        for server in procs.values():
            wait_healthy(server)
        yield procs
    finally:
        for server in procs.values():
            server.stop()


async def test_websocket_chat_over_wss(servers: dict[str, Server]) -> None:
    ws = await open_ws(servers["tls"])
    try:
        await send(ws, **user_chat("c1", "Hello over TLS", max_tokens=8, temperature=0))
        text, done = check_chat_frames((await collect(ws, {"c1"}))["c1"])
        assert done["usage"]["completion_tokens"] == 8 and text
    finally:
        await ws.close()


def test_openai_client_over_https(servers: dict[str, Server]) -> None:
    server = servers["tls"]
    with httpx.Client(verify=server.tls) as http:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", http_client=http)
        model = client.models.list().data[0].id
        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=4, temperature=0)
        assert chat.usage.completion_tokens == 4
        streamed = client.completions.create(model=model, prompt="Hi", max_tokens=4, temperature=0, stream=True)
        assert sum(1 for chunk in streamed if chunk.choices and chunk.choices[0].text) >= 1
        # the UI's files too
        assert "<html" in http.get(f"{server.url}/").text.lower()


def test_plain_http_and_untrusted_clients_are_refused(servers: dict[str, Server], pki: dict[str, Path]) -> None:
    server = servers["tls"]
    with pytest.raises(httpx.RemoteProtocolError):  # plain HTTP to a TLS port: the handshake fails, no reply
        httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=10)
    untrusting = ssl.create_default_context(cafile=str(pki["other_ca"]))
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{server.url}/health", verify=untrusting, timeout=10)
    assert httpx.get(f"{server.url}/health", verify=server.tls, timeout=10).status_code == 200  # still serving
    assert "Traceback" not in server.log_text()


async def test_mutual_tls_requires_a_client_certificate(servers: dict[str, Server], pki: dict[str, Path]) -> None:
    server = servers["mutual"]
    with pytest.raises(httpx.HTTPError):  # (the refusal may surface as a reset or a TLS alert)
        httpx.get(f"{server.url}/health", verify=client_context(pki), timeout=10)
    assert httpx.get(f"{server.url}/health", verify=server.tls, timeout=10).status_code == 200
    ws = await open_ws(server)  # (server.tls carries the client certificate)
    try:
        await send(ws, **user_chat("m1", "Hi", max_tokens=2))
        check_chat_frames((await collect(ws, {"m1"}))["m1"])
    finally:
        await ws.close()


def _serve_health_once(listener: socket.socket, context: ssl.SSLContext) -> None:
    """One TLS connection answered `200` (a stand-in for the server's /health, with its TLS context)."""
    conn, _ = listener.accept()
    with context.wrap_socket(conn, server_side=True) as tls:
        tls.recv(4096)
        tls.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
    listener.close()


def test_healthcheck_speaks_tls(servers: dict[str, Server], pki: dict[str, Path], tmp_path: Path) -> None:
    """The image's HEALTHCHECK reads the server's variables: https, the server's own certificate on trust, offered
    as the client's where one is required (the CA signed both here)."""
    for name, extra in (("tls", {}), ("mutual", {"SLUICE_SSL_CA_CERTS": str(pki["ca"]), "SLUICE_SSL_CERT_REQS": "2"})):
        env = {"SLUICE_PORT": str(servers[name].port), "SLUICE_SSL_KEYFILE": str(pki["key"]),
               "SLUICE_SSL_CERTFILE": str(pki["cert"]), **extra}
        assert probe(parse_config([], env)), name
    # client certificates checked when sent (1) against a CA of clients' own: the probe sends none, as a server's
    # certificate would fail that check
    server, clients = trustme.CA(), trustme.CA()
    cert = server.issue_cert("127.0.0.1")
    for name, blob in (("k1.pem", cert.private_key_pem), ("c1.pem", cert.cert_chain_pems[0]),
                       ("clients.pem", clients.cert_pem)):
        blob.write_to_path(str(tmp_path / name))
    optional = ServerConfig(ssl_keyfile=str(tmp_path / "k1.pem"), ssl_certfile=str(tmp_path / "c1.pem"),
                            ssl_ca_certs=str(tmp_path / "clients.pem"), ssl_cert_reqs=1)
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_serve_health_once, args=(listener, optional.tls_context()), daemon=True).start()
    assert probe(dataclasses.replace(optional, port=listener.getsockname()[1]))
    # without the TLS variables it speaks plain HTTP to the TLS port: unhealthy, not a hang or a crash
    assert not probe(parse_config([], {"SLUICE_PORT": str(servers["tls"].port)}))


def test_tls_flags_are_checked_at_start(pki: dict[str, Path], tmp_path: Path) -> None:
    key, cert = str(pki["key"]), str(pki["cert"])
    assert ServerConfig().tls_context() is None
    assert isinstance(ServerConfig(ssl_keyfile=key, ssl_certfile=cert).tls_context(), ssl.SSLContext)
    cases = [
        ({"ssl_keyfile": key}, "go together"),
        ({"ssl_certfile": cert}, "go together"),
        ({"ssl_ca_certs": str(pki["ca"])}, "need --ssl-certfile"),
        ({"ssl_cert_reqs": 2}, "need --ssl-certfile"),
        ({"ssl_keyfile": key, "ssl_certfile": cert, "ssl_cert_reqs": 2}, "needs --ssl-ca-certs"),
        ({"ssl_keyfile": key, "ssl_certfile": cert, "ssl_cert_reqs": 3}, "must be 0"),
        ({"ssl_keyfile": str(pki["client_key"]), "ssl_certfile": cert}, "--ssl-certfile / --ssl-keyfile"),  # not its key
        ({"ssl_keyfile": key, "ssl_certfile": str(tmp_path / "missing.pem")}, "--ssl-certfile / --ssl-keyfile"),
        ({"ssl_keyfile": key, "ssl_certfile": cert, "ssl_ca_certs": str(tmp_path / "missing.pem")}, "--ssl-ca-certs"),
    ]
    for fields, message in cases:
        with pytest.raises(ValueError, match=message):
            ServerConfig(**fields)
    with pytest.raises(SystemExit) as e:  # `sluice serve` exits 2 on them, before any model loads
        parse_config(["--ssl-keyfile", key])
    assert e.value.code == 2
