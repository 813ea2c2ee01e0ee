"""`sluice_kernels/cpu/build.py` and `load()`: the sources ship with the package; without a compiler, or on a failed
build, `load()` says why, leaves nothing half-built, and the torch twins serve."""
from __future__ import annotations

import logging
from pathlib import Path

import tomllib
import torch

import sluice_kernels as kernels
from sluice_kernels import cpu, reference
from sluice_kernels.cpu import binding, build
from tests.kernels.common import paged_batch


def test_the_package_ships_every_kernel_source():
    """Non-editable installs (the Docker image) compile from the installed package: csrc must be package data."""
    root = Path(kernels.__file__).resolve().parents[1]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["sluice_kernels.cpu"]
    shipped = {p for g in globs for p in (root / "sluice_kernels" / "cpu").glob(g)}
    assert {*build.SOURCES, *build.HEADERS} <= shipped
    assert set(build.CSRC.iterdir()) - {build.CSRC / "__pycache__"} <= shipped


def test_without_a_compiler_the_twin_serves(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(binding, "_lib", None)
    with caplog.at_level(logging.WARNING, logger="sluice.kernels"):
        assert cpu.load(tmp_path, cxx=str(tmp_path / "no-such-compiler")) is False
    assert "torch path" in caplog.text
    assert kernels.attention_backend(torch.device("cpu")) == "torch"
    args = [t.cpu() for t in paged_batch([1, 3], [4, 2], num_q_heads=2, num_kv_heads=1, head_dim=16, block_size=8).args()]
    torch.testing.assert_close(kernels.paged_attention(*args, 0.5), reference.paged_attention(*args, 0.5))


def test_a_failed_build_reports_the_compiler_error(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(binding, "_lib", None)
    monkeypatch.setattr(build, "FLAGS", (*build.FLAGS, "-DSLUICE_BROKEN", "-include", "no/such/header.h"))
    with caplog.at_level(logging.WARNING, logger="sluice.kernels"):
        assert cpu.load(tmp_path) is False
    assert "no/such/header.h" in caplog.text
    assert not list(tmp_path.glob("*.so"))  # nothing half-built is left to be loaded later


def test_the_builds_compile_without_warnings(variant_builds):
    """A compiler warning in kernel code is a bug until shown otherwise (GCC's -Waggressive-loop-optimizations once
    pointed at the plain loops' `dot`): none of the builds the tests run printed any."""
    for name, so in variant_builds.items():
        assert build.warnings_of(so).read_text() == "", name
