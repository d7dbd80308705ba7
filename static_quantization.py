"""Stage 2: static INT8 quantization of stage 1's FP32 ONNX model, calibrated on photos.

Writes artifacts/static_int8.onnx, results/02_static.csv, the four-variant comparison
results/model_variants.{csv,png} and results/summary.md.
"""
import argparse
import json
import sys
from pathlib import Path

from mnv3.accuracy import UnreadableLabels, array_batches, evaluate, held_out_batch, load_labels, predict
from mnv3.artifacts import (CALIBRATION_DIR, CLASS_NAMES_JSON, FP32_ONNX, STATIC_INT8_ONNX, MissingArtifact,
                            read_manifest, require, update_manifest)
from mnv3.latency import (add_stage_args, benchmark, make_session, measurement_settings, ort_runner,
                          positive_int, run_stage)
from mnv3.quantize import DEFAULT_RECIPE, RECIPES, calibration_photos, quantize_static_int8, size_mb
from mnv3.report import markdown_table, plot_variants, read_csv, write_csv, write_summary

CALIBRATION_IMAGES = (200, 16)  # (normal, --quick)
VARIANT_NAMES = {
    "pytorch_fp32": "PyTorch FP32",
    "onnx_fp32": "ONNX FP32",
    "onnx_dynamic_int8": "ONNX Dynamic INT8",
    "onnx_static_int8": "ONNX Static INT8",
}
COMPARISON_COLUMNS = ("mean_ms", "p95_ms", "size_mb", "batch_size", "per_image_ms", "top1_agreement",
                      "top5_agreement", "sqnr_db", "top1_accuracy", "top5_accuracy", "threads", "weights")


def get_args_parser(add_help=True):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=add_help)
    parser.add_argument("--calibration-dir", default=str(CALIBRATION_DIR),
                        help="calibration photos; filled with generated ones if it has none")
    parser.add_argument("--calibration-count", type=positive_int, default=None,
                        help=f"photos to calibrate on (default {CALIBRATION_IMAGES[0]}, {CALIBRATION_IMAGES[1]} with --quick)")
    parser.add_argument("--recipe", default=DEFAULT_RECIPE, choices=sorted(RECIPES),
                        help="static quantization recipe (mnv3/quantize.py RECIPES)")
    return add_stage_args(parser, artifacts_help="where stage 1's models are and stage 2's go")


def main(args):
    run_stage(run, args, user_errors=(MissingArtifact, UnreadableLabels))


def run(args):
    artifacts_dir, results_dir = Path(args.artifacts_dir), Path(args.results_dir)
    timing, batch_size = measurement_settings(args)
    fp32_path = require(artifacts_dir / FP32_ONNX, 1)
    baseline_rows = read_csv(require(results_dir / "01_baseline.csv", 1))
    class_names = json.loads(require(artifacts_dir / CLASS_NAMES_JSON, 1).read_text())
    labelled = load_labels(args.labels, class_names) if args.labels else None
    provenance = read_manifest(artifacts_dir).get("weights", "unknown")

    count = args.calibration_count or CALIBRATION_IMAGES[1 if args.quick else 0]
    calibration = calibration_photos(args.calibration_dir, count)
    if len(calibration) < count:
        print(f"warning: {args.calibration_dir} holds only {len(calibration)} of your images, fewer than the "
              f"{count} asked for", file=sys.stderr)
    recipe = RECIPES[args.recipe]
    print(f"calibrating recipe {args.recipe} on {len(calibration)} photos from {args.calibration_dir}")
    static_path = quantize_static_int8(fp32_path, artifacts_dir / STATIC_INT8_ONNX, calibration, recipe)

    held_out = held_out_batch(args.quick)
    reference = predict(ort_runner(make_session(fp32_path, args.threads)), array_batches(held_out, batch_size))
    run_static = ort_runner(make_session(static_path, args.threads))
    recipe_columns = {key: value for key, value in recipe.record().items() if not isinstance(value, (list, dict))}
    row = {
        "variant": "onnx_static_int8", **benchmark(run_static, held_out, batch_size, timing, desc="onnx_static_int8"),
        "size_mb": size_mb(static_path), "threads": args.threads, "weights": provenance,
        **evaluate(run_static, held_out, reference, labelled, batch_size),
        "recipe": args.recipe, **recipe_columns, "calibration_images": len(calibration),
    }
    write_csv(results_dir / "02_static.csv", [row])

    comparison = compare_variants(baseline_rows + [row])
    write_csv(results_dir / "model_variants.csv", comparison)
    plot_variants(comparison, results_dir / "model_variants.png")
    print(markdown_table(comparison))

    update_manifest(artifacts_dir, static_int8={
        "path": STATIC_INT8_ONNX, "recipe_name": args.recipe, "recipe": recipe.record(),
        "calibration_images": len(calibration), "calibration_dir": str(args.calibration_dir), "threads": args.threads,
    })
    print(f"wrote {write_summary(results_dir)}")


def compare_variants(rows: list[dict]) -> list[dict]:
    """The seed's four-row table, with latency relative to ONNX FP32."""
    settings = {(str(row["threads"]), str(row["batch_size"])) for row in rows}
    if len(settings) > 1:
        print(f"warning: stages 1 and 2 ran with different (threads, batch size) {sorted(settings)}; "
              "rerun stage 1 with the same flags for a fair comparison", file=sys.stderr)
    onnx_fp32_ms = next(float(row["mean_ms"]) for row in rows if row["variant"] == "onnx_fp32")
    return [
        {"variant": VARIANT_NAMES[row["variant"]],
         **{column: row.get(column, "") for column in COMPARISON_COLUMNS if any(r.get(column) for r in rows)},
         "mean_vs_onnx_fp32": round(float(row["mean_ms"]) / onnx_fp32_ms, 2)}
        for row in rows
    ]


if __name__ == "__main__":
    main(get_args_parser().parse_args())
