"""One loaded model: a runtime session, its class names, its preprocessing and an id that names the exact file.

The class names (CLASS_NAMES_JSON, or the file an older manifest records), the preprocessing and the weights
provenance (the manifest's) are read from beside the model file, where stage 1 wrote them, so a model is never
served with another model's labels or input size; a model with no manifest beside it gets torchvision's
ImageNet preprocessing, and its weights are "unknown". Loading stage 1's random-init stand-in logs a warning:
its labels mean nothing.

Serving code runs a model through `Engine.predict` (NCHW float32 batch -> softmax probabilities),
`Engine.top_k` and `Engine.warm_up`, and reads what it serves from the engine's attributes, never from the
session. A backend is a session answering onnxruntime's `run(None, {name: batch})`,
`get_inputs()`, `get_outputs()` and `get_providers()`: an onnxruntime InferenceSession, or
`mnv3.openvino_backend.OpenVINOSession` (imported only when that backend is chosen). Backend `auto`
serves what stage 2 measured fastest (mnv3/backend_choice.py; on another kind of machine, it says so), which
may be another file beside the given one; `Engine.choice` says what was asked for, what runs, and why.
"""

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mnv3.artifacts import (
    CLASS_NAMES_JSON,
    MANIFEST_JSON,
    STAND_IN_PROVENANCE,
    UnreadableClassNames,
    UnreadableManifest,
    model_preprocessing,
    read_class_names,
    read_manifest,
    remake_hint,
    weights_provenance,
)
from mnv3.backend_choice import AUTO, BACKENDS, OPENVINO_IR_SUFFIX, Choice, explicit, resolve_auto
from mnv3.preprocess import Preprocessing
from mnv3.runtime import DEFAULT_INTER_OP_THREADS, DEFAULT_INTRA_OP_THREADS, make_session

BACKEND_CHOICES = (AUTO, *BACKENDS)
# The server needs openvino alone; the requirements file (a checkout's) adds NNCF, for stage 2's INT8 builds.
OPENVINO_MISSING = (
    "backend openvino needs the openvino package: `pip install openvino` "
    "(in a checkout, `pip install -r requirements-openvino.txt`, with NNCF for stage 2)"
)
MODEL_SUFFIXES = (".onnx", OPENVINO_IR_SUFFIX)  # ONNX, and OpenVINO's IR (served by openvino)
TORCH_CHECKPOINT_SUFFIXES = (".pth", ".pt", ".ckpt")  # what torch.save and training scripts name their files
log = logging.getLogger(__name__)


class ModelLoadError(RuntimeError):
    """The model file cannot be served; the message is one line, fit for a CLI error."""


class InferenceError(RuntimeError):
    """The runtime failed on one batch; the requests in it fail, the server goes on."""


class NonFiniteOutput(RuntimeError):
    """The model's output for one image is not finite (NaN or infinite logits): that image's requests fail,
    identical ones waiting on it too, and nothing is cached (not an InferenceError, which a follower retries)."""


@dataclass(frozen=True)
class Prediction:
    class_id: int
    label: str
    probability: float


def top_k_ids(probabilities: np.ndarray, k: int) -> np.ndarray:
    """The ids of the k largest of one row, largest first, equal values in id order: `np.argsort(-row,
    kind="stable")[:k]`, without sorting the whole row: an answer needs k of a thousand classes, and it is
    made on the event loop, whose CPU every request shares. Every value from the k-th largest up is a
    candidate (all its equals too, so ties keep id order), and only the candidates are sorted. NaN, which
    the partition puts above every number, can leave fewer than k candidates: then the whole row is sorted."""
    k = min(k, len(probabilities))
    if k <= 0:  # none asked for (the partition below has no 0th largest)
        return np.empty(0, np.intp)
    kth = np.partition(probabilities, len(probabilities) - k)[len(probabilities) - k]
    candidates = np.flatnonzero(probabilities >= kth)
    if len(candidates) < k:
        return np.argsort(-probabilities, kind="stable")[:k]
    return candidates[np.argsort(-probabilities[candidates], kind="stable")][:k]


class Engine:
    def __init__(
        self,
        session,
        class_names: list[str],
        path: Path,
        sha256: str,
        backend: str,
        preprocessing: Preprocessing,
        choice: Choice,
        load_rss_bytes: int | None,
        weights: str,
        batch_threads: int,
    ):
        self.session = session
        # How much resident memory grew while the session opened: OpenVINO compiles and runs every static
        # batch size then, onnxruntime allocates most of its buffers at the first runs (the warm-up) instead.
        self.load_rss_bytes = load_rss_bytes
        self.backend = backend
        self.choice = choice
        self.batch_threads = batch_threads  # what a batch of more than one image runs on
        self.class_names = class_names
        # the model's output width; a model whose width is symbolic has as many classes as it has names
        width = session.get_outputs()[0].shape[-1]
        self.num_classes: int = width if isinstance(width, int) else len(class_names)
        self.preprocessing = preprocessing  # what every image must go through before `predict`
        self.weights = weights  # where the weights came from: the manifest's provenance (mnv3.artifacts)
        self.path = path
        self.sha256 = sha256
        self.model_id = f"{path.name}:{sha256[:12]}"
        self.input_name = session.get_inputs()[0].name
        self.input_shape = session.get_inputs()[0].shape

    @classmethod
    def load(
        cls,
        path,
        backend: str = "onnxruntime",
        intra_op_threads: int = DEFAULT_INTRA_OP_THREADS,
        inter_op_threads: int = DEFAULT_INTER_OP_THREADS,
        max_batch_size: int = 1,
        allow_spinning: bool = False,
        batch_threads: int | None = None,
    ) -> "Engine":
        """Open, validate and name a model, or raise ModelLoadError saying what is wrong.

        `backend` "auto" serves what stage 2 chose for `path` on this machine, as the server does by default.
        `max_batch_size`: the largest batch `predict` is meant for (the server's --max-batch-size); OpenVINO
        compiles the model at batch 1 and the powers of two up to the smaller of it and the part size (stage
        2's measured one, else openvino_backend.DEFAULT_PART_SIZE), and a larger batch runs in parts of those
        sizes, or one image at a time when it is 1. OpenVINO's inference precision is the chosen one under
        backend auto, else its default.
        `allow_spinning`: onnxruntime's idle threads busy-wait; off, as the server has it (--ort-spinning 0).
        `batch_threads`: OpenVINO's threads for batches of more than one (default `intra_op_threads`, as stage
        2 and the limit time an engine alone); 0, a server's default: what stage 2 measured fastest under load
        for the choice served, if measured with `intra_op_threads`, else half of them. onnxruntime runs every
        call on `intra_op_threads`."""
        if backend not in BACKEND_CHOICES:
            raise ModelLoadError(f"unknown backend {backend!r}; available: {', '.join(BACKEND_CHOICES)}")
        path = check_model_file(path)
        try:
            choice = resolve_auto(path) if backend == AUTO else explicit(path, backend)
        except UnreadableManifest as exc:  # the one error a caller catches: what _preprocessing raises for it too
            raise ModelLoadError(str(exc)) from exc
        path, backend, precision = choice.path, choice.backend, choice.precision
        if batch_threads == 0:
            batch_threads = choice.batch_threads(intra_op_threads)
        if path.suffix == OPENVINO_IR_SUFFIX and backend != "openvino":
            raise ModelLoadError(
                f"{path} is an OpenVINO IR, which {backend} cannot read: serve it with openvino "
                "(--backend openvino or auto, or PATH@openvino)"
            )
        if path.suffix in TORCH_CHECKPOINT_SUFFIXES:
            raise ModelLoadError(
                f"{path} is a PyTorch checkpoint, which the server does not read: export it with stage 1 "
                f"(python baseline_export_quantize.py --weights {path}, with its --arch and --class-names), then "
                "serve the .onnx file it writes"
            )
        sha256 = _digest(path)
        preprocessing = _preprocessing(path.parent)
        before = rss_bytes()
        try:
            session = open_session(
                path,
                backend,
                intra_op_threads,
                inter_op_threads,
                max_batch_size,
                allow_spinning,
                precision,
                choice.streams,
                batch_threads,
                choice.part_size,
            )
        except ModelLoadError:
            raise
        except Exception as exc:  # both runtimes raise their own untyped errors for bad protobufs
            kind = "OpenVINO IR" if path.suffix == OPENVINO_IR_SUFFIX else "ONNX model"
            raise ModelLoadError(f"{path} is not a loadable {kind} ({_one_line(exc)}): {remake_hint(path)}") from exc
        after = rss_bytes()
        _check_input(path, session.get_inputs(), max_batch_size, preprocessing.input_shape)
        if choice.requested == AUTO:  # once the model is known to load: a bad file's error stays one line
            log.log(
                logging.WARNING if choice.unservable or choice.measured_elsewhere else logging.INFO,
                "--backend auto: %s with %s: %s",
                path.name,
                backend,
                choice.reason,
            )
        weights = weights_provenance(path.parent)  # the manifest is known to parse: _preprocessing read it
        if weights == STAND_IN_PROVENANCE:
            log.warning(
                "%s: the weights are stage 1's random-init stand-in (ImageNet weights were unavailable): "
                "latency is real, the labels it answers with mean nothing; rerun stage 1 with --weights",
                path.name,
            )
        return cls(
            session,
            _class_names(class_names_file(path.parent), session.get_outputs()[0].shape[-1]),
            path,
            sha256,
            backend,
            preprocessing,
            choice,
            None if before is None or after is None else after - before,
            weights,
            # onnxruntime has one pool for every call; OpenVINO's session knows what its batches run on
            getattr(session, "batch_threads", intra_op_threads),
        )

    @property
    def providers(self) -> list[str]:
        """What runs the model, e.g. ['CPUExecutionProvider'] or ['OpenVINO:CPU:f32'] (for /model)."""
        return self.session.get_providers()

    def predict(self, batch: np.ndarray) -> np.ndarray:
        """(N, 3, crop, crop) float32 -> (N, classes) softmax probabilities; a ValueError (or TypeError) for an
        array whose images are of another shape (or type) than `mnv3.preprocess` makes them. InferenceError if the
        runtime fails (a model file whose batch size is fixed refuses other batch sizes so) or answers out of
        shape. A row whose logits are not all finite is NaN (the server answers that image 500)."""
        if not isinstance(batch, np.ndarray) or batch.dtype != np.float32:
            raise TypeError(f"predict takes a float32 numpy array, got {getattr(batch, 'dtype', type(batch))}")
        if batch.ndim != 4 or batch.shape[1:] != self.preprocessing.input_shape:
            raise ValueError(
                f"predict takes a batch of shape (N, {', '.join(map(str, self.preprocessing.input_shape))}), got "
                f"{batch.shape}: preprocess each image (mnv3.preprocess.preprocess_batch) and stack them"
            )
        try:
            logits = self.session.run(None, {self.input_name: batch})[0]
        except Exception as exc:
            raise InferenceError(f"{self.backend} failed on a batch of {len(batch)}: {_one_line(exc)}") from exc
        # Rows are handed out by position: output of another shape would give an image no row, or another's.
        width = self.num_classes or getattr(logits, "shape", (0, 0))[-1]
        if not isinstance(logits, np.ndarray) or logits.shape != (len(batch), width):
            raise InferenceError(
                f"{self.backend} answered a batch of {len(batch)} with output of shape "
                f"{getattr(logits, 'shape', type(logits).__name__)}, not ({len(batch)}, {width})"
            )
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))  # max-shift: no overflow
        return shifted / shifted.sum(axis=1, keepdims=True)

    def top_k(self, probabilities: np.ndarray, k: int) -> list[Prediction]:
        """The k most probable classes of one row (all of them when k is larger), most probable first; equal
        probabilities (an INT8 model's logits are quantized, so they tie) in class order, as argmax has it."""
        return [Prediction(int(i), self.label(int(i)), float(probabilities[i])) for i in top_k_ids(probabilities, k)]

    def label(self, class_id: int) -> str:
        if class_id < len(self.class_names):
            return self.class_names[class_id]
        return f"class_{class_id}"

    def warm_up(self, batch_sizes) -> None:
        """Run each batch size once so the first requests do not pay for the runtime's allocations."""
        for size in batch_sizes:
            self.predict(np.zeros((size, *self.preprocessing.input_shape), dtype=np.float32))


def check_model_file(path) -> Path:
    """`path` as a Path if it is a file, else a ModelLoadError saying what it is instead (a folder, with the
    models in it; missing, with the models beside it and a hint when NAME=PATH was read as one path)."""
    path = Path(path)
    if path.is_dir():
        models = _models_in(path)
        raise ModelLoadError(
            f"{path} is a folder: pass a model file in it"
            + (f" ({', '.join(models)})" if models else f" (it holds no {' or '.join(MODEL_SUFFIXES)} file)")
        )
    if not path.is_file():
        name, equals, rest = str(path).partition("=")
        if equals and Path(rest).is_file():  # NAME=PATH whose NAME has a '/' reads as one path (ModelSpec.parse)
            raise ModelLoadError(
                f"model file {path} not found; if {name!r} is its name, a model name cannot contain '/'"
            )
        beside = _models_in(path.parent) if path.parent.is_dir() else []
        listed = f" (the models in {path.parent}: {', '.join(beside)})" if beside else ""
        raise ModelLoadError(f"model file {path} not found{listed}: {remake_hint(path)}")
    return path


def _models_in(folder: Path) -> list[str]:
    try:
        return sorted(p.name for p in folder.iterdir() if p.suffix in MODEL_SUFFIXES)
    except OSError:  # unreadable: the message goes without the list
        return []


def open_session(
    path: Path,
    backend: str,
    intra_op_threads: int = DEFAULT_INTRA_OP_THREADS,
    inter_op_threads: int = DEFAULT_INTER_OP_THREADS,
    max_batch_size: int = 1,
    allow_spinning: bool = False,
    precision: str = "auto",
    streams: int = 1,
    batch_threads: int | None = None,
    part_size: int | None = None,
):
    """The runtime session `Engine` wraps (one of BACKENDS): what the server, stage 2's engine choice and the
    in-process limit all run, so what stage 2 timed is what is served, but for the threads a server gives
    OpenVINO's batches (`batch_threads`; stage 2 and the limit time the engine with every thread they are
    given). `precision`, `streams`, `batch_threads` and `part_size` (None: its default) are OpenVINO's (see
    OpenVINOSession)."""
    if backend == "onnxruntime":
        return make_session(path, intra_op_threads, inter_op_threads, allow_spinning=allow_spinning)
    if backend != "openvino":
        raise ValueError(f"no session for backend {backend!r}: one of {', '.join(BACKENDS)}")
    try:
        import openvino  # noqa: F401  (the optional dependency: imported only when this backend is chosen)
    except ImportError:
        raise ModelLoadError(OPENVINO_MISSING) from None
    from mnv3.openvino_backend import OpenVINOSession

    # OpenVINO has no inter-op pool to size: `intra_op_threads` threads for a batch of one.
    return OpenVINOSession(
        path,
        intra_op_threads,
        precision,
        max_batch_size=max_batch_size,
        streams=streams,
        batch_threads=batch_threads,
        part_size=part_size,
    )


def rss_bytes() -> int | None:
    """This process's resident memory, from /proc (Linux); None elsewhere."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def model_files(path: Path) -> list[Path]:
    """The files a model is: the one ONNX file, or an OpenVINO IR file (.xml) and the weights (.bin) beside it."""
    weights = path.with_suffix(".bin")
    return [path, weights] if path.suffix == OPENVINO_IR_SUFFIX and weights.is_file() else [path]


def model_bytes(path: Path) -> int:
    """The model's size on disk: its `model_files` together."""
    return sum(file.stat().st_size for file in model_files(path))


def model_size_mb(path) -> float:
    """`model_bytes` in MB, as the results tables give sizes (an OpenVINO IR's .xml with the weights beside it)."""
    return round(model_bytes(Path(path)) / 1e6, 3)


def _digest(path: Path) -> str:
    """SHA-256 of the model's files, in `model_files` order."""
    digest = hashlib.sha256()
    for file in model_files(path):
        digest.update(file.read_bytes())
    return digest.hexdigest()


def _preprocessing(model_dir: Path) -> Preprocessing:
    try:
        return model_preprocessing(model_dir)
    except (OSError, ValueError, KeyError, TypeError) as exc:  # a hand-edited or truncated manifest
        raise ModelLoadError(
            f"{model_dir / MANIFEST_JSON} has no valid preprocessing ({_one_line(exc)}); rerun stage 1 to rewrite it"
        ) from exc


def _check_input(path, inputs, max_batch_size: int, input_shape: tuple[int, int, int]) -> None:
    if len(inputs) != 1:
        raise ModelLoadError(f"{path} has {len(inputs)} inputs; expected one image input")
    shape = inputs[0].shape
    if len(shape) != 4 or tuple(shape[1:]) != input_shape:
        expected = ", ".join(map(str, input_shape))
        beside = Path(path).parent / MANIFEST_JSON
        source = (
            f"the preprocessing in {beside} gives"
            if beside.exists()
            else f"torchvision's preprocessing gives, with no {MANIFEST_JSON} beside it (copy stage 1's there)"
        )
        raise ModelLoadError(f"{path} takes input of shape {shape}; expected [batch, {expected}] as {source}")
    # A fixed batch axis runs only batches of exactly that size; batch 1 still serves without batching.
    if isinstance(shape[0], int) and (shape[0], max_batch_size) != (1, 1):
        raise ModelLoadError(
            f"{path} has a fixed batch size of {shape[0]}; export it with a dynamic batch axis "
            "(a batch-1 model can be served with --max-batch-size 1)"
        )


def class_names_file(model_dir: Path) -> Path:
    """CLASS_NAMES_JSON beside the model, or else the file its manifest records: a model built before the
    file had that name (imagenet_classes.json) keeps its labels, not class_<id>."""
    path = model_dir / CLASS_NAMES_JSON
    if path.exists():
        return path
    export = read_manifest(model_dir).get("fp32")
    recorded = export.get("class_names") if isinstance(export, dict) else None
    if isinstance(recorded, str) and Path(recorded).name == recorded:  # a name beside the model, no path
        return model_dir / recorded
    return path


def _class_names(path: Path, num_classes) -> list[str]:
    if not path.exists():
        log.warning("%s not found beside the model: labels will be class_<id>", path.name)
        return []
    try:
        names = read_class_names(path)
    except UnreadableClassNames as exc:
        raise ModelLoadError(f"{exc}; rerun stage 1 or delete it to label classes class_<id>") from exc
    if isinstance(num_classes, int) and len(names) != num_classes:
        raise ModelLoadError(f"{path} has {len(names)} class names but the model outputs {num_classes} classes")
    return names


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())
