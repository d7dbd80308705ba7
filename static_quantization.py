"""Stage 2: static INT8 quantization of stage 1's FP32 ONNX model, calibrated on photos preprocessed
as stage 1's manifest says the model was trained.

Writes artifacts/static_int8.onnx, results/02_static.csv, the comparison of stage 1's variants with
static INT8, results/model_variants.{csv,png}, and results/summary.md. With --compare-recipes, also builds and
measures several recipes against ONNX FP32 in the same run (results/02_recipes.csv).

Then chooses the engine that serves: every installed engine x precision (onnxruntime; OpenVINO in f32
and bf16 on FP32, on the static INT8 file and on NNCF's INT8 builds) timed in turns with ONNX FP32
(results/02_engines.csv). The fastest that agrees with FP32 (--min-agreement, with real weights) goes
into the manifest, and the server's default `--backend auto` serves it (mnv3/backend_choice.py). If that
is OpenVINO, the part size its batches are cut into is measured too (results/02_part_sizes.csv), and so is
how many threads a server gives those batches under load: its batching server with each, in turns
(results/02_batch_threads.csv; mnv3/batch_threads.py).
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

from mnv3 import batch_threads, cli, report
from mnv3.accuracy import UnreadableLabels
from mnv3.artifacts import (
    BASELINE_CSV,
    BATCH_THREADS_CSV,
    CALIBRATION_DIR,
    CLASS_NAMES_JSON,
    ENGINES_CSV,
    FP32_ONNX,
    MODEL_VARIANTS_CSV,
    MODEL_VARIANTS_PNG,
    OPENVINO_PROFILE_CSV,
    PART_SIZES_CSV,
    RECIPES_CSV,
    RECIPES_DIR,
    STAND_IN_PROVENANCE,
    STATIC_CSV,
    STATIC_INT8_ONNX,
    drop_manifest_entries,
    model_preprocessing,
    read_manifest,
    require,
    update_manifest,
    weights_provenance,
)
from mnv3.backend_choice import DEFAULT_MIN_AGREEMENT, MANIFEST_KEY, choose, manifest_entry
from mnv3.photos import is_generated, load_images
from mnv3.plots import plot_variants
from mnv3.preprocess import InvalidImage
from mnv3.quantize import DEFAULT_RECIPE, RECIPES, calibration_photos, quantize_static_int8
from mnv3.report import markdown_table, model_named, read_csv, row_model, write_csv, write_summary
from mnv3.variants import (
    ENGINE_TABLE_COLUMNS,
    PART_SIZE_TABLE_COLUMNS,
    Bench,
    EngineVariant,
    build_openvino_int8,
    candidates,
    compare_recipes,
    compare_variants,
    engine_rows,
    engine_runner,
    engine_variants,
    measure_static,
    part_size_rows,
    profile_openvino,
    ratio_table_rows,
    recipe_columns,
    recipe_path,
)


def get_args_parser(add_help=True):
    parser = argparse.ArgumentParser(description=cli.summary(__doc__), add_help=add_help)
    parser.add_argument(
        "--calibration-dir",
        default=str(CALIBRATION_DIR),
        help="calibration photos; filled with generated ones if it has none",
    )
    parser.add_argument(
        "--calibration-count",
        type=cli.positive_int,
        default=None,
        help=f"photos to calibrate on ({cli.full_and_quick('calibration_images')})",
    )
    parser.add_argument(
        "--recipe",
        default=DEFAULT_RECIPE,
        choices=sorted(RECIPES),
        help="static quantization recipe shipped as static_int8.onnx (mnv3/quantize.py RECIPES)",
    )
    parser.add_argument(
        "--compare-recipes",
        nargs="?",
        const="all",
        default=None,
        type=recipe_names,
        metavar="NAMES",
        help="also build and measure these recipes (comma-separated, or 'all', the "
        "default) against ONNX FP32 in the same interleaved run: results/02_recipes.csv",
    )
    parser.add_argument(
        "--min-agreement",
        type=cli.fraction,
        default=DEFAULT_MIN_AGREEMENT,
        help="top-1 agreement with FP32 a variant needs to be served by --backend auto, with real "
        "weights (default %(default)s; not applied to the random-init stand-in)",
    )
    return cli.add_model_stage_args(parser, artifacts_help="where stage 1's models are and stage 2's go")


def recipe_names(text: str) -> list[str]:
    names = sorted(RECIPES) if text == "all" else [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in RECIPES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown recipe(s) {unknown}; choose from {sorted(RECIPES)} or 'all'")
    return names


def main(args):
    mode = cli.defaults(args)
    cli.fill_unset(args, batch_size=mode.batch_size, calibration_count=mode.calibration_images)
    cli.run_stage(
        run, args, (UnreadableLabels, InvalidImage, NotADirectoryError), writes=("artifacts_dir", "results_dir")
    )


def generated_calibration_note(folder, calibration: list[Path], existed: bool) -> str | None:
    """What to tell the user when `folder` held none of their photos and stage 2 generated some there: a
    mistyped --calibration-dir would otherwise calibrate on the sample photos without a word."""
    if not calibration or not all(map(is_generated, calibration)):
        return None
    where = f"{folder} (created now)" if not existed else str(folder)
    return (
        f"calibration: no photos of yours in {where}, so {len(calibration)} generated views of the sample photos "
        "scikit-image and matplotlib ship; put your own photos there to calibrate on them"
    )


def calibrated_on(labelled: list[Path], calibration: list[Path]) -> int:
    """How many of the `labelled` photos are among the `calibration` photos (the same files, however named)."""
    return len({path.resolve() for path in labelled} & {path.resolve() for path in calibration})


# How to get stage 1's table of the model in --artifacts-dir back, in stage 2's refusals: stage 1 rerun on its
# defaults would export its default model over the user's.
RERUN_STAGE_1 = (
    "or rerun stage 1 with both folders and the flags that made that model (--arch, --weights, --class-names, "
    "--resize, --crop, --mean, --std): without them it exports its default model over it"
)


def stage_1_rows(model: dict, args) -> list[dict]:
    """Stage 1's rows in --results-dir, which must be of the model in --artifacts-dir (`model`, as
    report.row_model gives it): stage 2 tables its ratios with them, and folders from two stage 1 runs would
    compare two models without a word."""
    path = args.results_dir / BASELINE_CSV
    if not path.exists():
        raise cli.UsageError(
            f"{path} not found: stage 1 writes it beside the model now in {args.artifacts_dir} "
            f"({model_named(row_model(model))}): pass the --results-dir that run wrote to, {RERUN_STAGE_1}"
        )
    rows = read_csv(path)
    if not rows:
        raise cli.UsageError(f"{path} holds no rows: rerun stage 1")
    measured = row_model(rows[0])
    if measured != row_model(model):
        raise cli.UsageError(
            f"{path} is stage 1's of another model ({model_named(measured)}) than the one in {args.artifacts_dir} "
            f"({model_named(row_model(model))}): pass the --results-dir stage 1 wrote with this --artifacts-dir, "
            f"{RERUN_STAGE_1}"
        )
    return rows


def run(args):
    mode = cli.defaults(args)
    artifacts_dir, results_dir = args.artifacts_dir, args.results_dir
    fp32_path = require(artifacts_dir / FP32_ONNX, 1, artifacts_dir, results_dir)
    class_names = json.loads(require(artifacts_dir / CLASS_NAMES_JSON, 1, artifacts_dir, results_dir).read_text())
    manifest = read_manifest(artifacts_dir)
    provenance, arch = weights_provenance(artifacts_dir), manifest.get("model", {}).get("arch", "unknown")
    model_id = manifest.get("model", {}).get("id", "")
    baseline_rows = stage_1_rows(
        {"weights": provenance, "arch": arch, "classes": len(class_names), "model_id": model_id}, args
    )
    labelled = cli.labelled_photos(args, class_names, mode.held_out_count(provenance))
    preprocessing = model_preprocessing(artifacts_dir)  # what stage 1 exported the model for

    existed = Path(args.calibration_dir).is_dir()
    calibration = calibration_photos(args.calibration_dir, args.calibration_count)
    if note := generated_calibration_note(args.calibration_dir, calibration, existed):
        print(note)
    if len(calibration) < args.calibration_count:
        print(
            f"warning: {args.calibration_dir} holds only {len(calibration)} of your images, fewer than the "
            f"{args.calibration_count} asked for",
            file=sys.stderr,
        )
    if labelled and (shared := calibrated_on(labelled[0], calibration)):
        print(
            f"warning: {shared} of the --labels photos are calibration photos too: INT8's agreement with FP32 is "
            "measured on --labels photos, and on those it was calibrated for; keep the two folders apart",
            file=sys.stderr,
        )
    recipe = RECIPES[args.recipe]
    bench = Bench.for_stage(args, mode, preprocessing, class_names, labelled, provenance, arch, model_id)
    # The last run's choice goes before its files are rebuilt: a run stopped midway leaves --backend auto
    # serving the model it is given (and saying so), not a choice measured on files since replaced.
    drop_manifest_entries(artifacts_dir, MANIFEST_KEY)
    if args.compare_recipes:
        names = list(dict.fromkeys(args.compare_recipes + [args.recipe]))
        print(
            f"preprocessing {len(calibration)} calibration photos from {args.calibration_dir} once for "
            f"{len(names)} recipes"
        )
        recipes_dir = artifacts_dir / RECIPES_DIR
        recipe_rows, row = compare_recipes(
            fp32_path, names, args.recipe, calibration, recipes_dir, bench, mode.comparison_repeats
        )
        write_csv(results_dir / RECIPES_CSV, recipe_rows)
        print(markdown_table(ratio_table_rows(recipe_rows)))
        shutil.copyfile(recipe_path(recipes_dir, args.recipe), artifacts_dir / STATIC_INT8_ONNX)
    else:
        print(f"calibrating recipe {args.recipe} on {len(calibration)} photos from {args.calibration_dir}")
        static_path = quantize_static_int8(
            fp32_path, artifacts_dir / STATIC_INT8_ONNX, calibration, recipe, preprocessing=preprocessing
        )
        row = measure_static(fp32_path, static_path, bench)
    row |= {"recipe": args.recipe, **recipe_columns(args.recipe), "calibration_images": len(calibration)}
    write_csv(results_dir / STATIC_CSV, [row])

    comparison = compare_variants(baseline_rows + [row])
    write_csv(results_dir / MODEL_VARIANTS_CSV, comparison)
    plot_variants(comparison, results_dir / MODEL_VARIANTS_PNG)
    print(markdown_table(comparison))

    update_manifest(
        artifacts_dir,
        static_int8={
            "path": STATIC_INT8_ONNX,
            "recipe_name": args.recipe,
            "recipe": recipe.record(),
            "calibration_images": len(calibration),
            "calibration_dir": str(args.calibration_dir),
            "threads": args.threads,
        },
    )
    choose_engine(args, fp32_path, calibration, bench, mode.profile_runs)
    print(f"wrote {write_summary(results_dir)}")


def choose_engine(args, fp32_path, calibration, bench: Bench, profile_runs: int) -> dict:
    """Time every installed engine x precision in turns with ONNX FP32, write results/02_engines.csv, and
    record the fastest that agrees with FP32 in the manifest for `--backend auto`; then say how far the
    chosen is from this CPU's peak and, with OpenVINO, where its time goes (results/02_openvino_profile.csv)."""
    openvino_files = build_openvino_int8(fp32_path, calibration, args.artifacts_dir, bench.preprocessing)
    variants = engine_variants(STATIC_INT8_ONNX, openvino_files, args.threads)
    print(f"timing {len(variants) + 1} engine x precision variants in turns with ONNX FP32")
    runners = {
        variant: engine_runner(variant, args.artifacts_dir, args.threads, args.batch_size) for variant in variants
    }
    rows = engine_rows(fp32_path, runners, bench)
    served = candidates(rows)
    chosen, refused = choose(served, args.min_agreement, guard_applies=bench.weights != STAND_IN_PROVENANCE)
    entry = manifest_entry(
        chosen,
        refused,
        STATIC_INT8_ONNX,
        len(served),
        bench.weights,
        args.min_agreement,
        len(bench.held_out),
        report.cpu_info() | {"threads": args.threads, "versions": report.library_versions()},
    )
    rows = [row | {"chosen": row is chosen} for row in rows]
    write_csv(args.results_dir / ENGINES_CSV, rows)
    print(markdown_table([{key: row.get(key, "") for key in ENGINE_TABLE_COLUMNS} for row in rows]))
    (args.results_dir / PART_SIZES_CSV).unlink(missing_ok=True)  # an earlier run's, when OpenVINO was chosen
    if chosen["engine"] == "openvino":
        part_size, why = choose_part_size(
            fp32_path, next(v for v in variants if v.name == chosen["variant"]), bench, args.results_dir
        )
        entry |= part_size | {"reason": f"{entry['reason']}; {why}"}
    (args.results_dir / BATCH_THREADS_CSV).unlink(missing_ok=True)
    if chosen["engine"] == "openvino" and len(batch_threads.candidates(args.threads)) > 1:
        threads, why = choose_batch_threads(args, entry, bench)
        entry |= threads | {"reason": f"{entry['reason']}; {why}"}
    print(f"--backend auto will serve {entry['variant']}: {entry['reason']}")
    print(f"agreement guard: {entry['agreement_guard']}")
    print(silicon_summary(next(row for row in rows if row["chosen"]), bench.batch_size))
    profiled = profile_openvino(rows, args.artifacts_dir, bench, profile_runs, entry.get("part_size"))
    (args.results_dir / OPENVINO_PROFILE_CSV).unlink(missing_ok=True)  # an earlier run's, with OpenVINO
    if profiled:
        row, layers = profiled
        write_csv(args.results_dir / OPENVINO_PROFILE_CSV, layers)
        for size in dict.fromkeys(layer["batch_size"] for layer in layers):
            of_size = [layer for layer in layers if layer["batch_size"] == size]
            top = ", ".join(
                f"{layer['share_pct']:.0f}% {layer['layer_type']} {layer['kernel']}" for layer in of_size[:4]
            )
            print(
                f"OpenVINO's layer time of {row['variant']}, batch {size} on {of_size[0]['threads']} thread(s), "
                f"{sum(layer['ms_per_run'] for layer in of_size):.3f} ms a run: {top}"
            )
    update_manifest(args.artifacts_dir, **{MANIFEST_KEY: entry})
    return entry


def choose_part_size(fp32_path, variant: EngineVariant, bench: Bench, results_dir: Path) -> tuple[dict, str]:
    """Time the chosen OpenVINO variant's batches in parts of each size (variants.part_size_rows), write
    results/02_part_sizes.csv, and return the manifest keys for the fastest per image (its part size and
    same-run ratio) and why, for the choice's reason."""
    print(f"timing {variant.name}'s batches of {bench.batch_size} in parts of each size, in turns with ONNX FP32")
    rows = part_size_rows(fp32_path, variant, bench)
    best = min(rows[1:], key=lambda row: row["per_image_ms_vs_onnx_fp32"])
    rows = [row | {"chosen": row is best} for row in rows]
    write_csv(results_dir / PART_SIZES_CSV, rows)
    print(markdown_table([{key: row.get(key, "") for key in PART_SIZE_TABLE_COLUMNS} for row in rows]))
    sizes = ", ".join(str(row["part_size"]) for row in rows[1:])
    keys = {
        "part_size": best["part_size"],
        "part_size_per_image_ms_vs_onnx_fp32": best["per_image_ms_vs_onnx_fp32"],
    }
    return keys, (
        f"batches in parts of {best['part_size']} images, the fastest per image of part sizes {sizes} timed in "
        f"turns with ONNX FP32 ({best['per_image_ms_vs_onnx_fp32']}x FP32's time at batch {bench.batch_size})"
    )


# The printed table's columns of 02_batch_threads.csv, which holds each run's latency and CPU columns too.
BATCH_THREADS_TABLE_COLUMNS = (
    "batch_threads",
    "turn",
    "concurrency",
    "ok",
    "errors",
    "seconds",
    "req_per_s",
    "machine_cpu_busy",
    "chosen",
)


def choose_batch_threads(args, entry: dict, bench: Bench) -> tuple[dict, str]:
    """Time the batching server on the chosen engine with its batches on each candidate number of threads
    (mnv3.batch_threads), write results/02_batch_threads.csv, and return the manifest keys for the one that
    answered the most requests (its threads and each candidate's req/s) and why, for the choice's reason. Its
    rows name the model (`bench.provenance()`), as every stage-2 table's do."""
    mode = cli.defaults(args)
    update_manifest(args.artifacts_dir, **{MANIFEST_KEY: entry})  # what the servers serve under --backend auto
    requests = cli.REQUESTS_PER_SENDER * mode.concurrency
    print(
        f"timing the batching server's batches on {' and '.join(map(str, batch_threads.candidates(args.threads)))} "
        f"thread(s) in turns, {requests} distinct photos at concurrency {mode.concurrency}"
    )
    turns = batch_threads.measure(
        args.artifacts_dir / STATIC_INT8_ONNX,
        args.threads,
        load_images(requests),
        mode.concurrency,
        requests,
        1 if args.quick else batch_threads.ROUNDS,
    )
    keys, why = batch_threads.choose(turns)
    rows = [
        {
            "batch_threads": threads,
            "turn": turn,
            **run.as_row(),
            **bench.provenance(),
            "chosen": threads == keys["batch_threads"],
        }
        for threads, turn, run in turns
    ]
    write_csv(args.results_dir / BATCH_THREADS_CSV, rows)
    print(markdown_table([{key: row[key] for key in BATCH_THREADS_TABLE_COLUMNS} for row in rows]))
    return keys, why


def silicon_summary(row: dict, batch_size: int) -> str:
    """How far the row is from this CPU's measured peak (mnv3.silicon), as a line."""
    if row["of_peak"] is None:
        return (
            f"{row['variant']}: {row['gmac_per_s']} GMAC/s at batch {batch_size}; "
            f"no {row['computes_in']} peak measured here (the peak is measured with openvino)"
        )
    return (
        f"{row['variant']}: {row['gmac_per_s']} GMAC/s at batch {batch_size}, {row['of_peak']:.0%} of the fastest "
        f"{row['computes_in']} matrix product measured here ({row['peak_gmac_per_s']} GMAC/s)"
    )


if __name__ == "__main__":
    main(get_args_parser().parse_args())
