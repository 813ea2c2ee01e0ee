#!/usr/bin/env bash
# One-shot GPU check (H100/H200): installs the working tree into a venv, then runs bench/gpu_check.py
# which prints one markdown table (kernels vs reference, timings, decode GB/s, engine tokens/s).
# Usage: bench/gpu_check.sh [--skip-engine] [--no-torch-e2e] [--only-graphs | --only-workloads]
#                                                                                  (CPU logic check: --dry-run)
# Budget: <= 8 minutes on one H200 including the install. Works offline if torch+triton are preinstalled.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${SLUICE_GPU_VENV:-${TMPDIR:-/tmp}/sluice-gpu-venv}"
PY="${PYTHON:-python3}"
start=$(date +%s)

# --system-site-packages: reuse the image's CUDA torch/triton instead of downloading gigabytes.
[ -x "$VENV/bin/python" ] || "$PY" -m venv --system-site-packages "$VENV"
VPY="$VENV/bin/python"
PIP=("$VPY" -m pip install -q --disable-pip-version-check)

if "$VPY" -c "import torch, triton" 2>/dev/null; then
  # torch is present: never let the resolver touch it. Install the project without deps, then only
  # the pure-Python deps that are missing (skipped quietly when the box is offline).
  "${PIP[@]}" --no-deps -e . 2>/dev/null || "${PIP[@]}" --no-deps --no-build-isolation -e . 2>/dev/null \
    || echo "note: editable install failed; using PYTHONPATH=$ROOT" >&2
  missing=$("$VPY" - <<'PY'
import importlib.util
mods = {"numpy": "numpy", "safetensors": "safetensors", "tokenizers": "tokenizers", "transformers": "transformers",
        "jinja2": "jinja2", "tqdm": "tqdm", "matplotlib": "matplotlib",
        # the served workload runs `python -m service`
        "starlette": "starlette", "uvicorn": "uvicorn", "websockets": "websockets", "uvloop": "uvloop",
        "msgspec": "msgspec", "prometheus_client": "prometheus-client"}
print(" ".join(pkg for mod, pkg in mods.items() if importlib.util.find_spec(mod) is None))
PY
)
  if [ -n "$missing" ]; then
    "${PIP[@]}" $missing || echo "warning: could not install: $missing (engine rows may fail)" >&2
  fi
else
  "${PIP[@]}" -e ".[triton]"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_DEFAULT_FP_FUSION=1
versions=$("$VPY" -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.is_available())')
echo "install: $(( $(date +%s) - start ))s; torch, triton, cuda: $versions" >&2

rc=0
"$VPY" -m bench.gpu_check "$@" || rc=$?
echo "total: $(( $(date +%s) - start ))s" >&2
exit $rc
