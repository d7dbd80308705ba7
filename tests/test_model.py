"""Weights provenance (never silently random), what a weights file may hold, class names, and the ONNX
FP32 export's numerics."""

import argparse
import datetime
import hashlib
import urllib.error
import warnings
from pathlib import Path

import pytest
import torch
import torchvision.models._api
from torchvision.models import mobilenet_v3_large, mobilenet_v3_small

from mnv3.model import (
    EXPORT_TOLERANCE,
    IMAGENET_CLASSES,
    BadClassNames,
    BadWeights,
    class_names_for,
    export_max_abs_diff,
    export_onnx,
    load_model,
    num_classes,
    recalibrate_batchnorm,
)
from mnv3.photos import CALIBRATION_SOURCES, augmented_views, held_out_images
from mnv3.preprocess import preprocess_batch
from mnv3.runtime import make_session, ort_runner

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("arch", ["mobilenet_v3_large", "mobilenet_v3_small"])
def test_offline_falls_back_to_labelled_random_init(monkeypatch, arch):
    requested = []

    def offline(url, *args, **kwargs):
        requested.append(url)
        raise urllib.error.URLError("no network in tests")

    monkeypatch.setattr(torchvision.models._api, "load_state_dict_from_url", offline)
    with pytest.warns(UserWarning, match="RANDOM INIT"):
        model, provenance = load_model(arch)
    assert provenance == "random-init" and requested[0].rsplit("/", 1)[1].startswith(arch)  # that arch's weights
    with pytest.warns(UserWarning):
        again, _ = load_model(arch)
    # Seeded: two runs produce the same stand-in network.
    assert torch.equal(model.features[0][0].weight, again.features[0][0].weight)
    assert len(model.features) == len(getattr(torchvision.models, arch)().features) and num_classes(model) == 1000
    assert class_names_for(model) == (IMAGENET_CLASSES, "imagenet")


def test_local_state_dict_is_labelled_with_its_hash(tmp_path):
    torch.manual_seed(1)
    source = mobilenet_v3_large(weights=None)
    path = tmp_path / "weights.pth"
    torch.save(source.state_dict(), path)
    model, provenance = load_model("mobilenet_v3_large", path)
    assert provenance == f"file:{hashlib.sha256(path.read_bytes()).hexdigest()[:12]}"
    assert torch.equal(model.classifier[3].weight, source.classifier[3].weight)
    assert not model.training


def test_training_checkpoint_loads_its_model_entry_with_the_classes_of_its_head(tmp_path):
    torch.manual_seed(2)
    source = mobilenet_v3_small(num_classes=4)
    path = tmp_path / "model_9.pth"
    # As references/classification/train.py saves it, its argparse.Namespace included.
    torch.save(
        {
            "model": source.state_dict(),
            "optimizer": torch.optim.SGD(source.parameters(), lr=0.1).state_dict(),
            "epoch": 9,
            "args": argparse.Namespace(model="mobilenet_v3_small", lr=0.1),
            "model_ema": source.state_dict(),
        },
        path,
    )
    model, provenance = load_model("mobilenet_v3_small", path)
    assert provenance.startswith("file:") and num_classes(model) == 4
    assert torch.equal(model.classifier[3].weight, source.classifier[3].weight)


@pytest.mark.parametrize("wrapped", ["DataParallel", "model_ema"])
def test_weights_saved_under_module_load(tmp_path, wrapped):
    """(Distributed)DataParallel's state_dict, and train.py's model_ema (an AveragedModel, with n_averaged)."""
    torch.manual_seed(3)
    source = mobilenet_v3_small(num_classes=4)
    saved = {f"module.{key}": value for key, value in source.state_dict().items()}
    if wrapped == "model_ema":
        saved["n_averaged"] = torch.tensor(7)
    path = tmp_path / "wrapped.pth"
    torch.save(saved, path)
    model, _ = load_model("mobilenet_v3_small", path)
    assert num_classes(model) == 4 and torch.equal(model.classifier[3].weight, source.classifier[3].weight)


def test_other_archs_weights_name_the_right_arch(tmp_path):
    path = tmp_path / "small.pth"
    torch.save(mobilenet_v3_small(num_classes=3).state_dict(), path)
    with pytest.raises(BadWeights, match="holds mobilenet_v3_small weights.*pass --arch mobilenet_v3_small"):
        load_model("mobilenet_v3_large", path)


@pytest.mark.parametrize("change", ["extra", "missing"])
def test_this_archs_weights_under_other_names_are_named_not_sent_to_another_arch(tmp_path, change):
    state = mobilenet_v3_large(num_classes=5).state_dict()
    if change == "extra":
        state["extra.head.weight"] = torch.zeros(2)
    else:
        del state["features.0.0.weight"]
    path = tmp_path / "weights.pth"
    torch.save(state, path)
    with pytest.raises(BadWeights) as caught:
        load_model("mobilenet_v3_large", path)
    message = str(caught.value)
    assert "mobilenet_v3_large weights, but 1 of their names are not torchvision's" in message
    assert ("unexpected extra.head.weight" if change == "extra" else "missing features.0.0.weight") in message
    assert "--arch" not in message


def test_a_checkpoint_without_a_model_entry_names_its_keys(tmp_path):
    path = tmp_path / "mine.ckpt"
    torch.save({"epoch": 3, "weights": {"conv.weight": torch.zeros(1)}}, path)
    with pytest.raises(BadWeights) as refused:
        load_model("mobilenet_v3_large", path)
    assert str(refused.value) == (
        f"--weights {path}: holds no state_dict (a dict of tensors, or a checkpoint with one under 'model' or "
        "'model_state_dict' or 'state_dict') (its keys: epoch, weights); save one with "
        "torch.save(model.state_dict(), 'weights.pth')"
    )


@pytest.mark.parametrize(
    ("entry", "prefix"),
    [("model_state_dict", ""), ("state_dict", "model."), ("state_dict", "module.net."), ("state_dict", "classifier.")],
    ids=["PyTorch tutorial", "Lightning", "Lightning with DataParallel", "Lightning, an attribute named classifier"],
)
def test_the_state_dict_of_other_training_scripts_checkpoints_loads(tmp_path, entry, prefix):
    """Their state_dict was said to be none: "holds no state_dict (its keys: model_state_dict, ...)"."""
    torch.manual_seed(4)
    source = mobilenet_v3_small(num_classes=4)
    path = tmp_path / "checkpoint.ckpt"
    state = {f"{prefix}{key}": value for key, value in source.state_dict().items()}
    # "model" here is the model's config, not its weights: the entry that holds tensors is the one
    torch.save({"epoch": 2, "model": {"arch": "small"}, entry: state, "optimizer_states": []}, path)
    model, _ = load_model("mobilenet_v3_small", path)
    assert num_classes(model) == 4 and torch.equal(model.classifier[3].weight, source.classifier[3].weight)


def test_a_torchscript_archive_is_refused_without_advice_to_run_its_code(tmp_path):
    path = tmp_path / "scripted.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit is deprecated: users still have such files
        torch.jit.save(torch.jit.script(mobilenet_v3_small(num_classes=3)), path)
    with pytest.raises(BadWeights) as refused:
        load_model("mobilenet_v3_small", path)
    assert str(refused.value).startswith(f"--weights {path} is a TorchScript archive (torch.jit.save), whose ")
    assert "weights_only" not in str(refused.value)


def test_a_checkpoint_cut_short_says_so_and_to_copy_it_again(tmp_path):
    path = tmp_path / "model_29.pth"
    torch.save(mobilenet_v3_small(num_classes=3).state_dict(), path)
    path.write_bytes(path.read_bytes()[:100_000])
    with pytest.raises(BadWeights, match=r": a zip archive cut short or damaged .*: copy it again, or save it again"):
        load_model("mobilenet_v3_small", path)


def test_a_changed_head_is_named_and_refused(tmp_path):
    model = mobilenet_v3_small(num_classes=3)
    model.classifier[3] = torch.nn.Sequential(torch.nn.Dropout(0.5), torch.nn.Linear(1024, 3))
    path = tmp_path / "seqhead.pth"
    torch.save(model.state_dict(), path)
    with pytest.raises(BadWeights) as refused:  # was "... so not a torchvision MobileNetV3 state_dict"
        load_model("mobilenet_v3_small", path)
    assert "a MobileNetV3 whose head was changed (classifier.0.bias, classifier.0.weight, " in str(refused.value)
    assert str(refused.value).endswith(
        "replace model.classifier[3] with a torch.nn.Linear of your classes, and train that"
    )


def test_a_one_output_head_is_refused_as_its_softmax_is_always_one(tmp_path):
    path = tmp_path / "binary.pth"
    torch.save(mobilenet_v3_small(num_classes=1).state_dict(), path)
    with pytest.raises(BadWeights, match=r"a head of one output .* train a head of two outputs"):
        load_model("mobilenet_v3_small", path)


def test_whole_pickled_model_is_refused_saying_how_to_save_a_state_dict(tmp_path):
    path = tmp_path / "whole.pth"
    torch.save(mobilenet_v3_small(num_classes=3), path)
    with pytest.raises(BadWeights, match=r"whole pickled model.*torch.save\(model.state_dict\(\)"):
        load_model("mobilenet_v3_small", path)


@pytest.mark.parametrize(
    "text",
    ['["cat", "dog", "fox"]', "cat\ndog\n\nfox\n", "\ufeffcat\r\ndog\r\nfox\r\n", '\ufeff["cat", "dog", "fox"]'],
    ids=["json", "lines", "lines with a byte-order mark", "json with a byte-order mark"],
)
def test_class_names_file_names_each_class(tmp_path, text):
    path = tmp_path / "names"
    path.write_text(text)
    assert class_names_for(mobilenet_v3_small(num_classes=3), path) == (["cat", "dog", "fox"], "file:names")
    with pytest.raises(BadClassNames, match="has 3 names but the model has 4 classes"):
        class_names_for(mobilenet_v3_small(num_classes=4), path)


@pytest.mark.parametrize(
    "text", ["", "cat\ncat\ndog\n", '["cat", 3, "dog"]', '["cat", "dog"', '{"0": "cat", "1": "dog"}']
)
def test_unusable_class_names_file_is_a_clear_error(tmp_path, text):
    path = tmp_path / "names.txt"
    path.write_text(text)
    with pytest.raises(BadClassNames, match="--class-names"):
        class_names_for(mobilenet_v3_small(num_classes=3), path)


def test_custom_head_without_class_names_is_labelled_class_id_with_a_warning():
    with pytest.warns(UserWarning, match="--class-names"):
        names, source = class_names_for(mobilenet_v3_small(num_classes=3))
    assert names == ["class_0", "class_1", "class_2"] and source == "class_<id>"


@pytest.mark.parametrize("content", [None, b"not a checkpoint", "wrong_model", "no_tensors"])
def test_bad_weights_file_is_a_clear_error(tmp_path, content):
    path = tmp_path / "weights.pth"
    if content == "wrong_model":
        torch.save({"conv.weight": torch.zeros(3)}, path)
    elif content == "no_tensors":
        torch.save({"epoch": 3}, path)
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(BadWeights, match="--weights"):
        load_model("mobilenet_v3_large", path)


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"# a README, not weights\n", "not a file torch.save writes: neither a zip archive nor a pickle"),
        # short text files torch.load's legacy reader failed on with a KeyError and an IndexError: tracebacks
        (b"hello", "not a file torch.save writes"),
        (b"cat\ndog\n", "not a file torch.save writes"),
        (b"\x80\x02 a pickle cut short", "not a PyTorch state_dict or checkpoint"),
        (b"PK\x03\x04 cut short", "a zip archive cut short or damaged"),
        (
            {"conv.weight": torch.zeros(1), "saved_on": datetime.date(2026, 12, 3)},
            "Unsupported global: GLOBAL datetime.date",
        ),
    ],
)
def test_a_refused_weights_file_says_why_and_never_advises_loading_it_unsafely(tmp_path, content, reason):
    path = tmp_path / "weights.pth"
    if isinstance(content, dict):
        torch.save(content, path)
    else:
        path.write_bytes(content)
    with pytest.raises(BadWeights) as refused:
        load_model("mobilenet_v3_large", path)
    assert reason in str(refused.value) and "weights_only" not in str(refused.value)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    model = recalibrate_batchnorm(mobilenet_v3_large(weights=None), augmented_views(CALIBRATION_SOURCES, 8, 0))
    return model, export_onnx(model, tmp_path_factory.mktemp("export") / "fp32.onnx")


def test_onnx_export_matches_pytorch_at_batch_1_and_8(exported):
    model, path = exported
    photos = preprocess_batch(held_out_images(8))
    run = ort_runner(make_session(path))
    assert run(photos).shape == (8, 1000)  # the batch axis is dynamic
    assert export_max_abs_diff(model, run, [photos[:1], photos]) <= EXPORT_TOLERANCE


def test_export_check_detects_a_different_model(exported):
    model, path = exported
    torch.manual_seed(1)
    other = recalibrate_batchnorm(mobilenet_v3_large(weights=None), augmented_views(CALIBRATION_SOURCES, 8, 0))
    photos = preprocess_batch(held_out_images(2))
    assert export_max_abs_diff(other, ort_runner(make_session(path)), [photos]) > EXPORT_TOLERANCE


def test_imagenet_class_names_are_torchvisions():
    assert len(IMAGENET_CLASSES) == 1000 and IMAGENET_CLASSES[207] == "golden retriever"


def test_a_missing_class_names_file_is_named_as_missing(tmp_path):
    with pytest.raises(BadClassNames, match=r"^--class-names .*/nope.txt: no such file$"):
        class_names_for(mobilenet_v3_small(num_classes=3), tmp_path / "nope.txt")


def test_an_export_cut_short_leaves_the_last_model_and_no_remains(tmp_path, monkeypatch):
    # Written beside fp32.onnx and renamed over it: stage 2 never reads a truncated model
    (tmp_path / "fp32.onnx").write_bytes(b"the last export")

    def interrupted(model, args, path, **kwargs):
        Path(path).write_bytes(b"half a model")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch.onnx, "export", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_onnx(torch.nn.Identity(), tmp_path / "fp32.onnx")
    assert [p.name for p in tmp_path.iterdir()] == ["fp32.onnx"]
    assert (tmp_path / "fp32.onnx").read_bytes() == b"the last export"
