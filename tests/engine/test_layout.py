"""engine/layout.py: device and dtype resolution, KV pool sizing and the max_model_len refusals (docs/architecture.md §5)."""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.layout import Layout, placement, plan_layout
from engine.models import ModelConfig

CPU = torch.device("cpu")
# 2 layers x 2 KV heads x head_dim 16: a 16-token fp32 block of K and V is 2 * 2 * 16 * 2 * 16 * 4 = 8 KiB
MC = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
                          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                          "intermediate_size": 128, "max_position_embeddings": 1024})
BLOCK_BYTES = 8192


def test_placement() -> None:
    assert placement(EngineConfig(device="cpu")) == (CPU, torch.float32)
    assert placement(EngineConfig(device="cpu", dtype="bfloat16")) == (CPU, torch.bfloat16)
    assert placement(EngineConfig(device="cuda", dtype="auto")) == (torch.device("cuda"), torch.bfloat16)
    if not torch.cuda.is_available():
        assert placement(EngineConfig()) == (CPU, torch.float32)


def test_explicit_sizes_are_taken_as_given() -> None:
    layout = plan_layout(EngineConfig(num_kv_blocks=64, max_model_len=512), MC, CPU, torch.float32)
    assert layout == Layout(CPU, torch.float32, block_size=16, num_blocks=64, max_model_len=512)


def test_cpu_pool_is_sized_from_kv_cpu_bytes_and_caps_max_model_len() -> None:
    layout = plan_layout(EngineConfig(kv_cpu_bytes=10 * BLOCK_BYTES), MC, CPU, torch.float32)
    assert (layout.num_blocks, layout.max_model_len) == (10, 160)  # the pool, not max_position_embeddings, limits
    half = plan_layout(EngineConfig(kv_cpu_bytes=10 * BLOCK_BYTES), MC, CPU, torch.bfloat16)
    assert half.num_blocks == 20  # 2-byte KV: twice the blocks in the same bytes


@pytest.mark.parametrize("kv_cache_dtype,blocks", [("auto", 10), ("bfloat16", 20), ("int8", 32), ("fp8", 32)])
def test_the_kv_cache_dtype_sets_how_many_blocks_fit(kv_cache_dtype, blocks) -> None:
    """A quantized block is a quarter of an fp32 one plus a 4-byte scale per token and head: 16 + 4 bytes a head
    instead of 64, so 10 fp32 blocks' bytes hold 32 of them."""
    layout = plan_layout(EngineConfig(kv_cpu_bytes=10 * BLOCK_BYTES, kv_cache_dtype=kv_cache_dtype), MC, CPU,
                         torch.float32)
    assert layout.num_blocks == blocks and layout.dtype == torch.float32
    assert layout.quantized == (kv_cache_dtype in ("int8", "fp8"))
    assert layout.cache_dtype == {"auto": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8,
                                  "fp8": torch.float8_e4m3fn}[kv_cache_dtype]
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int4")


def test_pool_never_exceeds_max_num_seqs_full_requests() -> None:
    layout = plan_layout(EngineConfig(max_num_seqs=3), MC, CPU, torch.float32)  # 512 MiB would hold far more
    assert (layout.num_blocks, layout.max_model_len) == (3 * 1024 // 16, 1024)
    layout = plan_layout(EngineConfig(max_num_seqs=3, max_model_len=100), MC, CPU, torch.float32)
    assert layout.num_blocks == 3 * 7  # 100 tokens take 7 blocks


def test_a_max_model_len_that_cannot_fit_is_refused() -> None:
    with pytest.raises(ValueError) as info:
        plan_layout(EngineConfig(max_model_len=2048), MC, CPU, torch.float32)
    assert str(info.value) == "max_model_len=2048 exceeds the model's max_position_embeddings=1024"
    with pytest.raises(ValueError) as info:
        plan_layout(EngineConfig(num_kv_blocks=4, max_model_len=100), MC, CPU, torch.float32)
    assert str(info.value) == ("max_model_len=100 needs more KV than 4 blocks x 16 tokens = 64; "
                               "raise num_kv_blocks or lower max_model_len")
