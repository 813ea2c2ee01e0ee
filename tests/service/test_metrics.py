"""service/metrics.py's StepHistogram: what a Prometheus scrape reads of it is what prometheus_client's own
Histogram shows after the same observations one by one (buckets, count, sum), whatever the values: on a bound, past
the last, repeated as a step's gaps are."""
from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from service.metrics import _ITL_BUCKETS, StepHistogram


def _samples(registry: CollectorRegistry) -> dict[tuple, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples if not s.name.endswith("_created")}


def test_a_step_histogram_reads_as_prometheus_own() -> None:
    ours_registry, theirs_registry = CollectorRegistry(), CollectorRegistry()
    ours = StepHistogram("gap_seconds", "doc", _ITL_BUCKETS, ours_registry)
    theirs = Histogram("gap_seconds", "doc", buckets=_ITL_BUCKETS, registry=theirs_registry)
    rng = random.Random(15)
    for _ in range(200):  # steps: most gaps in a step are one value, a few others, bounds and outliers among them
        common = rng.choice([*_ITL_BUCKETS, rng.uniform(0, 3), rng.expovariate(50)])
        step = [common] * rng.randrange(0, 64) + [rng.uniform(0, 4) for _ in range(rng.randrange(0, 4))]
        ours.observe_many(step)
        for v in step:
            theirs.observe(v)
    got, want = _samples(ours_registry), _samples(theirs_registry)
    assert got.keys() == want.keys() and len(got) == len(_ITL_BUCKETS) + 3  # buckets, +Inf, count, sum
    for key, value in want.items():
        assert abs(got[key] - value) <= 1e-9 * max(1.0, abs(value)), key
    assert want[("gap_seconds_count", ())] > 5000
