"""The Prometheus metrics of one app, in a registry of its own.

Timings and batch sizes are histograms the serving code observes as it goes; they stay readable as
attributes (`request_latency`, `batch_size`, ...) for anything else that reports on them. Counts that
the cache and the batcher already keep (hits, misses, entries, queue depth, dropped) and the requests
in flight are read where they are kept, at scrape time, so there is one source for each. Every
rejection reason of `mnv3.errors` is exported, as 0, before its first rejection.
"""
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from mnv3.batcher import DynamicBatcher
from mnv3.cache import ResultCache
from mnv3.errors import REJECTION_REASONS


class Metrics:
    def __init__(self, cache: ResultCache, batcher: DynamicBatcher, in_flight: Callable[[], int]):
        self.registry = CollectorRegistry()  # per app, so tests can build several
        registry = self.registry
        self.request_latency = Histogram("mnv3_request_latency_seconds", "POST /predict, arrival to response",
                                         registry=registry)
        self.queue_wait = Histogram("mnv3_queue_wait_seconds", "queued until its batch's inference started",
                                    registry=registry)
        self.preprocess = Histogram("mnv3_preprocess_seconds", "decode + preprocess, including waiting for a thread",
                                    registry=registry)
        self.inference = Histogram("mnv3_inference_seconds", "one batched inference call", registry=registry)
        self.batch_size = Histogram("mnv3_batch_size", "requests per inference call",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=registry)
        self.rejections = Counter("mnv3_rejections", "requests refused, by reason", ["reason"], registry=registry)
        for reason in REJECTION_REASONS:
            self.rejections.labels(reason)  # exported as 0 before the first rejection
        registry.register(_LiveCounts(cache, batcher, in_flight))


class _LiveCounts:
    """Reads counts where they are kept, at scrape time, so the cache and batcher stay the one source."""

    def __init__(self, cache: ResultCache, batcher: DynamicBatcher, in_flight: Callable[[], int]):
        self.cache, self.batcher, self.in_flight = cache, batcher, in_flight

    def collect(self):
        yield CounterMetricFamily("mnv3_cache_hits", "answered from the cache or a shared computation",
                                  value=self.cache.hits)
        yield CounterMetricFamily("mnv3_cache_misses", "computed", value=self.cache.misses)
        yield GaugeMetricFamily("mnv3_cache_entries", "results stored", value=len(self.cache))
        yield GaugeMetricFamily("mnv3_queue_depth", "requests waiting for inference", value=self.batcher.depth)
        yield GaugeMetricFamily("mnv3_in_flight", "requests admitted and not yet answered", value=self.in_flight())
        yield CounterMetricFamily("mnv3_dropped", "requests skipped before inference: deadline passed or client gone",
                                  value=self.batcher.dropped)
