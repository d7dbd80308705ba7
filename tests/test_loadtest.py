import asyncio
import os
import signal
import socket
import threading
import time
from collections import namedtuple
from dataclasses import replace

import aiohttp
import numpy as np
import pytest
import requests

from mnv3.batching_benchmark import bucket_labels
from mnv3.loadtest import (
    FREE_PORT_LOW,
    STOP_MARGIN_S,
    LoadResult,
    PhotoForm,
    PredictClient,
    ServerProcess,
    ServerStartError,
    batch_size_histogram,
    busy_share,
    ephemeral_ports,
    free_port,
    metrics_delta,
    metrics_row,
    on_client_loop,
    parse_metrics,
    poisson_schedule,
    run_closed_loop,
    run_open_loop,
    run_with_metrics,
)
from mnv3.photos import load_images
from mnv3.thread_cpu import EVENT_LOOP, INFERENCE, PREPROCESS, ROLES

pytestmark = pytest.mark.integration

SAMPLE_METRICS = """\
# HELP mnv3_batch_size requests per inference call
# TYPE mnv3_batch_size histogram
mnv3_batch_size_bucket{le="1.0"} 2.0
mnv3_batch_size_bucket{le="2.0"} 2.0
mnv3_batch_size_bucket{le="4.0"} 5.0
mnv3_batch_size_bucket{le="8.0"} 6.0
mnv3_batch_size_bucket{le="+Inf"} 6.0
mnv3_batch_size_count 6.0
mnv3_batch_size_sum 20.0
# HELP mnv3_inference_seconds one batched inference call
# TYPE mnv3_inference_seconds histogram
mnv3_inference_seconds_bucket{le="+Inf"} 6.0
mnv3_inference_seconds_count 6.0
mnv3_inference_seconds_sum 0.3
# HELP mnv3_cache_hits_total cache hits
# TYPE mnv3_cache_hits_total counter
mnv3_cache_hits_total{model="a"} 3.0
mnv3_cache_hits_total{model="b"} 4.0
# HELP mnv3_cache_misses_total cache misses
# TYPE mnv3_cache_misses_total counter
mnv3_cache_misses_total 20.0
"""


def test_metrics_parsing_keeps_the_thread_cpu_roles_apart():
    text = SAMPLE_METRICS + (
        "# HELP mnv3_thread_cpu_seconds_total CPU by role\n# TYPE mnv3_thread_cpu_seconds_total counter\n"
        'mnv3_thread_cpu_seconds_total{threads="preprocess"} 2.0\n'
        'mnv3_thread_cpu_seconds_total{threads="event_loop"} 0.5\n'
    )
    metrics = parse_metrics(text)
    assert metrics[("mnv3_thread_cpu_seconds_total", "preprocess")] == 2.0
    assert metrics[("mnv3_thread_cpu_seconds_total", "event_loop")] == 0.5


def test_metrics_parsing_gives_histogram_breakdown_and_counters():
    metrics = parse_metrics(SAMPLE_METRICS)
    assert batch_size_histogram(metrics) == {"1": 2, "2": 0, "4": 3, "8": 1, "+Inf": 0}
    row = metrics_row(metrics)
    assert row["metrics_batches"] == 6 and row["metrics_mean_batch_size"] == pytest.approx(20 / 6, abs=1e-3)
    assert row["metrics_inference_ms"] == pytest.approx(50.0)
    assert row["metrics_cache_hits"] == 7  # summed over label sets
    assert row["metrics_cache_misses"] == 20
    assert np.isnan(row["metrics_queue_ms"])  # absent histogram: no number, not a zero


def test_metrics_delta_isolates_one_run():
    before = parse_metrics(SAMPLE_METRICS)
    one_more_batch_of_8 = SAMPLE_METRICS.replace('le="8.0"} 6.0', 'le="8.0"} 7.0').replace(
        'le="+Inf"} 6.0\nmnv3_batch_size_count', 'le="+Inf"} 7.0\nmnv3_batch_size_count'
    )
    after = parse_metrics(one_more_batch_of_8)
    assert batch_size_histogram(metrics_delta(before, after)) == {"1": 0, "2": 0, "4": 0, "8": 1, "+Inf": 0}


def test_busy_share_counts_all_but_idle_and_io_wait_guest_time_once_and_no_stolen_time():
    fields = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal", "guest", "guest_nice")
    times = namedtuple("scputimes", fields)
    before = times(*[10.0] * len(fields))
    # 4 s of user time, 1 of which ran a guest (Linux counts it in user too), 1 s system, 2 s idle, 1 s I/O wait
    after = before._replace(user=14.0, guest=11.0, system=11.0, idle=12.0, iowait=11.0)
    assert busy_share(before, after) == pytest.approx(5 / 8)
    assert busy_share(before, before) is None  # no time passed: no share, not a division by zero
    # 2 s more stolen by a virtual machine's host: the machine had its cores 8 s, not 10
    assert busy_share(before, after._replace(steal=12.0)) == pytest.approx(5 / 8)
    # where the system reports neither I/O wait nor guest time (macOS: user, nice, system, idle)
    plain = namedtuple("scputimes", ("user", "nice", "system", "idle"))
    assert busy_share(plain(1.0, 0.0, 1.0, 1.0), plain(2.0, 0.0, 2.0, 4.0)) == pytest.approx(2 / 5)


def test_poisson_schedule_has_the_target_rate():
    times = poisson_schedule(rate=200.0, seconds=10.0, max_requests=10_000, seed=0)
    assert np.all(np.diff(times) > 0) and times[-1] < 10.0
    assert len(times) == pytest.approx(2000, rel=0.1)
    assert len(poisson_schedule(rate=200.0, seconds=10.0, max_requests=50)) == 50  # the count bound wins


def fake_server(service_s: float, statuses=("200",)):
    """A `send` that takes `service_s` and answers one request at a time, like a one-worker server."""
    lock, calls = asyncio.Lock(), []

    async def send(body):
        async with lock:
            calls.append(body)
            status = statuses[(len(calls) - 1) % len(statuses)]
            await asyncio.sleep(service_s)
        return status, {"batch_size": 1, "queue_ms": 0.0, "preprocess_ms": 1.0, "inference_ms": 2.0, "cache_hit": False}

    return send, calls


def test_closed_loop_counts_and_errors_by_status():
    send, calls = fake_server(0.001, statuses=("200", "200", "503"))
    result = run_closed_loop(send, [b"a", b"b"], concurrency=3, count=9)
    assert len(calls) == 9 and set(calls) == {b"a", b"b"}
    assert (result.sent, result.ok, result.errors) == (9, 6, {"503": 3})
    assert result.latency.calls == 6
    # req/s counts answers, not sends; the one-at-a-time server makes the run at least 9 x 1 ms long
    assert result.rps == pytest.approx(6 / result.seconds) and result.seconds >= 9 * 0.001
    assert result.server["mean_inference_ms"] == 2.0 and result.server["cache_hits"] == 0


def test_pooled_turns_are_one_run_of_all_their_requests():
    fast, fast_calls = fake_server(0.001, statuses=("200", "503"))
    slow, _ = fake_server(0.004)
    turns = [
        replace(run_closed_loop(fast, [b"a"], 2, count=8), metrics={("m", ""): 3.0}, client_cpu_s=0.1),
        replace(run_closed_loop(slow, [b"b"], 2, count=4), metrics={("m", ""): 1.0}, client_cpu_s=0.2),
    ]
    turns[0] = replace(turns[0], server=turns[0].server | {"mean_inference_ms": 6.0}, machine_cpu_busy=0.5)
    turns[1] = replace(turns[1], machine_cpu_busy=1.0)
    pooled = LoadResult.pooled(*turns)
    assert (pooled.sent, pooled.ok, pooled.errors) == (12, 8, {"503": 4})
    assert pooled.seconds == pytest.approx(turns[0].seconds + turns[1].seconds)
    assert pooled.rps == pytest.approx(8 / pooled.seconds)  # the answers over the turns' seconds, not a mean of rates
    every_answer = sorted(turns[0].latencies_s + turns[1].latencies_s)
    assert pooled.latency.calls == 8 and pooled.latency.p50_ms == pytest.approx(1000 * np.median(every_answer))
    assert pooled.server["mean_inference_ms"] == pytest.approx((4 * 6.0 + 4 * 2.0) / 8)  # weighted by answers
    assert pooled.metrics == {("m", ""): 4.0} and pooled.client_cpu_s == pytest.approx(0.3)
    busy = (0.5 * turns[0].seconds + 1.0 * turns[1].seconds) / pooled.seconds
    assert pooled.machine_cpu_busy == pytest.approx(busy)
    assert LoadResult.pooled(turns[0], replace(turns[1], client_cpu_s=None)).client_cpu_s is None


def test_interrupting_a_load_cancels_its_senders():
    # Ctrl-C reaches the thread that waits for the load; the senders run on the client loop's own thread.
    cancelled = threading.Event()

    async def sender():
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    # Python's own Ctrl-C handler: a process started as a background job (`make test &`) inherits SIGINT ignored.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(0.2, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            on_client_loop(sender())
    finally:
        signal.signal(signal.SIGINT, previous)
    assert cancelled.wait(5), "the sender kept running after the interrupt"


def test_an_open_loop_stopped_midway_stops_the_sends_under_way():
    # They were tasks of their own: left running after Ctrl-C, each failed on the closed client, thousands of
    # "Task exception was never retrieved" tracebacks at stage 5's rates.
    cancelled = []

    async def send(body):
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(body)
            raise

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # see the test above
    try:
        threading.Timer(0.3, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            run_open_loop(send, [b"x"], rate=100.0, seconds=10)
    finally:
        signal.signal(signal.SIGINT, previous)

    async def sends_left() -> int:
        await asyncio.sleep(0.1)  # the load's cancel lands first
        return len(asyncio.all_tasks()) - 1  # but this one

    assert on_client_loop(sends_left()) == 0 and len(cancelled) >= 5


def test_open_loop_latency_counts_from_the_scheduled_send_time():
    # 10 requests scheduled within ~10 ms on a server that serves one per 20 ms: the k-th waits for the
    # k before it. A closed-loop client would report ~20 ms each; from the schedule it is ~20*(k+1) ms.
    send, calls = fake_server(0.02)
    result = run_open_loop(
        send, [b"x"], rate=1000.0, seconds=0.01, max_requests=10, max_in_flight=10, max_lateness_s=10.0
    )
    n = result.sent
    assert n == len(calls) >= 5 and result.dropped == 0 and result.ok == n
    assert result.latency.p99_ms >= 0.8 * 20 * n
    assert result.latency.mean_ms >= 0.8 * 20 * (n + 1) / 2
    assert result.target_rps == 1000.0 and result.mode == "open"
    # what the random draw offered: its requests over the run's seconds, not the target it was drawn at
    assert result.offered_rps == n / 0.01 and result.as_row()["offered_rps"] == n / 0.01
    assert f"of {n / 0.01:.1f} offered (the draw of 1000.0/s)" in result.summary()


def test_open_loop_drops_what_it_cannot_send_in_time():
    send, calls = fake_server(0.02)
    result = run_open_loop(
        send, [b"x"], rate=1000.0, seconds=0.01, max_requests=10, max_in_flight=1, max_lateness_s=0.03
    )
    assert result.dropped > 0 and result.sent == len(calls) and result.sent + result.dropped >= 5


def test_server_process_serves_and_stops(fp32_model_path):
    bodies = load_images(8)
    server = ServerProcess(fp32_model_path, cache_size=0, max_batch_size=4, batch_window_ms=5)
    with server as url:
        with PredictClient(url) as send:
            result = run_closed_loop(send, bodies, concurrency=4)
        assert requests.get(url + "/metrics", timeout=5).status_code == 200
    assert server.process.returncode is not None  # stopped, not orphaned
    assert (result.ok, result.errors) == (8, {})
    stats = result.latency
    assert 0 < stats.p50_ms <= stats.p95_ms <= stats.p99_ms
    assert 1 <= result.server["mean_batch_size"] <= 4 and result.server["mean_inference_ms"] > 0
    with pytest.raises(requests.ConnectionError):
        requests.get(url + "/readyz", timeout=2)


def test_a_measured_run_has_the_cpu_of_server_client_and_machine(fp32_model_path):
    bodies = load_images(16)
    cores = os.cpu_count() or 1
    with ServerProcess(fp32_model_path, cache_size=0) as url:
        start = time.perf_counter()
        result = run_with_metrics(url, lambda send: run_closed_loop(send, bodies, concurrency=8, count=320))
        window = time.perf_counter() - start
    row = result.as_row()
    assert (result.ok, result.errors) == (320, {})
    spent_s = [row[f"{who}_cpu_ms_per_request"] * result.ok / 1000 for who in ("server", "client")]
    assert all(0 < s <= cores * window for s in spent_s), spent_s
    # the server's CPU by what its threads did adds up to it, up to rounding to 0.001 ms
    by_role = {role: row[f"server_{role}_cpu_ms_per_request"] for role in ROLES}
    assert all(by_role[role] > 0 for role in (EVENT_LOOP, PREPROCESS, INFERENCE)), by_role
    assert sum(by_role.values()) == pytest.approx(row["server_cpu_ms_per_request"], abs=0.0025 * len(ROLES))
    # and agrees with the kernel's count of the process's CPU time, which is in 10-ms ticks
    ticks_s = result.metrics[("process_cpu_seconds_total", "")]
    assert row["server_cpu_ms_per_request"] * result.ok / 1000 == pytest.approx(ticks_s, abs=0.05)
    # the cores were busy at least while these two processes ran on them (anything else only adds to it)
    assert sum(spent_s) / (cores * window) - 0.03 <= row["machine_cpu_busy"] <= 1


def test_the_server_process_rarely_collects_garbage_under_load(fp32_model_path):
    # The collector as mnv3.server's main settles it: at Python's default thresholds this run, 32 requests in
    # flight, set off about a hundred collections on the server's event loop.
    bodies = load_images(32)
    with ServerProcess(fp32_model_path, cache_size=0) as url:
        result = run_with_metrics(url, lambda send: run_closed_loop(send, bodies, concurrency=32, count=640))
    assert (result.ok, result.errors) == (640, {})
    collections = result.metrics[("python_gc_collections_total", "")]  # every generation's, in the run
    assert collections <= 10


def test_photo_form_sends_the_bytes_aiohttps_form_data_writes():
    """What aiohttp.FormData().add_field("file", photo, filename="image.jpg", content_type="image/jpeg") sends
    (a MultipartWriter with that part), at the form's boundary."""
    photo = load_images(1)[0]
    form = PhotoForm()
    writer = aiohttp.MultipartWriter("form-data", boundary=form.content_type.rpartition("boundary=")[2])
    writer.append(photo, {"Content-Type": "image/jpeg"}).set_content_disposition(
        "form-data", name="file", filename="image.jpg"
    )
    assert writer.content_type == form.content_type
    assert asyncio.run(writer.as_bytes()) == form.body(photo)


def test_predict_client_reports_a_refused_connection_as_a_status():
    with PredictClient(f"http://127.0.0.1:{free_port()}") as send:  # nothing listens there
        status, payload = send.request(b"x")
    assert (status, payload) == ("ClientConnectorError", None)


def test_server_process_reports_why_the_server_failed(tmp_path):
    bad = tmp_path / "model.onnx"
    bad.write_bytes(b"not an onnx model")
    with pytest.raises(ServerStartError, match="exited with code 2") as info:
        with ServerProcess(bad):
            pass
    assert str(bad) in str(info.value)


def test_server_process_gives_up_after_its_start_timeout(fp32_model_path):
    server = ServerProcess(fp32_model_path, start_timeout_s=0.01)
    with pytest.raises(ServerStartError, match="not ready"):
        with server:
            pass
    assert server.process.returncode is not None


def test_server_process_waits_out_the_servers_drain_before_killing_it(monkeypatch):
    # SIGTERM gives in-flight requests the server's --shutdown-timeout-s (flag, else environment, else default).
    monkeypatch.delenv("MNV3_SHUTDOWN_TIMEOUT_S", raising=False)
    assert ServerProcess("m.onnx").stop_timeout_s == 30 + STOP_MARGIN_S
    assert ServerProcess("m.onnx", shutdown_timeout_s=90).stop_timeout_s == 90 + STOP_MARGIN_S
    monkeypatch.setenv("MNV3_SHUTDOWN_TIMEOUT_S", "45")
    assert ServerProcess("m.onnx").stop_timeout_s == 45 + STOP_MARGIN_S
    assert ServerProcess("m.onnx", shutdown_timeout_s=0).stop_timeout_s == STOP_MARGIN_S


def test_batch_size_buckets_are_labelled_with_the_sizes_they_hold():
    assert bucket_labels(["1", "2", "4", "8", "+Inf"]) == ["1", "2", "3-4", "5-8", ">8"]


def test_free_port_is_bindable_and_outside_the_range_port_0_binds_draw_from():
    # Else a process binding port 0 between the choice and the server's bind may take it (Ray's did).
    low, _ = ephemeral_ports()
    port = free_port()
    assert FREE_PORT_LOW <= port < low
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
