"""Model variants measured against ONNX FP32: stage 1's runtimes, stage 2's static INT8 recipes and
engine x precision variants (the choice `--backend auto` serves), and the table that puts them side by side.

Variants are timed in turns with an ONNX FP32 session in one interleaved run, never against an FP32
from another run: on a shared machine only ratios taken in turns hold. Agreement and SQNR are against
that FP32 session's logits on the same held-out photos.
"""

import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from mnv3 import report
from mnv3.accuracy import array_batches, evaluate, held_out_batch, predict
from mnv3.artifacts import (
    FP32_ONNX,
    MANIFEST_JSON,
    NNCF_INT8_XML,
    NNCF_REWRITTEN_FULL_INT8_XML,
    NNCF_REWRITTEN_INT8_XML,
    RECIPES_DIR,
    STATIC_INT8_ONNX,
    drop_manifest_entries,
)
from mnv3.backend_choice import MANIFEST_KEY, variant_name
from mnv3.engine import model_files, model_size_mb, open_session
from mnv3.latency import Timing, interleaved_benchmark
from mnv3.preprocess import Preprocessing
from mnv3.quantize import DEFAULT_RECIPE, RECIPES, quantize_static_int8
from mnv3.runtime import make_session, ort_runner
from mnv3.silicon import count_macs, gemm_peaks, silicon_columns

FP32 = "onnx_fp32"
STATIC_INT8 = "onnx_static_int8"
FP32_COLUMNS = ("mean_ms", "p50_ms", "per_image_ms", "size_mb")  # FP32's own, beside each recipe's ratios
COMPARISON_ROUNDS = 8  # --compare-recipes: more rounds than a stage-1 benchmark, so drift averages out
RATIO_TABLE_COLUMNS = (
    "recipe",
    "mean_ms_vs_onnx_fp32",
    "p50_ms_vs_onnx_fp32",
    "per_image_ms_vs_onnx_fp32",
    "size_mb_vs_onnx_fp32",
    "top1_agreement",
    "sqnr_db",
)
OPENVINO_PRECISIONS = {"f32": "fp32", "bf16": "bf16"}  # OpenVINO's precision hint -> the variant-name suffix
VARIANT_NAMES = {
    "pytorch_fp32": "PyTorch FP32",
    "onnx_fp32": "ONNX FP32",
    "onnx_dynamic_int8": "ONNX Dynamic INT8",
    "onnx_dynamic_int8_u8_weights": "ONNX Dynamic INT8, uint8 weights",
    "onnx_static_int8": "ONNX Static INT8",
    "openvino_fp32": "OpenVINO FP32",
    "openvino_bf16": "OpenVINO BF16",
}
COMPARISON_COLUMNS = (
    "mean_ms",
    "p95_ms",
    "size_mb",
    "batch_size",
    "per_image_ms",
    "top1_agreement",
    "top5_agreement",
    "sqnr_db",
    "top1_accuracy",
    "top5_accuracy",
    "threads",
    "weights",
    "arch",
    "classes",
    "model_id",
    "cpu",
)


@dataclass(frozen=True)
class Bench:
    """How a stage measures variants against ONNX FP32, and what every row it writes records."""

    threads: int
    timing: Timing
    batch_size: int
    held_out: np.ndarray  # preprocessed held-out photos: agreement, and the timed inputs
    labelled: tuple[list[Path], np.ndarray] | None  # --labels: true accuracy too
    weights: str  # provenance
    arch: str
    classes: int
    model_id: str  # artifacts.model_id, as stage 1 recorded it in the manifest ("" where it did not)
    preprocessing: Preprocessing  # the model's, which `held_out` already went through; `labelled` goes through it

    @classmethod
    def for_stage(
        cls,
        args,
        mode,
        preprocessing: Preprocessing,
        class_names: list[str],
        labelled: tuple[list[Path], np.ndarray] | None,
        weights: str,
        arch: str,
        model_id: str,
    ) -> "Bench":
        """Stage 1's or 2's bench: its --threads and --batch-size, its mode's (cli.defaults) timing and
        held-out photo count for these `weights`, those photos (of `labelled`, with --labels) put through the
        model's `preprocessing`, and what its rows record."""
        return cls(
            threads=args.threads,
            timing=mode.timing,
            batch_size=args.batch_size,
            held_out=held_out_batch(mode.held_out_count(weights), preprocessing, labelled),
            labelled=labelled,
            weights=weights,
            arch=arch,
            classes=len(class_names),
            model_id=model_id,
            preprocessing=preprocessing,
        )

    def provenance(self) -> dict:
        """The columns every row records: which model (report.MODEL_COLUMNS: its weights, architecture, classes
        and id), and where it was measured (report.machine_columns)."""
        model = {"weights": self.weights, "arch": self.arch, "classes": self.classes, "model_id": self.model_id}
        return model | report.machine_columns()


@dataclass(frozen=True)
class Measured:
    """One model from an interleaved run: its latency row, file size, and scores against FP32."""

    latency: dict
    size_mb: float
    scores: dict

    def columns(self) -> dict:
        return self.latency | {"size_mb": self.size_mb}


def measure_against_fp32(
    fp32_path: Path, models: dict[str, Path], bench: Bench, rounds: int = 5
) -> dict[str, Measured]:
    """Each of `models` on onnxruntime and ONNX FP32 (key FP32) timed in turns in one run, scored against
    FP32's logits."""
    return measure_runners(
        fp32_path,
        {name: (ort_runner(make_session(path, bench.threads)), model_size_mb(path)) for name, path in models.items()},
        bench,
        rounds,
    )


def measure_runners(
    fp32_path: Path,
    runners: dict[str, tuple[Callable, float]],
    bench: Bench,
    rounds: int = 5,
) -> dict[str, Measured]:
    """Each of `runners` ({name: (run(batch) -> logits, size in MB)}) and ONNX FP32 (key FP32, onnxruntime's
    defaults on the bench's threads) timed in turns in one run, scored against FP32's logits."""
    fp32 = ort_runner(make_session(fp32_path, bench.threads))
    reference = predict(fp32, array_batches(bench.held_out, bench.batch_size))
    latency = interleaved_benchmark(
        {FP32: fp32} | {name: run for name, (run, _) in runners.items()},
        bench.held_out,
        bench.batch_size,
        bench.timing,
        rounds=rounds,
        reference=FP32,
    )
    measured = {FP32: Measured(latency[FP32], model_size_mb(fp32_path), {})}
    for name, (run, size) in runners.items():
        scores = evaluate(run, bench.held_out, reference, bench.labelled, bench.batch_size, bench.preprocessing)
        measured[name] = Measured(latency[name], size, scores)
    return measured


@dataclass(frozen=True)
class Variant:
    """A stage-1 variant: its name (the CSV's `variant`), `run(batch) -> logits`, and its size."""

    name: str
    run: Callable[[np.ndarray], np.ndarray]
    size_mb: float


def openvino_variants(fp32_path: Path, threads: int) -> list[Variant]:
    """OpenVINO on the FP32 file: FP32, plus BF16 where the CPU computes it natively; none without openvino.

    Runs through the session the server's `--backend openvino` uses: its batch-1 model times batch 1, its
    static parts of the batch the batched run."""
    try:
        from mnv3.openvino_backend import OpenVINOSession, bf16_supported
    except ModuleNotFoundError as exc:
        if exc.name != "openvino":
            raise
        print("openvino: not installed, openvino rows SKIPPED (pip install -r requirements-openvino.txt to add them)")
        return []

    precisions = ["f32"]
    if bf16_supported():
        precisions.append("bf16")
    else:
        print("openvino: this CPU has no native BF16 (no AVX512_BF16/AMX), openvino_bf16 row skipped")
    return [
        Variant(
            f"openvino_{OPENVINO_PRECISIONS[precision]}",
            ort_runner(OpenVINOSession(fp32_path, threads, precision)),
            model_size_mb(fp32_path),
        )
        for precision in precisions
    ]


def baseline_rows(
    variants: list[Variant],
    bench: Bench,
    reference: np.ndarray,
    bn_recalibration_images: int,
    export_max_abs_diff: float,
) -> list[dict]:
    """Stage 1's rows: the variants timed in turns (a noisy neighbour slows all alike, so the ratios
    hold), each scored against ONNX FP32's `reference` logits."""
    latency = interleaved_benchmark(
        {variant.name: variant.run for variant in variants},
        bench.held_out,
        bench.batch_size,
        bench.timing,
        reference=FP32,
    )
    return [
        {
            "variant": variant.name,
            **latency[variant.name],
            "size_mb": variant.size_mb,
            "threads": bench.threads,
            **bench.provenance(),
            "bn_recalibration_images": bn_recalibration_images,
            "export_max_abs_diff": f"{export_max_abs_diff:.2e}" if variant.name == FP32 else "",
            # ONNX FP32 is the reference (it equals PyTorch to EXPORT_TOLERANCE), so it has no agreement.
            **evaluate(
                variant.run,
                bench.held_out,
                None if variant.name == FP32 else reference,
                bench.labelled,
                bench.batch_size,
                bench.preprocessing,
            ),
        }
        for variant in variants
    ]


def fastest(rows: list[dict]) -> str:
    """Which variant is fastest for one image at a time and which per image in a batch, by their same-run
    ratios to ONNX FP32, and how far ahead of the next."""

    def verdict(key: str) -> str:
        column = f"{key}_vs_onnx_fp32"
        first, second = sorted(rows, key=lambda row: row[column])[:2]
        return (
            f"{first['variant']} ({first[key]} ms, {first[column]}x ONNX FP32's time; next {second['variant']} "
            f"at {second[column] / first[column]:.2f}x its time)"
        )

    return (
        f"fastest at batch 1 (mean): {verdict('mean_ms')}\n"
        f"fastest per image at batch {rows[0]['batch_size']}: {verdict('per_image_ms')}"
    )


def static_row(static: Measured, bench: Bench) -> dict:
    """The 02_static.csv row of the shipped model (its recipe columns are added by the stage)."""
    return {
        "variant": STATIC_INT8,
        **static.latency,
        "size_mb": static.size_mb,
        "threads": bench.threads,
        **bench.provenance(),
        **static.scores,
    }


def measure_static(fp32_path: Path, static_path: Path, bench: Bench) -> dict:
    """The static INT8 model at `static_path` against FP32 in turns: its 02_static.csv row."""
    measured = measure_against_fp32(fp32_path, {STATIC_INT8: static_path}, bench)
    return static_row(measured[STATIC_INT8], bench)


def recipe_columns(name: str) -> dict:
    """Every field of recipe `name` as one CSV cell (lists space-separated, extra options as JSON)."""
    return {
        key: " ".join(value) if isinstance(value, list) else json.dumps(value) if isinstance(value, dict) else value
        for key, value in RECIPES[name].record().items()
    }


def recipe_path(recipes_dir: Path, name: str) -> Path:
    return Path(recipes_dir) / f"{name}.onnx"


def build_recipes(
    fp32_path: Path, names: list[str], calibration_images: np.ndarray, recipes_dir: Path
) -> dict[str, float]:
    """Build each recipe into `recipes_dir` on one preprocessed calibration set; seconds each took."""
    Path(recipes_dir).mkdir(parents=True, exist_ok=True)
    build_s = {}
    # One calibration cache for all: recipes that share a calibrated graph calibrate it once.
    with tempfile.TemporaryDirectory() as calibration_cache:
        for name in names:
            print(f"building recipe {name}")
            start = time.perf_counter()
            quantize_static_int8(
                fp32_path,
                recipe_path(recipes_dir, name),
                calibration_images,
                RECIPES[name],
                cache_dir=calibration_cache,
            )
            build_s[name] = round(time.perf_counter() - start, 1)
    return build_s


def compare_recipes(
    fp32_path: Path,
    names: list[str],
    shipped: str,
    calibration_images: np.ndarray,
    recipes_dir: Path,
    bench: Bench,
    repeats: int,
) -> tuple[list[dict], dict]:
    """Build every recipe in `names` into `recipes_dir`, time them and ONNX FP32 in turns in one run
    (`repeats` x the bench's calls, in COMPARISON_ROUNDS rounds), and score them against FP32.

    Returns (one 02_recipes.csv row per recipe, the `shipped` recipe's 02_static.csv row): the
    shipped row is the same measurement as its comparison row, not a second one."""
    build_s = build_recipes(fp32_path, names, calibration_images, recipes_dir)
    timing = replace(bench.timing, iters=bench.timing.iters * repeats, batch_iters=bench.timing.batch_iters * repeats)
    measured = measure_against_fp32(
        fp32_path,
        {name: recipe_path(recipes_dir, name) for name in names},
        replace(bench, timing=timing),
        rounds=COMPARISON_ROUNDS,
    )
    fp32 = measured[FP32].columns()
    rows = [
        {
            "recipe": name,
            "shipped": name == shipped,
            **recipe_columns(name),
            "calibration_images": len(calibration_images),
            "build_s": build_s[name],
            **measured[name].columns(),
            "size_mb_vs_onnx_fp32": round(measured[name].size_mb / fp32["size_mb"], 3),
            **measured[name].scores,
            **{f"onnx_fp32_{key}": fp32[key] for key in FP32_COLUMNS},
            "threads": bench.threads,
            **bench.provenance(),
        }
        for name in names
    ]
    return rows, static_row(measured[shipped], bench)


def ratio_table_rows(recipe_rows: list[dict]) -> list[dict]:
    """What stage 2 prints of the comparison: each recipe's ratios to FP32 and its agreement."""
    return [{key: row[key] for key in RATIO_TABLE_COLUMNS} for row in recipe_rows]


def compare_variants(rows: list[dict]) -> list[dict]:
    """The seed's four-row table (plus any other stage-1 variants), with latency relative to ONNX FP32."""
    settings = {(str(row["threads"]), str(row["batch_size"])) for row in rows}
    if len(settings) > 1:
        print(
            f"warning: stages 1 and 2 ran with different (threads, batch size) {sorted(settings)}; "
            "rerun stage 1 with the same flags for a fair comparison",
            file=sys.stderr,
        )
    onnx_fp32_ms = next(float(row["mean_ms"]) for row in rows if row["variant"] == FP32)
    return [
        {
            "variant": VARIANT_NAMES.get(row["variant"], row["variant"]),
            **{column: row.get(column, "") for column in COMPARISON_COLUMNS if any(r.get(column) for r in rows)},
            # each row's own ratio to the FP32 it was timed in turns with (stage 1's, or stage 2's for static INT8);
            # across the two runs only for a 01_baseline.csv written before stage 1 recorded its ratios
            "mean_vs_onnx_fp32": round(
                float(row.get("mean_ms_vs_onnx_fp32") or float(row["mean_ms"]) / onnx_fp32_ms), 2
            ),
        }
        for row in rows
    ]


@dataclass(frozen=True)
class EngineVariant:
    """One way to serve the model: a file beside the models, the engine that runs it (engine.BACKENDS),
    OpenVINO's inference precision for what is not quantized (f32 or bf16; onnxruntime has none), its
    streams for batches and the part size batches are cut into (OpenVINOSession; None: its default)."""

    name: str
    engine: str
    file: str
    precision: str = "auto"
    streams: int = 1
    part_size: int | None = None


# onnxruntime on the FP32 file as the server opens it: the candidate that runs everywhere. The engine table's
# ratios are against ONNX FP32 as stage 1 times it (onnxruntime's defaults), not against this row.
FP32_VARIANT = EngineVariant("onnxruntime_fp32", "onnxruntime", FP32_ONNX)


@dataclass(frozen=True)
class OpenVINOInt8Build:
    """How stage 2 builds an NNCF INT8 IR file: the exact FP32 rewrites it starts from, and whether the logits
    layer is quantized too (mnv3.openvino_int8)."""

    graph_rewrites: tuple[str, ...] = ()
    quantize_logits: bool = False


# The shipped recipe's rewrites except pad16 (padding depthwise channels feeds onnxruntime's kernel; OpenVINO
# would only do more work), and the global pools as AveragePool (OpenVINO's pooling kernel, not a ReduceMean).
_OPENVINO_REWRITES = (
    *(name for name in RECIPES[DEFAULT_RECIPE].graph_rewrites if name != "pad16"),
    "global_pool_to_avgpool",
)
OPENVINO_INT8_BUILDS = {
    NNCF_INT8_XML: OpenVINOInt8Build(),
    NNCF_REWRITTEN_INT8_XML: OpenVINOInt8Build(_OPENVINO_REWRITES),
    NNCF_REWRITTEN_FULL_INT8_XML: OpenVINOInt8Build(_OPENVINO_REWRITES, quantize_logits=True),
}

ENGINE_TABLE_COLUMNS = (
    "variant",
    "engine",
    "file",
    "precision",
    "streams",
    "mean_ms",
    "per_image_ms",
    "mean_ms_vs_onnx_fp32",
    "per_image_ms_vs_onnx_fp32",
    "top1_agreement",
    "top5_agreement",
    "sqnr_db",
    "of_peak",
    "chosen",
)


def build_openvino_int8(fp32_path: Path, calibration_images: np.ndarray, artifacts_dir: Path) -> list[str]:
    """Each OPENVINO_INT8_BUILDS file in `artifacts_dir`, quantized by NNCF on `calibration_images` (a
    preprocess_photos array); none (and says so) without nncf and openvino."""
    try:
        import nncf  # noqa: F401

        from mnv3.openvino_int8 import quantize_nncf_int8
    except ModuleNotFoundError as exc:
        if exc.name not in ("nncf", "openvino"):
            raise
        print(f"{exc.name}: not installed, NNCF INT8 variants SKIPPED (pip install -r requirements-openvino.txt)")
        return []
    for file, build in OPENVINO_INT8_BUILDS.items():
        rewrites = f" after {'+'.join(build.graph_rewrites)}" if build.graph_rewrites else ""
        print(f"building {file} with NNCF{rewrites}" + (", logits layer in INT8 too" if build.quantize_logits else ""))
        quantize_nncf_int8(
            fp32_path, Path(artifacts_dir) / file, calibration_images, build.graph_rewrites, build.quantize_logits
        )
    return list(OPENVINO_INT8_BUILDS)


def engine_variants(int8_file: str, openvino_files: list[str], threads: int) -> list[EngineVariant]:
    """Every installed engine x precision on the models beside FP32 (FP32_VARIANT is the reference, not here):
    onnxruntime on the INT8 file; OpenVINO on FP32, the INT8 file and `openvino_files`, in f32 and, where the
    CPU computes it natively, bf16; each with one CPU stream and with a stream a thread for batches."""
    variants = [EngineVariant(variant_name("onnxruntime", int8_file, "auto"), "onnxruntime", int8_file)]
    try:
        from mnv3.openvino_backend import bf16_supported
    except ModuleNotFoundError as exc:
        if exc.name != "openvino":
            raise
        print("openvino: not installed, only onnxruntime variants are candidates")
        return variants
    precisions = ["f32", "bf16"] if bf16_supported() else ["f32"]
    return variants + [
        EngineVariant(variant_name("openvino", file, precision, streams), "openvino", file, precision, streams)
        for file in [FP32_ONNX, int8_file, *openvino_files]
        for precision in precisions
        for streams in sorted({1, threads})
    ]


def engine_runner(variant: EngineVariant, artifacts_dir: Path, threads: int, batch_size: int) -> Callable:
    """The variant as the server opens it by default (engine.open_session; onnxruntime's idle threads
    sleep, ServerConfig.ort_spinning), compiled for batch 1 and `batch_size`, but with all `threads` for
    batches too: the engine alone, where a server gives OpenVINO's batches --batch-threads."""
    session = open_session(
        Path(artifacts_dir) / variant.file,
        variant.engine,
        threads,
        max_batch_size=batch_size,
        allow_spinning=False,
        precision=variant.precision,
        streams=variant.streams,
        part_size=variant.part_size,
    )
    return ort_runner(session)


def remove_stage_2_outputs(artifacts_dir: Path) -> str | None:
    """Remove what stage 2 built from the fp32.onnx that stage 1 has just replaced with another model (the
    static INT8 file, OpenVINO's builds, the recipes' models) and its manifest entries, so that no server and
    no later stage pairs them with the new model's class names and weights. Says what it removed, if anything."""
    removed = []
    built = [artifacts_dir / STATIC_INT8_ONNX, *(artifacts_dir / xml for xml in OPENVINO_INT8_BUILDS)]
    for path in (file for model in built for file in model_files(model)):
        if path.is_file():
            path.unlink()
            removed.append(path.name)
    if (artifacts_dir / RECIPES_DIR).is_dir():
        shutil.rmtree(artifacts_dir / RECIPES_DIR)
        removed.append(f"{RECIPES_DIR}/")
    if entries := drop_manifest_entries(artifacts_dir, "static_int8", MANIFEST_KEY):
        removed.append(f"{MANIFEST_JSON}'s {' and '.join(entries)}")
    return ", ".join(removed) or None


def engine_rows(fp32_path: Path, runners: dict[EngineVariant, Callable], bench: Bench) -> list[dict]:
    """ONNX FP32 (key FP32, the reference: onnxruntime with its defaults, as stage 1 times it), FP32_VARIANT
    and each of `runners` (both opened as the server opens them) timed in turns in one run (COMPARISON_ROUNDS
    rounds), each a row with its same-run ratios to the reference, its agreement with the reference's logits
    and how far its rate at the batch size is from this CPU's measured peak (mnv3.silicon; measured right
    after). The reference is the first row; it is not a way to serve (see `candidates`).

    Why the reference is not FP32_VARIANT: the server's onnxruntime lets idle threads sleep, which costs it
    markedly at batch 1 (each node wakes them), so ratios against it would flatter every other engine."""
    served_fp32 = engine_runner(FP32_VARIANT, Path(fp32_path).parent, bench.threads, bench.batch_size)
    measured = measure_runners(
        fp32_path,
        {
            variant.name: (run, model_size_mb(Path(fp32_path).parent / variant.file))
            for variant, run in {FP32_VARIANT: served_fp32, **runners}.items()
        },
        bench,
        rounds=COMPARISON_ROUNDS,
    )
    reference = EngineVariant(FP32, "onnxruntime", FP32_ONNX)
    variants = {variant.name: variant for variant in [reference, FP32_VARIANT, *runners]}
    rows = [
        {
            "variant": name,
            "engine": variants[name].engine,
            "file": variants[name].file,
            "precision": variants[name].precision,
            "streams": variants[name].streams,
            **result.latency,
            "size_mb": result.size_mb,
            # FP32_VARIANT runs the reference's file on its engine: its logits are the reference's, and the
            # infinite SQNR of identical logits is no JSON for the manifest /model shows.
            **(result.scores if name != FP32_VARIANT.name else {}),
            "threads": bench.threads,
            **bench.provenance(),
        }
        for name, result in measured.items()
    ]
    macs, peaks = count_macs(fp32_path), gemm_peaks(bench.threads)
    return [row | silicon_columns(row, FP32_ONNX, macs, peaks) for row in rows]


PART_SIZE_TABLE_COLUMNS = (
    "variant",
    "part_size",
    "per_image_ms",
    "per_image_ms_vs_onnx_fp32",
    "per_image_p50_ms_vs_onnx_fp32",
    "top1_agreement",
    "sqnr_db",
    "chosen",
)
# The part sizes stage 2 times the chosen OpenVINO variant's batches in (OpenVINOSession), those that fit a
# stream's share of a benchmark batch.
PART_SIZES = (2, 4, 8, 16, 32)


def part_size_rows(fp32_path: Path, variant: EngineVariant, bench: Bench) -> list[dict]:
    """The OpenVINO `variant` with its batches cut into parts of each PART_SIZES size up to a stream's share of
    a benchmark batch, and ONNX FP32 (the first row), timed in turns in one run (COMPARISON_ROUNDS rounds):
    each a row with its same-run ratios and agreement. Only the per-image time at batch N can differ; a batch
    of one never runs in parts."""
    largest = max(bench.batch_size // variant.streams, 1)
    sized = {size: replace(variant, part_size=size) for size in PART_SIZES if size <= largest}
    artifacts_dir = Path(fp32_path).parent
    measured = measure_runners(
        fp32_path,
        {
            f"parts of {size}": (
                engine_runner(sized_variant, artifacts_dir, bench.threads, bench.batch_size),
                model_size_mb(artifacts_dir / variant.file),
            )
            for size, sized_variant in sized.items()
        },
        bench,
        rounds=COMPARISON_ROUNDS,
    )
    fp32 = measured.pop(FP32).latency
    # Every row carries the threads and the model it measured, the reference too (as in engine_rows).
    model = {"threads": bench.threads, **bench.provenance()}
    reference = {"variant": FP32, "part_size": "", **fp32, **model}
    results = {size: measured[f"parts of {size}"] for size in sized}
    return [reference] + [
        {
            "variant": variant.name,
            "part_size": size,
            **result.latency,
            **result.scores,
            **model,
        }
        for size, result in results.items()
    ]


def candidates(rows: list[dict]) -> list[dict]:
    """engine_rows' rows but the reference: the ways to serve the model that stage 2 chooses from."""
    return [row for row in rows if row["variant"] != FP32]


def profile_openvino(
    rows: list[dict], artifacts_dir: Path, bench: Bench, runs: int, part_size: int | None = None
) -> tuple[dict, list[dict]] | None:
    """OpenVINO's per-layer time split (profiling.openvino_layer_summary) of the chosen row if OpenVINO runs it,
    else of the fastest OpenVINO row per image, for both calls the server makes: a single image on every
    thread, and one part of a benchmark batch (`part_size`, measured for the chosen row when OpenVINO runs it,
    else OpenVINOSession's default; the batch size if smaller) alone on one stream's threads. Rows of the
    single image first. None when no row is OpenVINO."""
    openvino_rows = [row for row in rows if row["engine"] == "openvino"]
    if not openvino_rows:
        return None
    from mnv3.openvino_backend import DEFAULT_PART_SIZE
    from mnv3.profiling import openvino_layer_summary

    row = next((row for row in openvino_rows if row.get("chosen")), None)
    row = row or min(openvino_rows, key=lambda row: float(row["per_image_ms"]))
    part = min(part_size or DEFAULT_PART_SIZE, bench.batch_size)
    # Batch 1 is timed on every thread (the single-image path); a part on its stream's share of them.
    calls = {1: bench.threads} | ({part: max(bench.threads // row["streams"], 1)} if part > 1 else {})
    layers = []
    for size, threads in calls.items():
        batch = np.ascontiguousarray(bench.held_out[np.arange(size) % len(bench.held_out)])
        summary = openvino_layer_summary(Path(artifacts_dir) / row["file"], batch, runs, threads, row["precision"])
        layers += [{"variant": row["variant"], "batch_size": size, "threads": threads} | layer for layer in summary]
    return row, layers
