"""Stage 5's measurement: the unbatched and the batching server under the same load in one run, and
the in-process limit the batching server is held to.

Both servers run with the cache off, so every request is decoded and classified, and both are up at
once, each idle while the other is measured (the CPU it spends meanwhile is recorded). The headline is the
two servers at the same concurrency in turns, in mirrored order (unbatched, batching, batching,
unbatched), with a turn of the served engine's in-process limit before each round and after the last:

    limit  unbatched  batching  limit  batching  unbatched  limit

So the three figures compared (the unbatched server, the batching server and the limit, each its turns
pooled) are centred on the same moment of the run, and a steady drift in the machine's speed (a shared
VM's is large, at times within seconds) lands on all three alike. Each round's own ratios show how far
the machine moved: `python -m mnv3.goals` gives no verdict on a goal whose rounds differ too much and
disagree on it.

The limit is the same decode + preprocess + inference with no server (mnv3/limit.py), measured while no
server answers requests, so it has the machine's cores to itself: for the engine the servers run
(`--backend auto`; its configurations are tried before the sweep, the fastest few again in turns, and the
fastest of those is the one measured around the headline), and for onnxruntime on the FP32 and INT8 files
beside it, so what the chosen engine gains shows end to end. The batching server is also swept over
concurrencies and driven open loop. Every limit decodes as the servers said they do (their jpeg_draft and
resize_crop_only settings, from GET /model).
"""

import os
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

from mnv3 import loadtest, plots
from mnv3.artifacts import BATCH_SIZE_HISTOGRAM_PNG, FP32_ONNX, LATENCY_PNG, THROUGHPUT_PNG
from mnv3.backend_choice import Choice, explicit, resolve_auto
from mnv3.latency import turn_order
from mnv3.limit import LimitResult, fastest, measure_again, pooled, run_limit, try_configurations
from mnv3.loadtest import LoadResult
from mnv3.thread_cpu import ROLES

MIN_SWEEP_REQUESTS = 32  # even at concurrency 1, enough requests for a median
HEADLINE_TURNS = 2  # per server: both are measured in the headline's first half and again in its second
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
    headline_turns: list[tuple[str, int, LoadResult]]  # (NO_BATCHING or BATCHING, turn from 1, its run at
    # plan.concurrency), in the order taken
    other_server_cpu_s: list[float]  # per headline turn: what the other, idle server spent meanwhile
    baseline_settings: dict  # what the unbatched server said it ran with (GET /model)
    sweep: dict[int, LoadResult]  # the batching server, closed loop, at the other concurrencies
    batching_settings: dict
    open_loop: LoadResult
    limit_turns: list[LimitResult]  # the served engine's fastest configuration, measured before each round of
    # headline turns and after the last, both servers idle
    server_cpu_s_during_limit_turns: float  # what the idle servers spent meanwhile (their /metrics)
    grid: list[LimitResult]  # every configuration tried, one short pass each
    finalists: list[LimitResult]  # the grid's fastest, measured again in turns; the fastest of them is the limit's
    other_limits: dict[str, tuple[LimitResult, list[LimitResult], list[LimitResult]]]  # (limit, grid, finalists)
    # of each other engine

    def turns_of(self, configuration: str) -> list[LoadResult]:
        return [result for name, _, result in self.headline_turns if name == configuration]

    @property
    def baseline(self) -> LoadResult:
        """The unbatched server at plan.concurrency: its turns, pooled."""
        return LoadResult.pooled(*self.turns_of(NO_BATCHING))

    @property
    def headline(self) -> LoadResult:
        """The batching server at plan.concurrency: its turns, pooled."""
        return LoadResult.pooled(*self.turns_of(BATCHING))

    @property
    def points(self) -> dict[int, LoadResult]:
        """The batching server, closed loop, per concurrency (the headline's turns pooled)."""
        return dict(sorted((self.sweep | {self.plan.concurrency: self.headline}).items()))

    @property
    def limit(self) -> LimitResult:
        """The served engine's limit: all of its turns, pooled."""
        return pooled(*self.limit_turns)

    @property
    def speedup(self) -> float:
        return loadtest.ratio(self.headline.rps, self.baseline.rps)

    @property
    def of_limit(self) -> float:
        return loadtest.ratio(self.headline.rps, self.limit.images_per_s)

    def round_ratios(self) -> list[dict]:
        """Per round of headline turns: the batching server's req/s over the unbatched server's in that round,
        and over the limit's turns on either side of it. Apart, they show how far a ratio moved in the run."""
        rounds = zip(self.turns_of(BATCHING), self.turns_of(NO_BATCHING), pairwise(self.limit_turns), strict=True)
        return [
            {
                "speedup_vs_no_batching": loadtest.ratio(batching.rps, unbatched.rps),
                "server_to_limit_ratio": loadtest.ratio(batching.rps, pooled(*limits).images_per_s),
            }
            for batching, unbatched, limits in rounds
        ]

    @property
    def histogram(self) -> dict[str, int]:
        return loadtest.batch_size_histogram(self.headline.metrics)

    def rows(self, environment: dict) -> list[dict]:
        """The CSV rows: each headline turn (a batching turn carries its round's ratios), the unbatched
        server's turns pooled, the sweep (the headline concurrency's row is its turns pooled and carries the
        ratios), the open loop, every limit configuration, the served engine's limit turns and each confirmed
        limit; each ends with `environment`."""
        settings = {NO_BATCHING: self.baseline_settings, BATCHING: self.batching_settings}
        round_ratios = iter(self.round_ratios())
        rows = [
            {"configuration": name, "turn": turn}
            | result.as_row()
            | settings[name]
            | {"other_server_cpu_s": round(other_cpu_s, 3)}
            | (next(round_ratios) if name == BATCHING else {})
            for (name, turn, result), other_cpu_s in zip(self.headline_turns, self.other_server_cpu_s, strict=True)
        ]
        ratios = {"speedup_vs_no_batching": self.speedup, "server_to_limit_ratio": self.of_limit}
        rows.append({"configuration": NO_BATCHING, "turn": "all"} | self.baseline.as_row() | self.baseline_settings)
        rows += [
            {"configuration": BATCHING}
            | ({"turn": "all"} | ratios if concurrency == self.plan.concurrency else {})
            | result.as_row()
            | self.batching_settings
            for concurrency, result in self.points.items()
        ]
        rows.append({"configuration": BATCHING} | self.open_loop.as_row() | self.batching_settings)
        limit_turns = [
            {"configuration": "in_process_limit_turn", "mode": "in_process", "turn": turn, "served": True} | r.as_row()
            for turn, r in enumerate(self.limit_turns, 1)
        ]
        idle_cpu_s = round(self.server_cpu_s_during_limit_turns, 3)
        limits = [
            (
                self.limit,
                self.grid,
                self.finalists,
                limit_turns,
                {"served": True, "server_cpu_s_during_limit_turns": idle_cpu_s},
            )
        ]
        limits += [
            (limit, grid, finalists, [], {"served": False}) for limit, grid, finalists in self.other_limits.values()
        ]
        for limit, grid, finalists, turns, columns in limits:
            rows += [{"configuration": "in_process_limit", "mode": "in_process"} | r.as_row() for r in grid]
            rows += [
                {"configuration": "in_process_limit_finalist", "mode": "in_process"} | r.as_row() for r in finalists
            ]
            rows += turns
            rows.append(
                {"configuration": "in_process_limit_confirmed", "mode": "in_process"} | limit.as_row() | columns
            )
        return [row | environment for row in rows]

    def cpu_summary(self) -> str:
        """Where the gap to the limit goes: the CPU the server and the load client spent per request (on the
        same cores) against the limit's per image, the most the server could answer with every core busy,
        and how busy the cores were (the server's rate is about that ceiling times the busy share); then the
        server's CPU by what its threads did beside the limit's decoding and the rest."""
        cpu = self.headline.cpu_row()
        server, client = cpu["server_cpu_ms_per_request"], cpu["client_cpu_ms_per_request"]
        cores = os.cpu_count() or 1  # as the environment columns record it
        ceiling = 1000 * cores / (server + client)  # NaN where the server's CPU is not exported
        limit = self.limit
        limit_rest = limit.cpu_ms_per_image - limit.preprocess_cpu_ms_per_image
        by_role = ", ".join(f"{role} {cpu[f'server_{role}_cpu_ms_per_request']:.2f}" for role in ROLES)
        return (
            f"CPU per image: the server {server:.2f} ms + the load client {client:.2f} ms, the limit "
            f"{limit.cpu_ms_per_image:.2f} ms; with all {cores} cores busy the server "
            f"could answer at most {ceiling:.0f} req/s, {loadtest.ratio(ceiling, limit.images_per_s)} of the "
            f"limit; in the run the cores were {cpu['machine_cpu_busy']:.0%} busy\n"
            f"the server's CPU per image by thread ({by_role} ms) against the limit's (preprocess "
            f"{limit.preprocess_cpu_ms_per_image:.2f}, the rest {limit_rest:.2f} ms)"
        )

    def summary(self) -> str:
        c, limit = self.plan.concurrency, self.limit
        per_round = self.round_ratios()

        def rates(name: str) -> str:
            return " / ".join(f"{r.rps:.1f}" for r in self.turns_of(name))

        return "\n".join(
            [
                f"\nat concurrency {c}, in {len(per_round)} rounds of turns "
                f"({', '.join(f'{name} {turn}' for name, turn, _ in self.headline_turns)}): "
                f"{self.baseline.rps:.1f} req/s without batching ({rates(NO_BATCHING)}) -> "
                f"{self.headline.rps:.1f} req/s with batching ({rates(BATCHING)}): {self.speedup}x "
                f"(per round {' / '.join(str(r['speedup_vs_no_batching']) for r in per_round)}); the idle server "
                f"used at most {max(self.other_server_cpu_s):.2f} s of CPU in a turn of the other",
                f"in-process limit of the served engine {limit.engine}: {limit.images_per_s:.1f} images/s (batch "
                f"{limit.batch_size}, intra-op {limit.intra_op_threads}, decode threads {limit.decode_threads}; the "
                f"fastest of {len(self.grid)} configurations, one pass each, then of the {len(self.finalists)} fastest "
                f"in turns ({' / '.join(f'{r.images_per_s:.1f}' for r in self.finalists)}), measured again before "
                f"each round and after the last: "
                f"{' / '.join(f'{r.images_per_s:.1f}' for r in self.limit_turns)}, the idle servers meanwhile using "
                f"{self.server_cpu_s_during_limit_turns:.2f} s of CPU); the server reaches {self.of_limit} of it "
                f"(per round {' / '.join(str(r['server_to_limit_ratio']) for r in per_round)})",
                self.cpu_summary(),
                *[
                    f"in-process limit of {name}, after the servers: {other.images_per_s:.1f} images/s (the served "
                    "engine's, not timed in turns with it, is "
                    f"{loadtest.ratio(limit.images_per_s, other.images_per_s)}x)"
                    for name, (other, _, _) in self.other_limits.items()
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
    """Both servers up at once, each idle while the other or the limit is measured: the served engine's limit
    configurations; the batching server's sweep; the headline: HEADLINE_TURNS rounds at plan.concurrency,
    the unbatched and the batching server in mirrored order, a turn of the served engine's limit before each
    round and after the last; the batching server open loop. Then, the servers stopped, the other engines' limits."""
    unbatched = plan.server_options | {"cache_size": 0, "max_batch_size": 1}
    with (
        loadtest.ServerProcess(model, plan.start_timeout_s, **unbatched) as unbatched_url,
        loadtest.ServerProcess(model, plan.start_timeout_s, **plan.batching_options) as batching_url,
    ):
        servers = {NO_BATCHING: unbatched_url, BATCHING: batching_url}
        baseline_settings, batching_settings = (loadtest.server_settings(url) for url in servers.values())
        print(loadtest.what_serves(batching_settings))
        limit_bodies = bodies[: plan.limit_images]
        # Every limit's grid: the same photos, decoded as the servers said they do, over the plan's configurations.
        grid_settings: dict[str, Any] = {
            "bodies": limit_bodies,
            "decoding": loadtest.server_decoding(baseline_settings),
            "batch_sizes": plan.limit_batch_sizes,
            "thread_splits": plan.limit_thread_splits,
        }
        (served_name, served), *others = limit_engines(model).items()
        served_grid, finalists = try_configurations(
            served_name, served, **grid_settings, desc=f"in-process limit, {served_name}"
        )

        def servers_cpu_s() -> float:
            return sum(read_process_cpu_s(url) for url in servers.values())

        def limit_turn(configuration: LimitResult) -> tuple[LimitResult, float]:
            """The configuration measured again, and the CPU seconds the idle servers spent meanwhile."""
            cpu_s = servers_cpu_s()
            turn = measure_again(configuration, served, limit_bodies, plan.limit_confirm_passes)
            return turn, servers_cpu_s() - cpu_s

        def headline_turn(name: str, turn: int) -> tuple[tuple[str, int, LoadResult], float]:
            """One server's turn at plan.concurrency, and the CPU seconds the other, idle, spent meanwhile."""
            [other_url] = [url for other, url in servers.items() if other != name]
            cpu_s = read_process_cpu_s(other_url)
            result = closed_loop(servers[name], bodies, plan.concurrency, plan.requests, f"{name} turn {turn}")
            return (name, turn, result), read_process_cpu_s(other_url) - cpu_s

        loadtest.warm_up(batching_url, bodies, plan.concurrency)
        sweep = {
            c: closed_loop(batching_url, bodies, c, plan.requests_at(c), BATCHING)
            for c in plan.concurrencies
            if c != plan.concurrency
        }
        for url in servers.values():  # both start the headline warm, whatever ran on them before
            loadtest.warm_up(url, bodies, plan.concurrency)
        configuration = fastest(finalists)
        limits, turns = [limit_turn(configuration)], []
        for turn in range(1, HEADLINE_TURNS + 1):
            turns += [headline_turn(name, turn) for name in turn_order(list(servers), turn)]
            limits.append(limit_turn(configuration))
        headline_turns = [run for run, _ in turns]
        batching_turns = [result for name, _, result in headline_turns if name == BATCHING]
        rate = plan.open_loop_fraction * LoadResult.pooled(*batching_turns).rps
        open_loop = loadtest.run_with_metrics(
            batching_url,
            lambda send: loadtest.run_open_loop(
                send, bodies, rate, plan.open_loop_seconds, max_in_flight=plan.concurrency, desc="open loop"
            ),
        )
        print(f"batching, open loop: {open_loop.summary()}")

    other_limits = {
        name: run_limit(
            name, engine, **grid_settings, confirm_passes=plan.limit_confirm_passes, desc=f"in-process limit, {name}"
        )
        for name, engine in others
    }
    return BatchingResult(
        plan,
        headline_turns,
        [cpu_s for _, cpu_s in turns],
        baseline_settings,
        sweep,
        batching_settings,
        open_loop,
        [limit for limit, _ in limits],
        sum(cpu_s for _, cpu_s in limits),
        served_grid,
        finalists,
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
