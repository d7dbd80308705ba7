"""Stage 2: static INT8 quantization of stage 1's FP32 ONNX model, calibrated on photos.

Writes artifacts/static_int8.onnx, results/02_static.csv, the four-variant comparison
results/model_variants.{csv,png} and results/summary.md. With --compare-recipes, also builds and
measures several recipes against ONNX FP32 in the same run (results/02_recipes.csv).
"""
import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from mnv3.accuracy import UnreadableLabels, array_batches, evaluate, held_out_batch, load_labels, predict
from mnv3.artifacts import (CALIBRATION_DIR, CLASS_NAMES_JSON, FP32_ONNX, STATIC_INT8_ONNX, MissingArtifact,
                            read_manifest, require, update_manifest)
from mnv3.latency import (add_stage_args, interleaved_benchmark, make_session, measurement_settings, ort_runner,
                          positive_int, run_stage)
from mnv3.quantize import (DEFAULT_RECIPE, RECIPES, calibration_photos, preprocess_photos, quantize_static_int8,
                           size_mb)
from mnv3.preprocess import InvalidImage
from mnv3.report import markdown_table, plot_variants, read_csv, write_csv, write_summary

CALIBRATION_IMAGES = (200, 16)  # (normal, --quick)
RATIO_KEYS = ("mean_ms", "p50_ms", "per_image_ms", "per_image_p50_ms")  # timed columns compared with FP32
COMPARISON_REPEATS = 4  # --compare-recipes: 4x the timed calls of a stage-1 benchmark, in 8 rounds
RECIPES_DIR = "recipes"  # under --artifacts-dir: every --compare-recipes model, kept for inspection
VARIANT_NAMES = {
    "pytorch_fp32": "PyTorch FP32",
    "onnx_fp32": "ONNX FP32",
    "onnx_dynamic_int8": "ONNX Dynamic INT8",
    "onnx_static_int8": "ONNX Static INT8",
    "openvino_fp32": "OpenVINO FP32",
    "openvino_bf16": "OpenVINO BF16",
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
                        help="static quantization recipe shipped as static_int8.onnx (mnv3/quantize.py RECIPES)")
    parser.add_argument("--compare-recipes", nargs="?", const="all", default=None, type=recipe_names,
                        metavar="NAMES", help="also build and measure these recipes (comma-separated, or 'all', the "
                        "default) against ONNX FP32 in the same interleaved run: results/02_recipes.csv")
    return add_stage_args(parser, artifacts_help="where stage 1's models are and stage 2's go")


def recipe_names(text: str) -> list[str]:
    names = sorted(RECIPES) if text == "all" else [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in RECIPES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown recipe(s) {unknown}; choose from {sorted(RECIPES)} or 'all'")
    return names


def main(args):
    run_stage(run, args, user_errors=(MissingArtifact, UnreadableLabels, InvalidImage))


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
    held_out = held_out_batch(args.quick)
    if args.compare_recipes:
        row = compare_recipes(args, fp32_path, calibration, held_out, labelled, provenance, timing, batch_size)
    else:
        print(f"calibrating recipe {args.recipe} on {len(calibration)} photos from {args.calibration_dir}")
        static_path = quantize_static_int8(fp32_path, artifacts_dir / STATIC_INT8_ONNX, calibration, recipe)
        run_fp32 = ort_runner(make_session(fp32_path, args.threads))
        reference = predict(run_fp32, array_batches(held_out, batch_size))
        run_static = ort_runner(make_session(static_path, args.threads))
        # FP32 again, in turns with INT8: stage 1's FP32 timing is from another run.
        latency = interleaved_benchmark({"onnx_fp32": run_fp32, "onnx_static_int8": run_static}, held_out,
                                        batch_size, timing)
        row = {
            "variant": "onnx_static_int8", **latency["onnx_static_int8"],
            **same_run_ratios(latency["onnx_static_int8"], latency["onnx_fp32"]),
            "size_mb": size_mb(static_path), "threads": args.threads, "weights": provenance,
            **evaluate(run_static, held_out, reference, labelled, batch_size),
        }
    recipe_columns = {key: value for key, value in recipe.record().items() if not isinstance(value, (list, dict))}
    row |= {"recipe": args.recipe, **recipe_columns, "calibration_images": len(calibration)}
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


def compare_recipes(args, fp32_path, calibration, held_out, labelled, provenance, timing, batch_size) -> dict:
    """Build every --compare-recipes recipe (and --recipe) into artifacts/recipes/ on one calibration set,
    measure them and ONNX FP32 interleaved in one run, write results/02_recipes.csv and ship --recipe as
    static_int8.onnx. Returns the shipped recipe's 02_static.csv row."""
    names = list(dict.fromkeys(args.compare_recipes + [args.recipe]))
    artifacts_dir, results_dir = Path(args.artifacts_dir), Path(args.results_dir)
    print(f"preprocessing {len(calibration)} calibration photos from {args.calibration_dir} once for {len(names)} recipes")
    calibration_images = preprocess_photos(calibration)
    recipes_dir = artifacts_dir / RECIPES_DIR
    recipes_dir.mkdir(parents=True, exist_ok=True)
    paths, build_s = {}, {}
    with tempfile.TemporaryDirectory() as calibration_cache:
        for name in names:
            print(f"building recipe {name}")
            start = time.perf_counter()
            paths[name] = quantize_static_int8(fp32_path, recipes_dir / f"{name}.onnx", calibration_images,
                                               RECIPES[name], cache_dir=calibration_cache)
            build_s[name] = round(time.perf_counter() - start, 1)
    runners = {"onnx_fp32": ort_runner(make_session(fp32_path, args.threads))}
    runners |= {name: ort_runner(make_session(paths[name], args.threads)) for name in names}
    reference = predict(runners["onnx_fp32"], array_batches(held_out, batch_size))
    if not args.quick:  # the ratios between recipes are a few percent: more calls, more rounds, less noise
        timing = replace(timing, iters=timing.iters * COMPARISON_REPEATS,
                         batch_iters=timing.batch_iters * COMPARISON_REPEATS)
    latency = interleaved_benchmark(runners, held_out, batch_size, timing, rounds=2 * COMPARISON_REPEATS)
    fp32 = latency["onnx_fp32"] | {"size_mb": size_mb(fp32_path)}
    rows = []
    for name in names:
        measured = latency[name] | {"size_mb": size_mb(paths[name])}
        rows.append({
            "recipe": name, "shipped": name == args.recipe, **_recipe_columns(RECIPES[name]),
            "calibration_images": len(calibration), "build_s": build_s[name], **measured,
            **same_run_ratios(measured, fp32, keys=RATIO_KEYS + ("size_mb",)),
            **evaluate(runners[name], held_out, reference, labelled, batch_size),
            **{f"onnx_fp32_{key}": fp32[key] for key in ("mean_ms", "p50_ms", "per_image_ms", "size_mb")},
            "threads": args.threads, "weights": provenance,
        })
    write_csv(results_dir / "02_recipes.csv", rows)
    print(markdown_table([{key: row[key] for key in ("recipe", "mean_ms_vs_onnx_fp32", "p50_ms_vs_onnx_fp32",
                                                     "per_image_ms_vs_onnx_fp32", "size_mb_vs_onnx_fp32",
                                                     "top1_agreement", "sqnr_db")} for row in rows]))
    shutil.copyfile(paths[args.recipe], artifacts_dir / STATIC_INT8_ONNX)
    shipped = next(row for row in rows if row["recipe"] == args.recipe)
    row = {"variant": "onnx_static_int8"} | {key: shipped[key] for key in latency[args.recipe]}
    row |= {f"{key}_vs_onnx_fp32": shipped[f"{key}_vs_onnx_fp32"] for key in RATIO_KEYS}
    return row | {"size_mb": shipped["size_mb"], "threads": args.threads, "weights": provenance} | {
        key: shipped[key] for key in shipped if key.endswith(("agreement", "accuracy", "sqnr_db"))}


def same_run_ratios(measured: dict, fp32: dict, keys=RATIO_KEYS) -> dict:
    """`<key>_vs_onnx_fp32` columns: a variant against the ONNX FP32 timed in turns with it."""
    return {f"{key}_vs_onnx_fp32": round(measured[key] / fp32[key], 3) for key in keys}


def _recipe_columns(recipe) -> dict:
    """Every recipe field as one CSV cell (lists space-separated, extra options as JSON)."""
    return {key: " ".join(value) if isinstance(value, list) else json.dumps(value) if isinstance(value, dict) else value
            for key, value in recipe.record().items()}


def compare_variants(rows: list[dict]) -> list[dict]:
    """The seed's four-row table (plus any other stage-1 variants), with latency relative to ONNX FP32."""
    settings = {(str(row["threads"]), str(row["batch_size"])) for row in rows}
    if len(settings) > 1:
        print(f"warning: stages 1 and 2 ran with different (threads, batch size) {sorted(settings)}; "
              "rerun stage 1 with the same flags for a fair comparison", file=sys.stderr)
    onnx_fp32_ms = next(float(row["mean_ms"]) for row in rows if row["variant"] == "onnx_fp32")
    return [
        {"variant": VARIANT_NAMES.get(row["variant"], row["variant"]),
         **{column: row.get(column, "") for column in COMPARISON_COLUMNS if any(r.get(column) for r in rows)},
         # INT8's own same-run ratio where stage 2 timed it in turns with FP32, else across the two runs
         "mean_vs_onnx_fp32": round(float(row.get("mean_ms_vs_onnx_fp32") or float(row["mean_ms"]) / onnx_fp32_ms), 2)}
        for row in rows
    ]


if __name__ == "__main__":
    main(get_args_parser().parse_args())
