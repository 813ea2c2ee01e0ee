"""Kernel tests run the Triton kernels on CPU tensors through the interpreter when there is no GPU.

`TRITON_INTERPRET` must be set before `kernels.triton_ops` (and so `triton.jit`) is first imported;
on a CUDA machine it stays unset and the same tests run the compiled kernels on the GPU.
`SLUICE_KERNELS` is deliberately not set here: `kernels` reads it once at import, and forcing it would
send every later test's engine through the (slow) interpreter. Tests call `kernels.triton_ops` directly.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
