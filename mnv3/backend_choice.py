"""Which engine serves a model: the one stage 2 measured fastest on the machine it ran on, unless told otherwise.

Stage 2 times every installed engine x precision in turns with ONNX FP32 and writes the fastest that
computes the same network into the manifest beside the models (key MANIFEST_KEY, `manifest_entry`).
`--backend auto` (the server's default) reads it back with `resolve_auto`. A choice holds only

- for the model it was made for (the INT8 file stages 3-5 serve, or the chosen file itself): any other
  file is served as given, since nothing measured it;
- where its engine is installed and its file is present.

A choice measured on another kind of machine (its CPU or ISA, as stage 2 recorded them, differ from this one's:
an image built on one machine and run on others) is served all the same, since it computes the same network,
and its reason says that which engine is fastest here was not measured.

Otherwise auto serves the given file with onnxruntime, the engine that installs everywhere (an OpenVINO
IR, `.xml`, with openvino, the one engine that reads it), and the reason says why. An explicit
`--backend onnxruntime|openvino` always wins.

This module reads JSON only: serving imports it without importing openvino or torch.
"""

import importlib.util
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from mnv3.artifacts import FILE_PROVENANCE_PREFIX, STAND_IN_PROVENANCE, read_manifest
from mnv3.report import UNKNOWN_CPU, cpu_info

AUTO = "auto"
BACKENDS = ("onnxruntime", "openvino")
FALLBACK = "onnxruntime"  # installs wherever requirements.txt does
OPENVINO_IR_SUFFIX = ".xml"
MANIFEST_KEY = "engine_choice"
DEFAULT_MIN_AGREEMENT = 0.99  # top-1 agreement with FP32 a variant needs to be chosen, with real weights
# What the choice minimises: a variant's batch-1 and per-image-at-batch-N times against FP32's, timed in
# turns. Their geometric mean weighs a 2x gain at either end the same; the server runs both sizes.
SPEED_COLUMNS = ("mean_ms_vs_onnx_fp32", "per_image_ms_vs_onnx_fp32")
# What resolve_auto reads of a MANIFEST_KEY entry (manifest_entry writes them all).
SERVED_KEYS = ("variant", "engine", "file", "precision", "streams", "for_model", "reason")
# The type each of them, and part_size (absent or null when stage 2 measured none), must have to be served.
SERVED_TYPES: dict[str, type] = dict.fromkeys(SERVED_KEYS, str) | {"streams": int, "part_size": int}
# Where stage 2 measured, as its rows record it (report.cpu_info). Not the core count: os.cpu_count() is the
# host's, whatever share of it a container gets, so it would tell two pods on one kind of machine apart.
MACHINE_KEYS = ("cpu", "isa")


@dataclass(frozen=True)
class Choice:
    """What serves: the file, its engine and OpenVINO precision, streams and part size for batches (None: the
    backend's default); what was asked for, and why this."""

    path: Path
    backend: str
    precision: str
    requested: str
    reason: str
    fallback: bool = False  # auto served onnxruntime on the given file: no measured choice applies
    manifest_entry: dict | None = None
    streams: int = 1
    unservable: bool = False  # a measured choice applies but cannot be served here: worth a warning
    part_size: int | None = None
    measured_elsewhere: bool = False  # served, but measured on another machine: worth a warning too

    @property
    def variant(self) -> str:
        """Stage 2's name for this engine x file x precision, e.g. onnxruntime_static_int8, openvino_fp32_bf16."""
        return variant_name(self.backend, self.path.name, self.precision, self.streams)

    def batch_threads(self, intra_op_threads: int) -> int:
        """OpenVINO's threads for a batch in a server under load: as stage 2 measured them for this choice
        (mnv3.batch_threads), if it measured with `intra_op_threads` intra-op threads; else the default."""
        entry = self.manifest_entry or {}
        measured = entry.get("batch_threads") if entry.get("threads") == intra_op_threads else None
        return measured or default_batch_threads(intra_op_threads)

    def describe(self) -> dict:
        """For GET /model."""
        return asdict(self) | {"path": self.path.name}


def default_batch_threads(intra_op_threads: int) -> int:
    """A server's threads for a batch without stage 2's measurement: half, so the other half decode the next
    images meanwhile (mnv3.batch_threads measures whether every thread does better)."""
    return max(1, intra_op_threads // 2)


def explicit(path: Path, backend: str, precision: str = "auto") -> Choice:
    return Choice(Path(path), backend, precision, backend, f"--backend {backend} given")


def resolve_auto(model: Path) -> Choice:
    """What `--backend auto` serves for `model`: stage 2's choice from the manifest beside it, else
    `model` on onnxruntime with the reason."""
    model = Path(model)
    entry = read_manifest(model.parent).get(MANIFEST_KEY)

    def fallback(why: str, unservable: bool = False) -> Choice:
        engine = "openvino" if model.suffix == OPENVINO_IR_SUFFIX else FALLBACK  # the one engine that reads an IR
        return Choice(
            model,
            engine,
            "auto",
            AUTO,
            f"{why}; serving {model.name} with {engine}",
            True,
            entry,
            unservable=unservable,
        )

    if not entry:
        return fallback(
            f"no engine choice in {model.parent}/manifest.json (stage 2, static_quantization.py, writes it)"
        )
    missing = [key for key in SERVED_KEYS if key not in entry] if isinstance(entry, dict) else list(SERVED_KEYS)
    if missing:  # edited by hand, or written by another version: serve what works and say how to mend it
        return fallback(
            f"the engine choice in {model.parent}/manifest.json lacks {', '.join(missing)} (rerun stage 2, "
            "static_quantization.py, to measure it again)",
            True,
        )
    mistyped = [  # by type(), not isinstance(): JSON's true is a bool, which isinstance() takes for an int
        key
        for key, kind in SERVED_TYPES.items()
        if type(entry.get(key)) is not kind and not (key == "part_size" and entry.get(key) is None)
    ]
    if mistyped:
        return fallback(
            f"the engine choice in {model.parent}/manifest.json has a value of the wrong type for "
            f"{', '.join(mistyped)} (rerun stage 2, static_quantization.py, to measure it again)",
            True,
        )
    if model.name not in (entry["for_model"], entry["file"]):
        return fallback(f"stage 2 chose an engine for {entry['for_model']}, not {model.name}")
    if entry["engine"] not in BACKENDS or importlib.util.find_spec(entry["engine"]) is None:
        return fallback(
            f"stage 2 chose {entry['variant']}, but {entry['engine']} is not installed here "
            f"(pip install {entry['engine']})",
            True,
        )
    chosen = model.parent / entry["file"]
    if not chosen.is_file():
        return fallback(f"stage 2 chose {entry['variant']}, but its file {chosen} is missing", True)
    elsewhere = other_machine(entry)
    return Choice(
        chosen,
        entry["engine"],
        entry["precision"],
        AUTO,
        entry["reason"] + (f"; {elsewhere}" if elsewhere else ""),
        False,
        entry,
        entry["streams"],
        part_size=entry.get("part_size"),
        measured_elsewhere=bool(elsewhere),
    )


def other_machine(entry: dict) -> str | None:
    """What to say if stage 2 measured `entry` on another kind of machine than this (the CPU or ISA it recorded
    differs), else None; also None where either CPU has no name, as nothing then tells them apart."""
    here = cpu_info()
    recorded = {key: entry[key] for key in MACHINE_KEYS if key in entry}
    if UNKNOWN_CPU in (here["cpu"], recorded.get("cpu")) or all(here[key] == recorded[key] for key in recorded):
        return None

    def machine(record: dict) -> str:
        return f"{record.get('cpu')}, ISA {record.get('isa')}"

    return (
        f"stage 2 ran on another kind of machine ({machine(entry)}), not this one ({machine(here)}): served as "
        "chosen, as it computes the same network, but which engine is fastest on this CPU is unmeasured: rerun "
        "stage 2 (static_quantization.py) on it"
    )


def variant_name(engine: str, file: str, precision: str, streams: int = 1) -> str:
    """e.g. onnxruntime_static_int8, openvino_fp32_bf16, openvino_nncf_int8_f32_2streams."""
    openvino = f"_{precision}" + (f"_{streams}streams" if streams > 1 else "") if engine == "openvino" else ""
    return f"{engine}_{Path(file).stem}{openvino}"


def speed(row: dict) -> float:
    """The number the choice minimises (see SPEED_COLUMNS)."""
    return math.sqrt(math.prod(float(row[column]) for column in SPEED_COLUMNS))


def choose(rows: list[dict], min_agreement: float, guard_applies: bool) -> tuple[dict, dict[str, str]]:
    """(the fastest row by `speed`, {variant: why it was passed over} for each faster one).

    Each row is a way to serve timed in turns with ONNX FP32, with its top-1 agreement with FP32 (onnxruntime
    on the FP32 file has none and always qualifies). With `guard_applies`, a variant below `min_agreement` is
    refused."""
    refused = {}
    for row in sorted(rows, key=speed):
        agreement = row.get("top1_agreement")
        if guard_applies and agreement not in (None, "") and float(agreement) < min_agreement:
            refused[row["variant"]] = f"top-1 agreement with FP32 {float(agreement):.4f} < {min_agreement}"
            continue
        return row, refused
    raise ValueError("no variant to choose from")


def guard_note(provenance: str, min_agreement: float, photos: int, labelled: bool) -> str:
    """What the agreement guard did, on how many held-out `photos` (the user's `labelled` ones, or the sample
    photos), and when they are too few for it to allow any disagreement at all."""
    if provenance == STAND_IN_PROVENANCE:
        return (
            "not applied: the weights are the random-init stand-in, whose agreement with FP32 says nothing "
            "about a trained model's; rerun stage 1 with --weights for a guarded choice"
        )
    note = f"applied: a variant needs top-1 agreement with FP32 >= {min_agreement} on the {photos} held-out photos"
    if not labelled and provenance.startswith(FILE_PROVENANCE_PREFIX):  # a user's weights: most likely a fine-tune
        note += (
            " (the sample photos scikit-image and matplotlib ship, not yours: a fine-tune's classes may not be "
            "among them; pass --labels with your labelled photos for an agreement on its own)"
        )
    if photos * (1 - min_agreement) < 1:
        note += (
            f"; of {photos}, a single disagreement refuses a variant: measure on more (run without --quick, "
            "which compares on a few; give more --labels photos, each of which is compared unless --labels-count "
            "holds them to fewer) or lower --min-agreement"
        )
    return note


def manifest_entry(
    chosen: dict,
    refused: dict[str, str],
    for_model: str,
    candidates: int,
    provenance: str,
    min_agreement: float,
    photos: int,
    labelled: bool,
    environment: dict,
) -> dict:
    """The MANIFEST_KEY entry: what serves, its same-run ratios and agreement (on `photos` held-out photos, the
    user's `labelled` ones or the sample photos), and why it was chosen."""
    columns = (
        "mean_ms_vs_onnx_fp32",
        "per_image_ms_vs_onnx_fp32",
        "batch_size",
        "top1_agreement",
        "top5_agreement",
        "sqnr_db",
    )
    return {
        "variant": chosen["variant"],
        "engine": chosen["engine"],
        "file": chosen["file"],
        "precision": chosen["precision"],
        "streams": chosen["streams"],
        "for_model": for_model,
        **{column: chosen.get(column) for column in columns},
        "reason": (
            f"fastest of {candidates} engine x precision variants timed in turns with ONNX FP32 on this "
            f"machine (batch 1 {chosen['mean_ms_vs_onnx_fp32']}x, per image at batch "
            f"{chosen['batch_size']} {chosen['per_image_ms_vs_onnx_fp32']}x FP32's time)"
            + (f"; passed over: {'; '.join(f'{k} ({v})' for k, v in refused.items())}" if refused else "")
        ),
        "agreement_guard": guard_note(provenance, min_agreement, photos, labelled),
        "min_agreement": min_agreement,
        "guard_applied": provenance != STAND_IN_PROVENANCE,
        "weights": provenance,
        **environment,
    }
