"""Prometheus metrics (docs/architecture.md §6), all prefixed `sluice_`, in a registry of their own.

Engine counters are not mirrored into Counter objects: a custom collector reads the latest stats
snapshot at scrape time, so the exposition is always exactly the engine's numbers.
"""
from __future__ import annotations

import bisect
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator
from itertools import accumulate
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

_ENGINE_COUNTERS = {
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache.",
    "num_preemptions": "Requests preempted for lack of KV blocks.",
    "fair_preemptions": "Requests preempted to give another client its share of the running seats or KV blocks.",
    "deferred_decodes": "Decodes left for a later step to give another client its share of a step that meets "
                        "--itl-slo-ms.",
    "num_steps": "Engine steps run.",
    "prompt_tokens_computed": "Prompt tokens run through the model (cache misses).",
    "generation_tokens": "Tokens generated.",
    "scheduler_mode_changes": "Changes of the scheduler's KV-pressure mode (normal, hold, static), either way.",
    "host_cache_hits": "Prompt tokens copied back from the host KV tier instead of recomputed.",
    "host_blocks_offloaded": "Cached KV blocks copied to the host tier when evicted from the pool.",
    "host_blocks_loaded": "KV blocks copied back from the host tier.",
    "host_cache_evictions": "Blocks dropped from the host tier to make room (segmented LRU: ones copied back go last).",
    "host_copy_seconds": "Seconds spent copying KV blocks between the pool and the host tier.",
    "spec_draft_tokens": "Draft tokens proposed and verified (speculative decoding, --speculative).",
    "spec_accepted_tokens": "Draft tokens verification accepted.",
    "spec_declined_steps": "Steps whose drafts speculative decoding's cost model declined (plain decoding yields more).",
}
_ENGINE_GAUGES = {
    "num_running": "Requests running in the engine.",
    "num_waiting": "Requests waiting for the engine.",
    "num_kv_blocks": "KV cache blocks in the pool.",
    "num_free_kv_blocks": "Free KV cache blocks (cached-but-unused blocks count as free).",
    "kv_usage": "Fraction of KV cache blocks in use (0..1).",
    "num_host_kv_blocks": "Slots of the host KV tier (--kv-offload-gb), one block each.",
    "num_free_host_kv_blocks": "Host KV tier slots holding nothing.",
    "kv_cache_bytes": "Bytes of the KV pool (--kv-cache-dtype sets how many tokens they hold).",
    "host_kv_cache_bytes": "Bytes of the host KV tier.",
    "scheduler_degraded": "The scheduler's KV-pressure mode: 0 normal, 1 hold (admits a request only if all of it "
                          "fits), 2 static (admits nothing while anything runs).",
}
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)


class _EngineCollector(Collector):
    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        stats = self._snapshot()
        if not stats:  # engine not started yet: expose nothing rather than made-up zeros
            return
        for key, doc in _ENGINE_COUNTERS.items():
            yield CounterMetricFamily(f"sluice_{key}", doc, value=float(stats.get(key, 0)))
        for key, doc in _ENGINE_GAUGES.items():
            yield GaugeMetricFamily(f"sluice_{key}", doc, value=float(stats.get(key, 0)))


class StepHistogram(Collector):
    """A Prometheus histogram observed a loop turn at a time. A turn (one step, or the steps the loop took together)
    brings one inter-token gap per streaming request, mostly one value (every request that had a token in the turn
    before has the same gap): equal values are
    counted together, one bucket search each, instead of a `Histogram.observe` (a bucket search and two locked
    increments) per token. Observed and collected on the event loop."""

    def __init__(self, name: str, doc: str, buckets: Iterable[float], registry: CollectorRegistry) -> None:
        self.name, self.doc = name, doc
        self.bounds = sorted(float(b) for b in buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # per bucket (le each bound, then +Inf), not cumulative
        self.sum = 0.0
        registry.register(self)

    def observe_many(self, values: Iterable[float]) -> None:
        for value, n in Tally(values).items():
            self.counts[bisect.bisect_left(self.bounds, value)] += n  # the first bucket whose bound is >= value
            self.sum += value * n

    def collect(self) -> Iterator[Metric]:
        les = [*map(floatToGoString, self.bounds), "+Inf"]
        yield HistogramMetricFamily(self.name, self.doc, buckets=list(zip(les, accumulate(self.counts))),
                                    sum_value=self.sum)


class Metrics:
    """Request-level metrics observed by the service, plus the engine's counters at scrape time."""

    def __init__(self, engine_stats: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("sluice_time_to_first_token_seconds", "Arrival to first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = StepHistogram("sluice_inter_token_latency_seconds", "Time between two deliveries of a request's "
                                 "tokens (a speculative step, or steps the event loop took together, may bring several).", _ITL_BUCKETS, r)
        self.e2e = Histogram("sluice_e2e_request_latency_seconds", "Arrival to the last token.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("sluice_queue_time_seconds", "Arrival to the first step that ran the request.",
                               buckets=_LATENCY_BUCKETS, registry=r)
        self.requests = Counter("sluice_requests", "Finished requests.", ["api", "finish_reason"], registry=r)
        self.completion_tokens = Counter("sluice_request_completion_tokens", "Completion tokens of finished requests.",
                                         ["api"], registry=r)
        self.errors = Counter("sluice_errors", "Error replies sent, by protocol error code.", ["code"], registry=r)
        self.websocket_connections = Gauge("sluice_websocket_connections", "Open WebSocket connections.",
                                           registry=r)
        self.engine_restarts = Counter("sluice_engine_restarts", "Engines rebuilt after a failure or a stuck step, "
                                       "their requests resumed.", registry=r)
        r.register(_EngineCollector(engine_stats))

    def observe_first_token(self, queue_s: float, ttft_s: float) -> None:
        self.queue.observe(queue_s)
        self.ttft.observe(ttft_s)

    def observe_inter_tokens(self, seconds: list[float]) -> None:
        """One loop turn's gaps, one per request that had a token in it and one before."""
        self.itl.observe_many(seconds)

    def observe_finish(self, handle: Any, finish_reason: str) -> None:
        """Every request ends here once; e2e latency only for those that produced tokens."""
        self.requests.labels(handle.api, finish_reason).inc()
        self.completion_tokens.labels(handle.api).inc(handle.completion_tokens)
        if handle.last_token_at is not None:
            self.e2e.observe(handle.last_token_at - handle.arrival)

    def observe_error(self, code: str) -> None:
        self.errors.labels(code).inc()

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
