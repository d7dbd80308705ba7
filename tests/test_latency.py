"""mnv3.latency: models timed in turns start on idle cores."""

import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from mnv3 import latency
from mnv3.latency import Timing, interleaved_benchmark, settle

pytestmark = pytest.mark.unit


def test_settle_waits_while_another_thread_of_the_process_is_busy():
    assert settle()  # nothing else runs: idle at once
    stop = threading.Event()

    def spin():  # as a runtime's intra-op thread spins between calls
        while not stop.is_set():
            pass

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        start = time.perf_counter()
        assert not settle(max_s=0.1)  # still busy when it gives up
        assert time.perf_counter() - start >= 0.1
    finally:
        stop.set()
        spinner.join()
    assert settle()


def test_every_turn_of_the_interleaved_benchmark_starts_settled(monkeypatch):
    events = []
    monkeypatch.setattr(latency, "settle", lambda: events.append("settle"))

    def runner(name):
        def run(batch):
            events.append(name)
            return np.zeros((len(batch), 2))

        return run

    images = np.zeros((4, 3, 8, 8), dtype=np.float32)
    timing = Timing(warmup=1, iters=4, batch_warmup=1, batch_iters=2)
    rows = interleaved_benchmark({"a": runner("a"), "b": runner("b")}, images, 4, timing, rounds=2)
    assert set(rows) == {"a", "b"}
    timed = events[events.index("settle") :]  # after the warm-up calls
    turns = [i for i, event in enumerate(timed) if event == "settle"]
    assert len(turns) == 2 * 2  # every model, every round
    # between two settles, calls of one model only: no model's turn runs on the previous one's threads
    for start, end in zip(turns, turns[1:] + [len(timed)], strict=True):
        assert len(set(timed[start + 1 : end])) == 1


def test_each_turn_times_the_steady_state_not_the_recovery_from_the_settle(monkeypatch):
    """A model whose first calls after an idle gap are slow (cold caches) is timed at its steady speed: every
    turn calls it untimed for turn_warmup_s first. With one untimed call a turn, the slow calls were timed."""
    slow_calls, slow_s = 4, 0.01
    calls_since_settle = [0]
    monkeypatch.setattr(latency, "settle", lambda: calls_since_settle.__setitem__(0, 0))

    def cold_after_settle(batch):
        calls_since_settle[0] += 1
        if calls_since_settle[0] <= slow_calls:
            time.sleep(slow_s)
        return np.zeros((len(batch), 2))

    images = np.zeros((4, 3, 8, 8), dtype=np.float32)
    timing = Timing(warmup=1, iters=8, batch_warmup=1, batch_iters=4)
    one_call = interleaved_benchmark({"a": cold_after_settle}, images, 4, replace(timing, turn_warmup_s=0), rounds=2)
    by_time = interleaved_benchmark(
        {"a": cold_after_settle}, images, 4, replace(timing, turn_warmup_s=slow_calls * slow_s * 2), rounds=2
    )
    assert one_call["a"]["mean_ms"] > 1000 * slow_s / 2  # 3 of every 4 timed calls were slow
    assert by_time["a"]["mean_ms"] < 1000 * slow_s / 10


def test_ratios_to_the_reference_are_the_median_of_the_rounds_so_one_burst_does_not_move_them(monkeypatch):
    """A model twice as fast as the reference, slowed tenfold in one of its three turns (a neighbour's burst):
    its ratios by round are 0.5, 5 and 0.5, so the ratio stays 0.5, where its mean over the reference's
    would say it is slower."""
    turns = [0]
    monkeypatch.setattr(latency, "settle", lambda: turns.__setitem__(0, turns[0] + 1))
    # The benchmark's clock moves only as the models say they take: real sleeps, on a busy machine, moved a
    # round's ratio past any tolerance now and then
    now = [0.0]
    monkeypatch.setattr(latency, "time", SimpleNamespace(perf_counter=lambda: now[0]))

    def taking(seconds):
        def run(batch):
            # the first round's turns are 1 (reference) and 2 (this model): the burst lands on turn 2
            now[0] += seconds * (10 if seconds < 0.04 and turns[0] == 2 else 1)
            return np.zeros((len(batch), 2))

        return run

    images = np.zeros((4, 3, 8, 8), dtype=np.float32)
    timing = Timing(warmup=1, iters=6, batch_warmup=1, batch_iters=3, turn_warmup_s=0)
    rows = interleaved_benchmark(
        {"ref": taking(0.04), "half": taking(0.02)}, images, 4, timing, rounds=3, reference="ref"
    )
    assert rows["half"]["mean_ms"] > rows["ref"]["mean_ms"]  # the burst, in full, in the means
    for key in ("mean_ms", "p50_ms", "per_image_ms", "per_image_p50_ms"):
        assert rows["half"][f"{key}_vs_ref"] == pytest.approx(0.5)
        assert rows["ref"][f"{key}_vs_ref"] == 1.0
    assert "mean_ms_vs_ref" not in interleaved_benchmark({"ref": taking(0)}, images, 4, timing, rounds=1)["ref"]
