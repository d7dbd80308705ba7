"""GET /stats: the server's recent behaviour as small JSON (requests/s, latency quantiles, batch sizes,
cache hit rate, queue depth, in flight, the cores its threads kept busy by what they do), for the page's
live panel and for `curl`. Server-wide: with several models, every figure is over all of them; `models`
adds each model's requests, latency, cache hit rate and queue depth.

It adds no work to the /predict hot path: it reads only what the server already counts, the
prometheus_client Histograms and Counters in `Metrics`, the live counts the caches, the batchers
(every model's, summed) and `Serving` keep, and the threads' own CPU clocks (mnv3.thread_cpu).
Windowed figures come from differences of cumulative readings: each call reads the cumulative
histogram buckets and CPU seconds, keeps that reading in a small ring (at most one per `spacing_s`),
and subtracts the newest kept reading that is at least `window_s` old.
Nothing runs between calls, so nobody watching costs nothing.

How exact it is:
- counts, rates, means, the cache hit rate and the batch-size distribution over the window are exact
  (differences of exact cumulative counts and sums; batch sizes are integers and the batch histogram's
  bounds are integers, so its buckets are exact ranges);
- quantiles are estimated from bucket counts as Prometheus's `histogram_quantile` does: the bucket
  holding the rank is found exactly, and the value within it is interpolated linearly between its
  bounds. The error is at most that bucket's width: the latency histograms' bounds are
  `metrics.LATENCY_BUCKETS` (0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 75, 100, 250, 500, 750 ms, 1, 2.5, 5, 7.5, 10,
  30, 60 s), so a p95 of "900 ms" means somewhere in 750-1000 ms. A rank in the overflow bucket (> 60 s)
  reports 60 s;
- the window is the time between the two readings: `window_s` says how long it really is. Right after
  start-up it is shorter (the first reading is taken at start-up); if nobody called for longer than
  `window_s`, it is the time since the last call's kept reading.
"""

import math
import time
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import APIRouter, Depends, FastAPI, Request
from pydantic import BaseModel, Field

WINDOW_S = 60.0
# One kept reading per second bounds the ring to ~WINDOW_S/SPACING_S entries however often /stats is
# called (several open pages, a tight curl loop), and still places the window's start within a second.
SPACING_S = 1.0
QUANTILES = (0.5, 0.95, 0.99)


@dataclass(frozen=True)
class HistogramReading:
    """A prometheus histogram at one moment, summed over its label sets: `cumulative[i]` observations
    were <= `bounds[i]`; the last bound is +inf, so `cumulative[-1]` is the count."""

    bounds: tuple[float, ...]
    cumulative: tuple[float, ...]
    total: float  # sum of the observed values

    @property
    def count(self) -> float:
        return self.cumulative[-1]

    def __sub__(self, earlier: "HistogramReading") -> "HistogramReading":
        """The observations made between `earlier` and this reading."""
        if earlier.bounds != self.bounds:
            raise ValueError("readings of histograms with different buckets")
        return HistogramReading(
            self.bounds,
            tuple(a - b for a, b in zip(self.cumulative, earlier.cumulative, strict=True)),
            self.total - earlier.total,
        )

    def mean(self) -> float | None:
        return self.total / self.count if self.count else None

    def quantile(self, q: float) -> float | None:
        """The q-quantile as Prometheus's histogram_quantile estimates it; None without observations."""
        if not 0 < q <= 1:
            raise ValueError(f"quantile must be in (0, 1], got {q}")
        if not self.count:
            return None
        rank = q * self.count
        b = next(i for i, c in enumerate(self.cumulative) if c >= rank)
        if b == len(self.bounds) - 1:  # in the overflow bucket: its lower bound is all we know
            return self.bounds[-2]
        lower, below = (self.bounds[b - 1], self.cumulative[b - 1]) if b else (min(0.0, self.bounds[0]), 0.0)
        # cumulative[b] > below, since below < rank <= cumulative[b]
        return lower + (self.bounds[b] - lower) * (rank - below) / (self.cumulative[b] - below)

    def bucket_counts(self) -> list[float]:
        """Observations per bucket (not cumulative)."""
        return [c - p for c, p in zip(self.cumulative, (0.0, *self.cumulative[:-1]), strict=True)]


def read_histogram(histogram) -> HistogramReading:
    """The cumulative buckets of a prometheus_client Histogram, summed over all its label sets."""
    buckets: dict[float, float] = {}
    total = 0.0
    for metric in histogram.collect():
        for sample in metric.samples:
            if sample.name.endswith("_bucket"):
                bound = float(sample.labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + sample.value
            elif sample.name.endswith("_sum"):
                total += sample.value
    bounds = tuple(sorted(buckets))
    return HistogramReading(bounds, tuple(buckets[b] for b in bounds), total)


def read_counter(counter, label: str) -> dict[str, float]:
    """A labelled prometheus_client Counter's totals by the value of `label`."""
    return {
        sample.labels[label]: sample.value
        for metric in counter.collect()
        for sample in metric.samples
        if sample.name.endswith("_total")
    }


@dataclass(frozen=True)
class Reading:
    """Cumulative counts at monotonic time `at`: histograms and counters by name."""

    at: float
    histograms: dict[str, HistogramReading]
    counters: dict[str, float]
    cpu_seconds: dict[str, float]  # the process's, by thread role (mnv3.thread_cpu)

    def __sub__(self, earlier: "Reading") -> "Reading":
        return Reading(
            self.at - earlier.at,
            {name: h - earlier.histograms[name] for name, h in self.histograms.items()},
            {name: v - earlier.counters.get(name, 0.0) for name, v in self.counters.items()},
            {role: v - earlier.cpu_seconds.get(role, 0.0) for role, v in self.cpu_seconds.items()},
        )


class ReadingRing:
    """Readings kept at least `spacing_s` apart, enough of them to reach `window_s` back."""

    def __init__(self, first: Reading, window_s: float = WINDOW_S, spacing_s: float = SPACING_S):
        self.window_s, self.spacing_s = window_s, spacing_s
        self._kept = deque([first])

    def window(self, now: Reading) -> Reading:
        """What happened between the newest kept reading at least `window_s` before `now` (or the
        oldest kept one, if none is that old) and `now`; `at` of the result is the window's length."""
        while len(self._kept) > 1 and self._kept[1].at <= now.at - self.window_s:
            self._kept.popleft()  # a newer reading is old enough to start the window
        base = self._kept[0]
        if now.at - self._kept[-1].at >= self.spacing_s:
            self._kept.append(now)
        return now - base

    def __len__(self) -> int:
        return len(self._kept)


# ----------------------------------------------------------------------------------------------- JSON


class LatencySummary(BaseModel):
    p50_ms: float | None = Field(description="estimated from histogram buckets (see the module docstring)")
    p95_ms: float | None
    p99_ms: float | None
    mean_ms: float | None = Field(description="exact")

    @classmethod
    def of(cls, seconds: HistogramReading) -> "LatencySummary":
        p50, p95, p99 = (_ms(seconds.quantile(q)) for q in QUANTILES)
        return cls(p50_ms=p50, p95_ms=p95, p99_ms=p99, mean_ms=_ms(seconds.mean()))


class BatchSizeBucket(BaseModel):
    smallest: int
    largest: int | None = Field(description="None: no upper bound")
    inferences: int = Field(description="inference calls with a batch size in [smallest, largest]")


class BatchSizes(BaseModel):
    inferences: int = Field(description="inference calls in the window")
    images: int = Field(description="images those calls inferred")
    mean: float | None
    buckets: list[BatchSizeBucket]


class CacheStats(BaseModel):
    hits: int = Field(description="in the window, all models")
    misses: int = Field(description="in the window, all models")
    hit_rate: float | None = Field(description="hits / (hits + misses) in the window; None without requests")
    entries: int = Field(description="results stored now, in every model's cache")


class Stages(BaseModel):
    queue: LatencySummary = Field(description="queued until its batch's inference started")
    preprocess: LatencySummary = Field(description="decode + preprocess, including waiting for a thread")
    inference: LatencySummary = Field(description="one batched inference call")


class ModelStats(BaseModel):
    requests: int = Field(
        description="this model's requests answered in the window, any status, of those admitted (a refusal "
        "before admission, such as a 503 busy or a 404 unknown model, is counted only in `rejected`)"
    )
    requests_per_s: float
    latency: LatencySummary = Field(description="arrival until its result or error is ready")
    cache_hit_rate: float | None = Field(description="in the window; None without requests")
    queue_depth: int = Field(description="now: this model's requests waiting for inference")


class StatsResponse(BaseModel):
    window_s: float = Field(
        description="seconds the windowed figures cover: the last minute, or less right after "
        "start-up, or more if /stats was not called for longer than that"
    )
    requests: int = Field(
        description="POST /predict and /v2 infer requests answered in the window, any status, any model, of "
        "those admitted (a refusal before admission, such as a 503 busy or a 404 unknown model, is counted only "
        "in `rejected`)"
    )
    requests_per_s: float
    latency: LatencySummary = Field(description="those requests, arrival until the result or error is ready")
    stages: Stages
    batch_size: BatchSizes
    cache: CacheStats
    rejected: dict[str, int] = Field(description="requests refused in the window, by reason")
    queue_depth: int = Field(description="now: requests waiting for inference, all models")
    in_flight: int = Field(description="now: requests admitted and not yet answered")
    cpu_cores: dict[str, float] = Field(
        description="cores the server's threads kept busy in the window, by what they do (CPU seconds / "
        "window_s): event_loop (HTTP, uploads, cache hits, answers), preprocess (decoding), inference "
        "(gathering batches, the calls into the engine), engine_and_other (the engine's own worker threads, "
        "threads that exited); their sum is the whole process's"
    )
    models: dict[str, ModelStats] = Field(description="the same, model by model, by name (the default first)")


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def _hit_rate(hits: float, misses: float) -> float | None:
    return hits / (hits + misses) if hits + misses else None


def _per_second(count: float, seconds: float) -> float:
    return count / seconds if seconds > 0 else 0.0


HISTOGRAMS = ("request_latency", "queue_wait", "preprocess", "inference", "batch_size")  # Metrics attributes


class LiveStats:
    """Reads one `Serving`'s counts, all its models together, and reports them over a sliding window."""

    def __init__(self, serving, window_s: float = WINDOW_S, spacing_s: float = SPACING_S, clock=time.monotonic):
        self.serving, self.clock = serving, clock
        self.ring = ReadingRing(self.read(), window_s, spacing_s)

    def read(self) -> Reading:
        metrics, models = self.serving.metrics, self.serving.models
        histograms = {name: read_histogram(getattr(metrics, name)) for name in HISTOGRAMS}
        counters = {
            "cache_hits": sum(m.cache.hits for m in models.values()),
            "cache_misses": sum(m.cache.misses for m in models.values()),
        }
        for name, m in models.items():  # "/": model names are URL path segments, so never hold one
            histograms[f"request_latency/{name}"] = read_histogram(m.metrics.request_latency)
            counters |= {f"cache_hits/{name}": m.cache.hits, f"cache_misses/{name}": m.cache.misses}
        rejections = read_counter(metrics.rejections, "reason")
        counters |= {f"rejected_{reason}": value for reason, value in rejections.items()}
        return Reading(self.clock(), histograms, counters, metrics.thread_cpu_seconds())

    def report(self) -> StatsResponse:
        window = self.ring.window(self.read())
        h, c = window.histograms, window.counters
        batches = h["batch_size"]
        lower_bounds = (1, *(int(b) + 1 for b in batches.bounds[:-1]))  # batch sizes are integers
        hits, misses = int(c["cache_hits"]), int(c["cache_misses"])
        return StatsResponse(
            window_s=window.at,
            requests=int(h["request_latency"].count),
            requests_per_s=_per_second(h["request_latency"].count, window.at),
            latency=LatencySummary.of(h["request_latency"]),
            stages=Stages(
                queue=LatencySummary.of(h["queue_wait"]),
                preprocess=LatencySummary.of(h["preprocess"]),
                inference=LatencySummary.of(h["inference"]),
            ),
            batch_size=BatchSizes(
                inferences=int(batches.count),
                images=int(batches.total),
                mean=batches.mean(),
                buckets=[
                    BatchSizeBucket(smallest=low, largest=None if math.isinf(high) else int(high), inferences=int(n))
                    for low, high, n in zip(lower_bounds, batches.bounds, batches.bucket_counts(), strict=True)
                ],
            ),
            cache=CacheStats(
                hits=hits,
                misses=misses,
                hit_rate=_hit_rate(hits, misses),
                entries=sum(len(m.cache) for m in self.serving.models.values()),
            ),
            rejected={name.removeprefix("rejected_"): int(v) for name, v in c.items() if name.startswith("rejected_")},
            queue_depth=sum(m.batcher.depth for m in self.serving.models.values()),
            in_flight=self.serving.in_flight,
            cpu_cores={role: _per_second(seconds, window.at) for role, seconds in window.cpu_seconds.items()},
            models={
                name: ModelStats(
                    requests=int(h[f"request_latency/{name}"].count),
                    requests_per_s=_per_second(h[f"request_latency/{name}"].count, window.at),
                    latency=LatencySummary.of(h[f"request_latency/{name}"]),
                    cache_hit_rate=_hit_rate(c[f"cache_hits/{name}"], c[f"cache_misses/{name}"]),
                    queue_depth=m.batcher.depth,
                )
                for name, m in self.serving.models.items()
            },
        )


@asynccontextmanager
async def lifespan(app: FastAPI):
    # Runs inside the app's own lifespan, so the Serving exists; the first reading starts the window.
    app.state.live_stats = LiveStats(app.state.serving)
    yield


async def live_stats(request: Request) -> LiveStats:
    return request.app.state.live_stats


stats_router = APIRouter(tags=["operations"], lifespan=lifespan)


@stats_router.get(
    "/stats",
    response_model=StatsResponse,
    summary="Requests/s, latency quantiles, batch sizes and cache hit rate over the last minute",
)
async def stats(live: LiveStats = Depends(live_stats)) -> StatsResponse:
    return live.report()
