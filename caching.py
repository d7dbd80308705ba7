"""Stage 4: the result cache, hit versus miss.

The stage-3 server (batching off) with its cache on. Each image is sent twice: the first time is a
miss (decode, preprocess, inference), the second a hit (a hash of the body and a lookup). Both
sequentially (one request at a time: pure round-trip latency) and under `--concurrency` (throughput).
The server's own cache counters from /metrics are recorded beside what the responses said.
Writes results/04_caching.csv.

    python caching.py            # 50 sequential, then 1000 at concurrency 250
    python caching.py --quick
"""

import argparse

from mnv3 import cli, loadtest
from mnv3.artifacts import CACHING_CSV
from mnv3.photos import load_images

WARM_UP_SEED = 3  # photos of the warm-up's own, none of them a phase's


def get_args_parser():
    parser = argparse.ArgumentParser(description=cli.summary(__doc__))
    cli.add_load_test_args(parser)
    parser.add_argument(
        "--sequential-requests",
        type=cli.positive_int,
        help=f"images sent one at a time ({cli.full_and_quick('sequential_requests')})",
    )
    parser.add_argument(
        "--cache-size",
        type=cli.positive_int,
        help="server cache entries (default: every image this stage sends, so hits are never evicted)",
    )
    return parser


def main(args):
    cli.fill_load_defaults(args, sequential_requests=cli.defaults(args).sequential_requests)
    cli.run_stage(run, args, writes=("results_dir",))


def run(args):
    needed = max(args.sequential_requests, args.requests)  # each phase's images, then the same again
    if args.cache_size is not None and args.cache_size < needed:
        raise cli.UsageError(
            f"--cache-size {args.cache_size} holds fewer than the {needed} images a phase sends twice, so the "
            f"second pass would miss too and measure no hit: pass at least {needed}, or leave it unset"
        )
    model, provenance = cli.serving_model(args)
    # Disjoint image sets, so the concurrent misses are first-time requests too.
    bodies = load_images(args.sequential_requests + args.requests)
    runs = (
        ("sequential", 1, bodies[: args.sequential_requests]),
        ("concurrent", args.concurrency, bodies[args.sequential_requests :]),
    )
    options = cli.server_options(
        args, cache_size=len(bodies) if args.cache_size is None else args.cache_size, max_batch_size=1
    )
    rows = []
    with loadtest.ServerProcess(model, args.start_timeout, **options) as url:
        environment = loadtest.server_settings(url) | cli.environment_row(model, provenance)
        print(loadtest.what_serves(environment))
        # One untimed round first: a new server's first requests pay for what its engine's warm-up does not
        # touch, which would count against the first phase's misses alone. Its entries are the oldest, so the
        # first a full cache evicts.
        loadtest.warm_up(url, load_images(args.concurrency, seed=WARM_UP_SEED), args.concurrency)
        for run_name, concurrency, images in runs:
            miss, hit = (measure_phase(url, images, concurrency, run_name, phase) for phase in ("miss", "hit"))
            speedup = loadtest.ratio(miss["latency_p50_ms"], hit["latency_p50_ms"])
            throughput = loadtest.ratio(hit["req_per_s"], miss["req_per_s"])
            rows += [miss, hit | {"hit_speedup_p50": speedup, "hit_throughput_ratio": throughput}]
            print(
                f"{run_name}: a hit's p50 round trip is {speedup}x shorter than a miss's; "
                f"hits give {throughput}x the req/s"
            )
    cli.write_results(args.results_dir, CACHING_CSV, [row | environment for row in rows])


def measure_phase(url: str, images: list[bytes], concurrency: int, run_name: str, phase: str) -> dict:
    """Every image once at `concurrency`: the CSV row, printed as it is measured."""
    name = f"{run_name} {phase}"
    result = loadtest.run_with_metrics(url, lambda send: loadtest.run_closed_loop(send, images, concurrency, desc=name))
    print(f"{name}: {result.summary()}, {result.server['cache_hits']} cache hits")
    return {"run": run_name, "phase": phase} | result.as_row()


if __name__ == "__main__":
    main(get_args_parser().parse_args())
