"""Stage 5's /v2-vs-/predict and side-by-side rows (mnv3/v2_benchmark.py) against real server processes
on the fixture models: the /v2 load client sends what tritonclient sends and gets /predict's answers,
and the rows hold their relations (every request answered, rates = counts / seconds, the agreement
recounted from the answers). No timing is compared: on a shared machine that is noise."""

import numpy as np
import pytest
import requests
import tritonclient.http as triton

from conftest import assert_rate
from mnv3.cli import UsageError
from mnv3.loadtest import ServerProcess
from mnv3.photos import load_images
from mnv3.v2_benchmark import (
    PREDICT,
    TOP_K,
    TURNS,
    V2_BINARY,
    V2Client,
    run_side_by_side,
    run_v2_vs_predict,
    side_by_side_models,
    v2_request,
)
from mnv3.v2_protocol import HEADER_LENGTH, PROBABILITIES_OUTPUT, ModelDescription, RequestedOutput, parse_infer_request

pytestmark = pytest.mark.integration

WAIT_S = 60
CONCURRENCY = 4
SERVER = {"cache_size": 0, "max_batch_size": 4, "batch_window_ms": 20, "deadline_ms": WAIT_S * 1000}
PROBABILITY_TOLERANCE = 1e-4  # batches of other sizes round differently; /v2 prints 6 decimals


@pytest.fixture(scope="module")
def photos():
    return load_images(8, seed=5)


def triton_body(photo: bytes) -> tuple[bytes, int]:
    """What tritonclient.http posts for one encoded photo, asking for the top TOP_K as JSON strings."""
    image = triton.InferInput("IMAGE", [1, 1], "BYTES")
    image.set_data_from_numpy(np.array([[photo]], dtype=object))
    top = triton.InferRequestedOutput(PROBABILITIES_OUTPUT, binary_data=False, class_count=TOP_K)
    return triton.InferenceServerClient.generate_request_body([image], outputs=[top])


def test_v2_request_is_tritonclients_and_the_servers_codec_reads_it(photos):
    model = ModelDescription(
        "m", "1", (3, 224, 224), [], 1000, max_images=8, batcher_max_batch_size=8, batch_window_s=0.02
    )
    for photo in photos[:3]:
        request = v2_request(photo)
        assert (request.body, request.header_length) == triton_body(photo)
        parsed = parse_infer_request(request.body, str(request.header_length), model)
        assert parsed.images == [photo] and parsed.pixels is None
        assert parsed.outputs == (RequestedOutput(PROBABILITIES_OUTPUT, binary_data=False, classification=TOP_K),)


def test_v2_client_answers_as_predict_does(fp32_model_path, photos):
    with ServerProcess(fp32_model_path, **SERVER) as url, V2Client(url, "fp32") as send:
        for photo in photos[:4]:
            status, answer = send.request(v2_request(photo))
            assert status == "200" and answer["model_name"] == "fp32"
            top = requests.post(
                url + "/predict", files={"file": ("p.jpg", photo, "image/jpeg")}, timeout=WAIT_S
            ).json()["predictions"]
            # Triton's classification strings, "probability:class_id:label", most probable first
            classifications = [text.split(":")[:2] for text in answer["outputs"][0]["data"]]
            assert [int(class_id) for _, class_id in classifications] == [p["class_id"] for p in top]
            probabilities = [float(probability) for probability, _ in classifications]
            np.testing.assert_allclose(probabilities, [p["probability"] for p in top], atol=PROBABILITY_TOLERANCE)
        with V2Client(url, "no_such_model") as unknown:
            assert unknown.request(v2_request(photos[0])) == ("404", None)
        # what a request header says about its length is checked: the client must send the right one
        wrong = requests.post(
            url + "/v2/models/fp32/infer", data=v2_request(photos[0]).body, headers={HEADER_LENGTH: "5"}, timeout=WAIT_S
        )
        assert wrong.status_code == 400 and "error" in wrong.json()


def test_v2_vs_predict_rows_alternate_paths_and_answer_every_request(fp32_model_path, photos):
    requests_per_turn = 6
    result = run_v2_vs_predict(fp32_model_path, photos, CONCURRENCY, requests_per_turn, SERVER, WAIT_S)
    # mirrored from one pair of turns to the next, so a steady drift does not favour either path
    assert [(path, turn) for path, turn, _ in result.turns] == [
        (PREDICT, 1),
        (V2_BINARY, 1),
        (V2_BINARY, 2),
        (PREDICT, 2),
    ]
    rows = result.rows({"model": fp32_model_path.name})
    per_turn, totals = rows[:-2], rows[-2:]
    for row in per_turn:
        assert (row["sent"], row["ok"], row["errors"]) == (requests_per_turn, requests_per_turn, 0)
        assert row["concurrency"] == CONCURRENCY and row["server_cache_size"] == 0
        # the server's metrics for the turn: every image went through exactly one batch, by either path
        batches = row["metrics_batches"]
        assert -(-row["ok"] // SERVER["max_batch_size"]) <= batches <= row["ok"]
        assert row["metrics_mean_batch_size"] * batches == pytest.approx(row["ok"], abs=0.01)
        assert_rate(row["req_per_s"], row["ok"], row["seconds"])
    for row in totals:
        turns = [r for r in per_turn if r["configuration"] == row["configuration"]]
        assert row["turn"] == "all" and len(turns) == TURNS
        assert row["sent"] == row["ok"] == TURNS * requests_per_turn and row["errors"] == 0
        assert row["seconds"] == pytest.approx(sum(r["seconds"] for r in turns), abs=0.002)
        assert_rate(row["req_per_s"], row["ok"], row["seconds"])
    predict, v2 = totals
    assert (predict["configuration"], v2["configuration"]) == (PREDICT, V2_BINARY)
    assert v2["v2_to_predict_ratio"] == pytest.approx(v2["req_per_s"] / predict["req_per_s"], rel=2e-3)
    assert "v2_to_predict_ratio" not in predict
    # each pair of turns (the same turn number) has its own ratio, on its /v2 row
    for turn in range(1, TURNS + 1):
        pair = {row["configuration"]: row for row in per_turn if row["turn"] == turn}
        assert pair[V2_BINARY]["v2_to_predict_ratio"] == pytest.approx(
            pair[V2_BINARY]["req_per_s"] / pair[PREDICT]["req_per_s"], rel=2e-3
        )
        assert "v2_to_predict_ratio" not in pair[PREDICT]


def test_side_by_side_sends_every_photo_to_both_and_counts_agreement(
    fp32_model_path, other_model_path, photos, tmp_path
):
    models = side_by_side_models([f"fp32={fp32_model_path}", f"other={other_model_path}"], tmp_path)
    result = run_side_by_side(models, photos, CONCURRENCY, SERVER, WAIT_S)
    rows = result.rows({"model": "ignored"})
    assert [row["served_model"] for row in rows] == ["fp32", "other", "all"]
    assert [row["model"] for row in rows] == ["fp32.onnx", "other.onnx", "fp32.onnx+other.onnx"]
    *per_model, total = rows
    for row in per_model:  # each model had every photo, over the whole run's seconds
        assert (row["sent"], row["ok"], row["errors"]) == (len(photos), len(photos), 0)
        assert row["seconds"] == total["seconds"]
        assert_rate(row["req_per_s"], row["ok"], row["seconds"])
    assert (total["sent"], total["ok"], total["errors"]) == (2 * len(photos), 2 * len(photos), 0)
    assert_rate(total["req_per_s"], total["ok"], total["seconds"])
    assert total["req_per_s"] == pytest.approx(sum(row["req_per_s"] for row in per_model), abs=0.02)

    assert sorted(result.answers) == sorted((name, i) for name in ("fp32", "other") for i in range(len(photos)))
    top1 = {key: answer["predictions"][0]["class_id"] for key, answer in result.answers.items()}
    agreeing = sum(top1[("fp32", i)] == top1[("other", i)] for i in range(len(photos)))
    assert (total["photos_agreeing"], total["photos_compared"]) == (agreeing, len(photos))
    assert 0 <= total["top1_agreement"] <= 1
    assert total["top1_agreement"] == pytest.approx(agreeing / len(photos), abs=1e-4)


def test_side_by_side_models_need_two_files_and_two_names(fp32_model_path, tmp_path):
    with pytest.raises(UsageError, match="name them NAME=PATH"):
        side_by_side_models([str(fp32_model_path), str(fp32_model_path)], tmp_path)
    with pytest.raises(FileNotFoundError, match="missing.onnx not found"):
        side_by_side_models([str(fp32_model_path), str(tmp_path / "missing.onnx")], tmp_path)
    with pytest.raises(FileNotFoundError, match="stage 1"):
        side_by_side_models(None, tmp_path)  # no fp32.onnx from stage 1 there


def test_side_by_side_defaults_pin_both_files_to_onnxruntime(tmp_path):
    # --backend auto may serve one chosen engine for both files; the row compares the two networks.
    for name in ("fp32.onnx", "static_int8.onnx"):
        (tmp_path / name).write_bytes(b"")
    fp32, int8 = side_by_side_models(None, tmp_path)
    assert (fp32.name, fp32.path, fp32.backend) == ("fp32", tmp_path / "fp32.onnx", "onnxruntime")
    assert (int8.name, int8.path, int8.backend) == ("static_int8", tmp_path / "static_int8.onnx", "onnxruntime")
