"""MobileNetV3 (Large or Small, any number of classes) with honest provenance, its class names, and the
ONNX FP32 export. Needs torch; serving does not.

Weights come from a local file (a state_dict, or a training checkpoint with the state_dict under "model",
"model_state_dict" or "state_dict", as training scripts save it), else torchvision's ImageNet
weights, else a seeded random init that says so. The class count is the file's classifier shape.
"""

import argparse
import hashlib
import io
import json
import socket
import warnings
import zipfile
from pathlib import Path

import numpy as np
import torch
from torchvision.models import (
    MobileNet_V3_Large_Weights,
    MobileNet_V3_Small_Weights,
    mobilenet_v3_large,
    mobilenet_v3_small,
)

from mnv3.artifacts import (
    FILE_PROVENANCE_PREFIX,
    INPUT_NAME,
    OUTPUT_NAME,
    STAND_IN_PROVENANCE,
    replaced_when_written,
)
from mnv3.preprocess import DEFAULT_PREPROCESSING, Preprocessing, preprocess_batch

ARCHS = {"mobilenet_v3_large": mobilenet_v3_large, "mobilenet_v3_small": mobilenet_v3_small}
DEFAULT_ARCH = "mobilenet_v3_large"
IMAGENET_WEIGHTS = {
    "mobilenet_v3_large": MobileNet_V3_Large_Weights.IMAGENET1K_V1,
    "mobilenet_v3_small": MobileNet_V3_Small_Weights.IMAGENET1K_V1,
}
IMAGENET_CLASSES = MobileNet_V3_Large_Weights.IMAGENET1K_V1.meta["categories"]  # Small's list is the same
CLASSIFIER_WEIGHT = "classifier.3.weight"  # the last Linear: (classes, features)
RANDOM_INIT_SEED = 0
DOWNLOAD_TIMEOUT_S = 10  # offline machines must fall back in seconds, not hang
OPSET = 17
# Max abs logit difference ONNX FP32 may have from PyTorch FP32, per unit of the largest |logit| above 1:
# float32 rounding grows with the logits' scale, and a fine-tuned head's can be far larger than ImageNet's.
EXPORT_TOLERANCE = 1e-3
EXPORT_CHECK_BATCHES = (1, 8)  # batch sizes the export is checked at: one image, and a batch
SAVE_STATE_DICT = "torch.save(model.state_dict(), 'weights.pth')"


class BadWeights(ValueError):
    """--weights does not point at a loadable MobileNetV3 state_dict of the chosen --arch."""


class BadClassNames(ValueError):
    """--class-names is unreadable or does not name each of the model's classes once."""


def load_model(arch: str = DEFAULT_ARCH, weights_path=None) -> tuple[torch.nn.Module, str]:
    """Return (`arch` in eval mode, provenance); its class count is the weights' (`num_classes(model)`).

    Provenance is `file:<sha256[:12]>` for a local file, `imagenet1k_v1` for torchvision's weights
    (from its cache or downloaded), or `random-init` when neither is reachable. Random init is seeded,
    warned about loudly, and recorded in every output that uses it.
    """
    if weights_path is not None:
        data = _read_weights_file(weights_path)
        state_dict = _state_dict(weights_path, data)
        model = ARCHS[arch](weights=None, num_classes=_classifier_classes(weights_path, state_dict))
        _check_fits(weights_path, arch, model, state_dict)
        model.load_state_dict(state_dict)
        return model.eval(), f"{FILE_PROVENANCE_PREFIX}{hashlib.sha256(data).hexdigest()[:12]}"
    model = ARCHS[arch](weights=None)
    previous_timeout = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)
    try:
        state_dict = IMAGENET_WEIGHTS[arch].get_state_dict(progress=False, check_hash=True)
        model.load_state_dict(state_dict)
        return model.eval(), "imagenet1k_v1"
    except (OSError, RuntimeError) as exc:  # URLError is an OSError; a bad cached file a RuntimeError
        warnings.warn(
            f"ImageNet weights unavailable ({exc}). Using a seeded RANDOM INIT (seed {RANDOM_INIT_SEED}): "
            "latency and INT8-vs-FP32 agreement are meaningful, predicted labels are not. "
            f"Pass --weights PATH to use a downloaded {Path(IMAGENET_WEIGHTS[arch].url).name}.",
            stacklevel=2,
        )
    finally:
        socket.setdefaulttimeout(previous_timeout)
    torch.manual_seed(RANDOM_INIT_SEED)
    return ARCHS[arch](weights=None).eval(), STAND_IN_PROVENANCE


def num_classes(model: torch.nn.Module) -> int:
    head = model.classifier[-1]  # type: ignore[index]
    assert isinstance(head, torch.nn.Linear)  # every torchvision MobileNetV3 ends in one
    return head.out_features


def _read_weights_file(path) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise BadWeights(
            f"--weights {path}: cannot read it ({exc.strerror or exc}); "
            "pass the path of your .pth state_dict or checkpoint"
        ) from exc


def _state_dict(path, data: bytes) -> dict:
    """The state_dict in `data`: the file itself, or a training checkpoint's entry that holds it.

    Loaded with weights_only=True, so the file cannot run code; train.py's checkpoints also hold its
    argparse.Namespace, which is allowed for that."""
    if not data.startswith(TORCH_SAVE_MAGIC):  # torch.load's legacy reader fails on text with any error at all
        raise BadWeights(
            f"--weights {path}: not a PyTorch state_dict or checkpoint (not a file torch.save writes: neither a "
            f"zip archive nor a pickle); save one with {SAVE_STATE_DICT}"
        )
    if data.startswith(TORCH_SAVE_MAGIC[0]):
        try:
            names = zipfile.ZipFile(io.BytesIO(data)).namelist()
        except (zipfile.BadZipFile, OSError):  # as zipfile.is_zipfile; torch.load's reason would be the zip reader's
            raise BadWeights(
                f"--weights {path}: a zip archive cut short or damaged (its end is missing), as a copy or a "
                f"save that did not finish leaves one: copy it again, or save it again with {SAVE_STATE_DICT}"
            ) from None
        if any(name.endswith("/constants.pkl") for name in names):
            raise BadWeights(  # torch.load's own answer advises weights_only=False
                f"--weights {path} is a TorchScript archive (torch.jit.save), whose weights cannot be loaded "
                f"without its code; save the model's weights instead: {SAVE_STATE_DICT}"
            )
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            loaded = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # the unpickler's and zip reader's errors are of many untyped kinds
        if _pickles_modules(data):
            raise BadWeights(
                f"--weights {path} is a whole pickled model (torch.save(model)), which cannot be loaded "
                f"without running code from the file; save its weights instead: {SAVE_STATE_DICT}"
            ) from exc
        raise BadWeights(
            f"--weights {path}: not a PyTorch state_dict or checkpoint ({_load_failure(exc)}); "
            f"save one with {SAVE_STATE_DICT}"
        ) from exc
    if isinstance(loaded, dict):
        entry = next((key for key in CHECKPOINT_ENTRIES if _holds_tensors(loaded.get(key))), None)
        loaded = _unwrapped(loaded[entry] if entry else loaded)
    if not isinstance(loaded, dict) or not all(isinstance(value, torch.Tensor) for value in loaded.values()):
        found = ""
        if isinstance(loaded, dict):
            found = f" (its keys: {_some(map(str, loaded), 5)})"
        raise BadWeights(
            f"--weights {path}: holds no state_dict (a dict of tensors, or a checkpoint with one under "
            f"{' or '.join(map(repr, CHECKPOINT_ENTRIES))}){found}; save one with {SAVE_STATE_DICT}"
        )
    return loaded


# Where training scripts keep the model's state_dict in a checkpoint, beside the optimizer's: torchvision's
# references/classification ("model"), PyTorch's tutorials ("model_state_dict"), Lightning and timm ("state_dict").
CHECKPOINT_ENTRIES = ("model", "model_state_dict", "state_dict")
# The modules of a torchvision MobileNetV3, whose names begin every key of its state_dict.
MOBILENET_V3_MODULES = frozenset({"features", "avgpool", "classifier"})


def _holds_tensors(entry) -> bool:
    """Whether a checkpoint's `entry` is a state_dict: a dict of tensors (not, say, the model's config)."""
    return isinstance(entry, dict) and bool(entry) and all(isinstance(value, torch.Tensor) for value in entry.values())


def _unwrapped(state: dict) -> dict:
    """`state` without the prefix a wrapper put before every name: (Distributed)DataParallel's and train.py's
    model_ema's "module." (an AveragedModel, with its n_averaged count beside), a Lightning module's attribute
    (e.g. "model.", or "classifier." itself). Names that are already torchvision's, or that share no prefix,
    are left as they are."""
    while True:
        keys = [key for key in state if key != "n_averaged"]
        if not keys or _is_mobilenet_v3(keys) or not all(isinstance(key, str) and "." in key for key in keys):
            return state
        prefixes = {key.split(".", 1)[0] for key in keys}
        if len(prefixes) != 1:
            return state
        prefix = f"{prefixes.pop()}."
        state = {key.removeprefix(prefix): state[key] for key in keys}


def _is_mobilenet_v3(names) -> bool:
    """Whether `names` are a torchvision MobileNetV3's: each begins with one of its modules' names, and both
    its features and its classifier are there."""
    tops = {str(name).split(".", 1)[0] for name in names}
    return tops <= MOBILENET_V3_MODULES and {"features", "classifier"} <= tops


# How a file torch.save wrote begins: its zip format, or the legacy format's pickle protocol byte.
TORCH_SAVE_MAGIC = (b"PK\x03\x04", b"\x80")


def _load_failure(exc: Exception) -> str:
    """Why torch.load refused `data`, in terms of the file. Not PyTorch's own first line for a refused pickle,
    which advises loading with weights_only=False: running the file's code is what --weights never does."""
    text = str(exc)
    if "WeightsUnpickler error:" in text:  # the reason follows PyTorch's advice, e.g. "Unsupported global: ..."
        detail = text.split("WeightsUnpickler error:", 1)[1].strip()
        return detail.splitlines()[0] if detail else _first_line(exc)
    return _first_line(exc)


def _pickles_modules(data: bytes) -> bool:
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))
    except Exception:  # not a torch.save zip at all: then it is no pickled model either
        return False
    return any(name.startswith(("torch.nn.", "torchvision.")) for name in names)


def _classifier_classes(path, state_dict: dict) -> int:
    weight = state_dict.get(CLASSIFIER_WEIGHT)
    if weight is None or weight.ndim != 2:
        head = sorted(key for key in state_dict if key.startswith("classifier."))
        if head:  # e.g. classifier[3] = Sequential(Dropout, Linear): "classifier.3.1.weight"
            raise BadWeights(
                f"--weights {path}: a MobileNetV3 whose head was changed ({_some(head, 3)}); only torchvision's "
                f"head is supported, whose last layer is one Linear ({CLASSIFIER_WEIGHT}): replace "
                "model.classifier[3] with a torch.nn.Linear of your classes, and train that"
            )
        raise BadWeights(
            f"--weights {path}: no {CLASSIFIER_WEIGHT} of shape (classes, features), so not a "
            "torchvision MobileNetV3 state_dict; pass the weights of a torchvision.models."
            "mobilenet_v3_large or mobilenet_v3_small"
        )
    if weight.shape[0] < 2:
        raise BadWeights(
            f"--weights {path}: a head of one output (a sigmoid's, for a yes/no class), whose softmax, what "
            "the server answers, is 1.0 whatever the photo: train a head of two outputs, one a class, with "
            "CrossEntropyLoss"
        )
    return weight.shape[0]


def _mismatches(model: torch.nn.Module, state_dict: dict) -> list[str]:
    expected = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    given = {key: tuple(value.shape) for key, value in state_dict.items()}
    return (
        [f"missing {key}" for key in expected.keys() - given.keys()]
        + [f"unexpected {key}" for key in given.keys() - expected.keys()]
        + [
            f"{key} is {given[key]}, not {expected[key]}"
            for key in expected.keys() & given.keys()
            if given[key] != expected[key]
        ]
    )


def _check_fits(path, arch: str, model: torch.nn.Module, state_dict: dict) -> None:
    """Raise BadWeights naming the right --arch when the weights are another arch's."""
    mismatches = _mismatches(model, state_dict)
    if not mismatches:
        return
    for other in ARCHS.keys() - {arch}:
        if not _mismatches(ARCHS[other](weights=None, num_classes=num_classes(model)), state_dict):
            raise BadWeights(f"--weights {path} holds {other} weights, not {arch}: pass --arch {other}")
    expected = model.state_dict()
    shared = expected.keys() & state_dict.keys()
    if len(shared) * 2 > len(expected) and all(state_dict[key].shape == expected[key].shape for key in shared):
        # this arch's tensors, under names that do not all match: another --arch would not help
        raise BadWeights(
            f"--weights {path}: {arch} weights, but {len(mismatches)} of their names are not torchvision's "
            f"({_some(sorted(mismatches), 3)}); save the model's state_dict alone, with no other entries or "
            f"renamed layers: {SAVE_STATE_DICT}"
        )
    raise BadWeights(
        f"--weights {path}: not a {arch} state_dict ({len(mismatches)} tensors differ, e.g. "
        f"{sorted(mismatches)[0]}); pass --arch {' or '.join(ARCHS)} to match how it was trained"
    )


def _some(items, most: int) -> str:
    """The first `most` of `items`, comma-separated, with "..." when there are more."""
    items = list(items)
    return ", ".join(items[:most]) + (", ..." if len(items) > most else "")


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def read_class_names(path) -> list[str]:
    """A JSON list of names, or a text file of one name a line (blank lines skipped)."""
    try:
        text = Path(path).read_text(encoding="utf-8-sig")  # a byte-order mark, as Windows editors write, is no name
    except FileNotFoundError:
        raise BadClassNames(f"--class-names {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BadClassNames(f"--class-names {path}: cannot read it as UTF-8 text ({_first_line(exc)})") from exc
    if text.lstrip().startswith("{"):
        raise BadClassNames(
            f"--class-names {path}: a JSON object; pass a JSON list of names in class-id order, or one name a line"
        )
    if text.lstrip().startswith("["):
        try:
            names = json.loads(text)
        except json.JSONDecodeError as exc:
            raise BadClassNames(f"--class-names {path}: starts like a JSON list but is not one ({exc})") from exc
    else:
        names = [line.strip() for line in text.splitlines() if line.strip()]
    if not isinstance(names, list) or not names or not all(isinstance(name, str) and name for name in names):
        raise BadClassNames(f"--class-names {path}: expected a JSON list of names or one name a line")
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise BadClassNames(f"--class-names {path}: names must be distinct; repeated: {', '.join(duplicates)}")
    return names


def class_names_for(model: torch.nn.Module, class_names_path=None) -> tuple[list[str], str]:
    """(the model's class names, where they came from: `file:<name>`, `imagenet` or `class_<id>`).

    Without --class-names a 1000-class model is taken to be ImageNet's, as torchvision's weights are;
    any other head gets class_0.. and a warning: every measurement holds, only the labels are unnamed."""
    count = num_classes(model)
    if class_names_path is not None:
        names = read_class_names(class_names_path)
        if len(names) != count:
            raise BadClassNames(
                f"--class-names {class_names_path} has {len(names)} names but the model has {count} "
                f"classes ({CLASSIFIER_WEIGHT}); give one name per class, in training order"
            )
        return names, f"file:{Path(class_names_path).name}"
    if count == len(IMAGENET_CLASSES):
        return IMAGENET_CLASSES, "imagenet"
    warnings.warn(
        f"the model has {count} classes and no --class-names: labels are class_0..class_{count - 1}. "
        "Pass --class-names FILE (one name a line, in training order: torchvision's ImageFolder sorts "
        "the class folder names)",
        stacklevel=2,
    )
    return [f"class_{i}" for i in range(count)], "class_<id>"


def export_onnx(model: torch.nn.Module, path, preprocessing: Preprocessing = DEFAULT_PREPROCESSING) -> Path:
    """Export for `preprocessing`'s input size with a dynamic batch axis (the batcher needs it) via the
    TorchScript exporter, opset 17."""
    path = Path(path)
    example = torch.randn(1, *preprocessing.input_shape)
    # An export cut short never leaves a truncated model for stage 2.
    with replaced_when_written(path) as partial, warnings.catch_warnings():
        # Chosen, not left over: the graph rewrites (mnv3.graph_rewrites) and INT8 recipes were written against
        # this exporter's graph, and the results measured on it; torch.export's exporter writes another graph.
        warnings.filterwarnings("ignore", "You are using the legacy TorchScript-based ONNX export", DeprecationWarning)
        torch.onnx.export(
            model,
            (example,),
            str(partial),
            dynamo=False,
            opset_version=OPSET,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
        )
    return path


@torch.no_grad()
def recalibrate_batchnorm(
    model: torch.nn.Module, images, batch_size: int = 32, preprocessing: Preprocessing = DEFAULT_PREPROCESSING
) -> torch.nn.Module:
    """Re-estimate BatchNorm running statistics on `images` (PIL), leaving every weight untouched.

    A random init has BN statistics (mean 0, var 1) unrelated to its activations, which shrink layer
    by layer until the logits are ~1e-10 and INT8 comparisons mean nothing. Real statistics give the
    stand-in network activation ranges like a trained one's. Used only for `random-init`.
    """
    batch_norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    for bn in batch_norms:
        bn.reset_running_stats()
        bn.momentum = None  # cumulative average over all batches
    model.train()
    for start in range(0, len(images), batch_size):
        model(torch.from_numpy(preprocess_batch(images[start : start + batch_size], preprocessing)))
    for bn in batch_norms:
        bn.momentum = 0.1
    return model.eval()


def torch_runner(model: torch.nn.Module):
    """`run(batch) -> logits` on numpy arrays, the same calling convention as an ORT session's runner."""

    def run(batch):
        with torch.inference_mode():
            return model(torch.from_numpy(batch)).numpy()

    return run


def export_max_abs_diff(model: torch.nn.Module, onnx_run, batches) -> float:
    """Largest |ONNX - PyTorch| logit over `batches` (the export check is run at several batch sizes)."""
    torch_run = torch_runner(model)
    return max(float(abs(onnx_run(batch) - torch_run(batch)).max()) for batch in batches)


def check_export(model: torch.nn.Module, onnx_run, images, batch_sizes=EXPORT_CHECK_BATCHES) -> float:
    """`export_max_abs_diff` at each of `batch_sizes` of `images`; over EXPORT_TOLERANCE (scaled by the largest
    |logit| when that is above 1) it raises: a wrong export is a bug, never shipped. Fewer `images` than a
    batch size (a user's few --labels photos) are cycled to fill it."""
    batches = [images[np.arange(n) % len(images)] for n in batch_sizes]
    diff = export_max_abs_diff(model, onnx_run, batches)
    tolerance = EXPORT_TOLERANCE * max(1.0, max(float(abs(onnx_run(batch)).max()) for batch in batches))
    if diff > tolerance:
        raise RuntimeError(
            f"ONNX export differs from PyTorch by {diff:.2e} > {tolerance:.2e} "
            f"(max abs logit, batches {tuple(batch_sizes)}): the export is wrong, not shipping it"
        )
    return diff


def state_dict_size_mb(model: torch.nn.Module) -> float:
    """Size of the model as torch.save writes it, comparable with the .onnx file sizes."""
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return round(buffer.tell() / 1e6, 3)
