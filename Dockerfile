# Sluice: streaming chat server (CPU image). Build: docker build -t sluice .  Run: docker compose up
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SLUICE_HOME=/data

WORKDIR /app

# torch first, from the CPU wheel index: `pip install .` then finds it satisfied and never pulls
# the multi-GB CUDA build. Its own layer, so code changes do not re-download it.
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch>=2.4"

COPY pyproject.toml README.md ./
COPY engine ./engine
COPY kernels ./kernels
COPY service ./service
COPY bench ./bench
COPY web ./web
RUN pip install . && python -c "import service.server"

# Unprivileged at run time; $SLUICE_HOME holds the embedded model (built on first start) and caches.
RUN useradd --create-home --uid 10001 sluice && mkdir -p /data && chown sluice:sluice /data
USER sluice
VOLUME ["/data"]

EXPOSE 8000
STOPSIGNAL SIGTERM
# slim has no curl; the first start builds the tiny model, hence the long start period
HEALTHCHECK --interval=10s --timeout=3s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2).status != 200)"]

ENTRYPOINT ["sluice"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
