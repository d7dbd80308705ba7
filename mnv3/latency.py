"""The latency harness the model stages use (the seed's method): warm-up, then timed calls of each
variant in turns, so that machine-load drift hits all variants alike and the ratios between them hold."""

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TypeVar

import numpy as np

WARMUP_CALLS = 10
TIMED_CALLS = 100
# Untimed calls at the start of every turn, for at least this long: see interleaved_benchmark.
TURN_WARMUP_S = 0.05
# settle(): the process counts as idle when its threads use under a fifth of a core over 10 ms.
SETTLE_WINDOW_S = 0.01
SETTLE_IDLE_SHARE = 0.2
SETTLE_MAX_S = 1.0
# The timed columns a model's ratios to the reference of an interleaved_benchmark are taken of.
RATIO_KEYS = ("mean_ms", "p50_ms", "per_image_ms", "per_image_p50_ms")
T = TypeVar("T")


@dataclass(frozen=True)
class Timing:
    """How many calls a benchmark makes. Batched calls are fewer: each one is `batch_size` images.
    `turn_warmup_s`: how long each turn of interleaved_benchmark calls a model untimed before timing it."""

    warmup: int = WARMUP_CALLS
    iters: int = TIMED_CALLS
    batch_warmup: int = 2
    batch_iters: int = 10
    turn_warmup_s: float = TURN_WARMUP_S


@dataclass(frozen=True)
class LatencyStats:
    mean_ms: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    calls: int

    @classmethod
    def from_seconds(cls, seconds) -> "LatencyStats":
        ms = np.asarray(seconds, dtype=np.float64) * 1000.0
        p50, p95, p99 = np.percentile(ms, [50, 95, 99])
        return cls(float(ms.mean()), float(p50), float(p95), float(p99), len(ms))

    def as_row(self, prefix: str = "") -> dict:
        return {
            f"{prefix}{key}": round(value, 3) if isinstance(value, float) else value
            for key, value in asdict(self).items()
        }


def settle(window_s: float = SETTLE_WINDOW_S, max_s: float = SETTLE_MAX_S) -> bool:
    """Wait until this process's threads are idle: CPU time over a `window_s` sleep under SETTLE_IDLE_SHARE of
    one core. True once they are; False if they were still busy after `max_s`.

    Why: onnxruntime's intra-op threads spin for tens of milliseconds after a call (its default), taking a
    core from whatever runs next in the process, so a model timed right after an onnxruntime session
    measured markedly slower than after a pause. Every model's turn starts on idle cores."""
    deadline = time.perf_counter() + max_s
    while time.perf_counter() < deadline:
        cpu = time.process_time()
        time.sleep(window_s)
        if time.process_time() - cpu < SETTLE_IDLE_SHARE * window_s:
            return True
    return False


def turn_order(items: Sequence[T], turn: int) -> list[T]:
    """`items` in the order of `turn` (from 1): as given in odd turns, reversed in even ones, so that a steady
    drift of the machine's speed lands on all of them alike over an even number of turns."""
    return list(items)[:: 1 if turn % 2 else -1]


def warm_up_turn(run, inputs, seconds: float) -> None:
    """Call `run(inputs)` untimed until `seconds` have passed, at least once."""
    end = time.perf_counter() + seconds
    run(inputs)
    while time.perf_counter() < end:
        run(inputs)


def interleaved_benchmark(
    runners: dict, images: np.ndarray, batch_size: int, timing: Timing, rounds: int = 5, reference: str | None = None
) -> dict:
    """Batch-1 latency stats and per-image ms at `batch_size` for each `run(batch) -> logits` in `runners`,
    measured in turns so that machine-load drift hits all alike (ratios between them are the result;
    `images` is a preprocessed (N, 3, H, W) array, and the batch cycles through it if N < batch_size).

    The timed calls are split into `rounds`; each round visits every model (in a rotated order) for its
    share of batch-1 and batch calls. Before a model's turn the process waits until the previous model's
    threads are idle (`settle`); then, for each kind of call, the model runs untimed for `timing.turn_warmup_s`
    (at least one call) before its timed calls.

    Why a warm-up by time, not one call: after the settle's idle gap (and the previous model's turn) a
    model's first calls run markedly slower on a shared VM (cold caches, most likely), by an amount that
    differs between engines (OpenVINO's INT8 more than onnxruntime's FP32). A turn of a few batch-1
    calls after a single untimed one then times the recovery, not the steady state the warm-up is for.

    With a `reference` (one of `runners`), every row also has `<key>_vs_<reference>` for each of RATIO_KEYS:
    the median over the rounds of the model's ratio to the reference in that round. Why per round: a
    neighbour's burst that lands on a few turns moves only those rounds' ratios, which the median leaves
    out, where the ratio of the whole run's means takes the burst in full against whichever models ran
    during it.
    """
    single = images[:1]
    batch = np.ascontiguousarray(images[np.arange(batch_size) % len(images)])
    rounds = max(1, min(rounds, timing.batch_iters, timing.iters))
    # each model's call times in seconds, a list per round
    singles: dict[str, list[list[float]]] = {name: [[] for _ in range(rounds)] for name in runners}
    batches: dict[str, list[list[float]]] = {name: [[] for _ in range(rounds)] for name in runners}
    for run in runners.values():
        for _ in range(timing.warmup):
            run(single)
        for _ in range(timing.batch_warmup):
            run(batch)
    order = list(runners)
    for round_index in range(rounds):
        for name in order[round_index % len(order) :] + order[: round_index % len(order)]:
            run = runners[name]
            settle()
            for inputs, seconds, iters in (
                (single, singles[name][round_index], timing.iters),
                (batch, batches[name][round_index], timing.batch_iters),
            ):
                warm_up_turn(run, inputs, timing.turn_warmup_s)
                for _ in range(math.ceil(iters / rounds)):
                    start = time.perf_counter()
                    run(inputs)
                    seconds.append(time.perf_counter() - start)
        print(f"timing round {round_index + 1}/{rounds} done")
    rows = {
        name: LatencyStats.from_seconds(sum(singles[name], [])).as_row()
        | {"batch_size": batch_size}
        | {key: round(ms, 3) for key, ms in per_image_ms(sum(batches[name], []), batch_size).items()}
        for name in runners
    }
    if reference is None:
        return rows
    by_round = {
        name: [
            ratio_columns(one, batched, batch_size) for one, batched in zip(singles[name], batches[name], strict=True)
        ]
        for name in runners
    }
    for name, row in rows.items():
        for key in RATIO_KEYS:
            ratios = [own[key] / ref[key] for own, ref in zip(by_round[name], by_round[reference], strict=True)]
            row[f"{key}_vs_{reference}"] = round(float(np.median(ratios)), 3)
    return rows


def ratio_columns(single_seconds: list[float], batch_seconds: list[float], batch_size: int) -> dict:
    """RATIO_KEYS (unrounded) of these batch-1 and batched calls: the same statistics as a row's."""
    stats = LatencyStats.from_seconds(single_seconds)
    return {"mean_ms": stats.mean_ms, "p50_ms": stats.p50_ms} | per_image_ms(batch_seconds, batch_size)


def per_image_ms(batch_seconds: list[float], batch_size: int) -> dict:
    """`per_image_ms` and `per_image_p50_ms`: the mean and the median batched call's time, per image in ms."""
    return {
        "per_image_ms": float(np.mean(batch_seconds)) * 1000 / batch_size,
        "per_image_p50_ms": float(np.median(batch_seconds)) * 1000 / batch_size,
    }
