"""Load testing the mnv3 server: start and stop it, drive it closed- or open-loop, read its /metrics.

Closed loop is the seed's method: N requests from `concurrency` senders, each sending its next request
as soon as its last one returns. It measures throughput at a fixed concurrency, but a slow server also
slows the senders down, so the latency it reports is optimistic (coordinated omission). The open loop
fixes every send time in advance (Poisson arrivals) and measures each latency from the request's
scheduled send time, so a stalled server shows up as latency instead of as a politely reduced load.

Against a server started with --api-keys, every client here sends the key in MNV3_API_KEY (or the one
given) as `Authorization: Bearer`; an environment variable, not a flag, so the key stays out of `ps`
and shell history. A server started here inherits the environment, so MNV3_API_KEYS (its key file)
and MNV3_API_KEY together run any stage against a protected server.

The senders are coroutines on one event loop with aiohttp, not a thread each (the seed's thread pool):
on a machine the client shares with the server, every millisecond of CPU the client spends is taken from
the server under test, and hundreds of threads cost the client (and the cores) far more a request than
coroutines do.
A `send` is a coroutine function, `await send(body) -> (status, JSON or None)`; the load functions here
are plain blocking calls that run their senders on `client_loop()`.
"""

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Coroutine
from dataclasses import dataclass, field, replace
from typing import IO, Any, TypeVar
from urllib.parse import urlencode

import aiohttp
import numpy as np
import psutil
import requests
import uvloop
from prometheus_client.parser import text_string_to_metric_families

from mnv3.config import API_KEY_ENV, ServerConfig, flag, variable
from mnv3.latency import LatencyStats
from mnv3.preprocess import DEFAULT_DECODING, Decoding
from mnv3.progress import progress_bar
from mnv3.thread_cpu import ROLES

START_TIMEOUT_S = 120  # loading + warming an engine on a busy 2-core machine can take a while
# After SIGTERM the server may take its --shutdown-delay-s and --shutdown-timeout-s; this much more, then it is killed.
STOP_MARGIN_S = 15
REQUEST_TIMEOUT_S = 60
READY_POLL_S = 0.1
MAX_CONNECTIONS = 1024  # kept-alive client connections: more than any load here has senders
OUTPUT_TAIL_LINES = 20
# free_port's candidates start here: above Ray's default worker ports (10002-19999), which `ray start` refuses
# to share with a port it is given, and the ports services commonly listen on.
FREE_PORT_LOW = 20_000
SERVER_FIELDS = ("batch_size", "queue_ms", "preprocess_ms", "inference_ms")
TIME_HISTOGRAMS = {
    "request_ms": "mnv3_request_latency_seconds",
    "queue_ms": "mnv3_queue_wait_seconds",
    "preprocess_ms": "mnv3_preprocess_seconds",
    "inference_ms": "mnv3_inference_seconds",
}


# ---------------------------------------------------------------------------------------- the server


def auth_headers(api_key: str | None = None) -> dict[str, str]:
    """The header that carries `api_key` (default: $MNV3_API_KEY); none without a key."""
    api_key = api_key or os.environ.get(API_KEY_ENV)
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class ServerStartError(RuntimeError):
    """The server exited or never became ready. `output` holds the tail of what it printed."""

    def __init__(self, message: str, output: str = ""):
        super().__init__(message)
        self.output = output


class KeyRefused(RuntimeError):
    """A server started with --api-keys refused the key the load test reads its settings or metrics with."""


def get_as_admin(base_url: str, path: str, api_key: str | None = None) -> requests.Response:
    """GET `path` (/model, /metrics) with the load test's key: under --api-keys, one of the admin scope, as
    a load test both sends requests (infer) and reads /metrics."""
    response = requests.get(base_url + path, headers=auth_headers(api_key), timeout=10)
    if response.status_code in (401, 403):
        raise KeyRefused(
            f"GET {path} answered {response.status_code} ({response.json().get('detail', '')}): a load test reads "
            f"/model and /metrics as well as sending requests, so {API_KEY_ENV} must hold a key of the admin scope"
        )
    response.raise_for_status()
    return response


def free_port() -> int:
    """A loopback port nothing is bound to, for a server about to start. Chosen below the kernel's ephemeral
    range: a port from that range (what binding port 0 hands out) may be given to any process that binds port 0
    before the server binds this one, and Ray starts many such processes between the two."""
    candidates = range(FREE_PORT_LOW, ephemeral_ports()[0])
    for port in random.sample(candidates, min(100, len(candidates))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use
                continue
            return port
    with socket.socket() as s:  # every one tried was taken: fall back to one the kernel picks
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for port 0 binds (Linux's default where /proc does not say)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def wait_until_ready(base_url: str, timeout_s: float, check=lambda: None) -> bool:
    """Poll GET /readyz until it answers 200 (True) or `timeout_s` passes (False). `check()` runs before
    each poll and may raise, e.g. when the server process has died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        check()
        try:
            if requests.get(base_url + "/readyz", timeout=2).status_code == 200:
                return True
        except requests.RequestException:
            pass  # not listening yet
        time.sleep(READY_POLL_S)
    return False


def _server_setting(options: dict, name: str) -> float:
    """A server's setting as it reads it: from its flag (`options`), else from the environment it inherits,
    else its default."""
    value = options.get(name)
    if value is None:
        value = os.environ.get(variable(name))
    return float(getattr(ServerConfig, name) if value is None else value)


class ServerProcess:
    """`with ServerProcess(model, cache_size=0) as url:` a server on a free 127.0.0.1 port, stopped on exit.

    Keyword options become server flags (`max_batch_size=1` -> `--max-batch-size 1`); None keeps the
    server's default. `extra_models` are served besides `model` (each a further `--model`, as
    `ServerConfig.extra_models`). `module` is what runs: `mnv3.server`, or `mnv3.ray_serve` (a local Ray
    cluster). Entering returns once GET /readyz answers 200. Logging defaults to warnings only: an access-log
    line per request would cost the server CPU under load.
    """

    def __init__(
        self,
        model,
        start_timeout_s: float = START_TIMEOUT_S,
        log_level: str = "warning",
        extra_models: tuple[str, ...] = (),
        module: str = "mnv3.server",
        **options,
    ):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.command = [
            sys.executable,
            "-m",
            module,
            "--model",
            str(model),
            *(flag for extra in extra_models for flag in ("--model", str(extra))),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
        for name, value in (options | {"log_level": log_level}).items():
            if value is not None:
                self.command += [flag(name), str(value)]
        self.start_timeout_s = start_timeout_s
        # After SIGTERM the server serves on for its --shutdown-delay-s, then drains for its --shutdown-timeout-s.
        shutdown = [_server_setting(options, name) for name in ("shutdown_delay_s", "shutdown_timeout_s")]
        self.stop_timeout_s = sum(shutdown) + STOP_MARGIN_S
        self.process: subprocess.Popen | None = None
        self._log: IO[bytes] | None = None

    def __enter__(self) -> str:
        # Output goes to a file, not a pipe: a pipe nobody reads fills up and blocks the server.
        self._log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(
            self.command, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT
        )
        try:
            self._wait_until_ready()
        except BaseException:
            self.stop()
            raise
        return self.url

    def __exit__(self, *exc_info):
        self.stop()

    def _wait_until_ready(self):
        if wait_until_ready(self.url, self.start_timeout_s, self._raise_if_exited):
            return
        raise ServerStartError(
            f"server not ready after {self.start_timeout_s:g} s (is the machine overloaded? "
            f"raise --start-timeout): {' '.join(self.command)}",
            self.output_tail(),
        )

    def _raise_if_exited(self):
        if self.process.poll() is not None:
            output = self.output_tail()
            last_line = output.strip().splitlines()[-1] if output.strip() else "(no output)"
            raise ServerStartError(f"server exited with code {self.process.returncode}: {last_line}", output)

    def stop(self):
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # lets uvicorn finish in-flight requests and exit cleanly
            try:
                self.process.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(STOP_MARGIN_S)
        if self._log is not None and not self._log.closed:
            self._log.close()

    @property
    def pid(self) -> int:
        assert self.process is not None, "the server has not been started"
        return self.process.pid

    def output_tail(self, lines: int = OUTPUT_TAIL_LINES) -> str:
        if self._log is None:
            return ""  # never started
        self._log.seek(0)
        return "\n".join(self._log.read().decode(errors="replace").splitlines()[-lines:])


_T = TypeVar("_T")
_client_loop: asyncio.AbstractEventLoop | None = None
_client_loop_lock = threading.Lock()


def client_loop() -> asyncio.AbstractEventLoop:
    """The event loop every client here runs on: uvloop, in a daemon thread of its own, started on first use.
    One loop for the process, not one a run: aiohttp's sessions belong to the loop they were made on, every
    run's client shares it, and the callers stay plain blocking code."""
    global _client_loop
    with _client_loop_lock:
        if _client_loop is None:
            _client_loop = uvloop.new_event_loop()
            threading.Thread(target=_client_loop.run_forever, name="mnv3-load-client", daemon=True).start()
        return _client_loop


def on_client_loop(coroutine: Coroutine[Any, Any, _T]) -> _T:
    """Run `coroutine` on `client_loop()` and wait for its result (from any thread but that loop's own). If the
    wait ends otherwise (Ctrl-C), the coroutine is cancelled: a load's senders stop with the caller."""
    running = asyncio.run_coroutine_threadsafe(coroutine, client_loop())
    try:
        return running.result()
    except BaseException:
        running.cancel()
        raise


class PredictClient:
    """`await send(body) -> (status, JSON or None)` for POST /predict on `client_loop()`, over kept-alive
    connections (up to MAX_CONNECTIONS); `send.request(body)` is the same call, blocking, for code that is
    not a coroutine. Status is the HTTP status or the client exception's name; JSON only with a 200. Use one
    client for a run: closing it closes the connections that run opened.

    aiohttp, sending the multipart form a browser or curl sends (`PhotoForm`); not `requests` (which the
    seed used): its own layers cost a large share of a cache hit's round trip.
    """

    def __init__(
        self, base_url: str, timeout_s: float = REQUEST_TIMEOUT_S, model: str | None = None, api_key: str | None = None
    ):
        self.timeout_s = timeout_s
        self.headers = auth_headers(api_key)
        # ?model= picks one of a server's models; without it, the server's default model answers.
        self._path = "/predict" if model is None else f"/predict?{urlencode({'model': model})}"
        self._form = PhotoForm()
        self._upload_headers = self.headers | {"Content-Type": self._form.content_type}
        self._session = on_client_loop(self._open(base_url))

    async def _open(self, base_url: str) -> aiohttp.ClientSession:
        # created on the loop that will use it, as aiohttp requires
        return aiohttp.ClientSession(
            base_url,
            connector=aiohttp.TCPConnector(limit=MAX_CONNECTIONS),
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
        )

    async def __call__(self, body: bytes) -> tuple[str, dict | None]:
        return await self.post(self._path, data=self._form.body(body), headers=self._upload_headers)

    def request(self, *args) -> tuple[str, dict | None]:
        """One request (the arguments `send` takes), from plain blocking code."""
        return on_client_loop(self(*args))

    async def post(self, path: str, **request) -> tuple[str, dict | None]:
        """POST `path` with aiohttp's request keywords (data=, headers=): (status, JSON or None)."""
        headers = self.headers | request.pop("headers", {})
        try:
            async with self._session.post(path, headers=headers, **request) as response:
                if response.status != 200:
                    return str(response.status), None
                return "200", await response.json()
        except (aiohttp.ClientError, TimeoutError) as exc:
            return type(exc).__name__, None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        on_client_loop(self._session.close())


class PhotoForm:
    """The multipart/form-data body that uploads a JPEG photo in field `file`, as the page and curl do: the
    bytes aiohttp's FormData writes for it (tests/test_loadtest.py compares them), with one boundary for
    every body, joined in one step: FormData's writer, built anew for each request, cost the load client over
    a quarter of its CPU a request, on the cores it shares with the server under test."""

    def __init__(self):
        boundary = uuid.uuid4().hex
        self.content_type = f"multipart/form-data; boundary={boundary}"
        self._head = (
            f"--{boundary}\r\nContent-Type: image/jpeg\r\n"
            'Content-Disposition: form-data; name="file"; filename="image.jpg"\r\n\r\n'
        ).encode()
        self._tail = f"\r\n--{boundary}--\r\n".encode()

    def body(self, photo: bytes) -> bytes:
        return b"".join((self._head, photo, self._tail))


# ---------------------------------------------------------------------------------------- the load


@dataclass(frozen=True)
class LoadResult:
    mode: str  # "closed" or "open"
    concurrency: int  # closed: concurrent senders; open: the most requests in flight at once
    sent: int
    ok: int
    errors: dict  # status (HTTP code or exception name) -> count
    seconds: float  # first send to last response
    latency: LatencyStats | None  # successful requests only
    server: dict  # means of what the server reported per request, and how many were cache hits
    target_rps: float | None = None
    # open loop: the rate its random schedule drew (requests scheduled / seconds), which is what was offered:
    # a short run's draw can miss the target by a few percent either way
    offered_rps: float | None = None
    dropped: int = 0  # open loop: not sent, because the client fell too far behind its schedule
    metrics: dict = field(default_factory=dict)  # the server's /metrics for this run alone, if read
    client_cpu_s: float | None = None  # CPU the sending process spent during the run, if measured
    # Share of every core's time the machine spent busy during the run (server, client and anything else
    # on it), if measured: below 1, the cores had time the server did not use.
    machine_cpu_busy: float | None = None
    latencies_s: tuple[float, ...] = field(default=(), repr=False)  # every answer's, so that runs can be pooled

    @property
    def rps(self) -> float:
        return self.ok / self.seconds if self.seconds > 0 else 0.0

    @classmethod
    def pooled(cls, first: "LoadResult", *more: "LoadResult") -> "LoadResult":
        """Closed-loop runs of one configuration (turns) as one: requests, errors, seconds, the server's metrics
        and the client's CPU added up, so its req/s is the answers over the turns' seconds; latency percentiles
        over every answer; the server's per-request means weighted by answers; the cores' busy share by seconds."""
        runs = (first, *more)
        ok = sum(r.ok for r in runs)
        answers = [latency for r in runs for latency in r.latencies_s]
        errors, metrics = _added([r.errors for r in runs]), _added([r.metrics for r in runs])
        seconds = sum(r.seconds for r in runs)
        server = {
            key: _weighted_mean([(r.server[key], r.ok) for r in runs]) for key in first.server if key != "cache_hits"
        } | {"cache_hits": sum(r.server.get("cache_hits", 0) for r in runs)}
        client_cpu = [r.client_cpu_s for r in runs]
        busy = [(r.machine_cpu_busy, r.seconds) for r in runs]
        return replace(
            first,
            sent=sum(r.sent for r in runs),
            ok=ok,
            errors=errors,
            seconds=seconds,
            latency=LatencyStats.from_seconds(answers) if answers else None,
            server=server,
            metrics=metrics,
            client_cpu_s=None if None in client_cpu else sum(client_cpu),  # type: ignore[arg-type]
            machine_cpu_busy=None if any(b is None for b, _ in busy) else _weighted_mean(busy),
            latencies_s=tuple(answers),
        )

    @classmethod
    def from_samples(cls, mode, concurrency, samples, seconds, **extra) -> "LoadResult":
        """samples: (status, latency in s, JSON body) per request; status "dropped" = never sent."""
        ok = [(latency, payload) for status, latency, payload in samples if status == "200"]
        errors = Counter(status for status, _, _ in samples if status not in ("200", "dropped"))
        server = {f"mean_{key}": _mean([payload.get(key) for _, payload in ok]) for key in SERVER_FIELDS}
        server["cache_hits"] = sum(bool(payload.get("cache_hit")) for _, payload in ok)
        latency = LatencyStats.from_seconds([latency for latency, _ in ok]) if ok else None
        dropped = sum(status == "dropped" for status, _, _ in samples)
        return cls(
            mode,
            concurrency,
            len(samples) - dropped,
            len(ok),
            dict(errors),
            seconds,
            latency,
            server,
            dropped=dropped,
            latencies_s=tuple(latency for latency, _ in ok),
            **extra,
        )

    def as_row(self) -> dict:
        row = {
            "mode": self.mode,
            "concurrency": self.concurrency,
            "sent": self.sent,
            "ok": self.ok,
            "errors": sum(self.errors.values()),
            "errors_by_status": ";".join(f"{status}:{n}" for status, n in sorted(self.errors.items())),
            "seconds": round(self.seconds, 3),
            "req_per_s": round(self.rps, 2),
        }
        if self.target_rps is not None:
            row |= {
                "target_rps": round(self.target_rps, 2),
                "offered_rps": _round(self.offered_rps),
                "dropped": self.dropped,
            }
        nan = float("nan")
        latency = (self.latency or LatencyStats(nan, nan, nan, nan, 0)).as_row("latency_")
        server = {key: _round(value) for key, value in self.server.items()}
        return row | latency | server | (metrics_row(self.metrics) if self.metrics else {}) | self.cpu_row()

    def cpu_row(self) -> dict:
        """CPU per answered request: the server's over the run, split by what its threads did
        (`server_<role>_cpu_ms_per_request`, mnv3.thread_cpu's roles, which add up to it), and the load
        client's, which on a shared machine takes cores the server would otherwise have; and the share of the
        machine's cores busy during the run (`machine_cpu_busy`). NaN where not measured."""
        by_role = {role: self.metrics.get(("mnv3_thread_cpu_seconds_total", role)) for role in ROLES}
        # engine_and_other is the process's clock less the threads' read a moment before it: between two reads it
        # can go back by the microseconds of those moments, which is no CPU anyone spent.
        by_role = {role: None if seconds is None else max(0.0, seconds) for role, seconds in by_role.items()}
        # The roles are read from nanosecond CPU clocks; process_cpu_seconds_total counts 10-ms ticks, as coarse as
        # a whole run of a few dozen cache hits. It stands in only for a server without the roles' metric.
        measured = [seconds for seconds in by_role.values() if seconds is not None]
        spent = {"server": sum(measured) if measured else self.metrics.get(("process_cpu_seconds_total", ""))}
        spent |= {f"server_{role}": seconds for role, seconds in by_role.items()}
        spent |= {"client": self.client_cpu_s}
        nan = float("nan")
        return {
            f"{who}_cpu_ms_per_request": _round(1000 * cpu_s / self.ok) if cpu_s is not None and self.ok else nan
            for who, cpu_s in spent.items()
        } | {"machine_cpu_busy": nan if self.machine_cpu_busy is None else round(self.machine_cpu_busy, 3)}

    def summary(self) -> str:
        p = self.latency
        percentiles = f"p50 {p.p50_ms:.0f} / p95 {p.p95_ms:.0f} / p99 {p.p99_ms:.0f} ms" if p else "no successes"
        load = (
            f"{self.rps:.1f} req/s at concurrency {self.concurrency}"
            if self.target_rps is None
            else f"{self.rps:.1f} req/s answered of {self.offered_rps:.1f} offered "
            f"(the draw of {self.target_rps:.1f}/s)"
        )
        errors = f", {sum(self.errors.values())} errors ({self.errors})" if self.errors else ""
        dropped = f", {self.dropped} dropped" if self.dropped else ""
        return f"{load}, {percentiles}{errors}{dropped}"


def _mean(values):
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else float("nan")


def _added(counts: list[dict]) -> dict:
    """{key: the sum of its values} over dicts of counts."""
    total: defaultdict = defaultdict(int)
    for count in counts:
        for key, value in count.items():
            total[key] += value
    return dict(total)


def _weighted_mean(pairs) -> float:
    """The mean of values (NaN: not measured) given as (value, weight) pairs, over the measured ones."""
    pairs = [(value, weight) for value, weight in pairs if not np.isnan(value) and weight > 0]
    total = sum(weight for _, weight in pairs)
    return sum(value * weight for value, weight in pairs) / total if total else float("nan")


def ratio(numerator: float, denominator: float, digits: int = 2) -> float:
    return round(numerator / denominator, digits) if denominator else float("nan")


def _round(value):
    return round(value, 3) if isinstance(value, float) else value


def run_closed_loop(
    send, bodies: list, concurrency: int, count: int | None = None, desc: str | None = None
) -> LoadResult:
    """`count` requests (default: one per body, cycling; the i-th sends body i) from `concurrency` senders,
    each sending its next as soon as its last is answered."""
    count = len(bodies) if count is None else count

    async def load() -> tuple[list, float]:
        numbers, samples = iter(range(count)), []
        with progress_bar(total=count, desc=desc) as progress:

            async def sender():
                for i in numbers:  # shared: each request is taken by whichever sender is free first
                    start = time.perf_counter()
                    status, payload = await send(bodies[i % len(bodies)])
                    samples.append((status, time.perf_counter() - start, payload))
                    progress.update()

            start = time.perf_counter()
            await asyncio.gather(*(sender() for _ in range(concurrency)))
            return samples, time.perf_counter() - start

    samples, seconds = on_client_loop(load())
    return LoadResult.from_samples("closed", concurrency, samples, seconds)


def poisson_schedule(rate: float, seconds: float, max_requests: int, seed: int = 0) -> np.ndarray:
    """Send times (s after the start) of Poisson arrivals at `rate`/s, cut at `seconds` or `max_requests`."""
    times = np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, max_requests))
    return times[times < seconds]


def run_open_loop(
    send,
    bodies: list[bytes],
    rate: float,
    seconds: float,
    max_requests: int | None = None,
    max_in_flight: int = 256,
    max_lateness_s: float = 1.0,
    seed: int = 0,
    desc: str | None = None,
) -> LoadResult:
    """Poisson arrivals at `rate`/s for `seconds`; each latency counts from the scheduled send time.

    A request waits for a free slot when `max_in_flight` are outstanding (that wait is part of its
    latency); one that could not start within `max_lateness_s` of its scheduled time is dropped and
    counted, which keeps an overloaded run bounded in time.
    """
    if rate <= 0:
        raise ValueError(f"open-loop rate must be positive, got {rate}")
    max_requests = max_requests or int(rate * seconds * 2) + 10
    schedule = poisson_schedule(rate, seconds, max_requests, seed)

    async def load() -> tuple[list, float]:
        slots = asyncio.Semaphore(max_in_flight)

        async def timed(body, scheduled):
            async with slots:
                if time.perf_counter() - scheduled > max_lateness_s:
                    return "dropped", None, None
                status, payload = await send(body)
                return status, time.perf_counter() - scheduled, payload

        start, requests = time.perf_counter(), []
        # A task group: a load stopped midway (Ctrl-C) cancels the sends under way, and waits for them,
        # instead of leaving them to fail on a closed client.
        async with asyncio.TaskGroup() as group:
            for i, offset in enumerate(progress_bar(schedule, desc)):
                delay = start + offset - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                requests.append(group.create_task(timed(bodies[i % len(bodies)], start + offset)))
        return [request.result() for request in requests], time.perf_counter() - start

    samples, elapsed = on_client_loop(load())
    return LoadResult.from_samples(
        "open", max_in_flight, samples, elapsed, target_rps=rate, offered_rps=len(schedule) / seconds
    )


# ---------------------------------------------------------------------------------------- /metrics


def parse_metrics(text: str) -> dict[tuple[str, str], float]:
    """Prometheus text -> {(sample name, le bound, or `threads` role, or ""): value}, summed over any other
    labels (a histogram's buckets by bound, the thread CPU series by role, every other series in one)."""
    values: defaultdict[tuple[str, str], float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[(sample.name, sample.labels.get("le", sample.labels.get("threads", "")))] += sample.value
    return dict(values)


def read_metrics(base_url: str, api_key: str | None = None) -> dict[tuple[str, str], float]:
    return parse_metrics(get_as_admin(base_url, "/metrics", api_key).text)


def metrics_delta(before: dict, after: dict) -> dict:
    """What happened between two reads of the (cumulative) server metrics."""
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


def batch_size_histogram(metrics: dict) -> dict[str, int]:
    """Batches per bucket (not cumulative), keyed by the bucket's upper bound: {"1": .., "2": .., "+Inf": ..}."""
    cumulative = sorted((float(le), value) for (name, le), value in metrics.items() if name == "mnv3_batch_size_bucket")
    histogram, below = {}, 0.0
    for bound, value in cumulative:
        histogram["+Inf" if bound == float("inf") else f"{bound:g}"] = round(value - below)
        below = value
    return histogram


def metrics_row(metrics: dict) -> dict:
    """Server-side view of a run: batches, images per batch, mean time per stage, cache counters."""
    batches = metrics.get(("mnv3_batch_size_count", ""), 0.0)
    row = {
        "metrics_batches": round(batches),
        "metrics_mean_batch_size": _round(metrics.get(("mnv3_batch_size_sum", ""), 0.0) / batches)
        if batches
        else float("nan"),
    }
    for key, name in TIME_HISTOGRAMS.items():
        count = metrics.get((f"{name}_count", ""), 0.0)
        row[f"metrics_{key}"] = _round(1000 * metrics.get((f"{name}_sum", ""), 0.0) / count) if count else float("nan")
    row["metrics_cache_hits"] = round(metrics.get(("mnv3_cache_hits_total", ""), 0.0))
    row["metrics_cache_misses"] = round(metrics.get(("mnv3_cache_misses_total", ""), 0.0))
    return row


def warm_up(base_url: str, bodies: list, concurrency: int, client=PredictClient) -> None:
    """One untimed round at `concurrency`: the engine has met the batch sizes this load makes, so a timed run
    measures the steady state and a server measured first is not at a disadvantage. On connections of its own:
    a timed run's client opens its own, so every run's window includes setting up its connections, the same
    for every configuration compared (and for none of the in-process limit's).
    Only for a server whose cache is off: with it on, these bodies would be hits afterwards. `client(base_url)`
    makes the sender (default: POST /predict)."""
    with client(base_url) as send:
        run_closed_loop(send, bodies, concurrency, count=concurrency, desc="warm-up")


def run_with_metrics(base_url: str, run, client=PredictClient) -> LoadResult:
    """`run(send)` with a fresh `client(base_url)` (default: POST /predict); its result carries the server's
    metrics for just that run, the CPU this (sending) process spent on it, and how busy the machine's
    cores were."""
    before, client_cpu_before = read_metrics(base_url), time.process_time()
    machine_before = psutil.cpu_times()
    with client(base_url) as send:
        result = run(send)
    machine_busy = busy_share(machine_before, psutil.cpu_times())
    client_cpu_s = time.process_time() - client_cpu_before
    return replace(
        result,
        metrics=metrics_delta(before, read_metrics(base_url)),
        client_cpu_s=client_cpu_s,
        machine_cpu_busy=machine_busy,
    )


def busy_share(before, after) -> float | None:
    """The share of every core's time spent busy between two `psutil.cpu_times()` readings: all but idle
    and (where the system reports it) I/O wait, of the time the machine had its cores: a virtual machine's
    steal time, when the host ran something else, is neither busy nor idle here. None if no time passed."""
    elapsed = {name: getattr(after, name) - getattr(before, name) for name in before._fields}
    # guest time is already in user time
    total = (
        sum(elapsed.values()) - elapsed.get("guest", 0.0) - elapsed.get("guest_nice", 0.0) - elapsed.get("steal", 0.0)
    )
    waiting = elapsed["idle"] + elapsed.get("iowait", 0.0)
    return (total - waiting) / total if total > 0 else None


def server_settings(base_url: str, api_key: str | None = None) -> dict:
    """What the server says it runs with (GET /model), as CSV columns: the record never guesses defaults."""
    info = get_as_admin(base_url, "/model", api_key).json()
    return (
        {
            "server_model": info["model"],  # the file served (--backend auto may serve stage 2's choice) and its hash
            "server_backend": info["backend"],
            "server_backend_reason": info["backend_choice"]["reason"],
            "server_providers": " ".join(info["providers"]),
        }
        | {f"server_{name}_threads": n for name, n in info["threads"].items()}
        | {f"server_{name}": value for name, value in info["batching"].items()}
        | {"server_ort_spinning": info["ort_spinning"], "server_cache_size": info["cache"]["size"]}
        | {f"server_{name}": info["preprocessing"][name] for name in DEFAULT_DECODING.record()}
    )


def what_serves(settings: dict) -> str:
    """`server_settings`' answer to which file and engine serve, and why, for a stage to print."""
    model, backend, reason = (settings[f"server_{name}"] for name in ("model", "backend", "backend_reason"))
    return f"the server runs {model} on {backend}: {reason}"


def server_decoding(settings: dict) -> Decoding:
    """How a server said it decodes uploads (`server_settings`' columns), for a limit to decode alike."""
    return Decoding(**{name: settings[f"server_{name}"] for name in DEFAULT_DECODING.record()})
