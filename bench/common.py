"""What every workload shares: the run settings, the model, the matmul peak and model FLOPs.

`Run` is built once by `bench/__main__.py` after the thread environment is fixed; the workloads
take it as their only configuration.
"""
from __future__ import annotations

import json
import os
import platform
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.layout import cpu_model  # noqa: F401  (re-exported: bench's host labels)

RESULTS_DIR = Path(__file__).parent / "results"


@dataclass(frozen=True)
class Run:
    model_dir: Path
    dtype: str  # "bfloat16" | "float32"
    threads: int
    quick: bool
    out_dir: Path
    seed: int = 0
    rounds: int = 1
    progress: bool = True
    command: str = "python -m bench"  # as invoked, recorded with the results
    # offline only: engine limits, also the transformers baselines' batch size and budget (None: the defaults)
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def rng(self, salt: str) -> random.Random:
        """A fresh seeded generator per use, so one workload's draws never shift another's."""
        return random.Random(f"{self.seed}:{salt}")

    def tokens(self, rng: random.Random, n: int, vocab: int) -> list[int]:
        """`n` random token ids, avoiding the low ids where the tiny tokenizer keeps its special tokens."""
        return [rng.randrange(16, vocab) for _ in range(n)]

    def host(self) -> dict[str, object]:
        return {
            "cpu": cpu_model(), "isa": isa(), "cores": os.cpu_count(), "threads": self.threads,
            "dtype": self.dtype, "kernels": kernel_path(), "torch": torch.__version__,
            "python": platform.python_version(),
        }


# The ISA features that pick a CPU path here: AMX runs bf16 prefill chunks on tiles, AVX512-BF16 multiplies
# bf16 natively (else the bench runs fp32), AVX-512 / AVX2 vectorize the native kernels.
ISA_FLAGS = {"AMX": "amx_bf16", "AVX512-BF16": "avx512_bf16", "AVX-512": "avx512f", "AVX2": "avx2"}


def isa() -> list[str]:
    """The features of ISA_FLAGS this CPU has, in that order."""
    flags = cpu_flags()
    return [name for name, flag in ISA_FLAGS.items() if flag in flags]


def kernel_path() -> str:
    """Which kernels the engine runs on this host (the CPU build it loads, or would load)."""
    import sluice_kernels as kernels
    from engine.config import kernel_cache_dir

    if torch.cuda.is_available() or kernels.MODE == "triton":
        return "triton"
    if kernels.MODE == "torch" or not (kernels.cpu.loaded() or kernels.cpu.load(kernel_cache_dir())):
        return "torch"  # as the engine does: it loads the same build (a server subprocess too)
    return "native, " + {"amx": "AMX", "avx512-bf16": "AVX512-BF16"}.get(kernels.cpu.prefill(), "SDPA") + " prefill"


def host_slug(host: dict | None = None) -> str:
    """A results folder name for this kind of host: CPU family and the feature that picks its path."""
    host = host or {"cpu": cpu_model(), "isa": isa()}
    cpu = str(host.get("cpu", "")).lower()
    family = next((f for f in ("xeon", "epyc", "ryzen", "core") if f in cpu), cpu.split(" ")[0] or "cpu")
    feats = host.get("isa") or []
    best = next((f for f in ("AMX", "AVX512-BF16", "AVX-512", "AVX2") if f in feats), "generic")
    return f"{family}-{best.lower().replace('-', '')}"


def host_line(host: dict) -> str:
    """One line naming where a result was measured, for the markdown beside it."""
    isa_list = host.get("isa")
    feats = ", ".join(isa_list) if isa_list else "no AVX2" if isa_list == [] else "ISA not recorded"
    return (f"{host.get('cpu')} ({feats}), {host.get('threads')} of {host.get('cores', '?')} cores, "
            f"{host.get('dtype')}, {host.get('kernels', 'kernels not recorded')} kernels, torch {host.get('torch')}")


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def pick_dtype() -> str:
    """bfloat16 where the CPU multiplies it natively (AMX or AVX512-BF16), else float32."""
    if torch.cuda.is_available():
        return "bfloat16"
    return "bfloat16" if cpu_flags() & {"amx_bf16", "avx512_bf16"} else "float32"


def default_model_dir() -> Path:
    """The `small` preset (~50M params), built once under $SLUICE_HOME by engine/tiny.py."""
    from engine.tiny import default_model_dir as build_once

    return build_once("small")


def model_config(model_dir: Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def matmul_peak_tflops(dtype: torch.dtype, seconds: float = 1.5) -> float:
    """Best sustained TFLOP/s of a square matmul in `dtype` on this host, measured now."""
    best = 0.0
    for n in (1024, 2048):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        for _ in range(2):
            a @ b  # oneDNN picks and JITs its kernel on the first calls
        deadline = time.perf_counter() + seconds / 2
        while time.perf_counter() < deadline:
            t = time.perf_counter()
            for _ in range(3):
                a @ b
            best = max(best, 3 * 2 * n**3 / (time.perf_counter() - t) / 1e12)
    return best


class FlopCounter:
    """Model FLOPs of useful work (no padding, no recompute): 2 per weight per token, plus attention.

    A request with prompt P and output O computes P + O - 1 positions through the layers
    (the last output token is never fed back), attends causally over them, and runs the LM head
    once per output token. Prompt tokens served from the prefix cache are not counted.
    """

    def __init__(self, cfg: dict):
        H, L = cfg["hidden_size"], cfg["num_hidden_layers"]
        Hq, Hkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
        D = cfg.get("head_dim") or H // Hq
        per_layer = H * (Hq + 2 * Hkv) * D + Hq * D * H + 3 * H * cfg["intermediate_size"]
        self.linear = 2 * L * per_layer  # per position
        self.attn = 4 * L * Hq * D  # per (query, key) pair: QK^T and PV
        self.head = 2 * H * cfg["vocab_size"]  # per sampled token

    def request(self, prompt: int, output: int, cached: int = 0) -> float:
        first, last = cached, prompt + output - 1  # positions [first, last) are computed
        n = max(0, last - first)
        pairs = (last * (last + 1) - first * (first + 1)) / 2  # position p attends to p + 1 keys
        return n * self.linear + pairs * self.attn + output * self.head
