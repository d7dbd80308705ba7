"""Weights provenance (never silently random) and the ONNX FP32 export's numerics."""
import hashlib
import json
import urllib.error

import pytest
import torch
import torchvision.models._api
from torchvision.models import mobilenet_v3_large

from mnv3.runtime import make_session, ort_runner
from mnv3.model import EXPORT_TOLERANCE, BadWeights, export_max_abs_diff, export_onnx, load_model, recalibrate_batchnorm
from mnv3.photos import CALIBRATION_SOURCES, augmented_views, held_out_images
from mnv3.preprocess import preprocess_batch

pytestmark = pytest.mark.integration


def test_offline_falls_back_to_labelled_random_init(monkeypatch):
    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network in tests")

    monkeypatch.setattr(torchvision.models._api, "load_state_dict_from_url", offline)
    with pytest.warns(UserWarning, match="RANDOM INIT"):
        model, provenance = load_model()
    assert provenance == "random-init"
    with pytest.warns(UserWarning):
        again, _ = load_model()
    # Seeded: two runs produce the same stand-in network.
    assert torch.equal(model.features[0][0].weight, again.features[0][0].weight)


def test_local_state_dict_is_labelled_with_its_hash(tmp_path):
    torch.manual_seed(1)
    source = mobilenet_v3_large(weights=None)
    path = tmp_path / "weights.pth"
    torch.save(source.state_dict(), path)
    model, provenance = load_model(path)
    assert provenance == f"file:{hashlib.sha256(path.read_bytes()).hexdigest()[:12]}"
    assert torch.equal(model.classifier[3].weight, source.classifier[3].weight)
    assert not model.training


@pytest.mark.parametrize("content", [None, b"not a checkpoint", "wrong_model"])
def test_bad_weights_file_is_a_clear_error(tmp_path, content):
    path = tmp_path / "weights.pth"
    if content == "wrong_model":
        torch.save({"conv.weight": torch.zeros(3)}, path)
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(BadWeights, match="--weights"):
        load_model(path)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    model = recalibrate_batchnorm(mobilenet_v3_large(weights=None), augmented_views(CALIBRATION_SOURCES, 8, 0))
    directory = tmp_path_factory.mktemp("export")
    path = export_onnx(model, directory / "fp32.onnx", directory / "classes.json")
    return model, path, directory / "classes.json"


def test_onnx_export_matches_pytorch_at_batch_1_and_8(exported):
    model, path, _ = exported
    photos = preprocess_batch(held_out_images(8))
    run = ort_runner(make_session(path))
    assert run(photos).shape == (8, 1000)  # the batch axis is dynamic
    assert export_max_abs_diff(model, run, [photos[:1], photos]) <= EXPORT_TOLERANCE


def test_export_check_detects_a_different_model(exported):
    model, path, _ = exported
    torch.manual_seed(1)
    other = recalibrate_batchnorm(mobilenet_v3_large(weights=None), augmented_views(CALIBRATION_SOURCES, 8, 0))
    photos = preprocess_batch(held_out_images(2))
    assert export_max_abs_diff(other, ort_runner(make_session(path)), [photos]) > EXPORT_TOLERANCE


def test_export_writes_imagenet_class_names(exported):
    names = json.loads(exported[2].read_text())
    assert len(names) == 1000 and names[207] == "golden retriever"
