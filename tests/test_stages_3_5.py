"""Stages 3-5 end to end in --quick mode against a real server on the fixture model.

Timings on a shared machine are noise: the tests check the relations every row must satisfy (counts,
ratios, what the server's metrics saw), never that one timing beats another.
"""

import os
import subprocess
import sys
from pathlib import Path

import onnxruntime
import pytest
from PIL import Image

import batching_loadtest
import caching
import fastapi_serving
from conftest import assert_rate
from mnv3 import limit
from mnv3.artifacts import (
    BATCH_SIZE_HISTOGRAM_PNG,
    BATCHING_CSV,
    CACHING_CSV,
    LATENCY_PNG,
    PHONE_PHOTOS_CSV,
    SERVING_BASELINE_CSV,
    SIDE_BY_SIDE_CSV,
    THROUGHPUT_PNG,
    V2_VS_PREDICT_CSV,
    update_manifest,
)
from mnv3.cli import QUICK, serving_model
from mnv3.phone_benchmark import TIME_PARTS
from mnv3.report import read_csv
from mnv3.thread_cpu import ENGINE_AND_OTHER, INFERENCE, PREPROCESS, ROLES

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]


def run_quick(stage, csv_name, model, results_dir, *extra):
    args = stage.get_args_parser().parse_args(
        [
            "--quick",
            "--model",
            str(model),
            "--results-dir",
            str(results_dir),
            "--artifacts-dir",
            str(results_dir / "artifacts"),
            *extra,
        ]
    )
    stage.main(args)
    return read_csv(results_dir / csv_name)


def assert_closed_loop_throughput(row):
    """req/s is answers (not sends) per second of the run; each closed-loop client has one request out at
    a time, so the answered requests' round trips add up to no more than concurrency x seconds."""
    ok, seconds = int(row["ok"]), float(row["seconds"])
    assert ok > 0
    assert_rate(row["req_per_s"], ok, seconds)
    assert ok * float(row["latency_mean_ms"]) / 1000 <= int(row["concurrency"]) * (seconds + 0.001)


def assert_server_batched_every_answer(row, max_batch_size):
    """The server's own metrics for the run: every answered image went through exactly one batch."""
    ok, batches = int(row["ok"]), int(row["metrics_batches"])
    assert -(-ok // max_batch_size) <= batches <= ok
    assert float(row["metrics_mean_batch_size"]) * batches == pytest.approx(ok, abs=0.5)


def test_stage3_baseline(fp32_model_path, tmp_path):
    [row] = run_quick(fastapi_serving, SERVING_BASELINE_CSV, fp32_model_path, tmp_path)
    assert row["configuration"] == "no_batching" and row["mode"] == "closed"
    assert (int(row["concurrency"]), int(row["sent"]), int(row["ok"]), int(row["errors"])) == (8, 32, 32, 0)
    assert_closed_loop_throughput(row)
    assert_server_batched_every_answer(row, max_batch_size=1)
    assert 0 < float(row["latency_p50_ms"]) <= float(row["latency_p95_ms"]) <= float(row["latency_p99_ms"])
    assert float(row["mean_batch_size"]) == 1.0 and row["server_cache_size"] == "0"
    assert row["model"] == "fp32.onnx" and row["load_image_size"] == "500x375" and row["load_image_quality"] == "90"
    assert row["cores"] == str(os.cpu_count()) and row["onnxruntime_version"] == onnxruntime.__version__
    # what served, and why: --backend auto may serve stage 2's choice in place of the file given
    assert row["server_model"].startswith("fp32.onnx:") and row["server_backend"] == "onnxruntime"
    assert row["server_backend_reason"]


def test_stage4_hits_are_answered_from_the_cache_without_inference(fp32_model_path, tmp_path):
    rows = run_quick(caching, CACHING_CSV, fp32_model_path, tmp_path)
    assert [(r["run"], r["phase"]) for r in rows] == [
        ("sequential", "miss"),
        ("sequential", "hit"),
        ("concurrent", "miss"),
        ("concurrent", "hit"),
    ]
    for miss, hit in (rows[:2], rows[2:]):
        assert int(miss["errors"]) == int(hit["errors"]) == 0
        assert int(miss["cache_hits"]) == 0 and int(hit["cache_hits"]) == int(hit["ok"])
        assert int(hit["metrics_cache_hits"]) == int(hit["ok"]) and int(miss["metrics_cache_misses"]) == int(miss["ok"])
        assert int(hit["metrics_cache_misses"]) == 0 and int(miss["metrics_cache_hits"]) == 0
        assert int(hit["metrics_batches"]) == 0 and int(miss["metrics_batches"]) == int(miss["ok"])  # batch size 1
        assert float(hit["mean_inference_ms"]) == 0 < float(miss["mean_inference_ms"])
        assert float(hit["hit_speedup_p50"]) == pytest.approx(
            float(miss["latency_p50_ms"]) / float(hit["latency_p50_ms"]), abs=0.01
        )
        assert float(hit["hit_throughput_ratio"]) == pytest.approx(
            float(hit["req_per_s"]) / float(miss["req_per_s"]), abs=0.01
        )


def test_stage5_batching_sweep_open_loop_and_limit(fp32_model_path, other_model_path, tmp_path, monkeypatch):
    # the servers' non-default settings, which the limit must follow
    monkeypatch.setenv("MNV3_JPEG_DRAFT", "0")
    monkeypatch.setenv("MNV3_RESIZE_CROP_ONLY", "0")
    rows = run_quick(
        batching_loadtest,
        BATCHING_CSV,
        fp32_model_path,
        tmp_path,
        "--side-by-side-models",
        str(fp32_model_path),
        str(other_model_path),
    )
    by_kind = {}
    for row in rows:
        by_kind.setdefault((row["configuration"], row["mode"]), []).append(row)
    # the headline: both servers at concurrency 8 in two rounds of turns, mirrored, then each pooled
    turns = [r for r in rows if r["turn"] not in ("", "all")]
    assert [(r["configuration"], r["turn"], r["mode"]) for r in turns] == [
        ("no_batching", "1", "closed"),
        ("batching", "1", "closed"),
        ("batching", "2", "closed"),
        ("no_batching", "2", "closed"),
        ("in_process_limit_turn", "1", "in_process"),
        ("in_process_limit_turn", "2", "in_process"),
        ("in_process_limit_turn", "3", "in_process"),
    ]
    server_turns, limit_turns = turns[:4], turns[4:]
    [baseline] = [r for r in by_kind[("no_batching", "closed")] if r["turn"] == "all"]
    batched = [r for r in by_kind[("batching", "closed")] if r not in server_turns]
    [open_loop] = by_kind[("batching", "open")]
    assert sorted(int(r["concurrency"]) for r in batched) == [1, 8]
    for row in [baseline, *batched, *server_turns]:
        assert int(row["errors"]) == 0
        assert_closed_loop_throughput(row)
    assert_server_batched_every_answer(baseline, max_batch_size=1)
    assert all(r["server_max_batch_size"] == "32" and r["server_batch_window_ms"] == "20.0" for r in batched)
    headline = next(r for r in batched if r["concurrency"] == "8")
    assert headline["turn"] == "all"
    for pooled, name in ((baseline, "no_batching"), (headline, "batching")):  # its turns, pooled
        mine = [r for r in server_turns if r["configuration"] == name]
        for column in ("sent", "ok", "metrics_batches"):
            assert int(pooled[column]) == sum(int(r[column]) for r in mine)
        assert float(pooled["seconds"]) == pytest.approx(sum(float(r["seconds"]) for r in mine), abs=0.002)
    # the other server sat idle through each turn: next to nothing of the turn's CPU
    for row in server_turns:
        busy_cpu_s = float(row["server_cpu_ms_per_request"]) * int(row["ok"]) / 1000
        assert 0 <= float(row["other_server_cpu_s"]) < 0.1 * busy_cpu_s, row
    assert float(headline["speedup_vs_no_batching"]) == pytest.approx(
        float(headline["req_per_s"]) / float(baseline["req_per_s"]), abs=0.01
    )
    assert_server_batched_every_answer(headline, max_batch_size=int(headline["server_max_batch_size"]))
    # the open loop offers a fraction of the headline's rate, and every request it sent was answered or refused
    fraction = batching_loadtest.get_args_parser().get_default("open_loop_fraction")
    assert float(open_loop["target_rps"]) == pytest.approx(fraction * float(headline["req_per_s"]), abs=0.01)
    assert int(open_loop["ok"]) > 0 and int(open_loop["ok"]) + int(open_loop["errors"]) == int(open_loop["sent"])
    grid = by_kind[("in_process_limit", "in_process")]
    finalists = by_kind[("in_process_limit_finalist", "in_process")]
    [confirmed] = by_kind[("in_process_limit_confirmed", "in_process")]
    decoding = {(r["server_jpeg_draft"], r["server_resize_crop_only"]) for r in [baseline, *batched]}
    assert decoding == {("False", "False")}
    cores = len(os.sched_getaffinity(0))
    for row in [baseline, *batched, *server_turns]:  # CPU seconds spent, within what the cores could spend in the run
        for who in ("server", "client"):
            cpu_s = float(row[f"{who}_cpu_ms_per_request"]) * int(row["ok"]) / 1000
            assert 0 < cpu_s <= cores * (float(row["seconds"]) + 1.0), (who, row)
        assert 0 < float(row["machine_cpu_busy"]) <= 1, row  # its lower bound: tests/test_loadtest.py
        # where the server's went: decoding and inference took some, and the roles add up to it
        by_role = {role: float(row[f"server_{role}_cpu_ms_per_request"]) for role in ROLES}
        assert by_role[PREPROCESS] > 0 and by_role[INFERENCE] + by_role[ENGINE_AND_OTHER] > 0, row
        server_ms = float(row["server_cpu_ms_per_request"])
        assert sum(by_role.values()) == pytest.approx(server_ms, abs=1000 * 0.05 / int(row["ok"]) + 0.002), row
    for row in [*grid, *finalists, *limit_turns, confirmed]:
        assert_rate(row["images_per_s"], row["images"], row["seconds"])
        assert 0 < float(row["cpu_seconds"]) <= cores * float(row["seconds"]) + 0.05
        assert float(row["cpu_ms_per_image"]) == pytest.approx(
            1000 * float(row["cpu_seconds"]) / int(row["images"]), rel=0.01, abs=0.002
        )
        # it decoded as the server it is compared with
        assert (row["jpeg_draft"], row["resize_crop_only"]) == ("False", "False")
        assert 0 < float(row["preprocess_cpu_seconds"]) < float(row["cpu_seconds"])
    # one engine here (FP32 on onnxruntime): the grid's fastest measured again in turns, the fastest of those
    # measured around the headline
    configuration = ("batch_size", "intra_op_threads", "decode_threads")
    by_speed = sorted(grid, key=lambda r: float(r["images_per_s"]), reverse=True)
    assert [[r[k] for k in configuration] for r in finalists] == [
        [r[k] for k in configuration] for r in by_speed[: limit.FINALISTS]
    ]
    assert all(int(r["images"]) == limit.FINAL_ROUNDS * QUICK.limit_images for r in finalists)
    fastest = max(finalists, key=lambda r: float(r["images_per_s"]))
    for row in [*limit_turns, confirmed]:
        assert [row[k] for k in configuration] == [fastest[k] for k in configuration]
    # the served limit pools its three turns (before each round of the headline and after the last)
    assert int(confirmed["images"]) == sum(int(r["images"]) for r in limit_turns)
    assert int(confirmed["images"]) == 3 * QUICK.limit_confirm_passes * QUICK.limit_images
    rates = [float(r["images_per_s"]) for r in limit_turns]
    assert min(rates) - 0.01 <= float(confirmed["images_per_s"]) <= max(rates) + 0.01
    # both servers were up but idle meanwhile: next to nothing of the limit turns' CPU time
    assert 0 <= float(confirmed["server_cpu_s_during_limit_turns"]) < 0.1 * float(confirmed["cpu_seconds"])
    assert float(headline["server_to_limit_ratio"]) == pytest.approx(
        float(headline["req_per_s"]) / float(confirmed["images_per_s"]), abs=0.006
    )
    # each round's own ratios: its batching turn against its unbatched turn and the limit turns either side
    for batching, unbatched, limits in (
        (server_turns[1], server_turns[0], limit_turns[:2]),
        (server_turns[2], server_turns[3], limit_turns[1:]),
    ):
        assert float(batching["speedup_vs_no_batching"]) == pytest.approx(
            float(batching["req_per_s"]) / float(unbatched["req_per_s"]), abs=0.01
        )
        limit_rate = sum(int(r["images"]) for r in limits) / sum(float(r["seconds"]) for r in limits)
        assert float(batching["server_to_limit_ratio"]) == pytest.approx(
            float(batching["req_per_s"]) / limit_rate, abs=0.01
        )
    for png in (THROUGHPUT_PNG, LATENCY_PNG, BATCH_SIZE_HISTOGRAM_PNG):
        with Image.open(tmp_path / png) as image:
            assert image.format == "PNG" and min(image.size) > 100
    # issue 11's rows (their relations: tests/test_v2_benchmark.py): every request of both answered
    v2_rows = read_csv(tmp_path / V2_VS_PREDICT_CSV)
    assert [(r["configuration"], r["turn"]) for r in v2_rows] == [
        ("predict", "1"),
        ("v2_binary", "1"),
        ("v2_binary", "2"),
        ("predict", "2"),
        ("predict", "all"),
        ("v2_binary", "all"),
    ]
    side_by_side = read_csv(tmp_path / SIDE_BY_SIDE_CSV)
    assert [r["served_model"] for r in side_by_side] == ["fp32", "other", "all"]
    for row in v2_rows + side_by_side:
        assert int(row["errors"]) == 0 and row["ok"] == row["sent"] and int(row["concurrency"]) == 8
    # a turn of each path, and the side-by-side run, as many requests as a headline turn
    assert v2_rows[0]["sent"] == side_by_side[-1]["sent"] == server_turns[0]["sent"]


def test_stage5_phone_photo_rows(fp32_model_path, tmp_path):
    run_quick(batching_loadtest, BATCHING_CSV, fp32_model_path, tmp_path, "--phone-photos", "3")
    decode, *uploads = read_csv(tmp_path / PHONE_PHOTOS_CSV)
    assert decode["configuration"] == "phone_decode" and decode["photos"] == "3" and decode["decode_rounds"] == "2"
    assert 2 <= float(decode["photo_mb_min"]) <= float(decode["photo_mb_mean"]) <= float(decode["photo_mb_max"]) <= 4
    assert decode["draft_decoded_size"] in ("1008x756", "756x1008")
    assert 0 < float(decode["tensor_mean_abs_diff"]) <= float(decode["tensor_max_abs_diff"])
    assert 0 < float(decode["pixel_mean_abs_diff_levels"]) <= float(decode["pixel_max_abs_diff_levels"])
    # no engine choice beside this model: auto serves it on onnxruntime, which is the reference itself
    assert decode["served_variant"] == "onnxruntime_fp32" and "reference_variant" not in decode
    assert [(r["configuration"], r["jpeg_draft"]) for r in uploads] == [("phone_upload", "1"), ("phone_upload", "0")]
    for row in uploads:
        assert row["load_image_size"] == "4032x3024" and row["server_cache_size"] == "0"
        assert (int(row["concurrency"]), int(row["sent"]), int(row["ok"]), int(row["errors"])) == (4, 16, 16, 0)
        assert_closed_loop_throughput(row)
        assert_server_batched_every_answer(row, max_batch_size=int(row["server_max_batch_size"]))
        # every part of the round trip took time, and together they are the round trip
        parts = {name: float(row[f"time_{name}"]) for name in TIME_PARTS}
        assert min(parts.values()) > 0
        assert sum(parts.values()) == pytest.approx(float(row["latency_mean_ms"]), abs=0.05)
        assert parts["decode_preprocess_ms"] == pytest.approx(float(row["mean_preprocess_ms"]), abs=0.01)
    assert float(uploads[0]["draft_speedup"]) == pytest.approx(
        float(uploads[0]["req_per_s"]) / float(uploads[1]["req_per_s"]), abs=0.01
    )


def test_stage5_refuses_a_negative_phone_photo_count(tmp_path):
    result = run_cli("batching_loadtest.py", "--quick", "--phone-photos", "-1", "--results-dir", str(tmp_path))
    assert result.returncode == 2 and "--phone-photos" in result.stderr and "Traceback" not in result.stderr


def run_cli(script, *args):
    return subprocess.run([sys.executable, str(REPO / script), *args], capture_output=True, text=True, timeout=120)


def test_stage3_without_stage2_names_stage2(tmp_path):
    result = run_cli("fastapi_serving.py", "--quick", "--artifacts-dir", str(tmp_path), "--results-dir", str(tmp_path))
    assert result.returncode == 2
    assert "stage 2" in result.stderr and "static_quantization.py" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_a_server_that_will_not_start_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "model.onnx"
    bad.write_bytes(b"not an onnx model")
    result = run_cli("caching.py", "--quick", "--model", str(bad), "--results-dir", str(tmp_path))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "error: server exited with code 2" in result.stderr and str(bad) in result.stderr


def test_default_model_is_the_one_stage2_recorded(tmp_path):
    update_manifest(tmp_path, weights="random-init", static_int8={"path": "int8.onnx", "threads": 2})
    (tmp_path / "int8.onnx").write_bytes(b"")
    args = fastapi_serving.get_args_parser().parse_args(["--artifacts-dir", str(tmp_path)])
    assert serving_model(args) == (tmp_path / "int8.onnx", "random-init")
