"""Llama-family forward (Llama 2/3, Mistral, SmolLM, TinyLlama, Qwen2, Qwen3) over a flat batch.

The batch is `T` new tokens of many sequences back to back; attention goes through the paged KV
cache via `kernels.paged_attention`, so a chunked prefill and a decode are the same code path.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

import sluice_kernels as kernels
from engine.parallel import Shard, all_gather_rows, all_reduce

if TYPE_CHECKING:
    from engine.loader import Weights

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    partial_rotary_factor: float = 1.0

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        arch = (cfg.get("architectures") or ["?"])[0]
        if arch not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg.get('hidden_act')!r} (only silu)")
        if cfg.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported")
        heads = cfg["num_attention_heads"]
        # transformers >= 5 nests rope settings in `rope_parameters`; older configs use rope_theta/rope_scaling.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rtype = rope.get("rope_type", rope.get("type", "default"))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            rope_theta=theta,
            rope_scaling=None if rtype == "default" else rope,
            partial_rotary_factor=float(cfg.get("partial_rotary_factor", 1.0)),
        )


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    rot = int(cfg.head_dim * cfg.partial_rotary_factor)
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, rot, 2, dtype=torch.int64).float() / rot))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    rtype = s.get("rope_type", s.get("type"))
    if rtype == "linear":
        return inv_freq / float(s["factor"])
    if rtype == "llama3":
        factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old_ctx = float(s["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / lo, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling type {rtype!r} (supported: default, linear, llama3)")


def cos_sin_cache(cfg: ModelConfig, max_len: int, device: torch.device) -> torch.Tensor:
    """[max_len, rot_dim] float32: cos of each frequency, then sin (what `rotary_embedding` takes)."""
    inv_freq = rope_inv_freq(cfg)
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)  # (L, rot/2)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)


class Linear:
    """y = x W^T + b. On CPU in bf16 with oneDNN, W is reordered once, at load, into oneDNN's blocked
    layout, as Inductor's CPU weight prepacking does. `F.linear` hands oneDNN the plain layout, which
    it repacks per call: on a 2-core host that was 20-30% of the matmul time of a 64- or 256-token
    step. Results are bit-identical."""

    __slots__ = ("bias", "packed", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True):
        self.bias = bias
        if pack and prepacks(weight):
            self.packed, self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 256), None  # 256: a batch hint
        else:
            self.packed, self.weight = None, weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def prepacks(w: torch.Tensor) -> bool:
    """Whether `Linear` prepacks this weight: bf16 on a CPU whose oneDNN runs bf16 natively."""
    return (w.device.type == "cpu" and w.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


@dataclass
class AttentionMetadata:
    """Per-step tensors shared by every layer (built once by the model runner)."""

    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    logits_indices: torch.Tensor  # [B] int64: the last new token of each sequence


class LlamaModel:
    """Holds fused weights (qkv, gate_up) and runs the forward; KV caches are owned by the runner.

    With a `shard` of a tensor-parallel group (engine/parallel.py) it holds that rank's part: its query and KV
    heads, MLP rows and vocabulary rows; the forward then all-reduces after o and down and the embedding, and
    gathers the logits, so every rank returns the whole [B, vocab]."""

    def __init__(self, cfg: ModelConfig, weights: Weights, device: torch.device, dtype: torch.dtype,
                 shard: Shard | None = None):
        """`weights`: the checkpoint (`engine.loader.Weights`); a tensor-parallel rank reads only its part of it."""
        self.cfg = cfg
        self.shard = sh = shard or Shard.plan(cfg)
        D = cfg.head_dim
        self.num_heads, self.num_kv_heads = sh.num_heads, sh.num_kv_heads
        self.q_size = sh.num_heads * D
        self.kv_size = sh.num_kv_heads * D
        self.scale = D**-0.5

        def need(name: str) -> str:
            if name not in weights:
                raise ValueError(f"checkpoint lacks tensor {name!r}")
            return name

        def w(name: str) -> torch.Tensor:
            return weights.get(need(name)).to(device=device, dtype=dtype)

        def rows(name: str, start: int, n: int) -> torch.Tensor:  # rows [start, start + n), zero-padded past the end
            return Shard.pad(weights.rows(need(name), start, start + n), n).to(device=device, dtype=dtype)

        def cols(name: str, start: int, n: int) -> torch.Tensor:  # input columns: a row-parallel weight
            return weights.cols(need(name), start, start + n).to(device=device, dtype=dtype)

        def qkv(kind: str) -> torch.Tensor:  # this rank's heads of q_proj, k_proj, v_proj (weight or bias)
            start, n = (sh.head_start, sh.num_heads) if kind[0] == "q" else (sh.kv_head_start, sh.num_kv_heads)
            return rows(f"{p}self_attn.{kind[0]}_proj.{kind[2:]}", start * D, n * D)

        self.embed = rows("model.embed_tokens.weight", sh.rank * sh.vocab, sh.vocab)
        self.layers = []
        I = sh.intermediate  # noqa: E741
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            layer = {
                "in_norm": w(p + "input_layernorm.weight"),
                "post_norm": w(p + "post_attention_layernorm.weight"),
                "qkv": Linear(torch.cat([qkv(f"{x}.weight") for x in "qkv"]),
                              torch.cat([qkv(f"{x}.bias") for x in "qkv"]) if cfg.attention_bias else None),
                "o": Linear(cols(p + "self_attn.o_proj.weight", sh.head_start * D, self.q_size)),
                "gate_up": Linear(torch.cat([rows(p + f"mlp.{x}_proj.weight", sh.rank * I, I) for x in ("gate", "up")])),
                "down": Linear(cols(p + "mlp.down_proj.weight", sh.rank * I, I)),
            }
            if cfg.qk_norm:
                layer["q_norm"] = w(p + "self_attn.q_norm.weight")
                layer["k_norm"] = w(p + "self_attn.k_norm.weight")
            self.layers.append(layer)
        self.norm = w("model.norm.weight")
        if cfg.tie_word_embeddings or "lm_head.weight" not in weights:
            self.lm_head = Linear(self.embed, pack=False)  # the embedding lookup needs the plain tensor
        else:
            self.lm_head = Linear(rows("lm_head.weight", sh.rank * sh.vocab, sh.vocab))
        self.cos_sin = cos_sin_cache(cfg, cfg.max_position_embeddings, device)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, ...]],  # per layer (k_cache, v_cache), quantized + (k_scale, v_scale)
    ) -> torch.Tensor:  # [B, vocab] float32 logits of each sequence's last new token
        cfg, T, sh = self.cfg, input_ids.shape[0], self.shard
        if sh.world == 1:
            h = self.embed[input_ids]  # (T, H)
        else:  # this rank's vocabulary rows; the others' ids look up zeros, and the sum has every row once
            local = input_ids - sh.rank * sh.vocab
            here = (local >= 0) & (local < sh.vocab)
            h = all_reduce(self.embed[local.clamp(0, sh.vocab - 1)] * here[:, None].to(self.embed.dtype), sh)
        residual = None
        for layer, (k_cache, v_cache, *scales) in zip(self.layers, kv_caches):
            if residual is None:
                residual = h
                x = kernels.rms_norm(h, layer["in_norm"], cfg.rms_norm_eps)
            else:
                x, residual = kernels.rms_norm(h, layer["in_norm"], cfg.rms_norm_eps, residual)
            qkv = layer["qkv"](x)  # (T, q + 2kv)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.reshape(T, self.num_heads, cfg.head_dim)  # copies: kernels want contiguous heads
            k = k.reshape(T, self.num_kv_heads, cfg.head_dim)
            v = v.reshape(T, self.num_kv_heads, cfg.head_dim).contiguous()
            if cfg.qk_norm:
                q = kernels.rms_norm(q.reshape(-1, cfg.head_dim), layer["q_norm"], cfg.rms_norm_eps).view_as(q)
                k = kernels.rms_norm(k.reshape(-1, cfg.head_dim), layer["k_norm"], cfg.rms_norm_eps).view_as(k)
            q, k = q.contiguous(), k.contiguous()
            q, k = kernels.rotary_embedding(meta.positions, q, k, self.cos_sin, True)
            kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, *scales)
            o = kernels.paged_attention(
                q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.seq_lens, self.scale, *scales
            )  # (T, Hq, D)
            h = all_reduce(layer["o"](o.view(T, self.q_size)), sh)
            x, residual = kernels.rms_norm(h, layer["post_norm"], cfg.rms_norm_eps, residual)
            h = all_reduce(layer["down"](kernels.silu_and_mul(layer["gate_up"](x))), sh)
        last_h = h[meta.logits_indices]  # only the last token of each sequence reaches the LM head
        last_h, _ = kernels.rms_norm(last_h, self.norm, cfg.rms_norm_eps, residual[meta.logits_indices])
        return all_gather_rows(self.lm_head(last_h).float(), sh)[:, : cfg.vocab_size]
