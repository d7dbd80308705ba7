"""Soak: many requests against one server with a churning cache; memory must stay flat and nothing fail.

    python -m mnv3.soak --model PATH [--requests 20000] [--cache-size 256] [--distinct 1024]
                        [--concurrency 16] [--quick]

More distinct images than cache entries, drawn at random with repeats, so the cache both hits and
evicts all the time. The server's RSS (VmRSS from /proc) is read after a warm-up that fills the cache
and opens ORT's buffers for the batch sizes this load makes, then after each tenth of the run. Exit
status 0 only if RSS grew less than --max-growth and no request failed; a 503 (load shed by design,
refused before any work) is counted apart and allowed. Writes results/07_soak.csv, one row per tenth.
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from mnv3 import cli, loadtest
from mnv3.artifacts import SOAK_CSV
from mnv3.loadtest import PredictClient, ServerProcess, read_metrics, run_closed_loop
from mnv3.photos import load_images

CHECKPOINTS = 10
INTENDED_REJECTIONS = {"503"}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024  # reported in kB
    raise RuntimeError(f"no VmRSS for process {pid}")


def soak(args) -> tuple[list[dict], bool]:
    """Rows for the CSV (one per checkpoint) and whether the soak passed."""
    if args.distinct <= args.cache_size:
        raise cli.UsageError(
            f"--distinct {args.distinct} must be more than --cache-size {args.cache_size}: with every image "
            "cached, the cache never evicts, which is what the soak is for"
        )
    model, provenance = cli.serving_model(args)
    bodies = load_images(args.distinct, seed=11)
    order = np.random.default_rng(0).integers(0, args.distinct, args.requests)
    server = ServerProcess(model, args.start_timeout, **cli.server_options(args, cache_size=args.cache_size))
    with server as url:
        settings = loadtest.server_settings(url)
        with PredictClient(url) as send:  # fills the cache; meets the batch sizes this load makes
            warm = run_closed_loop(send, bodies, args.concurrency, count=min(args.distinct, 2 * args.cache_size))
        if warm.ok != warm.sent:
            raise loadtest.ServerStartError(f"warm-up failed: {warm.errors}")
        start_rss = rss_mib(server.pid)
        rows, done, started = [], 0, time.perf_counter()
        for chunk in np.array_split(order, CHECKPOINTS):
            chunk_bodies = [bodies[i] for i in chunk]
            result = loadtest.run_with_metrics(
                url, lambda send, chunk_bodies=chunk_bodies: run_closed_loop(send, chunk_bodies, args.concurrency)
            )
            done += len(chunk)
            rss = rss_mib(server.pid)
            rejected = sum(n for status, n in result.errors.items() if status in INTENDED_REJECTIONS)
            counts = loadtest.metrics_row(result.metrics)
            rows.append(
                {
                    "requests_done": done,
                    "seconds": round(time.perf_counter() - started, 1),
                    "req_per_s": round(result.rps, 1),
                    "ok": result.ok,
                    "rejected_503": rejected,
                    "errors": sum(result.errors.values()) - rejected,
                    "errors_by_status": ";".join(f"{s}:{n}" for s, n in sorted(result.errors.items())),
                    "p50_ms": round(result.latency.p50_ms, 1) if result.latency else None,
                    "p99_ms": round(result.latency.p99_ms, 1) if result.latency else None,
                    "cache_hits": counts["metrics_cache_hits"],
                    "cache_misses": counts["metrics_cache_misses"],
                    "cache_entries": round(read_metrics(url)[("mnv3_cache_entries", "")]),
                    "rss_start_mib": round(start_rss, 1),
                    "rss_mib": round(rss, 1),
                    "rss_growth_pct": round(100 * (rss / start_rss - 1), 2),
                }
            )
            print(
                f"{done:>6} requests: RSS {rss:.1f} MiB ({rows[-1]['rss_growth_pct']:+.2f}%), "
                f"{rows[-1]['cache_hits']} hits / {rows[-1]['cache_misses']} misses, "
                f"{rows[-1]['errors']} errors, {rejected} rejected, p99 {rows[-1]['p99_ms']} ms"
            )
    growth = rows[-1]["rss_growth_pct"] / 100  # the CSV's figure, not one recomputed from the rounded RSS
    errors = sum(row["errors"] for row in rows)
    passed = growth < args.max_growth and errors == 0
    environment = cli.environment_row(model, provenance) | settings | {"distinct_images": args.distinct}
    rows = [environment | row | {"passed": passed} for row in rows]
    print(
        f"RSS {start_rss:.1f} -> {rows[-1]['rss_mib']:.1f} MiB ({100 * growth:+.2f}%, limit "
        f"{100 * args.max_growth:.0f}%), {errors} errors: {'PASS' if passed else 'FAIL'}"
    )
    return rows, passed


def get_args_parser():
    parser = argparse.ArgumentParser(
        prog="python -m mnv3.soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    cli.add_load_test_args(
        parser,
        concurrency_help=cli.full_and_quick("soak_concurrency"),
        requests_help=cli.full_and_quick("soak_requests"),
    )
    parser.add_argument(
        "--cache-size", type=cli.positive_int, help=f"server cache entries ({cli.full_and_quick('soak_cache_size')})"
    )
    parser.add_argument(
        "--distinct",
        type=cli.positive_int,
        help=f"distinct images, more than the cache holds ({cli.full_and_quick('soak_distinct')})",
    )
    parser.add_argument(
        "--max-growth",
        type=cli.non_negative_float,
        default=0.10,
        help="largest RSS growth allowed, as a fraction of the warmed-up RSS (default %(default)s)",
    )
    return parser


def main(args) -> int:
    """0 if the soak passed, else 1; exits 2 with one line on an error the user can fix."""
    mode = cli.defaults(args)
    cli.fill_unset(
        args,
        requests=mode.soak_requests,
        cache_size=mode.soak_cache_size,
        distinct=mode.soak_distinct,
        concurrency=mode.soak_concurrency,
    )
    rows, passed = cli.run_stage(soak, args, writes=("results_dir",))
    # A soak whose server stopped answering is a failed soak, worth its rows (and exit 1), not a usage error.
    cli.write_results(args.results_dir, SOAK_CSV, rows, require_answers=False)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main(get_args_parser().parse_args()))
