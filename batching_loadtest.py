"""Stage 5: dynamic batching under load, against the unbatched baseline and the in-process limit.

In one run, with the result cache off so every request is a miss, and both servers up at once (each
idle while the other is measured):
  1. the in-process limit of the engine the servers run (mnv3/limit.py): the same decode + preprocess +
     inference with no server, over a grid of batch sizes and thread splits;
  2. the batching server (a `--batch-window-ms` window, at most `--max-batch-size` per inference call,
     explicit engine threads) over a concurrency sweep, reading the batch-size histogram and time breakdown from
     /metrics after each point;
  3. the headline, at `--concurrency` (the seed: 250), closed loop: the stage-3 server (no batching) and the
     batching server in two rounds of turns, mirrored (unbatched, batching, batching, unbatched), with the
     fastest limit configuration measured again before each round and after the last, all three pooled;
  4. the batching server open loop: Poisson arrivals at `--open-loop-fraction` of its measured
     throughput, latency from each request's scheduled send time; then the limits of onnxruntime on
     the FP32 and INT8 files, for comparison;
  5. (mnv3/v2_benchmark.py) a batching server answering the same photos through /predict and through the
     Open Inference Protocol's binary path (/v2/models/NAME/infer) in turns at `--concurrency`;
  6. FP32 and static INT8 in one batching server (`--side-by-side-models`; with --model, only if given)
     under mixed traffic, every photo to both: throughput per model and their top-1 agreement;
  7. with --phone-photos N (make bench: 64): N distinct 12-megapixel phone JPEGs (mnv3/phone_benchmark.py):
     full vs draft JPEG decoding in process (cost in turns, and what it changes), then the batching
     server under those uploads with draft decoding on and off, and where a request's time goes.
Writes results/05_batching_loadtest.csv, 05_v2_vs_predict.csv, 05_side_by_side.csv and three plots (and
results/05_phone_photos.csv), and prints the ratios.

    python batching_loadtest.py            # 250 concurrent; sweep 1..250
    python batching_loadtest.py --phone-photos 64
    python batching_loadtest.py --quick
"""

import argparse

from mnv3 import cli
from mnv3.artifacts import BATCHING_CSV, PHONE_PHOTOS_CSV, SIDE_BY_SIDE_CSV, V2_VS_PREDICT_CSV
from mnv3.batching_benchmark import BatchingPlan, plot_batching, run_batching_benchmark
from mnv3.config import MAX_BATCH_SIZE, ServerConfig
from mnv3.phone_benchmark import PhonePlan, run_phone_benchmark
from mnv3.photos import load_images, phone_photos
from mnv3.v2_benchmark import run_side_by_side, run_v2_vs_predict, side_by_side_models


def get_args_parser():
    parser = argparse.ArgumentParser(description=cli.summary(__doc__))
    cli.add_load_test_args(parser)
    parser.add_argument(
        "--batch-window-ms",
        type=cli.non_negative_float,
        default=ServerConfig.batch_window_ms,
        help="how long a batch waits to fill (default %(default)s)",
    )
    parser.add_argument(
        "--max-batch-size",
        type=cli.bounded(
            int, 1, MAX_BATCH_SIZE, what=f"a whole number from 1 to {MAX_BATCH_SIZE} (the server's bound)"
        ),
        default=ServerConfig.max_batch_size,
        help="most images per inference call (default %(default)s)",
    )
    parser.add_argument(
        "--sweep",
        type=cli.positive_int,
        nargs="+",
        help=f"concurrencies for the batching server ({cli.full_and_quick('sweep')}); --concurrency is always added",
    )
    parser.add_argument(
        "--open-loop-fraction",
        type=cli.positive_float,
        default=0.8,
        help="open-loop rate, as a fraction of the batching server's closed-loop req/s (default %(default)s)",
    )
    parser.add_argument(
        "--open-loop-seconds",
        type=cli.positive_float,
        help=f"open-loop duration ({cli.full_and_quick('open_loop_seconds')})",
    )
    parser.add_argument(
        "--limit-images",
        type=cli.positive_int,
        help=f"images per in-process limit run ({cli.full_and_quick('limit_images')})",
    )
    parser.add_argument(
        "--limit-batch-sizes", type=cli.positive_int, nargs="+", help=cli.full_and_quick("limit_batch_sizes")
    )
    parser.add_argument(
        "--side-by-side-models",
        nargs=2,
        metavar="[NAME=]PATH[@BACKEND]",
        help="the two models served together under mixed traffic (default: fp32.onnx and "
        "the static INT8 model in --artifacts-dir, both on onnxruntime; with --model, no side-by-side row "
        "unless given)",
    )
    parser.add_argument(
        "--phone-photos",
        type=cli.non_negative_int,
        default=0,
        help="distinct 12-megapixel phone JPEGs (2-4 MB) for the phone-photo rows; 0 skips them "
        "(default %(default)s; make bench: 64)",
    )
    parser.add_argument(
        "--phone-concurrency",
        type=cli.positive_int,
        help=f"concurrent phone uploads ({cli.full_and_quick('phone_concurrency')})",
    )
    return parser


def main(args):
    mode = cli.defaults(args)
    cli.fill_load_defaults(
        args,
        sweep=mode.sweep,
        open_loop_seconds=mode.open_loop_seconds,
        limit_images=mode.limit_images,
        limit_batch_sizes=mode.limit_batch_sizes,
        phone_concurrency=mode.phone_concurrency,
    )
    cli.run_stage(run, args, writes=("results_dir",))


def run(args):
    mode = cli.defaults(args)
    model, provenance = cli.serving_model(args)
    # Checked before any load. With --model, stages 1-2's files may not exist: the row needs naming its models.
    side_by_side = (
        side_by_side_models(args.side_by_side_models, args.artifacts_dir)
        if args.side_by_side_models or args.model is None
        else None
    )
    plan = BatchingPlan(
        concurrency=args.concurrency,
        requests=args.requests,
        sweep=tuple(args.sweep),
        batch_window_ms=args.batch_window_ms,
        max_batch_size=args.max_batch_size,
        open_loop_fraction=args.open_loop_fraction,
        open_loop_seconds=args.open_loop_seconds,
        limit_images=args.limit_images,
        limit_batch_sizes=tuple(args.limit_batch_sizes),
        limit_thread_splits=mode.limit_thread_splits,
        limit_confirm_passes=mode.limit_confirm_passes,
        server_options=cli.server_options(args),
        start_timeout_s=args.start_timeout,
    )
    bodies = load_images(max(*map(plan.requests_at, plan.concurrencies), plan.limit_images))
    result = run_batching_benchmark(model, bodies, plan)
    rows = result.rows(cli.environment_row(model, provenance))
    cli.check_answered(BATCHING_CSV, rows)  # before the plot, which would replace the last run's
    plot_batching(result, args.results_dir)
    cli.write_results(args.results_dir, BATCHING_CSV, rows)
    print(result.summary())
    run_v2_rows(args, model, provenance, plan, bodies, side_by_side)
    if args.phone_photos > 0:
        run_phone_photos(args, model, provenance, plan.batching_options)


def run_phone_photos(args, model, provenance, batching_options: dict):
    """The phone-photo rows: the batching server's settings, phone uploads instead of 500x375 photos."""
    plan = PhonePlan(
        concurrency=args.phone_concurrency,
        requests=cli.REQUESTS_PER_SENDER * args.phone_concurrency,
        decode_rounds=cli.defaults(args).phone_decode_rounds,
        server_options=batching_options,
        start_timeout_s=args.start_timeout,
    )
    result = run_phone_benchmark(model, phone_photos(args.phone_photos), plan)
    cli.write_results(args.results_dir, PHONE_PHOTOS_CSV, result.rows(cli.environment_row(model, provenance)))
    print(result.summary())


def run_v2_rows(args, model, provenance, plan: BatchingPlan, bodies: list[bytes], side_by_side):
    """/v2 binary vs /predict in turns, then the two models side by side (05_v2_vs_predict.csv, 05_side_by_side.csv)."""
    environment = cli.environment_row(model, provenance)
    v2 = run_v2_vs_predict(
        model, bodies[: plan.requests], plan.concurrency, plan.requests, plan.batching_options, plan.start_timeout_s
    )
    cli.write_results(args.results_dir, V2_VS_PREDICT_CSV, v2.rows(environment))
    print(v2.summary())
    if side_by_side is None:
        print("side by side: skipped (--model without --side-by-side-models)")
        return
    # Each photo goes to both models: as many requests in all as a headline run.
    mixed = run_side_by_side(
        side_by_side, bodies[: plan.requests // 2], plan.concurrency, plan.batching_options, plan.start_timeout_s
    )
    cli.write_results(args.results_dir, SIDE_BY_SIDE_CSV, mixed.rows(environment))


if __name__ == "__main__":
    main(get_args_parser().parse_args())
