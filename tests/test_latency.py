"""mnv3.latency: models timed in turns start on idle cores."""

import threading
import time

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
