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
import sys

from mnv3 import loadtest
from mnv3.latency import positive_int
from mnv3.photos import load_images

CSV_NAME = "04_caching.csv"


def get_args_parser():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    loadtest.add_common_args(parser)
    parser.add_argument("--sequential-requests", type=positive_int,
                        help="images sent one at a time (default 50; --quick 8)")
    parser.add_argument("--cache-size", type=positive_int,
                        help="server cache entries (default: every image this stage sends, so hits are never evicted)")
    return parser


def main(args):
    loadtest.load_defaults(args)
    loadtest.apply_defaults(args, {"sequential_requests": 50}, {"sequential_requests": 8})
    model, provenance = loadtest.serving_model(args)
    # Disjoint image sets, so the concurrent misses are first-time requests too.
    bodies = load_images(args.sequential_requests + args.requests)
    runs = (("sequential", 1, bodies[:args.sequential_requests]),
            ("concurrent", args.concurrency, bodies[args.sequential_requests:]))
    options = loadtest.server_options(args, cache_size=len(bodies) if args.cache_size is None else args.cache_size,
                                     max_batch_size=1)
    rows = []
    with loadtest.ServerProcess(model, args.start_timeout, **options) as url:
        environment = loadtest.server_settings(url) | loadtest.environment_row(model, provenance)
        for run, concurrency, images in runs:
            for phase in ("miss", "hit"):
                result = loadtest.run_with_metrics(
                    url, lambda send: loadtest.run_closed_loop(send, images, concurrency, desc=f"{run} {phase}"))
                rows.append({"run": run, "phase": phase} | result.as_row())
                print(f"{run} {phase}: {result.summary()}, {result.server['cache_hits']} cache hits")
            miss, hit = rows[-2:]
            hit["hit_speedup_p50"] = loadtest.ratio(miss["latency_p50_ms"], hit["latency_p50_ms"])
            hit["hit_throughput_ratio"] = loadtest.ratio(hit["req_per_s"], miss["req_per_s"])
            print(f"{run}: a hit's p50 round trip is {hit['hit_speedup_p50']}x shorter than a miss's; "
                  f"hits give {hit['hit_throughput_ratio']}x the req/s")
    loadtest.write_results(args.results_dir, CSV_NAME, [row | environment for row in rows])


if __name__ == "__main__":
    sys.exit(loadtest.run_stage(main, get_args_parser().parse_args()))
