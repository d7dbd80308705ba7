"""Stage 2's choice of the threads a server's batches run on, from its timed turns."""

from types import SimpleNamespace

import pytest

from mnv3 import batch_threads, engine_benchmark
from mnv3.artifacts import read_manifest, update_manifest
from mnv3.batch_threads import choose
from mnv3.loadtest import LoadResult

pytestmark = pytest.mark.unit


def turn(threads: int, number: int, seconds: float) -> tuple[int, int, LoadResult]:
    samples = [("200", 0.01, {})] * 100
    return threads, number, LoadResult.from_samples("closed", 8, samples, seconds)


def test_the_threads_that_answered_the_most_are_chosen_and_a_tie_is_called_one():
    keys, reason = choose([turn(1, 1, 2.0), turn(2, 1, 1.0), turn(2, 2, 1.0), turn(1, 2, 2.0)])
    assert keys == {"batch_threads": 2, "batch_threads_req_per_s": {"1": 50.0, "2": 100.0}}
    assert reason.startswith("a server's batches on 2 thread(s), which answered the most of 1 thread(s) 50.0")
    keys, reason = choose([turn(1, 1, 1.0), turn(2, 1, 1.0)])
    assert keys["batch_threads"] == 1  # the first timed
    assert "which answered as many as any of 1 thread(s) 100.0 req/s, 2 thread(s) 100.0 req/s" in reason


def test_a_choice_of_fewer_threads_than_the_engines_streams_says_its_batches_get_fewer_streams():
    # The engine table timed the chosen engine alone on 2 streams; a batch on 1 thread runs on 1 stream.
    turns = [turn(1, 1, 1.0), turn(2, 1, 2.0)]
    assert choose(turns, streams=2)[1].endswith(
        "; so its batches run on 1 stream(s), not the 2 its row was timed on alone"
    )
    assert "stream" not in choose(turns, streams=1)[1]
    assert "stream" not in choose([turn(1, 1, 2.0), turn(2, 1, 1.0)], streams=2)[1]  # 2 threads: both streams


def test_a_measurement_stopped_midway_leaves_no_choice_for_auto(tmp_path, monkeypatch):
    # The servers it times serve the choice under --backend auto, so it is in the manifest while they run;
    # stopped then (Ctrl-C), it stayed, without the threads it was being measured for.
    def interrupted(*args, **kwargs):
        assert "engine_choice" in read_manifest(tmp_path)  # what the servers would serve
        raise KeyboardInterrupt

    monkeypatch.setattr(batch_threads, "measure", interrupted)
    monkeypatch.setattr(engine_benchmark, "load_images", lambda count: [])
    update_manifest(tmp_path, model={"id": "kept"})
    args = SimpleNamespace(artifacts_dir=tmp_path, threads=2, quick=True)
    with pytest.raises(KeyboardInterrupt):
        engine_benchmark.choose_batch_threads(args, {"variant": "openvino_nncf_int8_f32"}, bench=None)
    assert read_manifest(tmp_path) == {"model": {"id": "kept"}}
