"""Stage 3: the single-request serving baseline.

The server with its result cache off and batching off (every request is its own inference call), under the
seed's closed-loop load: `--concurrency` requests in flight (`mnv3.loadtest`), each with a
distinct JPEG body. Writes results/03_serving_baseline.csv; stage 5 repeats this configuration beside
the batched one, in the same run, for the speed-up.

    python fastapi_serving.py            # 250 concurrent, 1000 requests
    python fastapi_serving.py --quick    # 8 concurrent, 32 requests
"""

import argparse

from mnv3 import cli, loadtest
from mnv3.artifacts import SERVING_BASELINE_CSV
from mnv3.photos import load_images

NO_CACHE_NO_BATCHING = {"cache_size": 0, "max_batch_size": 1}


def get_args_parser():
    parser = argparse.ArgumentParser(description=cli.summary(__doc__))
    return cli.add_load_test_args(parser)


def main(args):
    cli.fill_load_defaults(args)
    cli.run_stage(run, args, writes=("results_dir",))


def run(args):
    model, provenance = cli.serving_model(args)
    bodies = load_images(args.requests)
    options = cli.server_options(args, **NO_CACHE_NO_BATCHING)
    print(f"serving {model} with cache and batching off; {args.requests} requests at concurrency {args.concurrency}")
    with loadtest.ServerProcess(model, args.start_timeout, **options) as url:
        settings = loadtest.server_settings(url)
        print(loadtest.what_serves(settings))
        loadtest.warm_up(url, bodies, args.concurrency)
        result = loadtest.run_with_metrics(
            url, lambda send: loadtest.run_closed_loop(send, bodies, args.concurrency, desc="no batching")
        )
    print(f"baseline: {result.summary()}")
    row = {"configuration": "no_batching"} | result.as_row() | settings | cli.environment_row(model, provenance)
    cli.write_results(args.results_dir, SERVING_BASELINE_CSV, [row])


if __name__ == "__main__":
    main(get_args_parser().parse_args())
