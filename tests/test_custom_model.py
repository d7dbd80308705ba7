"""A user's own fine-tuned MobileNetV3-Small, saved as torchvision's reference train.py saves it, through
stage 1, stage 2 and the server: the user's class names and preprocessing everywhere, the server's
answers PyTorch's. Plus the weights and class-name files a user can get wrong."""

import argparse
import hashlib
import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import requests
import torch
from torchvision.models import mobilenet_v3_large, mobilenet_v3_small
from torchvision.transforms import v2

import baseline_export_quantize
import static_quantization
from conftest import offline_weights
from mnv3 import cli
from mnv3.accuracy import agreement, held_out_batch, load_labels
from mnv3.artifacts import model_id
from mnv3.loadtest import PredictClient, ServerProcess
from mnv3.model import recalibrate_batchnorm
from mnv3.photos import augmented_views, encode_jpeg, spread
from mnv3.preprocess import Decoding, Preprocessing, decode_image, preprocess_files
from mnv3.report import read_csv
from mnv3.runtime import make_session, ort_runner

pytestmark = pytest.mark.e2e

# Four classes, each a photo that installed packages ship; the names in ImageFolder's (sorted) order.
SOURCES = {
    "cat": ("skimage", "data/chelsea.png"),
    "coins": ("skimage", "data/coins.png"),
    "retina": ("skimage", "data/retina.jpg"),
    "rocket": ("skimage", "data/rocket.jpg"),
}
CLASS_NAMES = sorted(SOURCES)
# Not torchvision's defaults, so a stage or a server that ignored the manifest would answer differently.
PREPROCESSING = Preprocessing(resize=160, crop=128, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
TRAIN_VIEWS, TEST_VIEWS = 16, 4  # per class
FINE_TUNE_STEPS = 200  # full-batch steps on the head alone: well under a second


def user_transform():
    """What the user trained and evaluated with: torchvision's transforms, with PREPROCESSING's values."""
    return v2.Compose(
        [
            v2.Resize(PREPROCESSING.resize),
            v2.CenterCrop(PREPROCESSING.crop),
            v2.PILToTensor(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(PREPROCESSING.mean, PREPROCESSING.std),
        ]
    )


def views(count: int, seed: int) -> tuple[list, torch.Tensor]:
    images, labels = [], []
    for class_id, name in enumerate(CLASS_NAMES):
        images += augmented_views([SOURCES[name]], count, seed=seed + class_id, size=(320, 240))
        labels += [class_id] * count
    return images, torch.tensor(labels)


def fine_tune() -> torch.nn.Module:
    """A new 4-class head on MobileNetV3-Small, trained a few steps (the backbone is a seeded random init
    with BatchNorm statistics from the training photos: no weights can be downloaded in tests)."""
    torch.manual_seed(0)
    model = mobilenet_v3_small(num_classes=len(CLASS_NAMES))
    images, labels = views(TRAIN_VIEWS, seed=10)
    recalibrate_batchnorm(model, images, preprocessing=PREPROCESSING)
    inputs = torch.stack([user_transform()(image) for image in images])
    with torch.no_grad():
        features = model.avgpool(model.features(inputs)).flatten(1)
    optimizer = torch.optim.Adam(model.classifier.parameters(), lr=1e-2)
    model.classifier.train()
    for _ in range(FINE_TUNE_STEPS):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model.classifier(features), labels).backward()
        optimizer.step()
    return model.eval()


def run_stage(module, *flags):
    module.main(module.get_args_parser().parse_args([str(flag) for flag in flags]))


@pytest.fixture(scope="module")
def user_run(tmp_path_factory):
    """The user's files (checkpoint, class names, a labelled folder per class name), then stages 1 and 2."""
    root = tmp_path_factory.mktemp("custom")
    model = fine_tune()
    checkpoint = root / "model_0.pth"
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 30).state_dict(),
            "epoch": 0,
            "args": argparse.Namespace(model="mobilenet_v3_small", lr=0.1, val_resize_size=160, val_crop_size=128),
        },
        checkpoint,
    )
    (root / "classes.txt").write_text("\n".join(CLASS_NAMES) + "\n")
    test_images, test_labels = views(TEST_VIEWS, seed=50)
    jpegs = [encode_jpeg(image) for image in test_images]
    for i, (jpeg, label) in enumerate(zip(jpegs, test_labels.tolist(), strict=True)):
        folder = root / "labelled" / CLASS_NAMES[label]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i}.jpg").write_bytes(jpeg)
    artifacts, results = root / "artifacts", root / "results"
    common = ["--quick", "--artifacts-dir", artifacts, "--results-dir", results, "--labels", root / "labelled"]
    run_stage(
        baseline_export_quantize,
        *common,
        "--arch",
        "mobilenet_v3_small",
        "--weights",
        checkpoint,
        "--class-names",
        root / "classes.txt",
        "--resize",
        PREPROCESSING.resize,
        "--crop",
        PREPROCESSING.crop,
        "--mean",
        *PREPROCESSING.mean,
        "--std",
        *PREPROCESSING.std,
        "--backends",
        "onnxruntime",
    )
    run_stage(static_quantization, *common, "--calibration-dir", root / "calibration")
    # What the user's PyTorch says, on the pixels the server decodes, preprocessed as the user trained.
    inputs = torch.stack([user_transform()(decode_image(jpeg)) for jpeg in jpegs])
    with torch.inference_mode():
        logits = model(inputs).numpy()
    return {
        "root": root,
        "artifacts": artifacts,
        "results": results,
        "checkpoint": checkpoint,
        "jpegs": jpegs,
        "labels": test_labels.numpy(),
        "torch_logits": logits,
        "user_inputs": inputs.numpy(),
    }


@pytest.mark.slow
def test_the_fine_tune_learned_its_classes(user_run):
    # Otherwise "the server agrees with PyTorch" could be one class for every photo.
    assert np.mean(user_run["torch_logits"].argmax(axis=1) == user_run["labels"]) >= 0.75


@pytest.mark.slow
def test_stage_1_records_the_users_model_and_preprocessing(user_run):
    artifacts = user_run["artifacts"]
    manifest = json.loads((artifacts / "manifest.json").read_text())
    fp32_sha256 = hashlib.sha256((artifacts / "fp32.onnx").read_bytes()).hexdigest()
    assert manifest["model"] == {
        "arch": "mobilenet_v3_small",
        "classes": 4,
        "class_names": "file:classes.txt",
        "id": model_id(fp32_sha256, PREPROCESSING),
    }
    assert Preprocessing.from_record(manifest["preprocessing"]) == PREPROCESSING
    assert manifest["weights"] == f"file:{hashlib.sha256(user_run['checkpoint'].read_bytes()).hexdigest()[:12]}"
    assert json.loads((artifacts / "class_names.json").read_text()) == CLASS_NAMES
    rows = read_csv(user_run["results"] / "01_baseline.csv")
    assert {(row["arch"], row["classes"], row["weights"], row["model_id"]) for row in rows} == {
        ("mobilenet_v3_small", "4", manifest["weights"], manifest["model"]["id"])
    }
    # The user's labelled folder scored against the user's classes; PyTorch and ONNX FP32 agree on it.
    accuracy = {row["variant"]: float(row["top1_accuracy"]) for row in rows}
    assert (
        accuracy["pytorch_fp32"]
        == accuracy["onnx_fp32"]
        == pytest.approx(np.mean(user_run["torch_logits"].argmax(axis=1) == user_run["labels"]))
    )


@pytest.mark.slow
def test_stage_2_quantizes_and_tables_the_small_model(user_run):
    static = read_csv(user_run["results"] / "02_static.csv")[0]
    assert (static["arch"], static["classes"]) == ("mobilenet_v3_small", "4")
    assert 0 <= float(static["top1_accuracy"]) <= float(static["top5_accuracy"]) == 1.0  # 4 classes: top-5 is all
    assert float(static["sqnr_db"]) > 10
    table = {row["variant"]: row for row in read_csv(user_run["results"] / "model_variants.csv")}
    assert {row["arch"] for row in table.values()} == {"mobilenet_v3_small"}
    assert "ONNX Static INT8" in table and "| mobilenet_v3_small |" in (user_run["results"] / "summary.md").read_text()


@pytest.mark.slow
def test_agreement_with_fp32_is_measured_on_the_users_labelled_photos(user_run):
    """With --labels, stage 2's SQNR and top-1 agreement are the INT8 model's on the user's own photos, which the
    agreement guard decides by, not on the held-out views of the sample photos (half of them of none of this
    model's classes), which give another figure."""
    artifacts = user_run["artifacts"]
    paths, _ = load_labels(user_run["root"] / "labelled", CLASS_NAMES)
    photos = spread(paths, cli.QUICK.held_out_images)

    def scores(inputs):
        reference = ort_runner(make_session(artifacts / "fp32.onnx"))(inputs)
        return agreement(reference, ort_runner(make_session(artifacts / "static_int8.onnx"))(inputs))

    own, samples = scores(preprocess_files(photos, PREPROCESSING)), scores(held_out_batch(len(photos), PREPROCESSING))
    static = read_csv(user_run["results"] / "02_static.csv")[0]
    assert float(static["sqnr_db"]) == pytest.approx(own["sqnr_db"], abs=0.05)
    assert float(static["top1_agreement"]) == own["top1_agreement"]
    assert abs(samples["sqnr_db"] - own["sqnr_db"]) > 0.5  # so the sample photos' figure would fail the first


@pytest.mark.slow
@pytest.mark.parametrize("model", ["fp32.onnx", "static_int8.onnx"])
def test_server_answers_with_the_users_labels_as_the_model_does_on_the_users_preprocessing(user_run, model):
    """FP32: the server's top-1 is PyTorch's. Static INT8: the server's top-1 is the INT8 file's own on
    the user's torchvision-preprocessed inputs (how far INT8 is from PyTorch is stage 2's agreement column;
    this random-init stand-in backbone quantizes far worse than a pretrained one)."""
    if model == "fp32.onnx":
        expected_top1 = user_run["torch_logits"].argmax(axis=1)
    else:
        run = ort_runner(make_session(user_run["artifacts"] / model))
        expected_top1 = run(user_run["user_inputs"]).argmax(axis=1)
    # onnxruntime, as `expected_top1` was computed: --backend auto would serve stage 2's engine choice instead.
    # The whole image resized, as torchvision did for `user_inputs`: the random-init stand-in's INT8 model turns
    # even the one-grey-level differences of resizing the crop alone into other top-1 classes.
    decoding = Decoding(resize_crop_only=False)
    with (
        ServerProcess(user_run["artifacts"] / model, top_k=10, backend="onnxruntime", resize_crop_only=0) as url,
        PredictClient(url) as client,
    ):
        answers = [client.request(jpeg) for jpeg in user_run["jpegs"]]
        served = requests.get(url + "/model", timeout=10).json()
    assert served["preprocessing"] == PREPROCESSING.record() | decoding.record()  # the manifest's, not ImageNet's
    checkpoint_sha256 = hashlib.sha256(user_run["checkpoint"].read_bytes()).hexdigest()
    assert served["weights"] == f"file:{checkpoint_sha256[:12]}"  # the user's, as stage 1 recorded them
    assert served["top_k"] == len(CLASS_NAMES)  # what an answer carries, not the 10 asked for
    assert [status for status, _ in answers] == ["200"] * len(answers)
    for _, body in answers:  # top_k 10 of 4 classes: all 4, each once, with the user's names for its class ids
        assert sorted(p["label"] for p in body["predictions"]) == CLASS_NAMES
        assert all(p["label"] == CLASS_NAMES[p["class_id"]] for p in body["predictions"])
    served_top1 = np.array([body["predictions"][0]["class_id"] for _, body in answers])
    np.testing.assert_array_equal(served_top1, expected_top1)


# ------------------------------------------------------------------------------------------ bad input


def expect_one_line_error(capsys, tmp_path, *flags) -> str:
    with pytest.raises(SystemExit) as exit_info:
        run_stage(
            baseline_export_quantize,
            "--quick",
            "--artifacts-dir",
            tmp_path / "artifacts",
            "--results-dir",
            tmp_path / "results",
            *flags,
        )
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and error.startswith("error: ") and len(error.strip().splitlines()) == 1
    assert not (tmp_path / "artifacts" / "fp32.onnx").exists()
    return error


def test_whole_pickled_model_exits_2_saying_how_to_save_a_state_dict(tmp_path, capsys):
    torch.save(mobilenet_v3_small(num_classes=4), tmp_path / "whole.pth")
    error = expect_one_line_error(capsys, tmp_path, "--arch", "mobilenet_v3_small", "--weights", tmp_path / "whole.pth")
    assert "torch.save(model.state_dict()" in error


def test_class_name_count_mismatch_exits_2_with_both_counts(tmp_path, capsys):
    torch.save({"model": mobilenet_v3_small(num_classes=4).state_dict(), "epoch": 0}, tmp_path / "ckpt.pth")
    (tmp_path / "names.json").write_text(json.dumps(["a", "b", "c"]))
    error = expect_one_line_error(
        capsys,
        tmp_path,
        "--arch",
        "mobilenet_v3_small",
        "--weights",
        tmp_path / "ckpt.pth",
        "--class-names",
        tmp_path / "names.json",
    )
    assert "3 names" in error and "4 classes" in error


def test_wrong_arch_exits_2_naming_the_right_one(tmp_path, capsys):
    torch.save(mobilenet_v3_large(num_classes=5).state_dict(), tmp_path / "large.pth")
    error = expect_one_line_error(capsys, tmp_path, "--arch", "mobilenet_v3_small", "--weights", tmp_path / "large.pth")
    assert "--arch mobilenet_v3_large" in error


@pytest.mark.parametrize("weights", ["missing.pth", "garbage.pth", "directory"])
def test_unreadable_weights_exit_2(tmp_path, capsys, weights):
    (tmp_path / "garbage.pth").write_bytes(b"\x80\x02 not a checkpoint")
    (tmp_path / "directory").mkdir()
    assert "--weights" in expect_one_line_error(capsys, tmp_path, "--weights", tmp_path / weights)


def test_unreadable_class_names_exit_2(tmp_path, capsys):
    torch.save(mobilenet_v3_small(num_classes=4).state_dict(), tmp_path / "small.pth")
    (tmp_path / "names.txt").write_bytes(b"\xff\xfe\x00 not utf-8")
    error = expect_one_line_error(
        capsys,
        tmp_path,
        "--arch",
        "mobilenet_v3_small",
        "--weights",
        tmp_path / "small.pth",
        "--class-names",
        tmp_path / "names.txt",
    )
    assert "--class-names" in error


def test_crop_larger_than_resize_exits_2(tmp_path, capsys):
    assert "--crop" in expect_one_line_error(capsys, tmp_path, "--resize", 200, "--crop", 224)


@pytest.mark.slow
def test_stage_1_on_another_model_removes_what_stage_2_built_from_the_last(user_run, tmp_path, capsys):
    """Else the server would load the last run's static_int8.onnx with the new model's class names and weights
    record; the same model again keeps them (the export is byte for byte the same)."""
    artifacts, results = tmp_path / "artifacts", tmp_path / "results"
    shutil.copytree(user_run["artifacts"], artifacts)
    shutil.copytree(user_run["results"], results)
    built = json.loads((artifacts / "manifest.json").read_text())["static_int8"]
    stage_1 = ["--quick", "--artifacts-dir", artifacts, "--results-dir", results, "--backends", "onnxruntime"]
    user_model = ["--arch", "mobilenet_v3_small", "--weights", user_run["checkpoint"], "--class-names"]
    user_model += [user_run["root"] / "classes.txt", "--resize", PREPROCESSING.resize, "--crop", PREPROCESSING.crop]
    user_model += ["--mean", *PREPROCESSING.mean, "--std", *PREPROCESSING.std]
    run_stage(baseline_export_quantize, *stage_1, *user_model)
    assert "removed" not in capsys.readouterr().out
    assert (artifacts / "static_int8.onnx").is_file()
    assert json.loads((artifacts / "manifest.json").read_text())["static_int8"] == built

    # the same file taking another preprocessing is another model: its export is the same, not its input
    resized = tmp_path / "resized"
    shutil.copytree(artifacts, resized)
    other_resize = [str(PREPROCESSING.resize + 32) if flag == PREPROCESSING.resize else flag for flag in user_model]
    run_stage(baseline_export_quantize, *[resized if part == artifacts else part for part in stage_1], *other_resize)
    assert "removed static_int8.onnx, " in capsys.readouterr().out
    assert not (resized / "static_int8.onnx").exists()
    # ... and its rows say so: stage 2's tables, of the same weights, arch and classes, are now the last model's
    new_id = json.loads((resized / "manifest.json").read_text())["model"]["id"]
    assert new_id != json.loads((artifacts / "manifest.json").read_text())["model"]["id"]
    assert {row["model_id"] for row in read_csv(results / "01_baseline.csv")} == {new_id}
    sections = {
        section.split("\n", 1)[0]: section for section in (results / "summary.md").read_text().split("\n## ")[1:]
    }
    assert "**Not of stage 1's model" in sections["02_static"]
    assert "**Not of stage 1's model" not in sections["01_baseline"]

    with offline_weights(), pytest.warns(UserWarning, match="RANDOM INIT"):
        run_stage(baseline_export_quantize, *stage_1)  # the default: another model altogether
    out = capsys.readouterr().out
    assert "removed static_int8.onnx, " in out and "manifest.json's static_int8 and engine_choice: stage 2" in out, out
    assert not (artifacts / "static_int8.onnx").exists()
    assert "static_int8" not in json.loads((artifacts / "manifest.json").read_text())
    with pytest.raises(SystemExit):  # stages 3-5 now say to run stage 2, not serve the last model
        cli.run_stage(cli.serving_model, SimpleNamespace(model=None, artifacts_dir=artifacts, results_dir=results))
