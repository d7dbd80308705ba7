"""mnv3.latency: models timed in turns start on idle cores."""

import threading
import time
from dataclasses import replace

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
