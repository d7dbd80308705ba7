"""The Prometheus metrics of one app, in a registry of its own.

Timings and batch sizes are histograms the serving code observes as it goes; they stay readable as
attributes (`request_latency`, `batch_size`, ...) for anything else that reports on them. Counts that
the cache and the batcher already keep (hits, misses, entries, queue depth, dropped) and the requests
in flight are read where they are kept, at scrape time, so there is one source for each. Every
rejection reason of `mnv3.errors` is exported, as 0, before its first rejection.

A server of several models labels every per-model series with `model` (its name); a server of one
model exports the same names without that label, exactly as before models could be several.
`for_model(name)` hands a model the series it observes.

`mnv3_thread_cpu_seconds_total{threads=...}` splits the process's CPU seconds by what its threads do
(`mnv3.thread_cpu`: the event loop, decoding, gathering batches and the calls into the engine, the engine's
own threads), read at scrape time: what a load test divides by its requests to see where a request's CPU goes.
Each of them is a counter that never goes down, its sum the process's CPU seconds to within what the threads
burn while one scrape reads them.
"""

import threading
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, GCCollector, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from mnv3.batcher import DynamicBatcher
from mnv3.cache import ResultCache
from mnv3.errors import REJECTION_REASONS, error_entry
from mnv3.thread_cpu import cpu_seconds_by_role

# Seconds. prometheus_client's default buckets start at 5 ms, where a cache hit (a fraction of a millisecond)
# and most queue waits would all fall in the first; and stop at 10 s, below --body-timeout-s's default.
LATENCY_BUCKETS = (
    *(0.00025, 0.0005, 0.001, 0.0025),  # below the default's: cache hits, queue waits
    *(0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10),  # prometheus_client's default
    *(30, 60),  # past --body-timeout-s's default
)


@dataclass(frozen=True)
class ModelMetrics:
    """The histograms of one model (children of the app's labelled ones when there are several models)."""

    request_latency: Histogram
    queue_wait: Histogram
    preprocess: Histogram
    inference: Histogram
    batch_size: Histogram


class Metrics:
    def __init__(self, model_names: list[str], in_flight: Callable[[], int], thread_roles: dict[int, str]):
        """`thread_roles`: threads no name gives a role to (mnv3.thread_cpu), e.g. the event loop's."""
        self.registry = CollectorRegistry()  # per app, so tests can build several
        registry = self.registry
        # The standard process_* series (CPU seconds, resident memory, open files), where the OS has /proc:
        # what a load test divides by its requests to see what one costs the server.
        ProcessCollector(registry=registry)
        # python_gc_*: collections by generation, the process's (the server's settle_garbage_collector keeps
        # young ones rare under load).
        GCCollector(registry=registry)
        self.labelled = len(model_names) > 1
        labels = ["model"] if self.labelled else []
        self.request_latency = Histogram(
            "mnv3_request_latency_seconds",
            "POST /predict or /v2 infer admitted (within --max-in-flight), from arrival until its result or error "
            "is ready (encoding and sending the answer not included)",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.queue_wait = Histogram(
            "mnv3_queue_wait_seconds",
            "queued until its batch's inference started",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.preprocess = Histogram(
            "mnv3_preprocess_seconds",
            "decode + preprocess, including waiting for a thread",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.inference = Histogram(
            "mnv3_inference_seconds", "one batched inference call", labels, buckets=LATENCY_BUCKETS, registry=registry
        )
        self.batch_size = Histogram(
            "mnv3_batch_size",
            "requests per inference call",
            labels,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),  # up to --max-batch-size's maximum
            registry=registry,
        )
        self.rejections = Counter(
            "mnv3_rejections", "requests refused or failed, by reason", ["reason"], registry=registry
        )
        for reason in REJECTION_REASONS:
            self.rejections.labels(reason)  # exported as 0 before the first rejection
        self._live = _LiveCounts(self.labelled, in_flight)
        registry.register(self._live)
        self.thread_roles = thread_roles
        self._thread_cpu: dict[str, float] = {}  # the last seconds given out, by role
        self._thread_cpu_lock = threading.Lock()  # scrapes, /stats and load tests read from several threads
        registry.register(_ThreadCpu(self.thread_cpu_seconds))

    def for_model(self, name: str, cache: ResultCache, batcher: DynamicBatcher) -> ModelMetrics:
        """The series model `name` observes; its cache's and batcher's counts are exported from now on."""
        self._live.models[name] = (cache, batcher)
        histograms = (self.request_latency, self.queue_wait, self.preprocess, self.inference, self.batch_size)
        return ModelMetrics(*(h.labels(name) if self.labelled else h for h in histograms))

    def thread_cpu_seconds(self) -> dict[str, float]:
        """The process's CPU seconds so far by thread role (mnv3.thread_cpu), this app's event loop included;
        never less than at an earlier call, as a counter must be. engine_and_other, the process's time less the
        threads', also holds what they burn while they are read one after the other: the next reading, their
        clocks read later, gives it back to them, and the counter would go down (Prometheus reads a reset)."""
        with self._thread_cpu_lock:
            read = cpu_seconds_by_role(self.thread_roles)
            self._thread_cpu = {role: max(seconds, self._thread_cpu.get(role, 0.0)) for role, seconds in read.items()}
            return dict(self._thread_cpu)

    def count_rejection(self, exc: Exception) -> None:
        _, reason, _ = error_entry(exc)
        if reason:
            self.rejections.labels(reason).inc()


class _LiveCounts:
    """Reads counts where they are kept, at scrape time, so the cache and batcher stay the one source."""

    def __init__(self, labelled: bool, in_flight: Callable[[], int]):
        self.labelled, self.in_flight = labelled, in_flight
        self.models: dict[str, tuple[ResultCache, DynamicBatcher]] = {}

    def collect(self):
        per_model = (
            (
                CounterMetricFamily,
                "mnv3_cache_hits",
                "answered from the cache or by an identical request's computation in flight (a failure it shared "
                "counts in neither)",
                lambda cache, batcher: cache.hits,
            ),
            (
                CounterMetricFamily,
                "mnv3_cache_misses",
                "not in the cache, so computed or tried (a refused or failed computation too); with --cache-size 0 "
                "nothing is looked up",
                lambda cache, batcher: cache.misses,
            ),
            (GaugeMetricFamily, "mnv3_cache_entries", "results stored", lambda cache, batcher: len(cache)),
            (
                GaugeMetricFamily,
                "mnv3_queue_depth",
                "requests waiting for inference",
                lambda cache, batcher: batcher.depth,
            ),
            (
                CounterMetricFamily,
                "mnv3_dropped",
                "requests skipped before inference: deadline passed or client gone",
                lambda cache, batcher: batcher.dropped,
            ),
        )
        for family_type, name, documentation, read in per_model:
            if not self.labelled:
                ((cache, batcher),) = self.models.values()
                yield family_type(name, documentation, value=read(cache, batcher))
                continue
            family = family_type(name, documentation, labels=["model"])
            for model, (cache, batcher) in self.models.items():
                family.add_metric([model], read(cache, batcher))
            yield family
        yield GaugeMetricFamily("mnv3_in_flight", "requests admitted and not yet answered", value=self.in_flight())


class _ThreadCpu:
    """The process's CPU seconds by thread role, read at scrape time."""

    def __init__(self, read: Callable[[], dict[str, float]]):
        self.read = read

    def collect(self):
        family = CounterMetricFamily(
            "mnv3_thread_cpu_seconds",
            "CPU seconds of this process's threads by what they do: event_loop (HTTP, cache hits), preprocess "
            "(decode), inference (gathering batches, the calls into the engine), engine_and_other (the engine's "
            "own threads, threads that exited); they add up to process_cpu_seconds_total",
            labels=["threads"],
        )
        for role, seconds in self.read().items():
            family.add_metric([role], seconds)
        yield family
