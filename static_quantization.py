"""Stage 2: static INT8 quantization of stage 1's FP32 ONNX model, calibrated on photos preprocessed
as stage 1's manifest says the model was trained.

Writes artifacts/static_int8.onnx, results/02_static.csv, the comparison of stage 1's variants with
static INT8, results/model_variants.{csv,png}, and results/summary.md. With --compare-recipes, also builds and
measures several recipes against ONNX FP32 in the same run (results/02_recipes.csv).

Then chooses the engine that serves (mnv3/engine_benchmark.py): every installed engine x precision
(onnxruntime; OpenVINO in f32 and bf16 on FP32, on the static INT8 file and on NNCF's INT8 builds) timed in
turns with ONNX FP32 (results/02_engines.csv). The fastest that agrees with FP32 (--min-agreement, with
real weights) goes into the manifest, and the server's default `--backend auto` serves it
(mnv3/backend_choice.py). If that is OpenVINO, the part size its batches are cut into is measured too
(results/02_part_sizes.csv), and so is how many threads a server gives those batches under load: its
batching server with each, in turns (results/02_batch_threads.csv; mnv3/batch_threads.py).
"""

import argparse
import shutil
import sys
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from mnv3 import cli
from mnv3.accuracy import UnreadableLabels
from mnv3.artifacts import (
    BASELINE_CSV,
    CALIBRATION_DIR,
    CLASS_NAMES_JSON,
    FP32_ONNX,
    MANIFEST_JSON,
    MODEL_VARIANTS_CSV,
    MODEL_VARIANTS_PNG,
    RECIPES_CSV,
    RECIPES_DIR,
    STATIC_CSV,
    STATIC_INT8_ONNX,
    UnreadableClassNames,
    drop_manifest_entries,
    model_preprocessing,
    read_class_names,
    read_manifest,
    remake_hint,
    replaced_when_written,
    require,
    update_manifest,
    weights_provenance,
)
from mnv3.backend_choice import DEFAULT_MIN_AGREEMENT, MANIFEST_KEY
from mnv3.engine_benchmark import choose_engine
from mnv3.photos import is_generated
from mnv3.plots import plot_variants
from mnv3.preprocess import InvalidImage
from mnv3.quantize import DEFAULT_RECIPE, RECIPES, calibration_photos, preprocess_photos, quantize_static_int8
from mnv3.report import markdown_table, model_named, read_csv, row_model, same_model, write_csv, write_summary
from mnv3.variants import (
    Bench,
    compare_recipes,
    compare_variants,
    measure_static,
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
        help="also build and measure these recipes (comma-separated, or 'all', what the flag alone means) "
        "against ONNX FP32 in the same interleaved run: results/02_recipes.csv (default: only --recipe)",
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
    if not same_model(measured, row_model(model)):
        raise cli.UsageError(
            f"{path} is stage 1's of another model ({model_named(measured)}) than the one in {args.artifacts_dir} "
            f"({model_named(row_model(model))}): pass the --results-dir stage 1 wrote with this --artifacts-dir, "
            f"{RERUN_STAGE_1}"
        )
    return rows


def check_onnx(fp32_path: Path) -> None:
    """UsageError if stage 1's model is not a whole ONNX file (a copy cut short, a disk that filled up)."""
    try:
        onnx.load(str(fp32_path))
    except (DecodeError, ValueError, OSError) as exc:
        raise cli.UsageError(
            f"{fp32_path} is not a readable ONNX model ({exc or type(exc).__name__}): rerun stage 1, which "
            "exports it, with the flags that made that model"
        ) from None


def run(args):
    mode = cli.defaults(args)
    artifacts_dir, results_dir = args.artifacts_dir, args.results_dir
    fp32_path = require(artifacts_dir / FP32_ONNX, 1, artifacts_dir, results_dir)
    class_names_path = require(artifacts_dir / CLASS_NAMES_JSON, 1, artifacts_dir, results_dir)
    try:
        class_names = read_class_names(class_names_path)
    except UnreadableClassNames as exc:
        raise cli.UsageError(f"{exc}: {remake_hint(fp32_path)}") from None
    require(artifacts_dir / MANIFEST_JSON, 1, artifacts_dir, results_dir)  # what the model is: without it, no row says
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
    check_onnx(fp32_path)
    # Once for every build (the recipes, NNCF's), and before anything is replaced: a photo it cannot read
    # stops the run with the last run's files and choice as they were.
    print(f"preprocessing {len(calibration)} calibration photos from {args.calibration_dir}")
    calibration_images = preprocess_photos(calibration, preprocessing)
    # The last run's choice goes before its files are rebuilt: a run stopped midway leaves --backend auto
    # serving the model it is given (and saying so), not a choice measured on files since replaced.
    drop_manifest_entries(artifacts_dir, MANIFEST_KEY)
    if args.compare_recipes:
        names = list(dict.fromkeys(args.compare_recipes + [args.recipe]))
        recipes_dir = artifacts_dir / RECIPES_DIR
        recipe_rows, row = compare_recipes(
            fp32_path, names, args.recipe, calibration_images, recipes_dir, bench, mode.comparison_repeats
        )
        write_csv(results_dir / RECIPES_CSV, recipe_rows)
        print(markdown_table(ratio_table_rows(recipe_rows)))
        with replaced_when_written(artifacts_dir / STATIC_INT8_ONNX) as partial:
            shutil.copyfile(recipe_path(recipes_dir, args.recipe), partial)
    else:
        print(f"calibrating recipe {args.recipe} on {len(calibration)} photos from {args.calibration_dir}")
        static_path = quantize_static_int8(fp32_path, artifacts_dir / STATIC_INT8_ONNX, calibration_images, recipe)
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
    choose_engine(args, fp32_path, calibration_images, bench, mode.profile_runs)
    print(f"wrote {write_summary(results_dir)}")


if __name__ == "__main__":
    main(get_args_parser().parse_args())
