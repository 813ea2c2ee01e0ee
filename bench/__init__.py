"""Benchmarks for Sluice: `python -m bench offline|stall|prefix|serve|all [--quick]` (see bench/README.md).

Every workload runs all its systems in one process, alternating, each after one warm-up, so the
ratios between systems are fair on a noisy machine; absolute numbers are only as good as the host.
"""
