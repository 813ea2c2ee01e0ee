"""Where the engine runs and how its KV pool is shaped: device, dtype, block count, max_model_len.

Resolved once, at construction, from `EngineConfig` and the model's config (docs/architecture.md §5,
Sizing); a `max_model_len` that cannot fit is refused here.
"""
from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.models import ModelConfig
from engine.parallel import Shard

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_DTYPES = {**TORCH_DTYPES, "int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
QUANTIZED = (torch.int8, torch.float8_e4m3fn)  # stored with a fp32 scale per token and KV head (kernels.reference)


@dataclass(frozen=True)
class Layout:
    device: torch.device
    dtype: torch.dtype
    block_size: int  # tokens per KV block
    num_blocks: int  # KV blocks in the pool
    max_model_len: int  # most tokens (prompt + output) of one request
    num_host_blocks: int = 0  # slots of the host tier (`kv_offload_gb`), each one block of every layer
    kv_dtype: torch.dtype | None = None  # what the cache stores; None: `dtype`

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_dtype or self.dtype

    @property
    def quantized(self) -> bool:
        return self.cache_dtype in QUANTIZED


def placement(config: EngineConfig) -> tuple[torch.device, torch.dtype]:
    """`auto` device: CUDA if available; `auto` dtype: bfloat16 on CUDA, float32 on CPU."""
    if config.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(config.device)
    if config.dtype == "auto":
        return device, torch.bfloat16 if device.type == "cuda" else torch.float32
    return device, TORCH_DTYPES[config.dtype]


def plan_layout(config: EngineConfig, mc: ModelConfig, device: torch.device, dtype: torch.dtype,
                draft: ModelConfig | None = None) -> Layout:
    """Sizes the KV pool. Call it once the weights are on `device`: on CUDA the pool takes a share of
    the memory they leave. Raises `ValueError` for an explicit `max_model_len` that cannot fit. A `draft` model
    (speculative decoding) keeps its KV in the same blocks: a block holds both models' layers."""
    block_size = config.block_size
    kv_dtype = dtype if config.kv_cache_dtype == "auto" else KV_DTYPES[config.kv_cache_dtype]
    if kv_dtype == torch.float8_e4m3fn and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError("kv_cache_dtype fp8 needs a GPU with fp8 conversions (compute capability 8.9 or newer); "
                         "use int8")
    # under tensor parallelism a rank holds its KV heads only: the budget is per rank (per GPU)
    bytes_per_block = kv_block_bytes(mc, block_size, kv_dtype, Shard.plan(mc, 0, config.tensor_parallel_size).num_kv_heads)
    host_block = bytes_per_block  # a host slot holds the model's KV only
    if draft is not None:
        bytes_per_block += kv_block_bytes(draft, block_size, kv_dtype)
    model_len = config.max_model_len or mc.max_position_embeddings
    num_blocks = config.num_kv_blocks
    if num_blocks is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * config.kv_memory_fraction)
        else:
            budget = config.kv_cpu_bytes
        needed = config.max_num_seqs * -(-model_len // block_size)  # never more than max_num_seqs full requests
        num_blocks = max(1, min(budget // bytes_per_block, needed))
    capacity = num_blocks * block_size
    if config.max_model_len is None:
        max_model_len = min(mc.max_position_embeddings, capacity)
    else:
        max_model_len = config.max_model_len
        if max_model_len > mc.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={mc.max_position_embeddings}"
            )
        if max_model_len > capacity:
            raise ValueError(
                f"max_model_len={max_model_len} needs more KV than {num_blocks} blocks x {block_size} tokens = {capacity}; "
                "raise num_kv_blocks or lower max_model_len"
            )
    host = int(config.kv_offload_gb * (1 << 30)) // host_block if config.enable_prefix_caching else 0
    return Layout(device, dtype, block_size, num_blocks, max_model_len, host,
                  None if config.kv_cache_dtype == "auto" else kv_dtype)


def kv_block_bytes(mc: ModelConfig, block_size: int, kv_dtype: torch.dtype, num_kv_heads: int | None = None) -> int:
    """Bytes of one KV block, every layer: K and V, and their scales in a quantized cache; of `num_kv_heads` heads
    (default: the model's)."""
    per_head = mc.head_dim * kv_dtype.itemsize + (4 if kv_dtype in QUANTIZED else 0)
    return 2 * mc.num_layers * block_size * (num_kv_heads or mc.num_kv_heads) * per_head


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), for labelling measurements (benchmarks, training runs)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
