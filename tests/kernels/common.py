"""Shared by the kernel tests: device, per-dtype error bounds and a paged-batch builder."""
from __future__ import annotations

from dataclasses import dataclass

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Max abs/rel error vs the torch twin. bf16 is loosest: the interpreter rounds fp32 -> bf16 by
# truncation (1 ulp = 2**-7 relative), and on the GPU the softmax weights feed the PV dot in bf16.
TOLERANCES = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.float16: {"atol": 4e-3, "rtol": 4e-3},
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
}
DTYPES = list(TOLERANCES)


@dataclass
class PagedBatch:
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32

    def args(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.k_cache, self.v_cache, self.block_tables, self.cu_seqlens_q, self.seq_lens


def paged_batch(
    q_lens: list[int], cached: list[int], *, num_q_heads: int, num_kv_heads: int, head_dim: int,
    block_size: int, dtype: torch.dtype = torch.float32, seed: int = 0, extra_blocks: int = 3,
) -> PagedBatch:
    """Sequence b has `cached[b]` context tokens plus `q_lens[b]` new ones; its blocks are a random
    (shuffled, non-contiguous) subset of the pool, and its block-table row is padded with junk ids."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(cached, q_lens)]
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(need) + extra_blocks
    perm = torch.randperm(num_blocks, generator=g)
    width = max(need) + 1
    tables = torch.randint(0, num_blocks, (len(q_lens), width), generator=g)  # junk past each sequence
    used = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[used:used + n]
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), num_q_heads, head_dim, generator=g).to(dtype)
    return PagedBatch(
        q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), tables.to(torch.int32).to(DEVICE),
        cu.to(DEVICE), torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
    )
