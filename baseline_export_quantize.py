"""Stage 1: PyTorch FP32 baseline, ONNX FP32 export checked against PyTorch, dynamic INT8 (with int8
weights, quantize_dynamic's default, and with uint8 weights), and an onnxruntime profile of the dynamic model
showing where its time goes. With openvino installed (requirements-openvino.txt) the same FP32 file also runs
on OpenVINO: FP32, and BF16 where the CPU has it.

The model is MobileNetV3-Large or -Small (--arch): torchvision's ImageNet weights, or your own fine-tuned
ones (--weights, --class-names, and the preprocessing it was trained with).

Writes artifacts/{fp32,dynamic_int8,dynamic_int8_u8_weights}.onnx, artifacts/class_names.json, the manifest
(arch, weights, classes, preprocessing: every later stage and the server read them from there),
results/01_baseline.csv, results/01_dynamic_int8_profile.csv and results/summary.md.
`--transformer-control` runs the same export -> dynamic INT8 -> timing -> profile on a ViT as well
(results/01_transformer_control*.csv): the other direction of the dynamic-INT8 finding.
"""

import argparse

import torch

from mnv3 import cli
from mnv3.accuracy import (
    UnreadableLabels,
    array_batches,
    held_out_batch,
    predict,
)
from mnv3.artifacts import (
    BASELINE_CSV,
    CLASS_NAMES_JSON,
    DYNAMIC_INT8_ONNX,
    DYNAMIC_INT8_PROFILE_CSV,
    DYNAMIC_INT8_U8_WEIGHTS_ONNX,
    FP32_ONNX,
    STAND_IN_PROVENANCE,
    TRANSFORMER_CONTROL_CSV,
    TRANSFORMER_CONTROL_PROFILE_CSV,
    file_sha256,
    model_id,
    read_manifest,
    update_manifest,
    write_class_names,
)
from mnv3.backend_choice import BACKENDS
from mnv3.engine import model_size_mb
from mnv3.model import (
    ARCHS,
    DEFAULT_ARCH,
    EXPORT_CHECK_BATCHES,
    BadClassNames,
    BadWeights,
    check_export,
    class_names_for,
    export_onnx,
    load_model,
    recalibrate_batchnorm,
    state_dict_size_mb,
    torch_runner,
)
from mnv3.photos import CALIBRATION_SOURCES, augmented_views
from mnv3.preprocess import DEFAULT_PREPROCESSING, Preprocessing
from mnv3.profiling import op_type_summary, profile_model
from mnv3.quantize import quantize_dynamic_int8
from mnv3.report import markdown_table, write_csv, write_summary
from mnv3.runtime import make_session, ort_runner
from mnv3.transformer_control import INTEGER_MATMUL_OPS, control_vit, int8_vs_fp32, op_shares, transformer_control
from mnv3.variants import Bench, Variant, baseline_rows, fastest, openvino_variants, remove_stage_2_outputs

PROFILED_OPS = ("ConvInteger", "DynamicQuantizeLinear")  # dynamic INT8's own ops, named in the printed shares
# Dynamic INT8's rows: variant -> (its file, uint8 weights). quantize_dynamic's default (int8 weights) is the
# write-up's row; uint8 weights reach onnxruntime's vector kernels for ConvInteger (quantize_dynamic_int8 says
# why), so the finding is timed both ways.
DYNAMIC_INT8_VARIANTS = {
    "onnx_dynamic_int8": (DYNAMIC_INT8_ONNX, False),
    "onnx_dynamic_int8_u8_weights": (DYNAMIC_INT8_U8_WEIGHTS_ONNX, True),
}


def get_args_parser(add_help=True):
    parser = argparse.ArgumentParser(description=cli.summary(__doc__), add_help=add_help)
    parser.add_argument("--arch", choices=sorted(ARCHS), default=DEFAULT_ARCH, help="default %(default)s")
    parser.add_argument(
        "--weights",
        default=None,
        help="your --arch weights: a state_dict (.pth), or a training checkpoint with it under "
        '"model" (as torchvision\'s references/classification/train.py saves it), "model_state_dict" or '
        '"state_dict" (any number of classes); default: torchvision\'s ImageNet weights, else random init',
    )
    parser.add_argument(
        "--class-names",
        default=None,
        help="the classes of --weights in training order: a text file of one name a line, or a JSON "
        "list (default: ImageNet's for 1000 classes, else class_0.. with a warning)",
    )
    parser.add_argument(
        "--resize",
        type=cli.positive_int,
        default=DEFAULT_PREPROCESSING.resize,
        help="the model's preprocessing: shorter side resized to this (default %(default)s)",
    )
    parser.add_argument(
        "--crop",
        type=cli.positive_int,
        default=DEFAULT_PREPROCESSING.crop,
        help="then the centre crop, the model's input size (default %(default)s)",
    )
    parser.add_argument(
        "--mean",
        type=float,
        nargs=3,
        default=DEFAULT_PREPROCESSING.mean,
        metavar=("R", "G", "B"),
        help="then (x/255 - mean)/std per channel (default ImageNet's: %(default)s)",
    )
    parser.add_argument(
        "--std",
        type=float,
        nargs=3,
        default=DEFAULT_PREPROCESSING.std,
        metavar=("R", "G", "B"),
        help="default ImageNet's: %(default)s",
    )
    parser.add_argument(
        "--backends",
        nargs="+",
        choices=BACKENDS,
        default=list(BACKENDS),
        help="runtimes to measure (default: both; openvino is skipped when not installed). "
        "PyTorch and onnxruntime always run: ORT FP32 is the accuracy reference",
    )
    parser.add_argument(
        "--transformer-control",
        action="store_true",
        help="also run the same export -> dynamic INT8 -> timing -> profile on a random-init ViT "
        "(ViT-Ti/16's shape; a 2-layer one with --quick), the control for the dynamic-INT8 "
        "finding (on in make bench)",
    )
    return cli.add_model_stage_args(parser, artifacts_help="where models and profiles go")


def main(args):
    cli.fill_unset(args, batch_size=cli.defaults(args).batch_size)
    cli.run_stage(run, args, (BadWeights, BadClassNames, UnreadableLabels), writes=("artifacts_dir", "results_dir"))


def run(args):
    mode = cli.defaults(args)
    artifacts_dir, results_dir = args.artifacts_dir, args.results_dir
    torch.set_num_threads(args.threads)  # the same intra-op count as every ORT session, so rows compare

    preprocessing = stage_preprocessing(args)
    model, provenance = load_model(args.arch, args.weights)
    class_names, class_names_source = class_names_for(model, args.class_names)
    labelled = cli.labelled_photos(args, class_names, mode.held_out_count(provenance))
    bn_images = 0
    if provenance == STAND_IN_PROVENANCE:
        # Without real BN statistics a random init's logits collapse to ~0 and INT8 comparisons are noise.
        bn_images = mode.bn_recalibration_images
        recalibrate_batchnorm(
            model, augmented_views(CALIBRATION_SOURCES, bn_images, seed=0), preprocessing=preprocessing
        )
        print(
            f"weights: {args.arch} RANDOM INIT, BatchNorm statistics re-estimated on {bn_images} "
            "calibration-source photos"
        )
    else:
        print(f"weights: {args.arch} {provenance}, {len(class_names)} classes (names: {class_names_source})")

    # The model is its export and the preprocessing it takes (the same file may take another --resize or --mean):
    # its id. Compared with the id the manifest records, not with the file this export replaces, as a run stopped
    # between the export and the manifest leaves the new file beside the last model's stage-2 builds.
    previous = read_manifest(artifacts_dir).get("model")
    fp32_path = export_onnx(model, artifacts_dir / FP32_ONNX, preprocessing)
    fp32_sha256 = file_sha256(fp32_path)
    assert fp32_sha256 is not None  # just written
    if not isinstance(previous, dict) or previous.get("id") != model_id(fp32_sha256, preprocessing):
        # The last model's dynamic INT8 files are rewritten below: gone now, should this run stop before then.
        for stale, _ in DYNAMIC_INT8_VARIANTS.values():
            (artifacts_dir / stale).unlink(missing_ok=True)
        if removed := remove_stage_2_outputs(artifacts_dir):
            print(f"removed {removed}: stage 2 built them from the previous model; rerun stage 2")
    write_class_names(artifacts_dir, class_names)
    # Recorded with the model, before anything is measured: a later stage or a server reading these files
    # never pairs this model with another run's preprocessing.
    model_record = {
        "arch": args.arch,
        "classes": len(class_names),
        "class_names": class_names_source,
        "id": model_id(fp32_sha256, preprocessing),
    }
    update_manifest(artifacts_dir, weights=provenance, preprocessing=preprocessing.record(), model=model_record)
    bench = Bench.for_stage(args, mode, preprocessing, class_names, labelled, provenance, args.arch, model_record["id"])
    fp32_run = ort_runner(make_session(fp32_path, args.threads))
    export_diff = check_export(model, fp32_run, bench.held_out)
    print(f"export check: max |ONNX - PyTorch| logit = {export_diff:.2e} at batch sizes {EXPORT_CHECK_BATCHES}")
    dynamic_paths = {
        variant: quantize_dynamic_int8(fp32_path, artifacts_dir / file, unsigned_weights=unsigned)
        for variant, (file, unsigned) in DYNAMIC_INT8_VARIANTS.items()
    }

    reference = predict(fp32_run, array_batches(bench.held_out, bench.batch_size))
    variants = [
        Variant("pytorch_fp32", torch_runner(model), state_dict_size_mb(model)),
        Variant("onnx_fp32", fp32_run, model_size_mb(fp32_path)),
        *(
            Variant(variant, ort_runner(make_session(path, args.threads)), model_size_mb(path))
            for variant, path in dynamic_paths.items()
        ),
    ]
    if "openvino" in args.backends:
        variants += openvino_variants(fp32_path, args.threads)
    rows = baseline_rows(variants, bench, reference, bn_images, export_diff)
    write_csv(results_dir / BASELINE_CSV, rows)
    print(markdown_table(rows))
    print(fastest(rows))

    trace = profile_model(
        dynamic_paths["onnx_dynamic_int8"],
        bench.held_out[:1],
        mode.profile_runs,
        args.threads,
        artifacts_dir / "dynamic_int8_profile.json",
    )
    profile = op_type_summary(trace, mode.profile_runs)
    write_csv(results_dir / DYNAMIC_INT8_PROFILE_CSV, profile)
    print("dynamic INT8 kernel time at batch 1: " + op_shares(profile, PROFILED_OPS))
    print(f"MobileNetV3 {int8_vs_fp32(rows)}")
    print(f"MobileNetV3, uint8 weights: {int8_vs_fp32(rows, 'onnx_dynamic_int8_u8_weights')}")
    if args.transformer_control:
        shape = control_vit(args.quick)
        # its own photos at ViT's 224 x 224, whatever preprocessing the MobileNetV3 was trained with
        control = transformer_control(
            shape,
            held_out_batch(mode.held_out_images),
            mode.timing,
            args.batch_size,
            args.threads,
            mode.profile_runs,
            artifacts_dir,
        )
        write_csv(results_dir / TRANSFORMER_CONTROL_CSV, control.rows)
        write_csv(results_dir / TRANSFORMER_CONTROL_PROFILE_CSV, control.profile)
        print(f"control, {shape.name} (random-init) {int8_vs_fp32(control.rows)}")
        print(
            "its dynamic INT8 kernel time at batch 1: "
            + op_shares(control.profile, INTEGER_MATMUL_OPS + ("ConvInteger",))
        )

    update_manifest(
        artifacts_dir,
        weights_bn_recalibration_images=bn_images,
        fp32={"path": FP32_ONNX, "class_names": CLASS_NAMES_JSON, "export_max_abs_diff": export_diff},
        dynamic_int8={"path": DYNAMIC_INT8_ONNX, "profile": trace.name, "threads": args.threads},
    )
    print(f"wrote {write_summary(results_dir)}")


def stage_preprocessing(args) -> Preprocessing:
    try:
        return Preprocessing(args.resize, args.crop, tuple(args.mean), tuple(args.std))
    except ValueError as exc:
        raise cli.UsageError(f"--resize/--crop/--mean/--std: {exc}") from exc


if __name__ == "__main__":
    main(get_args_parser().parse_args())
