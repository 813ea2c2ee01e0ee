# syntax=docker/dockerfile:1
# Sluice: one image, two targets. compose.yaml builds both (README "Deploy"); by hand:
#   docker build -t sluice:cuda .                          NVIDIA GPU hosts (torch's CUDA wheel + Triton)
#   docker build --build-arg TARGET=cpu -t sluice:cpu .    CPU hosts (torch's CPU wheel)
# Layers go from slowest- to fastest-changing (OS packages, torch, pinned deps, the project), so a
# code edit rebuilds only the last one. docker/requirements.txt pins every runtime dependency.
ARG TARGET=cuda
ARG TORCH_VERSION=2.13.0

FROM python:3.11-slim-bookworm AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SLUICE_HOME=/data
# Unprivileged at run time; $SLUICE_HOME holds the embedded model (built on first start) and caches.
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin sluice \
 && install -d -o 10001 -g 10001 /data
WORKDIR /app

FROM base AS torch-cpu
# The CPU attention kernel (kernels/csrc) is compiled for the host's instruction set on first start and
# cached under $SLUICE_HOME, so the CPU image carries a C++ compiler (without one, a slower torch path serves).
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*
ARG TORCH_VERSION
# Torch's own dependencies come pinned from PyPI in the next layer.
RUN pip install --no-cache-dir --no-deps --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}+cpu"

FROM base AS torch-cuda
# Triton JIT-compiles a small C launcher for each kernel signature, so the CUDA image needs a C compiler
# (Debian's current one: a pinned apt version would vanish from the mirror with the next security update).
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
# PyPI's torch bundles the CUDA 13 libraries and pins its Triton, so the host needs only the NVIDIA
# driver (>= 580) and the NVIDIA Container Toolkit. For an older driver, build from one of PyTorch's
# CUDA 12 indexes: --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG TORCH_VERSION
ARG TORCH_INDEX=https://pypi.org/simple
COPY docker/requirements.txt docker/
RUN pip install --no-cache-dir --extra-index-url "${TORCH_INDEX}" -c docker/requirements.txt "torch==${TORCH_VERSION}"
# Compiled kernels persist in the $SLUICE_HOME volume instead of being rebuilt on every start.
ENV TRITON_CACHE_DIR=/data/triton

# torch-cpu or torch-cuda: a stage of this file, which hadolint takes for an untagged image.
# hadolint ignore=DL3006
FROM torch-${TARGET} AS app
WORKDIR /app
COPY docker/requirements.txt docker/
RUN pip install --no-cache-dir -r docker/requirements.txt
COPY pyproject.toml README.md ./
COPY engine engine
COPY kernels kernels
COPY service service
COPY web web
# --no-deps: nothing but the pins above gets in; `pip check` proves they satisfy every requirement.
RUN pip install --no-cache-dir --no-deps --no-build-isolation . \
 && pip check \
 && python -c "import service.server"

USER 10001
VOLUME ["/data"]
EXPOSE 8000
STOPSIGNAL SIGTERM
# slim has no curl. Start period: the first start builds the tiny model, and a real one takes time to load.
HEALTHCHECK --interval=10s --timeout=3s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; sys.exit(urllib.request.urlopen(f\"http://127.0.0.1:{os.environ.get('SLUICE_PORT') or 8000}/health\", timeout=2).status != 200)"]

ENTRYPOINT ["sluice"]
CMD ["serve", "--host", "0.0.0.0"]
