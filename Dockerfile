# Sluice: one image, two kinds of host. compose.yaml builds it (README "Deploy"); by hand:
#   docker build -t sluice:cpu .                            any host (torch's CPU wheel)
#   docker build --build-arg TARGET=cuda -t sluice:cuda .   NVIDIA GPU hosts (torch's CUDA wheel + Triton)
# TARGET is read inside RUN steps, not used to pick a stage: every builder (BuildKit, or the legacy one, which
# builds every stage of a file) runs the same steps, so a CPU build never downloads the CUDA stack.
# Layers go from slowest- to fastest-changing (OS packages, torch, pinned deps, the project), so a code edit
# rebuilds only the last ones. docker/requirements.txt pins every runtime dependency.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# Behind a PyPI mirror: --build-arg PIP_INDEX_URL=https://mirror/simple (and PIP_TRUSTED_HOST=mirror for plain
# http); pip reads both from the environment of every RUN below. Neither stays in the image.

# The project as a wheel, built apart so the image holds the installed package and no source tree that
# could shadow it.
FROM ${PYTHON_IMAGE} AS wheel
ARG PIP_INDEX_URL
ARG PIP_TRUSTED_HOST
WORKDIR /src
COPY docker/requirements.txt docker/
RUN pip install --no-cache-dir --disable-pip-version-check -c docker/requirements.txt setuptools
COPY pyproject.toml README.md ./
COPY engine engine
COPY sluice_kernels sluice_kernels
COPY service service
COPY web web
RUN pip wheel --no-cache-dir --disable-pip-version-check --no-deps --no-build-isolation --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SLUICE_HOME=/data \
    TRITON_CACHE_DIR=/data/triton
# Unprivileged at run time; $SLUICE_HOME holds compiled kernels
# and caches.
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin sluice \
 && install -d -o 10001 -g 10001 /data

ARG PIP_INDEX_URL
ARG PIP_TRUSTED_HOST
ARG TARGET=cpu
# A compiler stays in the runtime image on purpose. cpu: the attention kernel (sluice_kernels/cpu/csrc) is compiled with
# -march=native for the CPU it runs on, on first start (cached in $SLUICE_HOME); a build host cannot know that
# CPU, and without g++ a slower torch path serves. cuda: Triton compiles a small C launcher per kernel.
# Debian's current compiler: a pinned apt version would vanish from the mirror with the next security update.
# hadolint ignore=DL3008
RUN case "$TARGET" in \
      cpu) compiler=g++ ;; \
      cuda) compiler=gcc ;; \
      *) echo "TARGET must be cpu or cuda, not '$TARGET'" >&2; exit 1 ;; \
    esac \
 && apt-get update \
 && apt-get install -y --no-install-recommends "$compiler" libc6-dev \
 && rm -rf /var/lib/apt/lists/*

# TORCH_INDEX (empty: the default for TARGET) is where torch comes from: a mirror, or another build.
#   cpu:  https://download.pytorch.org/whl/cpu, the only index asked (its CPU wheel; torch's own dependencies
#         come pinned from PyPI in the next layer).
#   cuda: PyPI (or PIP_INDEX_URL), whose torch bundles the CUDA 13 libraries and pins its Triton, so the host needs only the
#         NVIDIA driver (>= 580) and the NVIDIA Container Toolkit. For an older driver, one of PyTorch's
#         CUDA 12 indexes: --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=
COPY docker/requirements.txt /tmp/docker/
RUN if [ "$TARGET" = cpu ]; then \
      pip install --no-cache-dir --no-deps --index-url "${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}" \
        "torch==${TORCH_VERSION}"; \
    else \
      set --; [ -z "$TORCH_INDEX" ] || set -- --extra-index-url "$TORCH_INDEX"; \
      pip install --no-cache-dir "$@" -c /tmp/docker/requirements.txt "torch==${TORCH_VERSION}"; \
    fi
RUN pip install --no-cache-dir -r /tmp/docker/requirements.txt

# --no-deps: nothing but the pins above gets in; `pip check` proves they satisfy every requirement. The check
# runs outside any source tree, so it imports the installed package (nothing else is on the path) and finds the installed UI.
WORKDIR /home/sluice
COPY --from=wheel /wheels /tmp/wheels
RUN pip install --no-cache-dir --no-deps /tmp/wheels/*.whl \
 && rm -rf /tmp/wheels /tmp/docker \
 && pip check \
 && python -c "import sys, service.server, service.app as a; print('sluice:', a.__file__, 'UI:', a.web_dir()); \
sys.exit('/site-packages/' not in a.__file__ or a.web_dir() is None)"

USER 10001
VOLUME ["/data"]
EXPOSE 8000
STOPSIGNAL SIGTERM
# slim has no curl: GET /health from Python, on the port (and with the TLS) the SLUICE_* variables give the server.
# Start period: the first start builds the tiny model, and a real one takes time to load.
HEALTHCHECK --interval=10s --timeout=3s --start-period=180s --retries=3 \
    CMD ["python", "-m", "service.healthcheck"]

ENTRYPOINT ["sluice"]
CMD ["serve", "--host", "0.0.0.0"]
