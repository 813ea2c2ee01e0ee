# HAProxy in front of Sluice replicas (compose.scale.yaml; README "Scaling"). Debian's haproxy, and the
# configuration generated at start from deploy/haproxy.cfg.template by deploy/haproxy.py (the same generator and
# template the tests run against real replicas), for up to SLUICE_REPLICAS replicas found under the DNS name
# SLUICE_REPLICAS_DNS (compose's `sluice`). Checked with `haproxy -c` before it serves.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}
# Debian's current haproxy (2.6 on bookworm): a pinned apt version would vanish with the next security update.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends haproxy \
 && rm -rf /var/lib/apt/lists/* \
 && install -d -o haproxy -g haproxy /run/sluice-proxy
COPY deploy/haproxy.py deploy/haproxy.cfg.template /opt/sluice-proxy/
ENV SLUICE_REPLICAS=2 \
    SLUICE_REPLICAS_DNS=sluice:8000 \
    SLUICE_RATE_LIMIT=1000
# Debian's haproxy user, by name: the package creates it, so its uid is not known here
# hadolint ignore=DL3066
USER haproxy
EXPOSE 8000
STOPSIGNAL SIGUSR1
# healthy while the proxy answers and some replica serves (GET /health through it)
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python3", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2).status != 200)"]
# -W: master-worker (SIGUSR2 reloads: new workers at once, old ones finish their streams); -db: stay in the
# foreground, logs on stderr
ENTRYPOINT ["/bin/sh", "-c", "python3 /opt/sluice-proxy/haproxy.py --bind :8000 --replicas-dns \"$SLUICE_REPLICAS_DNS\" --count \"$SLUICE_REPLICAS\" --rate-limit \"$SLUICE_RATE_LIMIT\" -o /run/sluice-proxy/haproxy.cfg && haproxy -c -q -f /run/sluice-proxy/haproxy.cfg && exec haproxy -W -db -f /run/sluice-proxy/haproxy.cfg"]
