"""Prometheus metrics of one server: requests by outcome, tokens, latencies, and the engine's
queue and KV usage (read from the engine at scrape time). Each app has its own registry; with
several API server processes (server/api_servers.py) the values live in prometheus_client's
multiprocess files and any process's `/metrics` counts them all.

The inter-token latency is observed for every request on every engine step: it is a
`StepHistogram`, which costs a bisect and two additions per observation (prometheus_client's
Histogram takes a lock per bucket and per sum, and with several processes writes its file twice:
3 us against 0.2) and is exposed with the same samples, or flushed into a multiprocess Histogram.
"""

from __future__ import annotations

import bisect
import math
import os
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.utils import floatToGoString

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self) -> None:
        """With several API server processes (PROMETHEUS_MULTIPROC_DIR set: server/api_servers.py)
        every metric is prometheus_client's multiprocess kind and `render` counts every process."""
        self.registry = CollectorRegistry()
        self.shared = "PROMETHEUS_MULTIPROC_DIR" in os.environ
        r = self.registry
        self.requests = Counter("siesta_requests", "Finished requests by outcome", ["outcome"], registry=r)
        self.prompt_tokens = Counter("siesta_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("siesta_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram(
            "siesta_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        itl = ("siesta_inter_token_latency_seconds", "Time between tokens")
        sink = Histogram(*itl, buckets=_LATENCY_BUCKETS, registry=r) if self.shared else None
        self.itl = StepHistogram(*itl, _LATENCY_BUCKETS, r, sink)
        self.e2e = Histogram(
            "siesta_e2e_request_latency_seconds", "Request latency", buckets=_LATENCY_BUCKETS, registry=r
        )
        # Read from the engine at scrape time: the latest scrape's value, whichever process made it.
        recent = {"multiprocess_mode": "livemostrecent"}
        self.running = Gauge("siesta_num_requests_running", "Requests running in the engine", registry=r, **recent)
        self.waiting = Gauge("siesta_num_requests_waiting", "Requests waiting in the engine", registry=r, **recent)
        self.kv_usage = Gauge("siesta_kv_cache_usage_ratio", "Fraction of KV blocks in use", registry=r, **recent)

    def tracker(self) -> RequestTracker:
        return RequestTracker(self)

    def render(self, info: dict[str, Any]) -> bytes:
        """The text exposition, with the engine gauges set from `info` (EngineCore.get_info)."""
        self.running.set(info["num_running"])
        self.waiting.set(info["num_waiting"])
        total = info["kv_blocks_total"]
        self.kv_usage.set((total - info["kv_blocks_free"]) / total if total else 0.0)
        if not self.shared:
            return generate_latest(self.registry)
        every_process = CollectorRegistry()
        MultiProcessCollector(every_process)
        return generate_latest(every_process)


class RequestTracker:
    """Latencies of one request: time to first token, then time between tokens."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.start = self.last = time.monotonic()
        self.num_tokens = 0

    def on_tokens(self, n: int) -> None:
        if n == 0:
            return
        now = time.monotonic()
        (self.metrics.itl if self.num_tokens else self.metrics.ttft).observe(now - self.last)
        self.last = now
        self.num_tokens += n

    def finish(self, outcome: str, prompt_tokens: int) -> None:
        """`outcome`: a finish reason (stop, length, abort), or error / disconnected."""
        m = self.metrics
        m.requests.labels(outcome=outcome).inc()
        m.prompt_tokens.inc(prompt_tokens)
        m.generation_tokens.inc(self.num_tokens)
        m.e2e.observe(time.monotonic() - self.start)
        m.itl.flush()


class StepHistogram:
    """A histogram without labels, observed from the event loop's thread only (no lock), exposed
    as prometheus_client's Histogram exposes one: cumulative buckets up to +Inf, count, sum and
    created. With a `sink` (a multiprocess Histogram of the same name and buckets: several API
    server processes) it is not exposed itself: `flush` adds what it observed since the last flush
    to the sink's per-bucket values and sum (one file write each, not two per observation), at
    every request's end and every FLUSH_EVERY observations."""

    FLUSH_EVERY = 1024

    def __init__(
        self, name: str, documentation: str, buckets: tuple[float, ...], registry: CollectorRegistry,
        sink: Histogram | None = None,
    ) -> None:
        self.name, self.documentation = name, documentation
        self.bounds = [*buckets, math.inf]
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0
        self.created = time.time()
        self.sink = sink
        self.flushed, self.flushed_sum, self.unflushed = [0] * len(self.bounds), 0.0, 0
        if sink is None:
            registry.register(self)

    def observe(self, amount: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, amount)] += 1  # the first bucket with amount <= bound
        self.sum += amount
        if self.sink is not None:
            self.unflushed += 1
            if self.unflushed >= self.FLUSH_EVERY:
                self.flush()

    def flush(self) -> None:
        if self.sink is None or not self.unflushed:
            return
        # prometheus_client's Histogram keeps one value per bucket (not cumulative) and its sum.
        for value, count, flushed in zip(self.sink._buckets, self.counts, self.flushed, strict=True):  # noqa: SLF001
            if count != flushed:
                value.inc(count - flushed)
        self.sink._sum.inc(self.sum - self.flushed_sum)  # noqa: SLF001
        self.flushed, self.flushed_sum, self.unflushed = list(self.counts), self.sum, 0

    def describe(self) -> list[Metric]:
        return [Metric(self.name, self.documentation, "histogram")]

    def collect(self) -> list[Metric]:
        metric = Metric(self.name, self.documentation, "histogram")
        total = 0
        for bound, count in zip(self.bounds, self.counts, strict=True):
            total += count
            metric.add_sample(self.name + "_bucket", {"le": floatToGoString(bound)}, float(total))
        metric.add_sample(self.name + "_count", {}, float(total))
        metric.add_sample(self.name + "_sum", {}, self.sum)
        metric.add_sample(self.name + "_created", {}, self.created)
        return [metric]
