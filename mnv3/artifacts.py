"""Where each stage reads and writes, and the error a user sees when an earlier stage is missing."""
import json
from pathlib import Path

ARTIFACTS_DIR = Path("artifacts")  # git-ignored: ONNX files, profiles, manifest
RESULTS_DIR = Path("results")  # committed: CSVs, plots, summary.md
CALIBRATION_DIR = Path("calibration_images")

FP32_ONNX = "fp32.onnx"
DYNAMIC_INT8_ONNX = "dynamic_int8.onnx"
STATIC_INT8_ONNX = "static_int8.onnx"
# ImageNet class names written beside the models so serving never needs torchvision.
CLASS_NAMES_JSON = "imagenet_classes.json"
# What each stage produced (weights provenance, which file is the shipped INT8 model, ...).
MANIFEST_JSON = "manifest.json"

STAGE_SCRIPTS = {
    1: "baseline_export_quantize.py",
    2: "static_quantization.py",
    3: "fastapi_serving.py",
    4: "caching.py",
    5: "batching_loadtest.py",
}


class MissingArtifact(FileNotFoundError):
    """An input that an earlier stage writes is not there."""


def require(path, stage: int) -> Path:
    """Return `path` if it exists, else raise an error that names the stage to run."""
    path = Path(path)
    if not path.exists():
        raise MissingArtifact(
            f"{path} not found: it is written by stage {stage}. "
            f"Run `python {STAGE_SCRIPTS[stage]}` first (or `make run` for all stages)."
        )
    return path


def read_manifest(artifacts_dir) -> dict:
    path = Path(artifacts_dir) / MANIFEST_JSON
    return json.loads(path.read_text()) if path.exists() else {}


def update_manifest(artifacts_dir, **entries) -> dict:
    """Merge `entries` into the manifest; each stage owns its own keys."""
    manifest = read_manifest(artifacts_dir) | entries
    path = Path(artifacts_dir) / MANIFEST_JSON
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    tmp.replace(path)  # atomic: a crash mid-write never leaves a truncated manifest
    return manifest
