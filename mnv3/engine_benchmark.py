"""Stage 2's engine benchmark: which engine serves, chosen by measurement on this machine.

Every installed engine x precision (onnxruntime; OpenVINO in f32 and bf16 on FP32, on the static INT8 file
and on NNCF's INT8 builds) is timed in turns with ONNX FP32 (results/02_engines.csv); the fastest that agrees
with FP32 (the guard of mnv3.backend_choice, with real weights) goes into the manifest, where the server's
`--backend auto` reads it. If that is OpenVINO, the part size its batches are cut into is measured too
(results/02_part_sizes.csv), and so is how many threads a server gives those batches under load
(results/02_batch_threads.csv; mnv3.batch_threads); then how far the chosen is from this CPU's peak and,
with OpenVINO, where its time goes (results/02_openvino_profile.csv).
"""

from pathlib import Path

from mnv3 import batch_threads, cli, report
from mnv3.artifacts import (
    BATCH_THREADS_CSV,
    ENGINES_CSV,
    OPENVINO_PROFILE_CSV,
    PART_SIZES_CSV,
    STAND_IN_PROVENANCE,
    STATIC_INT8_ONNX,
    drop_manifest_entries,
    update_manifest,
)
from mnv3.backend_choice import MANIFEST_KEY, choose, manifest_entry
from mnv3.photos import load_images
from mnv3.report import markdown_table, write_csv
from mnv3.variants import (
    ENGINE_TABLE_COLUMNS,
    PART_SIZE_TABLE_COLUMNS,
    Bench,
    EngineVariant,
    build_openvino_int8,
    candidates,
    engine_rows,
    engine_runner,
    engine_variants,
    part_size_rows,
    profile_openvino,
)


def choose_engine(args, fp32_path, calibration_images, bench: Bench, profile_runs: int) -> dict:
    """Time every installed engine x precision in turns with ONNX FP32, write results/02_engines.csv, and
    record the fastest that agrees with FP32 in the manifest for `--backend auto`; then say how far the
    chosen is from this CPU's peak and, with OpenVINO, where its time goes (results/02_openvino_profile.csv).
    `args` are stage 2's (its folders, --threads, --batch-size, --min-agreement, --quick)."""
    openvino_files = build_openvino_int8(fp32_path, calibration_images, args.artifacts_dir)
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
        bench.labelled is not None,
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
    try:
        turns = batch_threads.measure(
            args.artifacts_dir / STATIC_INT8_ONNX,
            args.threads,
            load_images(requests),
            mode.concurrency,
            requests,
            1 if args.quick else batch_threads.ROUNDS,
        )
    except BaseException:  # stopped midway (Ctrl-C, a server that would not start): the choice is not whole yet
        drop_manifest_entries(args.artifacts_dir, MANIFEST_KEY)
        raise
    keys, why = batch_threads.choose(turns, entry["streams"])
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
