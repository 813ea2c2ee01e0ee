"""`EngineConfig`: the one frozen config of the engine boundary, validated on construction.

The environment is read here and nowhere else in `engine/` (`SLUICE_HOME`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

SCHEDULING_POLICIES = ("mixed", "prefill_first", "static")
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8", "fp8_e4m3")  # auto: the model's dtype
DEVICES = ("auto", "cpu", "cuda")
CUDAGRAPH_MODES = ("full", "full_decode_only")
# the generation config's keys that set requests' sampling defaults (vLLM's); max_new_tokens caps every request
GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


def default_model_dir() -> Path:
    """The embedded default model: a small chat model trained by engine/train.py, shipped in the package."""
    return Path(__file__).parent / "sluice-chat"


def sluice_home() -> Path:
    return Path(os.environ.get("SLUICE_HOME", Path.home() / ".cache" / "sluice"))


def kernel_cache_dir() -> Path:
    """Where the native CPU kernels are compiled, once per CPU and source (sluice_kernels/cpu/build.py)."""
    return sluice_home() / "build"


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # local HF directory; None = the embedded default (`default_model_dir()`)
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    kv_cache_dtype: str = "auto"  # what the KV cache stores: the model's dtype, another float, or int8 / fp8 (e4m3)
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from memory (kv_memory_fraction / kv_cpu_bytes)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings, capped by the KV pool
    scheduling: str = "mixed"
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int | None = None  # None: no per-prompt cap below the budget
    max_num_partial_prefills: int = 4
    itl_slo_ms: float | None = None  # `mixed`: size each step's prompt tokens to keep its time (a stream's ITL) under this
    seed: int = 0
    kv_memory_fraction: float = 0.85  # CUDA: fraction of free memory after weights that holds KV
    kv_cpu_bytes: int = 512 << 20  # CPU: bytes of KV cache when num_kv_blocks is None
    kv_offload_gb: float = 0.0  # host memory for a second KV tier (cached blocks evicted from the pool); 0: none
    kv_eviction: str = "slru"  # which free cached block (and host tier entry) goes first: "slru" (ones hit before go last) or "lru"
    prefix_store: bool = True  # pinned prefixes' KV kept on disk under $SLUICE_HOME/prefix-store, loaded on start
    tensor_parallel_size: int = 1  # ranks the model is sharded over (engine/parallel.py): processes, a GPU each on CUDA
    speculative: str | None = None  # "ngram" (prompt lookup) or "draft:DIR" (a small model): drafts verified in the step (engine/spec.py)
    num_speculative_tokens: int = 4  # most draft tokens a request verifies in one step
    ngram_prompt_lookup_max: int = 4  # longest suffix of a request's tokens matched against its earlier tokens
    ngram_prompt_lookup_min: int = 2  # shortest
    speculative_disable_by_batch_size: int = 16  # no drafts in a step with this many decoding requests or more
    speculative_adaptive: bool = True  # below that, draft only where the step-time model says drafts pay (engine/spec.py)
    async_output_proc: bool = False  # make a step's outputs while the next step's forward runs (one step later; §4)
    async_scheduling: bool = False  # schedule and prepare step N+1 while step N runs (its outputs made then too; §4)
    enforce_eager: bool = True  # False: steps replay CUDA graphs (engine/cuda_graphs.py; on until a GPU has measured them)
    cudagraph_mode: str = "full"  # with graphs: "full" (decode and mixed steps) or "full_decode_only" (vLLM's names)
    chat_template: str | None = None  # a Jinja chat template (its text) in place of the model's own
    # (vLLM's) where requests' sampling defaults come from: "auto" the model's generation_config.json, "vllm" none
    # (SamplingParams' own), or a directory holding a generation_config.json; engine/loader.py `sampling_defaults`
    generation_config: str = "auto"
    override_generation_config: dict | None = None  # (vLLM's) generation config keys over those, e.g. {"temperature": 0.5}

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"EngineConfig: {msg}")

        need(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        need(self.kv_cache_dtype in KV_CACHE_DTYPES, f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        need(self.cudagraph_mode in CUDAGRAPH_MODES,
             f"cudagraph_mode must be one of {CUDAGRAPH_MODES}, got {self.cudagraph_mode!r}")
        need(self.device in DEVICES, f"device must be one of {DEVICES}, got {self.device!r}")
        need(self.scheduling in SCHEDULING_POLICIES, f"scheduling must be one of {SCHEDULING_POLICIES}, got {self.scheduling!r}")
        need(self.block_size > 0 and self.block_size & (self.block_size - 1) == 0, f"block_size must be a power of two, got {self.block_size}")
        need(self.num_kv_blocks is None or self.num_kv_blocks > 0, f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        need(self.max_num_seqs > 0, f"max_num_seqs must be positive, got {self.max_num_seqs}")
        need(self.max_num_batched_tokens > 0, f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        need(self.max_model_len is None or self.max_model_len > 1, f"max_model_len must be > 1, got {self.max_model_len}")
        need(
            self.long_prefill_token_threshold is None or self.long_prefill_token_threshold > 0,
            f"long_prefill_token_threshold must be positive, got {self.long_prefill_token_threshold}",
        )
        need(self.itl_slo_ms is None or self.itl_slo_ms > 0, f"itl_slo_ms must be positive, got {self.itl_slo_ms}")
        need(self.max_num_partial_prefills > 0, f"max_num_partial_prefills must be positive, got {self.max_num_partial_prefills}")
        need(self.kv_eviction in ("lru", "slru"), f"kv_eviction must be lru or slru, got {self.kv_eviction!r}")
        need(self.kv_offload_gb >= 0.0, f"kv_offload_gb must be >= 0, got {self.kv_offload_gb}")
        need(self.tensor_parallel_size >= 1, f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        need(self.tensor_parallel_size == 1 or self.kv_offload_gb == 0.0,
             "kv_offload_gb (the host KV tier) does not run with tensor_parallel_size > 1 yet")
        need(self.speculative in (None, "ngram") or (self.speculative.startswith("draft:") and len(self.speculative) > 6),
             f"speculative must be ngram or draft:DIR (or unset), got {self.speculative!r}")
        need(self.draft_model is None or self.tensor_parallel_size == 1,
             "speculative draft:DIR does not run with tensor_parallel_size > 1 yet")
        need(self.num_speculative_tokens >= 1, f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        need(1 <= self.ngram_prompt_lookup_min <= self.ngram_prompt_lookup_max,
             f"need 1 <= ngram_prompt_lookup_min ({self.ngram_prompt_lookup_min}) <= ngram_prompt_lookup_max "
             f"({self.ngram_prompt_lookup_max})")
        need(self.speculative_disable_by_batch_size >= 1,
             f"speculative_disable_by_batch_size must be >= 1, got {self.speculative_disable_by_batch_size}")
        need(self.generation_config in ("auto", "vllm") or os.path.isdir(self.generation_config),
             f"generation_config must be auto, vllm or a directory, got {self.generation_config!r}")
        need(self.override_generation_config is None or isinstance(self.override_generation_config, dict),
             "override_generation_config must be a dict of generation config keys")
        need(not set(self.override_generation_config or ()) - set(GENERATION_KEYS),
             f"override_generation_config takes {', '.join(GENERATION_KEYS)}; "
             f"not {', '.join(sorted(set(self.override_generation_config or ()) - set(GENERATION_KEYS)))}")
        need(0.0 < self.kv_memory_fraction <= 1.0, f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")

    @property
    def draft_model(self) -> str | None:
        """The draft model's directory of `speculative="draft:DIR"`, else None."""
        s = self.speculative
        return s.removeprefix("draft:") if s and s.startswith("draft:") else None

    @property
    def chunk_limit(self) -> int:
        """Most prompt tokens one request may compute in one `mixed` step."""
        t = self.long_prefill_token_threshold
        return self.max_num_batched_tokens if t is None else min(t, self.max_num_batched_tokens)
