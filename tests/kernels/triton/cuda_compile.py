"""Compiles every Triton kernel for sm_90 (H100/H200) on a machine without a GPU.

Run as a script in a process WITHOUT `TRITON_INTERPRET`: launches made by the real launchers (on CPU
tensors) are intercepted, specialised exactly as the CUDA driver would, and compiled to a cubin
instead of run. Prints one JSON line per compiled kernel (name, registers, local-memory spill bytes).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

TARGET = GPUTarget("cuda", 90, 32)
_BACKEND = make_backend(TARGET)
_SEEN: set[str] = set()


def _resource_usage(cubin: bytes) -> dict[str, int]:
    """Registers and local memory from `cuobjdump -res-usage` (shipped inside the triton wheel)."""
    import triton.backends.nvidia as nv

    tool = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    line = next(l for l in text.splitlines() if "REG:" in l)
    fields = dict(tok.split(":") for tok in line.split() if ":" in tok)
    return {"registers": int(fields["REG"]), "local_bytes": int(fields["LOCAL"]), "stack_bytes": int(fields["STACK"])}


def _compile_instead_of_run(self: JITFunction, *args, grid, warmup, **kwargs):
    binder = create_function_from_signature(self.signature, self.params, _BACKEND)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = self._pack_args(_BACKEND, kwargs, bound_args, specialization, options)
    kernel = triton.compile(ASTSource(self, signature, constexprs, attrs), target=TARGET, options=options.__dict__)
    consts = {self.arg_names[k[0]]: (str(v) if not isinstance(v, (int, bool)) else v) for k, v in constexprs.items()}
    key = f"{self.__name__}{sorted(consts.items())}{options.num_warps}"
    if key not in _SEEN:
        _SEEN.add(key)
        usage = _resource_usage(kernel.asm["cubin"])
        print(json.dumps({"kernel": self.__name__, "num_warps": options.num_warps, "shared": kernel.metadata.shared,
                          **usage, "constexprs": consts}), flush=True)


def compile_all() -> None:
    """Drives each launcher at real model shapes (tiny token counts: only shapes/dtypes matter)."""
    from sluice_kernels import triton as K

    dtype = torch.bfloat16  # fp16 lowers the same way; fp32 (ieee dots) is compiled below
    for Hq, Hkv, D in ((32, 8, 128), (14, 2, 64)):  # Llama-8B-like; Qwen2-0.5B-like (GQA 7, padded to 8)
        kc = torch.zeros(8, 16, Hkv, D, dtype=dtype)
        bt = torch.zeros(2, 64, dtype=torch.int32)  # 1024 tokens: the auto split-KV path for decodes
        lens = torch.tensor([33, 40], dtype=torch.int32)
        for T in (2, 9):  # decode-only step (split-KV + merge), mixed step
            cu = torch.tensor([0, 1, T], dtype=torch.int32)
            K.paged_attention(torch.zeros(T, Hq, D, dtype=dtype), kc, kc, bt, cu, lens, 0.1)
        K.store_kv(torch.zeros(3, Hkv, D, dtype=dtype), torch.zeros(3, Hkv, D, dtype=dtype), kc, kc,
                   torch.zeros(3, dtype=torch.int64))
        cs = torch.zeros(64, D, dtype=torch.float32)
        for neox in (True, False):
            K.rotary_embedding(torch.zeros(3, dtype=torch.int64), torch.zeros(3, Hq, D, dtype=dtype),
                               torch.zeros(3, Hkv, D, dtype=dtype), cs, neox)
    x = torch.zeros(3, 896, dtype=dtype)
    K.rms_norm(x, torch.zeros(896, dtype=dtype), 1e-6)
    K.rms_norm(x, torch.zeros(896, dtype=dtype), 1e-6, torch.zeros_like(x))
    K.silu_and_mul(torch.zeros(3, 2 * 4864, dtype=dtype))
    for cache_dtype in (torch.int8, torch.float8_e4m3fn):  # quantized caches (--kv-cache-dtype), both launchers
        kq, ks = torch.zeros(8, 16, 2, 64, dtype=cache_dtype), torch.zeros(8, 16, 2)
        for T in (2, 9):
            K.paged_attention(torch.zeros(T, 14, 64, dtype=dtype), kq, kq, torch.zeros(2, 64, dtype=torch.int32),
                              torch.tensor([0, 1, T], dtype=torch.int32), torch.tensor([33, 40], dtype=torch.int32),
                              0.1, ks, ks)
        K.store_kv(torch.zeros(3, 2, 64, dtype=dtype), torch.zeros(3, 2, 64, dtype=dtype), kq, kq,
                   torch.zeros(3, dtype=torch.int64), ks, ks)
    kc = torch.zeros(8, 16, 2, 64, dtype=torch.float32)  # fp32 path (ieee dots)
    K.paged_attention(torch.zeros(2, 4, 64), kc, kc, torch.zeros(2, 4, dtype=torch.int32),
                      torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([3, 9], dtype=torch.int32), 0.1)


if __name__ == "__main__":
    assert not os.environ.get("TRITON_INTERPRET"), "run without TRITON_INTERPRET: this compiles for the GPU"
    JITFunction.run = _compile_instead_of_run
    compile_all()
    sys.exit(0)
