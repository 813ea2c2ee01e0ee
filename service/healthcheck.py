"""`python -m service.healthcheck`: the container's HEALTHCHECK. Exit 0 while `GET /health` on this machine answers
200, 1 otherwise. It reads the server's settings from the same `SLUICE_*` variables the server does (the port, and
TLS: https with the server's certificate taken on trust, as it is its own, and offered back as the client's when
`--ssl-cert-reqs 2` requires one, which works where the CA in `--ssl-ca-certs` signed it for client authentication
too)."""
from __future__ import annotations

import ssl
import sys
import urllib.request

from service.config import ServerConfig, parse_config


def probe(config: ServerConfig, timeout: float = 2.0) -> bool:
    client = None
    if config.ssl_certfile is not None:
        client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        client.check_hostname = False  # (127.0.0.1 is rarely a name the certificate holds)
        client.verify_mode = ssl.CERT_NONE
        if config.ssl_cert_reqs == ssl.CERT_REQUIRED:  # (optional: none is sent, as one would be checked)
            client.load_cert_chain(config.ssl_certfile, config.ssl_keyfile)
    url = f"{'https' if client else 'http'}://127.0.0.1:{config.port}/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=client) as r:
            return r.status == 200
    except OSError:  # (refused, timed out, TLS refused; an HTTPError, 503 while loading or draining, is one too)
        return False


if __name__ == "__main__":
    sys.exit(0 if probe(parse_config([])) else 1)
