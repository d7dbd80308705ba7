"""Where each stage reads and writes, and the error a user sees when an earlier stage is missing."""

import hashlib
import json
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mnv3.preprocess import DEFAULT_PREPROCESSING, Preprocessing

ARTIFACTS_DIR = Path("artifacts")  # git-ignored: ONNX files, profiles, manifest
RESULTS_DIR = Path("results")  # committed: CSVs, plots, summary.md
CALIBRATION_DIR = Path("calibration_images")

FP32_ONNX = "fp32.onnx"
DYNAMIC_INT8_ONNX = "dynamic_int8.onnx"
DYNAMIC_INT8_U8_WEIGHTS_ONNX = "dynamic_int8_u8_weights.onnx"
STATIC_INT8_ONNX = "static_int8.onnx"
# Stage 2's OpenVINO INT8 builds (NNCF), each an IR (.xml, the weights in a .bin beside it): from the graph as
# exported, from the rewritten graph, and from the rewritten graph with the logits layer in INT8 too.
NNCF_INT8_XML = "nncf_int8.xml"
NNCF_REWRITTEN_INT8_XML = "nncf_rewritten_int8.xml"
NNCF_REWRITTEN_FULL_INT8_XML = "nncf_rewritten_full_int8.xml"
# The model's class names (a JSON list, index = class id) written beside the models by stage 1, so
# serving needs neither torchvision nor the training folders.
CLASS_NAMES_JSON = "class_names.json"
RECIPES_DIR = "recipes"  # stage 2's --compare-recipes models, kept for inspection
# What each stage produced (weights provenance, arch, preprocessing, which file is the shipped INT8 model, ...).
MANIFEST_JSON = "manifest.json"
# The weights provenance stage 1 records for its seeded stand-in network (mnv3/model.py), and what a model
# with no record beside it gets.
STAND_IN_PROVENANCE = "random-init"
UNKNOWN_PROVENANCE = "unknown"
FILE_PROVENANCE_PREFIX = "file:"  # weights from a --weights file: "file:" and the first 12 hex digits of its SHA-256
# The names stage 1's ONNX export gives the model's input and output (calibration feeds the input by name).
INPUT_NAME, OUTPUT_NAME = "input", "logits"

# Under RESULTS_DIR: what each stage and tool writes. summary.md has one section per file stem, in
# file-name order, so the number prefix orders the stages.
BASELINE_CSV = "01_baseline.csv"
DYNAMIC_INT8_PROFILE_CSV = "01_dynamic_int8_profile.csv"
# stage 1 --transformer-control: the same dynamic-INT8 harness on a ViT, and its INT8 profile
TRANSFORMER_CONTROL_CSV = "01_transformer_control.csv"
TRANSFORMER_CONTROL_PROFILE_CSV = "01_transformer_control_profile.csv"
STATIC_CSV = "02_static.csv"
RECIPES_CSV = "02_recipes.csv"
ENGINES_CSV = "02_engines.csv"
PART_SIZES_CSV = "02_part_sizes.csv"  # the chosen OpenVINO variant's batches cut into parts of each size
BATCH_THREADS_CSV = "02_batch_threads.csv"  # the batching server on the chosen OpenVINO variant, per batch threads
OPENVINO_PROFILE_CSV = "02_openvino_profile.csv"  # OpenVINO's per-layer time split of the served (or fastest) variant
MODEL_VARIANTS_CSV = "model_variants.csv"
MODEL_VARIANTS_PNG = "model_variants.png"
SERVING_BASELINE_CSV = "03_serving_baseline.csv"
CACHING_CSV = "04_caching.csv"
BATCHING_CSV = "05_batching_loadtest.csv"
THROUGHPUT_PNG = "05_throughput_vs_concurrency.png"
LATENCY_PNG = "05_latency_vs_concurrency.png"
BATCH_SIZE_HISTOGRAM_PNG = "05_batch_size_histogram.png"
PHONE_PHOTOS_CSV = "05_phone_photos.csv"
# stage 5: the Open Inference Protocol's binary path against /predict, in turns on one server
V2_VS_PREDICT_CSV = "05_v2_vs_predict.csv"
# stage 5: two models in one server under mixed traffic, and their top-1 agreement
SIDE_BY_SIDE_CSV = "05_side_by_side.csv"
RAY_SERVE_CSV = "06_ray_serve.csv"
SOAK_CSV = "07_soak.csv"
RAY_CLUSTER_LOSS_CSV = "08_ray_cluster_loss.csv"
RAY_CLUSTER_CACHE_CSV = "09_ray_cluster_cache.csv"
RAY_CLUSTER_AUTOSCALE_CSV = "10_ray_cluster_autoscale.csv"
GOALS_CSV = "goals.csv"

STAGE_SCRIPTS = {
    1: "baseline_export_quantize.py",
    2: "static_quantization.py",
    3: "fastapi_serving.py",
    4: "caching.py",
    5: "batching_loadtest.py",
}


STAGE_1_MODELS = (FP32_ONNX, DYNAMIC_INT8_ONNX, DYNAMIC_INT8_U8_WEIGHTS_ONNX)
STAGE_2_MODELS = (STATIC_INT8_ONNX, NNCF_INT8_XML, NNCF_REWRITTEN_INT8_XML, NNCF_REWRITTEN_FULL_INT8_XML)


def remake_hint(model_path) -> str:
    """How to get a model file back that is missing or broken: the stage that writes it (stage 1 its own
    models, stage 2 its INT8 builds and its --compare-recipes models), with the model's folder where that is not
    the default."""
    path = Path(model_path)
    folder = path.parent
    if path.name in STAGE_1_MODELS:
        stage = 1
    elif path.name in STAGE_2_MODELS:
        stage = 2
    elif folder.name == RECIPES_DIR:
        return f"stage 2 writes it with --compare-recipes: run {stage_command(2, folder.parent)} --compare-recipes"
    else:
        return "if one of this project's stages wrote it, rerun that stage"
    flags = " (with the flags that made the model, if it is your own)" if stage == 1 else ""
    return f"stage {stage} writes it: run {stage_command(stage, folder)}{flags}"


def stage_command(stage: int, artifacts_dir=ARTIFACTS_DIR, results_dir=RESULTS_DIR) -> str:
    """The command that runs `stage` on these folders: each named where it is not the default `make run` uses."""
    return " ".join(["python", STAGE_SCRIPTS[stage], *_folder_flags(artifacts_dir, results_dir)])


def _folder_flags(artifacts_dir, results_dir) -> list[str]:
    return [
        f"--{flag} {folder}"
        for flag, folder, default in (
            ("artifacts-dir", artifacts_dir, ARTIFACTS_DIR),
            ("results-dir", results_dir, RESULTS_DIR),
        )
        if Path(folder) != Path(default)
    ]


class MissingArtifact(FileNotFoundError):
    """An input that an earlier stage writes is not there."""


def require(path, stage: int, artifacts_dir=ARTIFACTS_DIR, results_dir=RESULTS_DIR) -> Path:
    """Return `path` if it exists, else raise an error that names the stage to run: with the folders the
    caller was given (`artifacts_dir`, `results_dir`), where they are not the defaults `make run` uses."""
    path = Path(path)
    for flag, folder in (("artifacts-dir", artifacts_dir), ("results-dir", results_dir)):
        if Path(folder).is_file() and path.is_relative_to(folder):  # not "run stage N" into a file: it cannot
            raise MissingArtifact(f"--{flag} {folder} is a file: pass the folder stage {stage} wrote to")
    if not path.exists():
        command = stage_command(stage, artifacts_dir, results_dir)
        raise MissingArtifact(
            f"{path} not found: it is written by stage {stage}. Run `{command}` first"
            + (" (or `make run` for all stages)." if command == stage_command(stage) else ".")
        )
    return path


def file_sha256(path) -> str | None:
    """The file's SHA-256, or None if there is no such file."""
    path = Path(path)
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def model_id(fp32_sha256: str, preprocessing: Preprocessing) -> str:
    """The model's 12-hex-digit id in every stage's rows: its FP32 export (weights, arch, classes, the stand-in's
    re-estimated BatchNorm) and the preprocessing it takes, which the same file may take another of."""
    record = json.dumps([fp32_sha256, preprocessing.record()], sort_keys=True)
    return hashlib.sha256(record.encode()).hexdigest()[:12]


class UnreadableManifest(ValueError):
    """The manifest is there but is not the JSON object stages 1 and 2 write (cut short, edited by hand)."""


def read_manifest(artifacts_dir) -> dict:
    """The manifest in `artifacts_dir`, {} if there is none; UnreadableManifest if it cannot be one."""
    path = Path(artifacts_dir) / MANIFEST_JSON
    if not path.exists():
        return {}
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        problem = f"is not JSON ({exc})"
    else:
        if isinstance(manifest, dict):
            return manifest
        problem = f"holds a JSON {type(manifest).__name__}, not an object"
    raise UnreadableManifest(f"{path} {problem}: stages 1 and 2 write it; remove it and rerun them")


def weights_provenance(model_dir) -> str:
    """Where the weights of the models in `model_dir` came from, as stage 1 recorded it in the manifest beside
    them (`imagenet1k_v1`, `file:<sha256[:12]>` or STAND_IN_PROVENANCE); UNKNOWN_PROVENANCE for a model with
    no record beside it (exported elsewhere): never a guess."""
    weights = read_manifest(model_dir).get("weights")
    return weights if isinstance(weights, str) else UNKNOWN_PROVENANCE


def write_class_names(model_dir, names: list[str]) -> Path:
    return write_atomically(Path(model_dir) / CLASS_NAMES_JSON, json.dumps(names))


class UnreadableClassNames(ValueError):
    """The class names file is there but is not a JSON list of names (cut short, edited by hand)."""


def read_class_names(path: Path) -> list[str]:
    """The JSON list of class names at `path`, or UnreadableClassNames saying what it is instead."""
    try:
        names = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UnreadableClassNames(f"{path} is not a JSON list of class names ({' '.join(str(exc).split())})") from exc
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise UnreadableClassNames(f"{path} is not a JSON list of class names")
    return names


def model_preprocessing(model_dir) -> Preprocessing:
    """The preprocessing stage 1 recorded for the models in `model_dir`; torchvision's ImageNet one for a
    model with no manifest beside it (one exported elsewhere)."""
    record = read_manifest(model_dir).get("preprocessing")
    return DEFAULT_PREPROCESSING if record is None else Preprocessing.from_record(record)


def update_manifest(artifacts_dir, **entries) -> dict:
    """Merge `entries` into the manifest; each stage owns its own keys."""
    return _write_manifest(artifacts_dir, read_manifest(artifacts_dir) | entries)


def drop_manifest_entries(artifacts_dir, *keys: str) -> list[str]:
    """Remove `keys` from the manifest (those it had, which are returned)."""
    manifest = read_manifest(artifacts_dir)
    dropped = [key for key in keys if key in manifest]
    if dropped:
        _write_manifest(artifacts_dir, {key: value for key, value in manifest.items() if key not in dropped})
    return dropped


def _write_manifest(artifacts_dir, manifest: dict) -> dict:
    write_atomically(Path(artifacts_dir) / MANIFEST_JSON, json.dumps(manifest, indent=2, sort_keys=True))
    return manifest


def write_atomically(path: Path, text: str) -> Path:
    """`text` as the file at `path`, as `replaced_when_written` writes it: never a truncated manifest or table."""
    with replaced_when_written(path) as partial:
        partial.write_text(text, newline="")  # as given: the csv module writes its own line ends
    return path


PARTIAL_SUFFIX = ".partial"  # replaced_when_written's folders: hidden, named .FILE.RANDOM.partial


def remove_leftover_partials(folder: Path) -> None:
    """Remove what writes in `folder` left when their process was killed (SIGKILL, power loss: nothing ran to
    remove it). Only for a writer holding the folder (cli.hold_folder): another's writes would be under way."""
    for leftover in Path(folder).glob(f".*{PARTIAL_SUFFIX}"):
        shutil.rmtree(leftover, ignore_errors=True)


@contextmanager
def replaced_when_written(path: Path) -> Iterator[Path]:
    """A path of `path`'s name in a new folder beside it, for the block to write; once the block ends without
    an error, every file written in that folder is renamed over its namesake beside it (`path` last: an
    OpenVINO IR's weights before its .xml; a Ctrl-C or SIGTERM between the two renames both), and the folder is
    removed whatever happens. So a crash, a full disk or two runs at once never leave a truncated file under
    `path`'s name, and a process that has the old file open keeps reading the old one (a server's OpenVINO
    maps an IR's weights, which an in-place write changed under it, or cut short: a bus error). A process
    opening an IR in the instant between its two renames would read the new weights with the old graph."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=PARTIAL_SUFFIX, dir=path.parent))
    try:
        yield folder / path.name
        try:
            _rename_into_place(folder, path)
        except BaseException as exc:
            if not isinstance(exc, Exception):  # Ctrl-C or SIGTERM between an IR's two files: rename the rest
                _rename_into_place(folder, path)
            raise
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _rename_into_place(folder: Path, path: Path) -> None:
    for written in sorted(folder.iterdir(), key=lambda file: file.name == path.name):
        written.replace(path.parent / written.name)
