"""GPU check of the Triton kernels and the engine: correctness vs `kernels.reference`, timings vs the
reference and vs SDPA on pre-gathered KV, decode GB/s vs HBM peak, engine output tokens/s. One
markdown table on stdout. Run by `bench/gpu_check.sh`; `python -m bench.gpu_check --dry-run` runs tiny
shapes on CPU through the Triton interpreter (logic only).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Iterator

DRY = "--dry-run" in sys.argv
if DRY:  # before triton/kernels are imported: both read the environment once
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["SLUICE_KERNELS"] = "triton"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import sluice_kernels as kernels  # noqa: E402
from sluice_kernels import reference  # noqa: E402
from sluice_kernels import triton as triton_ops  # noqa: E402

HBM_PEAK_GBS = 4800.0  # H200 HBM3e
TOL = {torch.bfloat16: 3e-2, torch.float16: 4e-3, torch.float32: 2e-5}  # max abs error vs the reference


@contextlib.contextmanager
def kernel_mode(mode: str) -> Iterator[None]:
    """`kernels.MODE` (the dispatch reads it per call) and `SLUICE_KERNELS` (what a server started here reads) set to
    `mode` for the block."""
    old = kernels.MODE, os.environ.get("SLUICE_KERNELS")
    kernels.MODE = os.environ["SLUICE_KERNELS"] = mode
    try:
        yield
    finally:
        kernels.MODE = old[0]
        if old[1] is None:
            os.environ.pop("SLUICE_KERNELS")
        else:
            os.environ["SLUICE_KERNELS"] = old[1]


@dataclass
class Row:
    check: str
    shape: str
    err: str = "–"
    triton_ms: str = "–"
    ref_ms: str = "–"
    sdpa_ms: str = "–"
    gbs: str = "–"
    tok_s: str = "–"
    ok: bool = True
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Sizes:
    hq: int
    hkv: int
    d: int
    block_size: int
    n_decode: int
    decode_ctx: int
    chunk: int  # new tokens of each of the two prefill chunks
    chunk_cached: tuple[int, int]  # cached context in front of each chunk
    few_decodes: int  # small decode batch at long context: where split-KV matters
    long_ctx: int
    tokens: int  # rows for the elementwise kernels
    hidden: int
    inter: int
    dtype: torch.dtype


REAL = Sizes(32, 8, 128, 16, 64, 4096, 512, (1536, 0), 4, 16384, 1088, 4096, 14336, torch.bfloat16)
TINY = Sizes(4, 2, 32, 8, 3, 40, 8, (16, 0), 2, 1100, 12, 64, 96, torch.float32)


def timed(fn: Callable[[], object], dev: str) -> float:
    """Milliseconds per call: triton's do_bench (L2 flushed, median) on CUDA; one call on CPU."""
    if dev == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=60))
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def fmt(x: float) -> str:
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def judge(row: Row, err: float, dtype: torch.dtype) -> None:
    row.err = f"{err:.1e}"
    if not err <= TOL[dtype]:  # NaN fails too
        row.ok = False
        row.notes.append(f"error {err:.2e} > {TOL[dtype]:.0e}")


def ulp_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| in units in the last place of a's dtype, at the larger of |a| and |b|."""
    mantissa = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[a.dtype]
    big = torch.maximum(a.float().abs(), b.float().abs()).clamp_min(torch.finfo(a.dtype).tiny)
    ulp = torch.exp2(torch.floor(torch.log2(big)) - mantissa)
    return float(((a.float() - b.float()).abs() / ulp).max())


def judge_rounded(row: Row, pairs: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> None:
    """For outputs computed in fp32 and rounded once to a 16-bit dtype, as the reference computes them.

    NOTE: the GPU compiler contracts `a * b - c * d` into an FMA (TRITON_DEFAULT_FP_FUSION), so its fp32
    value differs from torch's by a few fp32 ulps, and where that straddles a rounding boundary the
    16-bit results differ by one ulp: 3.1e-2 at |x| in [4, 8) for bf16, over any fixed absolute
    tolerance sized for |x| near 1. One ulp is the exact bound; anything more is a real error."""
    if dtype == torch.float32:
        return judge(row, max(max_err(a, b) for a, b in pairs), dtype)
    err, ulps = max(max_err(a, b) for a, b in pairs), max(ulp_err(a, b) for a, b in pairs)
    row.err = f"{err:.1e} ({ulps:g} ulp)"
    if not ulps <= 1.0:
        row.ok = False
        row.notes.append(f"error {ulps:g} ulp > 1 ulp")


# ---------------------------------------------------------------- attention


def paged(q_lens: list[int], ctx: list[int], s: Sizes, dev: str, seed: int = 0):
    """Batch over a shuffled block pool: (q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    bs = s.block_size
    need = [-(-c // bs) for c in ctx]
    nblocks = sum(need)
    perm = torch.randperm(nblocks, device=dev, generator=g).to(torch.int32)
    tables = torch.zeros(len(ctx), max(need), dtype=torch.int32, device=dev)
    off = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[off:off + n]
        off += n
    kc = torch.randn(nblocks, bs, s.hkv, s.d, device=dev, dtype=s.dtype, generator=g)
    vc = torch.randn(nblocks, bs, s.hkv, s.d, device=dev, dtype=s.dtype, generator=g)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    q = torch.randn(sum(q_lens), s.hq, s.d, device=dev, dtype=s.dtype, generator=g)
    return q, kc, vc, tables, cu, torch.tensor(ctx, dtype=torch.int32, device=dev)


def sdpa_gathered(q_lens: list[int], ctx: list[int], args, scale: float) -> Callable[[], object]:
    """SDPA on KV gathered into dense tensors beforehand (gather not timed): a dense-kernel bar.
    Decodes go as one padded-free batch (all share one context length here), chunks one by one."""
    q, kc, vc, tables, cu, _ = args
    from torch.nn.attention.bias import causal_lower_right

    def dense(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = -(-ctx[b] // kc.shape[1])
        k = kc[tables[b, :n].long()].flatten(0, 1)[: ctx[b]].transpose(0, 1)  # (Hkv, L, D)
        v = vc[tables[b, :n].long()].flatten(0, 1)[: ctx[b]].transpose(0, 1)
        return k.contiguous(), v.contiguous()

    cu_l = cu.tolist()
    dec = [b for b, n in enumerate(q_lens) if n == 1]
    assert len({ctx[b] for b in dec}) <= 1, "decodes share one context length in these checks"
    calls = []
    if dec:
        kv = [dense(b) for b in dec]
        kd, vd = torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv])  # (B, Hkv, L, D)
        qd = q[[cu_l[b] for b in dec]].unsqueeze(2)  # (B, Hq, 1, D)
        calls.append(lambda: F.scaled_dot_product_attention(qd, kd, vd, scale=scale, enable_gqa=True))
    for b, n in enumerate(q_lens):
        if n > 1:
            k, v = dense(b)
            qb = q[cu_l[b]:cu_l[b + 1]].transpose(0, 1).unsqueeze(0)  # (1, Hq, n, D)
            mask = causal_lower_right(n, ctx[b])
            calls.append(lambda qb=qb, k=k, v=v, mask=mask: F.scaled_dot_product_attention(
                qb, k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=True))
    return lambda: [c() for c in calls]


def kv_bytes(ctx: list[int], s: Sizes) -> int:
    return sum(ctx) * s.hkv * s.d * 2 * s.dtype.itemsize  # K and V, each read once per KV head


def attention_row(name: str, q_lens: list[int], ctx: list[int], s: Sizes, dev: str, *, sdpa: bool = True,
                  bandwidth: bool = False, **kw) -> Row:
    shape = f"{name}; Hq={s.hq} Hkv={s.hkv} D={s.d} bs={s.block_size}" + (f" splits={kw['num_splits']}" if kw else "")
    row = Row("paged_attention", shape)
    args = paged(q_lens, ctx, s, dev)
    scale = s.d ** -0.5
    out = triton_ops.paged_attention(*args, scale, **kw)
    judge(row, max_err(out, reference.paged_attention(*args, scale)), s.dtype)
    t = timed(lambda: triton_ops.paged_attention(*args, scale, **kw), dev)
    row.triton_ms = fmt(t)
    row.ref_ms = fmt(timed(lambda: reference.paged_attention(*args, scale), dev))
    if sdpa:
        row.sdpa_ms = fmt(timed(sdpa_gathered(q_lens, ctx, args, scale), dev))
    if bandwidth:
        gbs = kv_bytes(ctx, s) / (t * 1e-3) / 1e9
        row.gbs = f"{gbs:.0f} ({100 * gbs / HBM_PEAK_GBS:.0f}%)"
    return row


def attention_rows(s: Sizes, dev: str) -> list[Callable[[], Row]]:
    dec_q, dec_ctx = [1] * s.n_decode, [s.decode_ctx] * s.n_decode
    chunk_ctx = [c + s.chunk for c in s.chunk_cached]
    few_q, few_ctx = [1] * s.few_decodes, [s.long_ctx] * s.few_decodes
    return [
        lambda: attention_row(f"{s.n_decode} decodes @{s.decode_ctx} + 2 chunks of {s.chunk} (cached {s.chunk_cached})",
                              dec_q + [s.chunk] * 2, dec_ctx + chunk_ctx, s, dev),
        lambda: attention_row(f"{s.n_decode} decodes @{s.decode_ctx}", dec_q, dec_ctx, s, dev, bandwidth=True),
        lambda: attention_row(f"{s.few_decodes} decodes @{s.long_ctx} (auto split-KV)", few_q, few_ctx, s, dev,
                              bandwidth=True),
        lambda: attention_row(f"{s.few_decodes} decodes @{s.long_ctx}", few_q, few_ctx, s, dev, sdpa=False,
                              bandwidth=True, num_splits=1),
    ]


def quantized_rows(s: Sizes, dev: str) -> list[Callable[[], Row]]:
    """--kv-cache-dtype int8 / fp8: attention over the quantized cache vs the twin over the same cache, its time and
    decode bandwidth (the cache's own bytes, scales included), and the quantizing store vs the twin (one grid step)."""
    dec_q, dec_ctx = [1] * s.n_decode, [s.decode_ctx] * s.n_decode
    chunk_ctx = [c + s.chunk for c in s.chunk_cached]

    def quantized(args, cache_dtype):
        q, kc, vc, tables, cu, lens = args
        nb, bs, h, d = kc.shape
        (kq, ks), (vq, vs) = (reference.quantize(c.reshape(-1, h, d), cache_dtype) for c in (kc, vc))
        return (q, kq.view(kc.shape), vq.view(vc.shape), tables, cu, lens, d**-0.5, ks.view(nb, bs, h),
                vs.view(nb, bs, h))

    def attention(name: str, q_lens: list[int], ctx: list[int], cache_dtype: torch.dtype, bandwidth: bool) -> Row:
        label = str(cache_dtype).removeprefix("torch.")
        row = Row("paged_attention", f"{name}; {label} KV, Hq={s.hq} Hkv={s.hkv} D={s.d}")
        args = quantized(paged(q_lens, ctx, s, dev), cache_dtype)
        judge(row, max_err(triton_ops.paged_attention(*args), reference.paged_attention(*args)), s.dtype)
        t = timed(lambda: triton_ops.paged_attention(*args), dev)
        row.triton_ms = fmt(t)
        row.ref_ms = fmt(timed(lambda: reference.paged_attention(*args), dev))
        if bandwidth:
            gbs = sum(ctx) * s.hkv * (s.d + 4) * 2 / (t * 1e-3) / 1e9
            row.gbs = f"{gbs:.0f} ({100 * gbs / HBM_PEAK_GBS:.0f}%)"
        return row

    def store(cache_dtype: torch.dtype) -> Row:
        label = str(cache_dtype).removeprefix("torch.")
        row = Row("store_kv", f"{s.tokens} tokens into a {label} cache, Hkv={s.hkv} D={s.d}")
        g = torch.Generator(device=dev).manual_seed(3)
        k, v = ((3 * torch.randn(s.tokens, s.hkv, s.d, device=dev, generator=g)).to(s.dtype) for _ in range(2))
        nb = -(-s.tokens // s.block_size) + 1
        slots = torch.randperm(nb * s.block_size, device=dev, generator=g)[: s.tokens]
        out = [[torch.zeros(nb, s.block_size, s.hkv, s.d, dtype=cache_dtype, device=dev) for _ in range(2)]
               + [torch.zeros(nb, s.block_size, s.hkv, device=dev) for _ in range(2)] for _ in range(2)]
        triton_ops.store_kv(k, v, *out[0][:2], slots, *out[0][2:])
        reference.store_kv(k, v, *out[1][:2], slots, *out[1][2:])
        # scales equal; each stored code within one step of the twin's at its own magnitude (a GPU's division may
        # put a value on a rounding boundary)
        codes = [(a.float(), b.float()) for a, b in zip(out[0][:2], out[1][:2])]
        if cache_dtype == torch.int8:
            steps = [torch.ones_like(b) for _, b in codes]
        else:  # e4m3: 3 mantissa bits, subnormals 2^-9 apart
            steps = [torch.where(b.abs() >= 2**-6, torch.exp2(torch.floor(torch.log2(b.abs().clamp_min(2**-6))) - 3),
                                 torch.full_like(b, 2**-9)) for _, b in codes]
        worst = max(float(((a - b).abs() / st).max()) for (a, b), st in zip(codes, steps))
        scales = max(max_err(a, b) for a, b in zip(out[0][2:], out[1][2:]))
        row.err = f"{worst:.2f} steps; scales {scales:.1e}"
        if worst > 1.0 or scales > 1e-6 * float(max(t.abs().max() for t in out[1][2:])):
            row.ok = False
            row.notes.append("a code more than one step from the twin's, or the scales differ")
        row.triton_ms = fmt(timed(lambda: triton_ops.store_kv(k, v, *out[0][:2], slots, *out[0][2:]), dev))
        return row

    rows: list[Callable[[], Row]] = []
    for cache_dtype in (torch.int8, torch.float8_e4m3fn):
        rows += [
            lambda c=cache_dtype: attention(f"{s.n_decode} decodes @{s.decode_ctx} + 2 chunks of {s.chunk}",
                                            dec_q + [s.chunk] * 2, dec_ctx + chunk_ctx, c, False),
            lambda c=cache_dtype: attention(f"{s.n_decode} decodes @{s.decode_ctx}", dec_q, dec_ctx, c, True),
            lambda c=cache_dtype: store(c),
        ]
    return rows


# ---------------------------------------------------------------- elementwise kernels


def elementwise_rows(s: Sizes, dev: str) -> list[Callable[[], Row]]:
    T, dt = s.tokens, s.dtype
    g = torch.Generator(device=dev).manual_seed(1)

    def rnd(*shape: int, dtype: torch.dtype = dt) -> torch.Tensor:
        return torch.randn(*shape, device=dev, generator=g).to(dtype)

    def store() -> Row:
        row = Row("store_kv", f"T={T} Hkv={s.hkv} D={s.d}, 1/8 slots -1")
        k, v = rnd(T, s.hkv, s.d), rnd(T, s.hkv, s.d)
        nb = -(-2 * T // s.block_size)
        kc, vc = rnd(nb, s.block_size, s.hkv, s.d), rnd(nb, s.block_size, s.hkv, s.d)
        slots = torch.randperm(nb * s.block_size, device=dev, generator=g)[:T]
        slots[::8] = -1
        kr, vr = kc.clone(), vc.clone()
        triton_ops.store_kv(k, v, kc, vc, slots)
        reference.store_kv(k, v, kr, vr, slots)
        judge(row, max(max_err(kc, kr), max_err(vc, vr)), torch.float32)  # a copy: exact
        row.triton_ms = fmt(timed(lambda: triton_ops.store_kv(k, v, kc, vc, slots), dev))
        row.ref_ms = fmt(timed(lambda: reference.store_kv(k, v, kr, vr, slots), dev))
        return row

    def norm() -> Row:
        row = Row("rms_norm + residual", f"T={T} H={s.hidden}")
        x, r, w = rnd(T, s.hidden), rnd(T, s.hidden), rnd(s.hidden)
        (o, nr), (ro, rr) = triton_ops.rms_norm(x, w, 1e-6, r), reference.rms_norm(x, w, 1e-6, r)
        judge(row, max(max_err(o, ro), max_err(nr, rr)), dt)
        row.triton_ms = fmt(timed(lambda: triton_ops.rms_norm(x, w, 1e-6, r), dev))
        row.ref_ms = fmt(timed(lambda: reference.rms_norm(x, w, 1e-6, r), dev))
        return row

    def rope(is_neox: bool) -> Row:
        row = Row("rotary_embedding", f"T={T} Hq={s.hq} Hkv={s.hkv} D={s.d} {'neox' if is_neox else 'gptj'}")
        q, k = rnd(T, s.hq, s.d), rnd(T, s.hkv, s.d)
        pos = torch.randint(0, 4096, (T,), device=dev, generator=g)
        cs = rnd(4096, s.d, dtype=torch.float32)
        qr, kr = reference.rotary_embedding(pos, q.clone(), k.clone(), cs, is_neox)
        qt, kt = triton_ops.rotary_embedding(pos, q.clone(), k.clone(), cs, is_neox)
        judge_rounded(row, [(qt, qr), (kt, kr)], dt)
        row.triton_ms = fmt(timed(lambda: triton_ops.rotary_embedding(pos, q, k, cs, is_neox), dev))
        row.ref_ms = fmt(timed(lambda: reference.rotary_embedding(pos, q, k, cs, is_neox), dev))
        return row

    def silu() -> Row:
        row = Row("silu_and_mul", f"T={T} d={s.inter}")
        x = rnd(T, 2 * s.inter)
        judge(row, max_err(triton_ops.silu_and_mul(x), reference.silu_and_mul(x)), dt)
        row.triton_ms = fmt(timed(lambda: triton_ops.silu_and_mul(x), dev))
        row.ref_ms = fmt(timed(lambda: reference.silu_and_mul(x), dev))
        return row

    return [store, norm, lambda: rope(True), lambda: rope(False), silu]


# ---------------------------------------------------------------- engine end to end

# Qwen2-0.5B layer shapes (llama layout, no qkv bias) with the tiny builder's 8k BPE vocab.
MODEL_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 head_dim=64, intermediate_size=4864, max_position_embeddings=4096, tie_word_embeddings=True)
MODEL_DRY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, intermediate_size=128, max_position_embeddings=1024)
# Sluice's configurations under test: the defaults, CUDA graphs (decode and mixed steps; decode steps only), and
# graphs with the step loop's two overlaps (the outputs made while the next forward runs; the next step scheduled and
# launched before the last one's tokens are known). A dry run has no graphs to capture: its buckets run eagerly on the
# graphs' buffers.
MODES = {"eager": {}, "graphs": {"enforce_eager": False},
         "graphs (decode only)": {"enforce_eager": False, "cudagraph_mode": "full_decode_only"},
         "graphs + async outputs": {"enforce_eager": False, "async_output_proc": True},
         "graphs + async scheduling": {"enforce_eager": False, "async_scheduling": True}}
WORKLOAD_MODES = {m: MODES[m] for m in ("eager", "graphs + async outputs", "graphs + async scheduling")}
# the server's engine runs in a process of its own (--engine-process, the default); on a GPU one more mode puts it on a
# thread of the server's, sharing its interpreter lock, for the same load side by side (a flag: not in the dry run)
SERVED_MODES = {**WORKLOAD_MODES, "graphs + async scheduling, engine thread": {
    **MODES["graphs + async scheduling"], "engine_process": False}}
VOCAB = {"cuda": 8192, "cpu": 1024}  # the tiny tokenizer builder's BPE vocabulary
DTYPE = {"cuda": "bfloat16", "cpu": "float32"}  # the engine sections' model dtype (fp32 where the dry run has no bf16)
_MODELS: dict[str, str] = {}


def model_dir(dev: str, dtype: str) -> tuple[str, int]:
    """(directory, vocab) of the check's model in `dtype`: 0.5B-shaped on a GPU, tiny in a dry run; written once per
    run and dtype (seed 0), shared by every engine section and the transformers baseline."""
    shape, vocab = (MODEL_05B if dev == "cuda" else MODEL_DRY), VOCAB[dev]
    if dtype not in _MODELS:
        from engine.tiny import write_model

        _MODELS[dtype] = str(write_model(tempfile.mkdtemp(prefix=f"sluice-gpu-check-{dtype}-"), shape, seed=0,
                                         dtype=getattr(torch, dtype), tokenizer_vocab=vocab, progress=False))
    return _MODELS[dtype], vocab


def engine_rows(
    dev: str, batches: list[int], prompt_len: int, new_tokens: int, with_torch: bool
) -> list[Callable[[], Row]]:
    from engine import EngineConfig, LLMEngine, SamplingParams

    state: dict[str, object] = {}

    def engine() -> tuple[object, int]:
        if "eng" not in state:
            dtype = DTYPE[dev]
            path, vocab = model_dir(dev, dtype)
            state["eng"] = LLMEngine(EngineConfig(
                model=path, dtype=dtype, device=dev,
                max_num_seqs=max(batches), max_num_batched_tokens=8192, max_model_len=1024,
                num_kv_blocks=None if dev == "cuda" else 256,
            ))
            state["vocab"] = vocab
        return state["eng"], state["vocab"]  # type: ignore[return-value]

    def run(bs: int) -> float:
        eng, vocab = engine()
        g = torch.Generator().manual_seed(bs)
        prompts = [torch.randint(3, vocab, (prompt_len,), generator=g).tolist() for _ in range(bs)]
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        eng.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))  # JIT warm-up
        if dev == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        outs = eng.generate(prompts, params)
        if dev == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t
        assert all(len(o.token_ids) == new_tokens for o in outs)
        return bs * new_tokens / elapsed

    def row(bs: int) -> Row:
        r = Row("engine end to end", f"{'0.5B-shaped bf16' if dev == 'cuda' else 'tiny fp32'}, batch {bs}, "
                                     f"{prompt_len} in / {new_tokens} out")
        tok_s = run(bs)
        r.tok_s = f"{tok_s:,.0f}"
        if with_torch:
            with kernel_mode("torch"):
                r.tok_s += f" (torch ref: {run(bs):,.0f})"
        return r

    return [lambda bs=bs: row(bs) for bs in batches]


def graph_rows(dev: str, batches: list[int], steps: int, mixed: tuple[int, int]) -> list[Callable[[], Row]]:
    """Decode steps replayed from CUDA graphs against the same steps run eagerly (engine/cuda_graphs.py): ms per
    step and the GPU's busy share of it (kernel time from torch.profiler over the step's wall time) at each batch
    size, bf16; mixed steps (`mixed` = (decodes, prompt tokens) per step) with graphs for them, with decode graphs
    only, and eager; then greedy tokens of every mode in fp32. A dry run replays nothing: the buckets run eagerly on
    the graphs' buffers (logic only)."""
    import gc

    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.cuda_graphs import graph_sizes

    vocab = VOCAB[dev]

    def engine(dtype: str, mode: str, budget: int = 8192) -> LLMEngine:
        kw = dict(MODES[mode])
        graphs = not kw.pop("enforce_eager", True)
        if graphs and dev == "cuda":
            try:  # CUPTI must be set up before a graph is captured, else profiling its replays can lose kernels
                torch.profiler._utils._init_for_cuda_graphs()
            except Exception as e:
                print(f"profiler set-up for graphs: {type(e).__name__}: {e}", file=sys.stderr)
        gc.collect()  # the last engine's pool and graphs go before this one sizes its own
        if dev == "cuda":
            torch.cuda.empty_cache()
        eng = LLMEngine(EngineConfig(model=model_dir(dev, dtype)[0], dtype=dtype, device=dev, max_num_seqs=max(batches),
                                     max_num_batched_tokens=budget, max_model_len=1024, num_kv_blocks=4096,
                                     enforce_eager=not (graphs and dev == "cuda"), **kw))
        if graphs and dev != "cuda":
            eng.runner.graphs = eng.runner.step_graphs(*graph_sizes(eng.config), capture=False)
        return eng

    def decode(eng: LLMEngine, bs: int, chunk: int = 0) -> tuple[float, float]:
        """(ms per step, GPU busy share) for `bs` requests decoding at 128 tokens of context and up; with `chunk`,
        each step also computes a new prompt of that many tokens (which samples its one token and ends)."""
        g = torch.Generator().manual_seed(bs)
        for i in range(bs):
            eng.add_request(f"d{bs}-{i}", torch.randint(3, vocab, (128,), generator=g).tolist(),
                            SamplingParams(max_tokens=3 * steps + 16, temperature=0.0, ignore_eos=True))
        while len(eng.scheduler.running) < bs or any(r.is_prefilling for r in eng.scheduler.running):
            eng.step()
        prompts = iter(range(10**6))

        def step() -> None:
            if chunk:  # a prompt of its own each step: nothing cached
                eng.add_request(f"p{bs}-{next(prompts)}", torch.randint(3, vocab, (chunk,), generator=g).tolist(),
                                SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
            eng.step()

        for _ in range(3):  # warm: the steps after prefill, at this batch size
            step()
        t = time.perf_counter()
        for _ in range(steps):
            step()  # each ends on the host: the sampled tokens were read
        ms = (time.perf_counter() - t) / steps * 1e3
        busy = float("nan")
        if dev == "cuda":
            from torch.profiler import ProfilerActivity, profile

            try:  # the share is worth a row's notes, not the row
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(steps // 2):
                        step()
                    torch.cuda.synchronize()
                # kernels only: an op's own entry carries its kernels' time too, which would count them twice
                kernel_ms = sum(e.self_device_time_total for e in prof.key_averages()
                                if e.device_type == torch.autograd.DeviceType.CUDA
                                and not getattr(e, "is_user_annotation", False)) / 1e3 / (steps // 2)
                busy = kernel_ms / ms
            except Exception as e:
                print(f"profiler: {type(e).__name__}: {e}", file=sys.stderr)
        for rid in list(eng.requests):
            eng.abort(rid)
        eng.step()
        return ms, busy

    state: dict[str, dict[int, tuple[float, float]]] = {}

    def measured(mode: str) -> dict[int, tuple[float, float]]:
        """Each batch's decode steps, and under key -1 the mixed steps, in this mode."""
        if mode not in state:
            eng = engine(DTYPE[dev], mode)
            state[mode] = {bs: decode(eng, bs) for bs in batches} if mode != "graphs (decode only)" else {}
            state[mode][-1] = decode(eng, *mixed)
            eng.close()
        return state[mode]

    def pct(x: float) -> str:
        return "–" if x != x else f"{x:.0%}"  # (nan: not measured)

    def row(bs: int) -> Row:
        (g_ms, g_busy), (e_ms, e_busy) = measured("graphs")[bs], measured("eager")[bs]
        a_ms, a_busy = measured("graphs + async scheduling")[bs]
        r = Row("decode step: graphs vs eager", f"{'0.5B-shaped bf16' if dev == 'cuda' else 'tiny fp32'}, batch {bs}, "
                f"ms/step {g_ms:.2f} vs {e_ms:.2f}, GPU busy {pct(g_busy)} vs {pct(e_busy)}; graphs + async "
                f"scheduling {a_ms:.2f} ms/step, GPU busy {pct(a_busy)}")
        r.triton_ms, r.ref_ms = f"{g_ms:.2f}", f"{e_ms:.2f}"
        r.tok_s = f"{bs / g_ms * 1e3:,.0f} vs {bs / e_ms * 1e3:,.0f} (ahead: {bs / a_ms * 1e3:,.0f})"
        return r

    def mixed_row() -> Row:
        modes = ("graphs", "graphs (decode only)", "eager")
        got = {m: measured(m)[-1] for m in modes}
        r = Row("mixed step: graphs vs decode-only graphs vs eager",
                f"{'0.5B-shaped bf16' if dev == 'cuda' else 'tiny fp32'}, {mixed[0]} decodes + a {mixed[1]}-token "
                f"prompt per step, ms/step {' vs '.join(f'{got[m][0]:.2f}' for m in modes)}, GPU busy "
                f"{' vs '.join(pct(got[m][1]) for m in modes)}")
        r.triton_ms, r.ref_ms = f"{got['graphs'][0]:.2f}", f"{got['eager'][0]:.2f}"
        r.tok_s = " vs ".join(f"{(mixed[0] + 1) / got[m][0] * 1e3:,.0f}" for m in modes)
        return r

    def same_tokens() -> Row:
        """7 prompts (one past 512 tokens: two KV splits in the graphs), ending at different steps: the batch
        shrinks through padded buckets (7 in 8, 5 in 8, 3 in 4); a budget of 256 tokens cuts the long prompt into
        chunks beside decodes. In every mode of MODES."""
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 40, 128, 600, 17, 64, 9)]
        longest = 32 if dev == "cuda" else 4
        params = [SamplingParams(max_tokens=longest - 4 * (i % 3) * longest // 16, temperature=0.0, ignore_eos=True)
                  for i in range(len(prompts))]
        toks = {}
        for mode in MODES:
            eng = engine("float32", mode, budget=256)
            toks[mode] = [o.token_ids for o in eng.generate(prompts, params)]
            eng.close()
        r = Row(f"greedy tokens: {', '.join(MODES)}", f"fp32, {len(prompts)} prompts, up to {longest} tokens")
        r.ok = all(t == toks["eager"] for t in toks.values())
        r.err = "identical" if r.ok else "DIFFER"
        for name, other in toks.items():
            if other != toks["eager"]:
                r.notes.append(f"{name}: {sum(a != b for a, b in zip(toks['eager'], other))} of {len(prompts)} "
                               "sequences differ")
        return r

    return [lambda bs=bs: row(bs) for bs in batches] + [mixed_row, same_tokens]


# ---------------------------------------------------------------- offline and served workloads


@dataclass(frozen=True)
class Load:
    title: str
    requests: int
    prompt: tuple[int, int]  # lengths drawn uniformly from [lo, hi]
    output: tuple[int, int]


# The workloads issue 15 measured before graphs (README "GPU path"); a dry run shrinks them.
LOADS = {"cuda": [Load("256 × 128 in / 256 out, all at once", 256, (128, 128), (256, 256)),
                  Load("256 requests, prompts 16–2,048, outputs 4–256, all at once", 256, (16, 2048), (4, 256))],
         "cpu": [Load("4 × 8 in / 4 out, all at once", 4, (8, 8), (4, 4)),
                 Load("4 requests, prompts 4–40, outputs 2–6, all at once", 4, (4, 40), (2, 6))]}
# (chats, system prompt tokens, user turn tokens, output tokens)
SERVED = {"cuda": (256, 2048, (32, 64), 128), "cpu": (4, 24, (4, 8), 3)}


def workload_rows(dev: str) -> list[Callable[[], list[Row]]]:
    """Output tok/s of Sluice in each of WORKLOAD_MODES against transformers' static `generate` (batch 256, sdpa, the
    same weights) on LOADS, every request at once; then `sluice serve` in each of SERVED_MODES (WORKLOAD_MODES in a dry
    run) under a WebSocket load: SERVED's chats, all on one shared system prompt, all sent at once (tok/s, TTFT,
    ITL). Sluice keeps its default step budget (2,048 tokens). bf16 on a GPU; a dry run (fp32, interpreter) checks
    the plumbing only."""
    import gc
    import random
    from pathlib import Path

    from bench.driver import EngineSystem, Req, measure, summarize
    from bench.hf import HFStatic
    from engine import EngineConfig

    dtype = DTYPE[dev]
    max_len = 4096 if dev == "cuda" else 1024

    def free() -> None:
        gc.collect()
        if dev == "cuda":
            torch.cuda.empty_cache()

    def blocks(n: int, longest: int) -> int:
        return n * -(-longest // 16) + 64

    def result(check: str, r: dict, base: dict | None = None) -> Row:
        row = Row(check, r["system"])
        if r.get("error"):
            row.ok, row.notes = False, [str(r["error"])[:160]]
            return row
        num = lambda k, spec: "–" if r.get(k) is None else format(r[k], spec)  # noqa: E731
        row.shape += f": TTFT p50 {num('ttft_p50_ms', ',.0f')} ms, ITL p50 {num('itl_p50_ms', '.1f')} / p99 " \
                     f"{num('itl_p99_ms', '.1f')} ms"
        row.tok_s = f"{r['throughput_tok_s']:,.0f}"
        if base and base is not r and base.get("throughput_tok_s"):
            row.tok_s += f" ({r['throughput_tok_s'] / base['throughput_tok_s']:.2f}× transformers)"
        return row

    def offline(load: Load) -> list[Row]:
        path, vocab = model_dir(dev, dtype)

        def reqs(tag: str, ld: Load = load) -> list[Req]:  # the same prompts for every system
            rng = random.Random(ld.title)
            return [Req(f"{tag}-{i}", [rng.randrange(16, vocab) for _ in range(rng.randint(*ld.prompt))],
                        rng.randint(*ld.output)) for i in range(ld.requests)]

        n, longest = load.requests, load.prompt[1] + load.output[1]
        systems = [EngineSystem(f"sluice, {mode}", EngineConfig(
            model=path, dtype=dtype, device=dev, max_num_seqs=n, max_model_len=max_len, block_size=16,
            num_kv_blocks=blocks(n, longest), seed=0, **flags)) for mode, flags in WORKLOAD_MODES.items()]
        systems.append(HFStatic(f"transformers generate, static batch {n}", path, getattr(torch, dtype), n, dev))
        warm = Load("warm-up", 2, (16, 16), (4, 4))
        try:
            rows, _ = measure(systems, workload=reqs, warmup=lambda tag: reqs(tag, warm), row=lambda s, tr: summarize(
                s.name, tr), progress=False)
        finally:
            for s in systems:
                s.close()
            free()
        return [result(f"offline: {load.title}", r, rows[-1]) for r in rows]

    def served() -> list[Row]:
        from transformers import AutoTokenizer

        from bench.common import Run
        from bench.serve import Chat, Server, run_server

        path, vocab = model_dir(dev, dtype)
        n, system_len, user_len, max_tokens = SERVED[dev]
        tok = AutoTokenizer.from_pretrained(path)
        rng = random.Random("served")
        text = lambda k: tok.decode([rng.randrange(16, vocab) for _ in range(k)])  # noqa: E731

        def chats(tag: str, count: int, out: int) -> list[Chat]:
            system = text(system_len)  # one per run: the warm-up leaves the measured run's prompt uncached
            msgs = [[{"role": "system", "content": system}, {"role": "user", "content": text(rng.randint(*user_len))}]
                    for _ in range(count)]
            return [Chat(f"{tag}-{i}", tok(tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
                                          add_special_tokens=False)["input_ids"], out, messages=m)
                    for i, m in enumerate(msgs)]

        run = Run(model_dir=Path(path), dtype=dtype, threads=os.cpu_count() or 1, quick=dev != "cuda",
                  out_dir=Path(tempfile.mkdtemp(prefix="sluice-gpu-serve-")))
        longest = system_len * 2 + user_len[1] + max_tokens  # the tokenizer's round trip can lengthen the text
        out = []
        for mode, flags in (SERVED_MODES if dev == "cuda" else WORKLOAD_MODES).items():
            args = ["--device", dev, "--max-num-seqs", str(n), "--max-model-len", str(max_len),
                    "--num-kv-blocks", str(blocks(n, longest)), "--seed", "0",
                    *(f"--{'' if v else 'no-'}{k.replace('_', '-')}" for k, v in flags.items())]
            server = Server(run, args)
            try:
                server.wait_ready(timeout=600)
                run_server(server, chats("warm", 2, 2), "warm-up", progress=False)
                reqs = chats("chat", n, max_tokens)
                tr = run_server(server, reqs, mode, progress=False)
                prompt = sorted(len(r.prompt) for r in reqs)[n // 2]
                out.append(result(f"served: {n} WebSocket chats, shared system prompt ({prompt}-token prompts, "
                                  f"median), {max_tokens} out", summarize(f"sluice serve, {mode}", tr)))
            except Exception as e:  # one mode's failure is a row, and the next mode still runs
                out.append(Row("served", f"sluice serve, {mode}", ok=False,
                               notes=[f"{type(e).__name__}: {e}"[:160], server.tail()[-200:]]))
            finally:
                server.stop()
        return out

    # NOTE: a dry run checks this section's plumbing; the sections above checked the engine's Triton kernels, and through
    # the interpreter every step takes ~0.6 s: here its engines and servers run the CPU kernels
    mode = "auto" if dev == "cpu" else kernels.MODE

    def with_mode(section: Callable[[], list[Row]]) -> list[Row]:
        with kernel_mode(mode):
            return section()

    return [lambda ld=ld: with_mode(lambda: offline(ld)) for ld in LOADS[dev]] + [lambda: with_mode(served)]


# ---------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU via TRITON_INTERPRET (logic check)")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--only-graphs", action="store_true", help="only the CUDA-graph rows (decode steps, equality)")
    ap.add_argument("--only-workloads", action="store_true",
                    help="only the offline and served workloads (Sluice vs transformers; sluice serve under load)")
    ap.add_argument("--no-torch-e2e", action="store_true", help="skip the torch-reference engine comparison")
    args = ap.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run for a CPU logic check", file=sys.stderr)
        return 2
    dev = "cpu" if args.dry_run else "cuda"
    s = TINY if args.dry_run else REAL
    only = args.only_graphs or args.only_workloads
    checks = [] if only else attention_rows(s, dev) + quantized_rows(s, dev) + elementwise_rows(s, dev)
    if not (args.skip_engine or only):
        batches = [1, 2] if args.dry_run else [1, 16, 64, 128]
        checks += engine_rows(dev, batches, 8 if args.dry_run else 128, 3 if args.dry_run else 128,
                              with_torch=not args.no_torch_e2e)
    if not (args.skip_engine or args.only_workloads):
        checks += graph_rows(dev, [1, 2] if args.dry_run else [1, 64, 256], 3 if args.dry_run else 20,
                             (2, 20) if args.dry_run else (64, 256))
    if not (args.skip_engine or args.only_graphs):
        checks += workload_rows(dev)

    rows: list[Row] = []
    t0 = time.perf_counter()
    for i, make in enumerate(checks):
        try:
            made = make()
            rows += made if isinstance(made, list) else [made]
        except Exception as e:  # one broken check must not hide the others
            traceback.print_exc(file=sys.stderr)
            rows.append(Row(f"check #{i}", "–", ok=False, notes=[f"{type(e).__name__}: {e}"[:120]]))
        print(f"[{time.perf_counter() - t0:6.1f}s] {rows[-1].check}: {rows[-1].shape}", file=sys.stderr, flush=True)

    name = torch.cuda.get_device_name() if dev == "cuda" else "CPU (TRITON_INTERPRET dry run: timings meaningless)"
    print(f"\n### Sluice GPU check: {name}, torch {torch.__version__}\n")
    print("| check | shape | max abs err | Triton ms | reference ms | SDPA (gathered KV) ms "
          "| decode KV GB/s (% of 4.8 TB/s) | output tok/s | status |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        status = "ok" if r.ok else "FAIL " + "; ".join(r.notes)
        print(f"| {r.check} | {r.shape} | {r.err} | {r.triton_ms} | {r.ref_ms} | {r.sdpa_ms} | {r.gbs} "
              f"| {r.tok_s} | {status} |")
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
