"""GET /stats's windowed math: histogram quantiles as Prometheus estimates them, bucket differences, the
ring of readings, and the endpoint against a real server."""

import os
import time
from types import SimpleNamespace

import numpy as np
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, Counter, Histogram

from mnv3.photos import load_images
from mnv3.server import ServerConfig, create_app
from mnv3.stats import HISTOGRAMS, HistogramReading, LiveStats, read_histogram
from mnv3.thread_cpu import ENGINE_AND_OTHER, EVENT_LOOP, INFERENCE, PREPROCESS, ROLES

pytestmark = pytest.mark.integration

BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, float("inf"))


def histogram(values, labels=()):
    h = Histogram("h", "test", list(labels), registry=CollectorRegistry())
    for v in values:
        (h.labels(*labels) if labels else h).observe(v)
    return h


def test_quantile_interpolates_linearly_inside_the_bucket_holding_the_rank():
    reading = read_histogram(histogram([0.2] * 10 + [0.6] * 30))  # 10 in (0.1, 0.25], 30 in (0.5, 0.75]
    assert reading.bounds == BOUNDS
    # p20: rank 8 of the 10 in (0.1, 0.25]; p75: rank 30 = 20th of the 30 in (0.5, 0.75]
    assert reading.quantile(0.2) == pytest.approx(0.1 + 0.15 * 8 / 10)
    assert reading.quantile(0.75) == pytest.approx(0.5 + 0.25 * 20 / 30)
    assert reading.mean() == pytest.approx((10 * 0.2 + 30 * 0.6) / 40)


@pytest.mark.parametrize("q", [0.5, 0.95, 0.99])
def test_the_estimate_is_in_the_bucket_of_the_exact_quantile(q):
    values = np.random.default_rng(4).lognormal(np.log(0.3), 1.0, 5000)
    estimate = read_histogram(histogram(values)).quantile(q)
    exact = np.quantile(values, q, method="inverted_cdf")
    bucket = np.searchsorted(BOUNDS, exact)  # index of the first bound >= exact
    lower = BOUNDS[bucket - 1] if bucket else 0.0
    assert lower <= estimate <= BOUNDS[bucket]


def test_ranks_past_the_last_finite_bound_report_that_bound_and_no_observations_report_none():
    assert read_histogram(histogram([20.0, 30.0])).quantile(0.5) == 10.0
    assert read_histogram(histogram([])).quantile(0.5) is None
    assert read_histogram(histogram([])).mean() is None
    with pytest.raises(ValueError):
        read_histogram(histogram([1.0])).quantile(0)


def test_label_sets_are_summed_and_differences_count_what_happened_in_between():
    h = histogram([], labels=("model",))
    h.labels("fp32").observe(0.2)
    h.labels("int8").observe(0.6)
    earlier = read_histogram(h)
    assert earlier.count == 2 and earlier.total == pytest.approx(0.8)
    h.labels("int8").observe(3.0)
    h.labels("fp32").observe(0.2)
    between = read_histogram(h) - earlier
    assert between.count == 2 and between.total == pytest.approx(3.2)
    assert sum(between.bucket_counts()) == 2
    assert between.bucket_counts()[BOUNDS.index(0.25)] == 1 and between.bucket_counts()[BOUNDS.index(5.0)] == 1
    with pytest.raises(ValueError):
        HistogramReading((1.0, float("inf")), (0, 0), 0) - earlier


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class FakeCache:
    def __init__(self):
        self.hits = self.misses = 0

    def __len__(self):
        return 7


def fake_serving():
    """What LiveStats reads of a Serving: real prometheus metrics, and the live counts of its one model."""
    registry = CollectorRegistry()
    metrics = SimpleNamespace(rejections=Counter("rejections", "r", ["reason"], registry=registry))
    for name in HISTOGRAMS:
        buckets = (1, 2, 4, 8, 16, 32, 64, 128) if name == "batch_size" else Histogram.DEFAULT_BUCKETS
        setattr(metrics, name, Histogram(name, name, buckets=buckets, registry=registry))
    cpu_seconds = dict.fromkeys(ROLES, 0.0)  # the process's so far, by thread role: tests advance it
    metrics.thread_cpu_seconds = lambda: dict(cpu_seconds)
    model = SimpleNamespace(cache=FakeCache(), batcher=SimpleNamespace(depth=3), metrics=metrics)  # one model
    return SimpleNamespace(metrics=metrics, models={"only": model}, in_flight=5, cpu_seconds=cpu_seconds)


def request(serving, latency_s, batch=None, hit=False):
    serving.metrics.request_latency.observe(latency_s)
    cache = serving.models["only"].cache
    if hit:
        cache.hits += 1
    else:
        cache.misses += 1
        serving.metrics.batch_size.observe(batch)


def test_the_window_covers_the_last_minute_only():
    serving, clock = fake_serving(), Clock()
    live = LiveStats(serving, window_s=60, spacing_s=1, clock=clock)
    for _ in range(30):  # 30 slow requests, then a minute of polling and 10 fast ones
        request(serving, 2.0, batch=8)
    serving.cpu_seconds[PREPROCESS] += 50.0  # busy decoding before the window
    clock.now += 1
    live.report()
    for second in range(70):
        clock.now += 1
        serving.cpu_seconds[PREPROCESS] += 0.5  # half a core decoding, a tenth on HTTP, every second
        serving.cpu_seconds[EVENT_LOOP] += 0.1
        if second >= 60:
            request(serving, 0.02, batch=1, hit=second % 2 == 0)
        stats = live.report()
    assert 60 <= stats.window_s < 61
    assert stats.requests == 10 and stats.requests_per_s == pytest.approx(10 / stats.window_s)
    assert 10 <= stats.latency.p99_ms <= 25 and stats.latency.mean_ms == pytest.approx(20)
    assert (stats.cache.hits, stats.cache.misses, stats.cache.hit_rate) == (5, 5, 0.5)
    assert stats.batch_size.inferences == 5 and stats.batch_size.images == 5
    assert [(b.smallest, b.largest, b.inferences) for b in stats.batch_size.buckets][:4] == [
        (1, 1, 5),
        (2, 2, 0),
        (3, 4, 0),
        (5, 8, 0),
    ]
    assert stats.batch_size.buckets[-1].largest is None
    assert (stats.queue_depth, stats.in_flight, stats.cache.entries) == (3, 5, 7)
    assert stats.cpu_cores == pytest.approx({EVENT_LOOP: 0.1, PREPROCESS: 0.5, INFERENCE: 0, ENGINE_AND_OTHER: 0})
    only = stats.models["only"]  # a server of one model: its figures are the server's
    assert (only.requests, only.cache_hit_rate, only.queue_depth) == (10, 0.5, 3)
    assert only.latency == stats.latency and only.requests_per_s == stats.requests_per_s


def test_right_after_start_the_window_is_the_time_since_start():
    serving, clock = fake_serving(), Clock()
    live = LiveStats(serving, clock=clock)
    request(serving, 0.3, batch=2)
    serving.metrics.rejections.labels("queue_full").inc(4)
    clock.now += 5
    stats = live.report()
    assert stats.window_s == 5 and stats.requests == 1 and stats.rejected == {"queue_full": 4}
    assert stats.batch_size.mean == 2


def test_frequent_calls_keep_the_ring_bounded():
    serving, clock = fake_serving(), Clock()
    live = LiveStats(serving, window_s=60, spacing_s=1, clock=clock)
    for _ in range(10_000):  # one call every 50 ms for over 8 minutes
        clock.now += 0.05
        live.report()
    assert len(live.ring) <= 62


def test_after_a_long_pause_the_window_reaches_back_to_the_last_call_and_says_so():
    serving, clock = fake_serving(), Clock()
    live = LiveStats(serving, window_s=60, spacing_s=1, clock=clock)
    clock.now += 1
    live.report()
    clock.now += 300
    request(serving, 0.3, batch=1)
    clock.now += 300
    stats = live.report()
    assert stats.window_s == 600 and stats.requests == 1


def test_stats_endpoint_counts_what_the_server_did(fp32_model_path):
    images = load_images(3, seed=8)
    with TestClient(create_app(ServerConfig(model=fp32_model_path, cache_size=16))) as client:
        give_up = time.monotonic() + 60
        while client.get("/readyz").status_code != 200:
            assert time.monotonic() < give_up, "warm-up did not finish"
            time.sleep(0.05)
        for data in images + images[:1]:
            assert client.post("/predict", files={"file": ("p.jpg", data, "image/jpeg")}).status_code == 200
        assert (
            client.post("/predict", content=b"not an image", headers={"content-type": "image/jpeg"}).status_code == 400
        )
        stats = client.get("/stats").json()
    assert stats["requests"] == 5 and stats["requests_per_s"] > 0
    assert (stats["cache"]["hits"], stats["cache"]["misses"]) == (1, 4)
    assert stats["batch_size"]["images"] == 3
    assert {reason: count for reason, count in stats["rejected"].items() if count} == {"bad_input": 1}
    assert stats["latency"]["p50_ms"] > 0 and stats["queue_depth"] == 0 and stats["in_flight"] == 0
    # three images decoded and inferred: each kind of thread was busy, none more than the machine's cores
    cores = stats["cpu_cores"]
    assert set(cores) == set(ROLES) and all(cores[role] > 0 for role in (EVENT_LOOP, PREPROCESS, INFERENCE))
    assert sum(cores.values()) <= len(os.sched_getaffinity(0)) + 0.05


def test_with_two_models_the_stats_are_over_both(fp32_model_path, other_model_path):
    images = load_images(2, seed=9)
    config = ServerConfig(model=f"fp32={fp32_model_path}", extra_models=(f"shifted={other_model_path}",), cache_size=16)
    with TestClient(create_app(config)) as client:
        give_up = time.monotonic() + 60
        while client.get("/readyz").status_code != 200:
            assert time.monotonic() < give_up, "warm-up did not finish"
            time.sleep(0.05)
        for model, data in (
            ("fp32", images[0]),
            ("shifted", images[0]),
            ("shifted", images[1]),
            ("shifted", images[1]),
        ):
            answer = client.post("/predict", params={"model": model}, files={"file": ("p.jpg", data, "image/jpeg")})
            assert answer.status_code == 200
        models = client.get("/models").json()["models"]
        stats = client.get("/stats").json()
    assert stats["requests"] == 4 and stats["batch_size"]["images"] == 3
    assert (stats["cache"]["hits"], stats["cache"]["misses"]) == (1, 3)
    assert stats["cache"]["entries"] == sum(m["cache"]["entries"] for m in models) == 3
    assert stats["queue_depth"] == 0
    each = stats["models"]
    assert list(each) == ["fp32", "shifted"]
    assert (each["fp32"]["requests"], each["fp32"]["cache_hit_rate"]) == (1, 0)
    assert (each["shifted"]["requests"], each["shifted"]["cache_hit_rate"]) == (3, pytest.approx(1 / 3))
    assert each["shifted"]["requests_per_s"] == pytest.approx(3 * stats["requests_per_s"] / 4)
    assert each["fp32"]["latency"]["mean_ms"] > 0 and each["shifted"]["queue_depth"] == 0
