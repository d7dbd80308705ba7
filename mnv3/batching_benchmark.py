"""Stage 5's measurement: the unbatched and the batching server under the same load in one run, and
the in-process limit the batching server is held to.

Both servers run with the cache off, so every request is decoded and classified. The headline is the
two servers at the same concurrency, measured minutes apart on the same machine; the batching server
is also swept over concurrencies and driven open loop. The limit is measured while no server answers
requests, so it has the machine's cores to itself: for the engine the servers run (`--backend auto`), and
for onnxruntime on the FP32 and INT8 files beside it, so what the chosen engine gains shows end to end.

The served engine's limit brackets the batching server's headline run: its configurations are tried
before that server starts, and the fastest is measured right before the headline run and right after
it, the server up but idle (its CPU meanwhile is recorded); the limit is both turns pooled. So a drift
in the machine's speed (a shared VM's is large, at times within seconds) moves the limit as it moves the
server, and the two turns show how far it moved. Every limit decodes as the servers said they do (their
jpeg_draft setting, from GET /model).
"""

import os
from dataclasses import dataclass
from pathlib import Path

from mnv3 import loadtest, plots
from mnv3.artifacts import BATCH_SIZE_HISTOGRAM_PNG, FP32_ONNX, LATENCY_PNG, THROUGHPUT_PNG
from mnv3.backend_choice import Choice, explicit, resolve_auto
from mnv3.limit import LimitResult, fastest, measure_again, pooled, run_limit, try_configurations
from mnv3.loadtest import LoadResult

MIN_SWEEP_REQUESTS = 32  # even at concurrency 1, enough requests for a median
NO_BATCHING, BATCHING = "no_batching", "batching"


@dataclass(frozen=True)
class BatchingPlan:
    """What stage 5 measures: its flags, after the --quick defaults are filled in."""

    concurrency: int  # the headline: both servers at this concurrency
    requests: int  # closed-loop requests at `concurrency`; other sweep points get proportionally fewer
    sweep: tuple[int, ...]
    batch_window_ms: float
    max_batch_size: int
    open_loop_fraction: float  # of the batching server's closed-loop req/s at `concurrency`
    open_loop_seconds: float
    limit_images: int
    limit_batch_sizes: tuple[int, ...]
    limit_thread_splits: tuple[tuple[int, int], ...]
    limit_confirm_passes: int
    server_options: dict  # tuning flags both servers get (threads, deadline)
    start_timeout_s: float

    @property
    def concurrencies(self) -> list[int]:
        return sorted(set(self.sweep) | {self.concurrency})

    def requests_at(self, concurrency: int) -> int:
        if concurrency == self.concurrency:
            return self.requests
        return max(round(self.requests * concurrency / self.concurrency), MIN_SWEEP_REQUESTS)

    @property
    def batching_options(self) -> dict:
        """The batching server's flags (cache off, so every request is decoded and classified)."""
        return self.server_options | {
            "cache_size": 0,
            "batch_window_ms": self.batch_window_ms,
            "max_batch_size": self.max_batch_size,
        }

    def title(self) -> str:
        return f"window {self.batch_window_ms:g} ms, max batch {self.max_batch_size}, cache off"


@dataclass(frozen=True)
class BatchingResult:
    plan: BatchingPlan
    baseline: LoadResult  # the unbatched server at plan.concurrency
    baseline_settings: dict  # what that server said it ran with (GET /model)
    points: dict[int, LoadResult]  # the batching server, closed loop, per concurrency
    batching_settings: dict
    open_loop: LoadResult
    limit_turns: tuple[LimitResult, LimitResult]  # the served engine's fastest configuration, measured right
    # before and right after the headline run, the batching server idle
    server_cpu_s_during_limit_turns: float  # what that idle server spent meanwhile (its /metrics)
    grid: list[LimitResult]  # every configuration tried
    other_limits: dict[str, tuple[LimitResult, list[LimitResult]]]  # (limit, grid) of each other engine

    @property
    def limit(self) -> LimitResult:
        """The served engine's limit: both of its turns, pooled."""
        return pooled(*self.limit_turns)

    @property
    def headline(self) -> LoadResult:
        return self.points[self.plan.concurrency]

    @property
    def speedup(self) -> float:
        return loadtest.ratio(self.headline.rps, self.baseline.rps)

    @property
    def of_limit(self) -> float:
        return loadtest.ratio(self.headline.rps, self.limit.images_per_s)

    @property
    def histogram(self) -> dict[str, int]:
        return loadtest.batch_size_histogram(self.headline.metrics)

    def rows(self, environment: dict) -> list[dict]:
        """The CSV rows: the unbatched server, the sweep (the headline row carries the ratios), the open
        loop, every limit configuration and the confirmed limit; each ends with `environment`."""
        ratios = {"speedup_vs_no_batching": self.speedup, "server_to_limit_ratio": self.of_limit}
        rows = [{"configuration": NO_BATCHING} | self.baseline.as_row() | self.baseline_settings]
        rows += [
            {"configuration": BATCHING}
            | result.as_row()
            | self.batching_settings
            | (ratios if concurrency == self.plan.concurrency else {})
            for concurrency, result in sorted(self.points.items())
        ]
        rows.append({"configuration": BATCHING} | self.open_loop.as_row() | self.batching_settings)
        limits = [(self.limit, self.grid, {"served": True} | self.turn_columns())]
        limits += [(limit, grid, {"served": False}) for limit, grid in self.other_limits.values()]
        for limit, grid, columns in limits:
            rows += [{"configuration": "in_process_limit", "mode": "in_process"} | r.as_row() for r in grid]
            rows.append(
                {"configuration": "in_process_limit_confirmed", "mode": "in_process"} | limit.as_row() | columns
            )
        return [row | environment for row in rows]

    def turn_columns(self) -> dict:
        before, after = self.limit_turns
        return {
            "images_per_s_before_headline": round(before.images_per_s, 2),
            "images_per_s_after_headline": round(after.images_per_s, 2),
            "server_cpu_s_during_limit_turns": round(self.server_cpu_s_during_limit_turns, 3),
        }

    def cpu_summary(self) -> str:
        """Where the gap to the limit goes: the CPU the server and the load client spent per request (on the
        same cores) against the limit's per image, the most the server could answer with every core busy,
        and how busy the cores were (the server's rate is about that ceiling times the busy share)."""
        cpu = self.headline.cpu_row()
        server, client = cpu["server_cpu_ms_per_request"], cpu["client_cpu_ms_per_request"]
        cores = os.cpu_count() or 1  # as the environment columns record it
        ceiling = 1000 * cores / (server + client)  # NaN where the server's CPU is not exported
        return (
            f"CPU per image: the server {server:.2f} ms + the load client {client:.2f} ms, the limit "
            f"{self.limit.cpu_ms_per_image:.2f} ms; with all {cores} cores busy the server "
            f"could answer at most {ceiling:.0f} req/s, {loadtest.ratio(ceiling, self.limit.images_per_s)} of the "
            f"limit; in the run the cores were {cpu['machine_cpu_busy']:.0%} busy"
        )

    def summary(self) -> str:
        c, limit = self.plan.concurrency, self.limit
        return "\n".join(
            [
                f"\nat concurrency {c}: {self.baseline.rps:.1f} req/s without batching -> "
                f"{self.headline.rps:.1f} req/s with batching ({self.speedup}x)",
                f"in-process limit of the served engine {limit.engine}: {limit.images_per_s:.1f} images/s (batch "
                f"{limit.batch_size}, intra-op {limit.intra_op_threads}, decode threads {limit.decode_threads}; the "
                f"fastest of {len(self.grid)} configurations, measured again over {limit.images} images: "
                f"{self.limit_turns[0].images_per_s:.1f} right before the headline run, "
                f"{self.limit_turns[1].images_per_s:.1f} right after it, the idle server meanwhile using "
                f"{self.server_cpu_s_during_limit_turns:.2f} s of CPU); the server reaches {self.of_limit} of it",
                self.cpu_summary(),
                *[
                    f"in-process limit of {name}: {other.images_per_s:.1f} images/s (the served engine's is "
                    f"{loadtest.ratio(limit.images_per_s, other.images_per_s)}x)"
                    for name, (other, _) in self.other_limits.items()
                ],
                f"batches at concurrency {c} (size bucket: count): {self.histogram}",
                f"open loop, latency from each request's scheduled send time: {self.open_loop.summary()}",
            ]
        )


def closed_loop(
    url: str, bodies: list, concurrency: int, count: int, configuration: str, client=loadtest.PredictClient
) -> LoadResult:
    """One closed-loop run through a fresh `client(url)` with the server's metrics for it, printed as it is measured."""
    result = loadtest.run_with_metrics(
        url,
        lambda send: loadtest.run_closed_loop(
            send, bodies, concurrency, count, desc=f"{configuration} c={concurrency}"
        ),
        client,
    )
    print(f"{configuration}: {result.summary()}")
    return result


def run_batching_benchmark(model: Path, bodies: list[bytes], plan: BatchingPlan) -> BatchingResult:
    """The unbatched server; the served engine's limit configurations; the batching server: the sweep, the
    headline run between two turns of the served engine's limit, then open loop; the other engines'
    limits. No limit runs while a server answers requests."""
    unbatched = plan.server_options | {"cache_size": 0, "max_batch_size": 1}
    with loadtest.ServerProcess(model, plan.start_timeout_s, **unbatched) as url:
        loadtest.warm_up(url, bodies, plan.concurrency)
        baseline_settings = loadtest.server_settings(url)
        baseline = closed_loop(url, bodies, plan.concurrency, plan.requests, NO_BATCHING)

    limit_bodies = bodies[: plan.limit_images]
    # Every limit's grid: the same photos, decoded as the servers said they do, over the plan's configurations.
    grid_settings = {
        "bodies": limit_bodies,
        "jpeg_draft": baseline_settings["server_jpeg_draft"],
        "batch_sizes": plan.limit_batch_sizes,
        "thread_splits": plan.limit_thread_splits,
    }

    def limit_of(name: str, engine: Choice) -> tuple[LimitResult, list[LimitResult]]:
        return run_limit(
            name, engine, **grid_settings, confirm_passes=plan.limit_confirm_passes, desc=f"in-process limit, {name}"
        )

    (served_name, served), *others = limit_engines(model).items()
    served_grid = try_configurations(served_name, served, **grid_settings, desc=f"in-process limit, {served_name}")

    with loadtest.ServerProcess(model, plan.start_timeout_s, **plan.batching_options) as url:
        batching_settings = loadtest.server_settings(url)
        loadtest.warm_up(url, bodies, plan.concurrency)

        def limit_turn(configuration: LimitResult) -> tuple[LimitResult, float]:
            """The configuration measured again, and the CPU seconds the idle server spent meanwhile."""
            server_cpu_s = read_process_cpu_s(url)
            turn = measure_again(configuration, served, limit_bodies, plan.limit_confirm_passes)
            return turn, read_process_cpu_s(url) - server_cpu_s

        sweep = [c for c in plan.concurrencies if c != plan.concurrency]
        points = {c: closed_loop(url, bodies, c, plan.requests_at(c), BATCHING) for c in sweep}
        limit_before, idle_before = limit_turn(fastest(served_grid))
        points[plan.concurrency] = closed_loop(url, bodies, plan.concurrency, plan.requests, BATCHING)
        limit_after, idle_after = limit_turn(limit_before)
        rate = plan.open_loop_fraction * points[plan.concurrency].rps
        open_loop = loadtest.run_with_metrics(
            url,
            lambda send: loadtest.run_open_loop(
                send, bodies, rate, plan.open_loop_seconds, max_in_flight=plan.concurrency, desc="open loop"
            ),
        )
        print(f"batching, open loop: {open_loop.summary()}")

    other_limits = {name: limit_of(name, engine) for name, engine in others}
    return BatchingResult(
        plan,
        baseline,
        baseline_settings,
        dict(sorted(points.items())),
        batching_settings,
        open_loop,
        (limit_before, limit_after),
        idle_before + idle_after,
        served_grid,
        other_limits,
    )


def read_process_cpu_s(url: str) -> float:
    """The server process's CPU seconds so far (the standard process_cpu_seconds_total of its /metrics)."""
    return loadtest.read_metrics(url)[("process_cpu_seconds_total", "")]


def limit_engines(model: Path) -> dict[str, Choice]:
    """{name: engine} whose in-process limit stage 5 measures: first what `--backend auto` serves for
    `model` (as the servers do), then onnxruntime on the FP32 file beside it and on `model`, each once."""
    engines = {}
    fp32 = model.parent / FP32_ONNX
    for engine in (resolve_auto(model), explicit(fp32, "onnxruntime"), explicit(model, "onnxruntime")):
        if engine.path.is_file() and engine.variant not in engines:
            engines[engine.variant] = engine
    return engines


def plot_batching(result: BatchingResult, results_dir: Path) -> None:
    """Throughput and latency over concurrency (the unbatched server as one point), and the batch sizes
    at the headline concurrency."""
    plan, title = result.plan, result.plan.title()
    concurrencies = sorted(result.points)
    closed = [result.points[c] for c in concurrencies]
    plots.plot_over_concurrency(
        results_dir / THROUGHPUT_PNG,
        concurrencies,
        {"batching": [r.rps for r in closed]},
        "requests / s",
        f"Throughput ({title})",
        points={"no batching": (plan.concurrency, result.baseline.rps)},
        level=("in-process limit", result.limit.images_per_s),
    )
    plots.plot_over_concurrency(
        results_dir / LATENCY_PNG,
        concurrencies,
        {
            f"batching {name[:3]}": [getattr(r.latency, name, float("nan")) for r in closed]
            for name in ("p50_ms", "p95_ms", "p99_ms")
        },
        "round trip (ms)",
        f"Latency, closed loop ({title})",
        points={"no batching p50": (plan.concurrency, getattr(result.baseline.latency, "p50_ms", float("nan")))},
        log_y=True,
    )
    histogram = result.histogram
    plots.plot_bars(
        results_dir / BATCH_SIZE_HISTOGRAM_PNG,
        bucket_labels(list(histogram)),
        list(histogram.values()),
        "batch size",
        "batches",
        f"Batch sizes at concurrency {plan.concurrency} ({title})",
    )


def bucket_labels(bounds: list[str]) -> list[str]:
    """Prometheus upper bounds ("1", "2", "4", .., "+Inf") as the batch sizes each bucket holds."""
    labels, low = [], 1
    for bound in bounds:
        if bound == "+Inf":
            labels.append(f">{low - 1}")
            continue
        high = int(float(bound))
        labels.append(str(high) if high == low else f"{low}-{high}")
        low = high + 1
    return labels
