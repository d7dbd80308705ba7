"""MobileNetV3-Large weights (with honest provenance) and the ONNX FP32 export. Needs torch; serving does not."""
import hashlib
import io
import json
import pickle
import socket
import warnings
from pathlib import Path

import torch
from torchvision.models import MobileNet_V3_Large_Weights, mobilenet_v3_large

from mnv3.preprocess import CROP_SIZE

WEIGHTS = MobileNet_V3_Large_Weights.IMAGENET1K_V1
RANDOM_INIT_SEED = 0
DOWNLOAD_TIMEOUT_S = 10  # offline machines must fall back in seconds, not hang
OPSET = 17
EXPORT_TOLERANCE = 1e-3  # max abs logit difference ONNX FP32 may have from PyTorch FP32
EXPORT_CHECK_BATCHES = (1, 8)  # batch sizes the export is checked at: one image, and a batch


class BadWeights(ValueError):
    """--weights does not point at a loadable mobilenet_v3_large state_dict."""


def load_model(weights_path=None) -> tuple[torch.nn.Module, str]:
    """Return (model in eval mode, provenance).

    Provenance is `file:<sha256[:12]>` for a local state_dict, `imagenet1k_v1` for torchvision's
    weights (from its cache or downloaded), or `random-init` when neither is reachable. Random init
    is seeded, warned about loudly, and recorded in every output that uses it.
    """
    model = mobilenet_v3_large(weights=None)
    if weights_path is not None:
        try:
            data = Path(weights_path).read_bytes()
            state_dict = torch.load(weights_path, map_location="cpu", weights_only=True)
            model.load_state_dict(state_dict)
        except (OSError, RuntimeError, pickle.UnpicklingError, TypeError, AttributeError) as exc:
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise BadWeights(
                f"--weights {weights_path}: not a loadable mobilenet_v3_large state_dict ({first_line}). "
                "Pass the file torchvision downloads (mobilenet_v3_large-8738ca79.pth) or omit --weights."
            ) from exc
        return model.eval(), f"file:{hashlib.sha256(data).hexdigest()[:12]}"
    previous_timeout = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)
    try:
        state_dict = WEIGHTS.get_state_dict(progress=False, check_hash=True)
        model.load_state_dict(state_dict)
        return model.eval(), "imagenet1k_v1"
    except (OSError, RuntimeError) as exc:  # URLError is an OSError; a bad cached file a RuntimeError
        warnings.warn(
            f"ImageNet weights unavailable ({exc}). Using a seeded RANDOM INIT (seed {RANDOM_INIT_SEED}): "
            "latency and INT8-vs-FP32 agreement are meaningful, predicted labels are not. "
            "Pass --weights PATH to use a downloaded mobilenet_v3_large-8738ca79.pth.",
            stacklevel=2,
        )
    finally:
        socket.setdefaulttimeout(previous_timeout)
    torch.manual_seed(RANDOM_INIT_SEED)
    return mobilenet_v3_large(weights=None).eval(), "random-init"


def export_onnx(model: torch.nn.Module, path, class_names_path=None) -> Path:
    """Export with a dynamic batch axis (the batcher needs it) via the TorchScript exporter, opset 17."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    example = torch.randn(1, 3, CROP_SIZE, CROP_SIZE)
    torch.onnx.export(
        model, example, str(path), dynamo=False, opset_version=OPSET,
        input_names=["input"], output_names=["logits"],
        dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
    )
    if class_names_path is not None:
        Path(class_names_path).write_text(json.dumps(WEIGHTS.meta["categories"]))
    return path


@torch.no_grad()
def recalibrate_batchnorm(model: torch.nn.Module, images, batch_size: int = 32) -> torch.nn.Module:
    """Re-estimate BatchNorm running statistics on `images` (PIL), leaving every weight untouched.

    A random init has BN statistics (mean 0, var 1) unrelated to its activations, which shrink layer
    by layer until the logits are ~1e-10 and INT8 comparisons mean nothing. Real statistics give the
    stand-in network activation ranges like a trained one's. Used only for `random-init`.
    """
    from mnv3.preprocess import preprocess_batch

    batch_norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    for bn in batch_norms:
        bn.reset_running_stats()
        bn.momentum = None  # cumulative average over all batches
    model.train()
    for start in range(0, len(images), batch_size):
        model(torch.from_numpy(preprocess_batch(images[start:start + batch_size])))
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


def check_export(model: torch.nn.Module, onnx_run, images) -> float:
    """`export_max_abs_diff` at each EXPORT_CHECK_BATCHES size of `images`; over EXPORT_TOLERANCE it raises:
    a wrong export is a bug, never shipped."""
    diff = export_max_abs_diff(model, onnx_run, [images[:n] for n in EXPORT_CHECK_BATCHES])
    if diff > EXPORT_TOLERANCE:
        raise RuntimeError(f"ONNX export differs from PyTorch by {diff:.2e} > {EXPORT_TOLERANCE} "
                           f"(max abs logit, batches {EXPORT_CHECK_BATCHES}): the export is wrong, not shipping it")
    return diff


def state_dict_size_mb(model: torch.nn.Module) -> float:
    """Size of the model as torch.save writes it, comparable with the .onnx file sizes."""
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return round(buffer.tell() / 1e6, 3)
