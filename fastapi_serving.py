"""Stage 3: the single-request serving baseline.

The server with its result cache off and batching off (every request is its own ORT run), under the
seed's closed-loop load: `--concurrency` requests in flight through a thread pool, each with a
distinct JPEG body. Writes results/03_serving_baseline.csv; stage 5 repeats this configuration beside
the batched one, in the same run, for the speed-up.

    python fastapi_serving.py            # 250 concurrent, 1000 requests
    python fastapi_serving.py --quick    # 8 concurrent, 32 requests
"""
import argparse
import sys

from mnv3 import loadtest
from mnv3.photos import load_images

CSV_NAME = "03_serving_baseline.csv"
NO_CACHE_NO_BATCHING = {"cache_size": 0, "max_batch_size": 1}


def get_args_parser():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    return loadtest.add_common_args(parser)


def main(args):
    loadtest.load_defaults(args)
    model, provenance = loadtest.serving_model(args)
    bodies = load_images(args.requests)
    options = loadtest.server_options(args, **NO_CACHE_NO_BATCHING)
    print(f"serving {model} with cache and batching off; {args.requests} requests at concurrency {args.concurrency}")
    with loadtest.ServerProcess(model, args.start_timeout, **options) as url:
        settings = loadtest.server_settings(url)
        loadtest.warm_up(url, bodies, args.concurrency)
        result = loadtest.run_with_metrics(
            url, lambda send: loadtest.run_closed_loop(send, bodies, args.concurrency, desc="no batching"))
    print(f"baseline: {result.summary()}")
    row = {"configuration": "no_batching"} | result.as_row() | settings | loadtest.environment_row(model, provenance)
    loadtest.write_results(args.results_dir, CSV_NAME, [row])


if __name__ == "__main__":
    sys.exit(loadtest.run_stage(main, get_args_parser().parse_args()))
