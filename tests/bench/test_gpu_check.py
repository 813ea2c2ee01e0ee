"""bench/gpu_check.py's verdict on the rotary kernel: one bf16 ulp apart from the reference is right, more is
not. The GPU's result is emulated here: its compiler fuses `a * b - c * d` into an FMA (one rounding less)."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # bench.gpu_check imports triton's kernels: as tests/kernels/conftest.py does
    os.environ["TRITON_INTERPRET"] = "1"

from bench.gpu_check import TOL, Row, judge, judge_rounded, max_err, ulp_err  # noqa: E402
from sluice_kernels import reference  # noqa: E402


def _fma_rotary(q: torch.Tensor, cs: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """neox rotary as a GPU computes it with FMA contraction: x1*c exact, one fp32 rounding for the pair."""
    half = q.shape[-1] // 2
    c, s = cs[pos][:, None, :half].double(), cs[pos][:, None, half:].double()
    x1, x2 = q[..., :half].double(), q[..., half:].double()
    f32 = lambda t: t.float().double()  # noqa: E731
    return torch.cat((f32(x1 * c - f32(x2 * s)), f32(x2 * c + f32(x1 * s))), -1).to(q.dtype)


def test_one_ulp_from_fma_contraction_passes_and_two_ulps_fail() -> None:
    g = torch.Generator().manual_seed(0)
    q = (2 * torch.randn(256, 32, 128, generator=g)).to(torch.bfloat16)  # outputs up to |x| ~ 16
    cs = torch.randn(4096, 128, generator=g)
    pos = torch.randint(0, 4096, (256,), generator=g)
    ref, _ = reference.rotary_embedding(pos, q.clone(), q[:, :1].clone(), cs, True)
    gpu = _fma_rotary(q, cs, pos)

    # what the H200 run saw: the two differ by exactly one ulp where |x| >= 4, over the absolute tolerance
    assert max_err(gpu, ref) > TOL[torch.bfloat16] and ulp_err(gpu, ref) == 1.0
    old, new = Row("rope", ""), Row("rope", "")
    judge(old, max_err(gpu, ref), torch.bfloat16)
    judge_rounded(new, [(gpu, ref)], torch.bfloat16)
    assert not old.ok and new.ok, new.notes

    wrong = ref.clone()
    i = int(ref.float().abs().argmin())  # even near zero, two ulps off is an error
    wrong.view(-1)[i] = ref.view(-1)[i].float() + 2 * (2.0 ** (torch.floor(torch.log2(ref.view(-1)[i].float().abs())) - 7))
    bad = Row("rope", "")
    judge_rounded(bad, [(wrong, ref)], torch.bfloat16)
    assert not bad.ok and "2 ulp" in bad.notes[0]


def test_the_quantized_kv_rows_pass_on_the_interpreter() -> None:
    """The int8 / fp8 rows a GPU session will run (attention vs the twin, the quantizing store within a grid step),
    at the dry run's shapes."""
    from bench.gpu_check import TINY, quantized_rows

    rows = [make() for make in quantized_rows(TINY, "cpu")]
    assert len(rows) == 6 and all(r.ok for r in rows), [(r.shape, r.err, r.notes) for r in rows]


def test_the_workload_rows_run_end_to_end_in_a_dry_run() -> None:
    """`bench/gpu_check.sh --only-workloads`, as a GPU session would run it, at the dry run's sizes (and with the CPU
    kernels: the other sections check the Triton ones): Sluice in each mode and transformers on each offline load,
    then `sluice serve` in each mode under a WebSocket load. A GPU session is short: the plumbing (the transformers
    baseline, the server's flags, the client) must not be what fails there."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--dry-run", "--only-workloads"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith(("| offline", "| served"))]
    assert len(rows) == 11 and all(line.endswith("| ok |") for line in rows), out.stdout
    for mode in ("eager", "graphs + async outputs", "graphs + async scheduling"):
        assert sum(f"sluice, {mode}:" in line for line in rows) == 2
        assert sum(f"sluice serve, {mode}:" in line for line in rows) == 1
    assert sum("× transformers)" in line for line in rows) == 6  # every Sluice row against the same run's baseline
