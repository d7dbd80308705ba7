"""Stage 5: dynamic batching under load, against the unbatched baseline and the in-process limit.

In one run, with the result cache off so every request is a miss:
  1. the stage-3 server (no batching) at `--concurrency` (the seed: 250), closed loop;
  2. the batching server (a `--batch-window-ms` window, at most `--max-batch-size` per ORT run,
     explicit ORT threads) over a concurrency sweep that includes `--concurrency`, reading the
     batch-size histogram and time breakdown from /metrics after each point;
  3. the batching server open loop: Poisson arrivals at `--open-loop-fraction` of its measured
     throughput, latency from each request's scheduled send time;
  4. the in-process limit (mnv3/limit.py): the same decode + preprocess + inference with no server,
     over a grid of batch sizes and thread splits; the fastest is measured again, longer, as the limit.
Writes results/05_batching_loadtest.csv and three plots, and prints the ratios.

    python batching_loadtest.py            # 250 concurrent; sweep 1..250; ~3 minutes on 2 cores
    python batching_loadtest.py --quick
"""
import argparse
import sys
from pathlib import Path

from mnv3 import loadtest
from mnv3.latency import positive_int
from mnv3.limit import BATCH_SIZES, CONFIRM_PASSES, THREAD_SPLITS, run_limit
from mnv3.photos import load_images

CSV_NAME = "05_batching_loadtest.csv"
THROUGHPUT_PNG = "05_throughput_vs_concurrency.png"
LATENCY_PNG = "05_latency_vs_concurrency.png"
HISTOGRAM_PNG = "05_batch_size_histogram.png"
MIN_SWEEP_REQUESTS = 32  # even at concurrency 1, enough requests for a median
FULL = {"sweep": [1, 8, 32, 64, 128, 250], "open_loop_seconds": 15.0, "limit_images": 128,
        "limit_batch_sizes": list(BATCH_SIZES)}
QUICK = {"sweep": [1, 8], "open_loop_seconds": 2.0, "limit_images": 16, "limit_batch_sizes": [1, 8]}
QUICK_THREAD_SPLITS = THREAD_SPLITS[:2]


def get_args_parser():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    loadtest.add_common_args(parser)
    parser.add_argument("--batch-window-ms", type=float, default=20.0,
                        help="how long a batch waits to fill (default %(default)s)")
    parser.add_argument("--max-batch-size", type=positive_int, default=32,
                        help="most images per ORT run (default %(default)s)")
    parser.add_argument("--sweep", type=positive_int, nargs="+", help=f"concurrencies for the batching server "
                        f"(default {FULL['sweep']}; --quick {QUICK['sweep']}); --concurrency is always added")
    parser.add_argument("--open-loop-fraction", type=float, default=0.8,
                        help="open-loop rate, as a fraction of the batching server's closed-loop req/s "
                             "(default %(default)s)")
    parser.add_argument("--open-loop-seconds", type=float, help="open-loop duration (default 15; --quick 2)")
    parser.add_argument("--limit-images", type=positive_int,
                        help="images per in-process limit run (default 128; --quick 16)")
    parser.add_argument("--limit-batch-sizes", type=positive_int, nargs="+",
                        help=f"default {list(BATCH_SIZES)}; --quick [1, 8]")
    return parser


def main(args):
    loadtest.load_defaults(args)
    loadtest.apply_defaults(args, FULL, QUICK)
    model, provenance = loadtest.serving_model(args)
    sweep = sorted(set(args.sweep) | {args.concurrency})
    requests_at = {c: args.requests if c == args.concurrency
                   else max(round(args.requests * c / args.concurrency), MIN_SWEEP_REQUESTS) for c in sweep}
    bodies = load_images(max(*requests_at.values(), args.limit_images))
    environment = loadtest.environment_row(model, provenance)
    rows = []

    def closed_loop(url, concurrency, configuration, settings):
        result = loadtest.run_with_metrics(url, lambda send: loadtest.run_closed_loop(
            send, bodies, concurrency, requests_at[concurrency], desc=f"{configuration} c={concurrency}"))
        print(f"{configuration}: {result.summary()}")
        rows.append({"configuration": configuration} | result.as_row() | settings)
        return result

    unbatched = loadtest.server_options(args, cache_size=0, max_batch_size=1)
    with loadtest.ServerProcess(model, args.start_timeout, **unbatched) as url:
        loadtest.warm_up(url, bodies, args.concurrency)
        baseline = closed_loop(url, args.concurrency, "no_batching", loadtest.server_settings(url))

    batched = loadtest.server_options(args, cache_size=0, batch_window_ms=args.batch_window_ms,
                                      max_batch_size=args.max_batch_size)
    with loadtest.ServerProcess(model, args.start_timeout, **batched) as url:
        settings = loadtest.server_settings(url)
        loadtest.warm_up(url, bodies, args.concurrency)
        points = {c: closed_loop(url, c, "batching", settings) for c in sweep}
        headline = points[args.concurrency]
        rate = args.open_loop_fraction * headline.rps
        open_loop = loadtest.run_with_metrics(url, lambda send: loadtest.run_open_loop(
            send, bodies, rate, args.open_loop_seconds, max_in_flight=args.concurrency, desc="open loop"))
        print(f"batching, open loop: {open_loop.summary()}")
        rows.append({"configuration": "batching"} | open_loop.as_row() | settings)

    # After the servers stop, so the limit has the machine to itself.
    best, limits = run_limit(model, bodies[:args.limit_images], args.limit_batch_sizes,
                             QUICK_THREAD_SPLITS if args.quick else THREAD_SPLITS, 1 if args.quick else CONFIRM_PASSES)
    rows += [{"configuration": "in_process_limit", "mode": "in_process"} | r.as_row() for r in limits]
    rows.append({"configuration": "in_process_limit_confirmed", "mode": "in_process"} | best.as_row())

    speedup = loadtest.ratio(headline.rps, baseline.rps)
    of_limit = loadtest.ratio(headline.rps, best.images_per_s)
    headline_row = next(row for row in rows if row["configuration"] == "batching" and row["mode"] == "closed"
                        and row["concurrency"] == args.concurrency)
    headline_row |= {"speedup_vs_no_batching": speedup, "server_to_limit_ratio": of_limit}
    histogram = loadtest.batch_size_histogram(headline.metrics)
    plot(args.results_dir, points, baseline, best.images_per_s, histogram, args)
    loadtest.write_results(args.results_dir, CSV_NAME, [row | environment for row in rows])

    print(f"\nat concurrency {args.concurrency}: {baseline.rps:.1f} req/s without batching -> "
          f"{headline.rps:.1f} req/s with batching ({speedup}x)")
    print(f"in-process limit: {best.images_per_s:.1f} images/s (batch {best.batch_size}, ORT intra-op "
          f"{best.intra_op_threads}, decode threads {best.decode_threads}; the fastest of {len(limits)} "
          f"configurations, measured again over {best.images} images); the server reaches {of_limit} of it")
    print(f"batches at concurrency {args.concurrency} (size bucket: count): {histogram}")
    print(f"open loop, latency from each request's scheduled send time: {open_loop.summary()}")


def plot(results_dir: Path, points: dict, baseline, limit_images_per_s: float, histogram: dict, args):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    concurrencies = sorted(points)
    results = [points[c] for c in concurrencies]
    title = f"window {args.batch_window_ms:g} ms, max batch {args.max_batch_size}, cache off"
    results_dir.mkdir(parents=True, exist_ok=True)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(concurrencies, [r.rps for r in results], "o-", label="batching")
    ax.plot([args.concurrency], [baseline.rps], "s", color="tab:red", label="no batching")
    ax.axhline(limit_images_per_s, ls="--", color="gray", label="in-process limit")
    ax.set(xscale="log", xlabel="concurrent requests", ylabel="requests / s", title=f"Throughput ({title})")
    ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
    ax.legend()
    fig.savefig(results_dir / THROUGHPUT_PNG, dpi=120, bbox_inches="tight")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in ("p50_ms", "p95_ms", "p99_ms"):
        ax.plot(concurrencies, [getattr(r.latency, name, float("nan")) for r in results], "o-",
                label=f"batching {name[:3]}")
    ax.plot([args.concurrency], [getattr(baseline.latency, "p50_ms", float("nan"))], "s", color="tab:red",
            label="no batching p50")
    ax.set(xscale="log", yscale="log", xlabel="concurrent requests", ylabel="round trip (ms)",
           title=f"Latency, closed loop ({title})")
    ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
    ax.legend()
    fig.savefig(results_dir / LATENCY_PNG, dpi=120, bbox_inches="tight")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.bar(bucket_labels(list(histogram)), list(histogram.values()))
    ax.set(xlabel="batch size", ylabel="batches", title=f"Batch sizes at concurrency {args.concurrency} ({title})")
    fig.savefig(results_dir / HISTOGRAM_PNG, dpi=120, bbox_inches="tight")
    plt.close(fig)


def bucket_labels(bounds: list[str]) -> list[str]:
    """Prometheus upper bounds ("1", "2", "4", .., "+Inf") as the batch sizes each bucket holds."""
    labels, low = [], 1
    for bound in bounds:
        if bound == "+Inf":
            labels.append(f">{low - 1}")
            continue
        high = int(float(bound))
        labels.append(str(high) if high == low else f"{low}-{high}")
        low = high + 1
    return labels


if __name__ == "__main__":
    sys.exit(loadtest.run_stage(main, get_args_parser().parse_args()))
