"""The latency harness every stage uses (the seed's method), the one place ORT sessions are made, and
the command-line flags and error handling the model stages share."""
import math
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

WARMUP_CALLS = 10
TIMED_CALLS = 100
DEFAULT_INTRA_OP_THREADS = 2  # the machines this project is measured on have 2 cores
DEFAULT_INTER_OP_THREADS = 1
DEFAULT_BATCH_SIZE = 32  # for per-image throughput; single-image latency is always batch 1


@dataclass(frozen=True)
class Timing:
    """How many calls a benchmark makes. Batched calls are fewer: each one is `batch_size` images."""
    warmup: int = WARMUP_CALLS
    iters: int = TIMED_CALLS
    batch_warmup: int = 2
    batch_iters: int = 10


QUICK_TIMING = Timing(warmup=3, iters=10, batch_warmup=1, batch_iters=3)
QUICK_BATCH_SIZE = 8


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)  # argparse turns this into "invalid positive_int value" and exit code 2
    return value


def add_stage_args(parser, artifacts_help: str):
    """The flags every model stage takes: where things go, how hard to measure, optional labels."""
    from mnv3.artifacts import ARTIFACTS_DIR, RESULTS_DIR

    parser.add_argument("--artifacts-dir", default=str(ARTIFACTS_DIR), help=artifacts_help)
    parser.add_argument("--results-dir", default=str(RESULTS_DIR), help="where CSVs, plots and summary.md go")
    parser.add_argument("--quick", action="store_true",
                        help="few timed calls and images, small batch: a smoke run in well under a minute")
    parser.add_argument("--threads", type=positive_int, default=DEFAULT_INTRA_OP_THREADS,
                        help="intra-op threads for onnxruntime and torch (recorded in the results)")
    parser.add_argument("--batch-size", type=positive_int, default=None,
                        help=f"batch for per-image throughput (default {DEFAULT_BATCH_SIZE}, {QUICK_BATCH_SIZE} with --quick)")
    parser.add_argument("--labels", default=None,
                        help="folder-per-class tree or CSV of file,class_id: adds true top-1/top-5 accuracy")
    return parser


def run_stage(run, args, user_errors: tuple):
    """`run(args)`; an error the user can fix (missing input, bad flag value) is one line and exit code 2."""
    try:
        run(args)
    except user_errors as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


def measurement_settings(args) -> tuple[Timing, int]:
    """(timing, batch size) for parsed `args`."""
    if args.quick:
        return QUICK_TIMING, args.batch_size or QUICK_BATCH_SIZE
    return Timing(), args.batch_size or DEFAULT_BATCH_SIZE


@dataclass(frozen=True)
class LatencyStats:
    mean_ms: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    calls: int

    @classmethod
    def from_seconds(cls, seconds) -> "LatencyStats":
        ms = np.asarray(seconds, dtype=np.float64) * 1000.0
        p50, p95, p99 = np.percentile(ms, [50, 95, 99])
        return cls(float(ms.mean()), float(p50), float(p95), float(p99), len(ms))

    def as_row(self, prefix: str = "") -> dict:
        return {f"{prefix}{key}": round(value, 3) if isinstance(value, float) else value
                for key, value in asdict(self).items()}


def interleaved_benchmark(runners: dict, images: np.ndarray, batch_size: int, timing: Timing, rounds: int = 5) -> dict:
    """Batch-1 latency stats and per-image ms at `batch_size` for each `run(batch) -> logits` in `runners`,
    measured in turns so that machine-load drift hits all alike (ratios between them are the result;
    `images` is a preprocessed (N, 3, H, W) array, and the batch cycles through it if N < batch_size).

    The timed calls are split into `rounds`; each round visits every model (in a rotated order) for its
    share of batch-1 and batch calls, after one untimed call of each kind so the previous model's
    spinning ORT threads have wound down.
    """
    single = images[:1]
    batch = np.ascontiguousarray(images[np.arange(batch_size) % len(images)])
    rounds = max(1, min(rounds, timing.batch_iters, timing.iters))
    singles, batches = {name: [] for name in runners}, {name: [] for name in runners}
    for run in runners.values():
        for _ in range(timing.warmup):
            run(single)
        for _ in range(timing.batch_warmup):
            run(batch)
    order = list(runners)
    for round_index in range(rounds):
        for name in order[round_index % len(order):] + order[:round_index % len(order)]:
            run = runners[name]
            for inputs, seconds, iters in ((single, singles[name], timing.iters),
                                           (batch, batches[name], timing.batch_iters)):
                run(inputs)
                for _ in range(math.ceil(iters / rounds)):
                    start = time.perf_counter()
                    run(inputs)
                    seconds.append(time.perf_counter() - start)
        print(f"timing round {round_index + 1}/{rounds} done")
    return {name: LatencyStats.from_seconds(singles[name]).as_row()
            | {"batch_size": batch_size, "per_image_ms": round(float(np.mean(batches[name])) * 1000 / batch_size, 3),
               "per_image_p50_ms": round(float(np.median(batches[name])) * 1000 / batch_size, 3)}
            for name in runners}


def ort_runner(session):
    """`run(batch) -> logits` for a single-input, single-output session."""
    input_name = session.get_inputs()[0].name
    return lambda batch: session.run(None, {input_name: batch})[0]


def make_session(model_path, intra_op_threads: int = DEFAULT_INTRA_OP_THREADS,
                 inter_op_threads: int = DEFAULT_INTER_OP_THREADS, profile_prefix: str | None = None,
                 optimized_model_path: str | None = None, allow_spinning: bool = True):
    """A CPU onnxruntime session with explicit (and therefore recordable) thread settings.

    `allow_spinning=False` makes idle intra-op threads sleep instead of busy-waiting: a little slower
    for one stream of calls on idle cores, much faster when other threads (decoding) share the cores.
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = inter_op_threads
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if allow_spinning else "0")
    if profile_prefix:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    if optimized_model_path:
        options.optimized_model_filepath = str(optimized_model_path)
    return ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
