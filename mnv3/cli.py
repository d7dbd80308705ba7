"""What every entry point shares: the common flags, what --quick changes, the model a load test
serves, the environment row, and the one-line error (exit code 2) for a mistake the user can fix.

An entry point is `get_args_parser()` + `main(args)`, as in torchvision's references/classification;
`main` runs the stage through `run_stage`, and the stage's steps (reading the last stage's artifacts, each
measurement, writing its tables) are calls into the package, with the counts the user left unset from
`defaults(args)`.
"""

import argparse
import contextlib
import errno
import fcntl
import math
import os
import signal
import sys
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mnv3 import report
from mnv3.accuracy import labelled_summary, load_labels, spread_labelled
from mnv3.artifacts import (
    ARTIFACTS_DIR,
    RESULTS_DIR,
    STAND_IN_PROVENANCE,
    STATIC_INT8_ONNX,
    MissingArtifact,
    UnreadableManifest,
    read_manifest,
    remove_leftover_partials,
    require,
    weights_provenance,
)
from mnv3.config import ServerConfig, flag
from mnv3.latency import Timing
from mnv3.limit import BATCH_SIZES, CONFIRM_PASSES, THREAD_SPLITS
from mnv3.loadtest import REQUEST_TIMEOUT_S, START_TIMEOUT_S, KeyRefused, ServerStartError
from mnv3.photos import LOAD_IMAGE_QUALITY, LOAD_IMAGE_SIZE
from mnv3.runtime import DEFAULT_INTRA_OP_THREADS


class UsageError(ValueError):
    """Flag values that cannot work together; the message names the fix."""


REQUESTS_PER_SENDER = 4  # a closed-loop run's default requests per concurrent sender: enough for stable numbers


@dataclass(frozen=True)
class Defaults:
    """Every count that --quick changes, for every entry point. `defaults(args)` picks FULL or QUICK
    once; a flag the user sets wins over both."""

    # stages 1-2: the model
    timing: Timing
    batch_size: int  # for per-image throughput; batch-1 latency is always measured too
    held_out_images: int  # QUICK keeps >= 8, the largest export-check batch
    # with real weights, where stage 2's agreement guard applies: at 0.99, 64 photos would allow not one
    # disagreement, and a variant that flips 1% of them would pass about half the time (0.99 ** 64)
    guarded_held_out_images: int
    bn_recalibration_images: int  # the random-init stand-in's BatchNorm statistics
    profile_runs: int
    calibration_images: int
    comparison_repeats: int  # --compare-recipes: the ratios between recipes are a few percent, so more calls
    # stages 3-5: the server under load
    concurrency: int
    sequential_requests: int
    sweep: tuple[int, ...]
    open_loop_seconds: float
    limit_images: int
    limit_batch_sizes: tuple[int, ...]
    limit_thread_splits: tuple[tuple[int, int], ...]
    limit_confirm_passes: int
    phone_concurrency: int  # stage 5 --phone-photos: each request uploads 2-4 MB
    phone_decode_rounds: int  # full vs draft decode, in turns
    # python -m mnv3.soak: more distinct images than cache entries, so the cache churns
    soak_requests: int
    soak_cache_size: int
    soak_distinct: int
    soak_concurrency: int
    # python -m mnv3.ray_serve --bench
    ray_bench_concurrency: int
    # python -m mnv3.ray_cluster: closed-loop clients, seconds of load and the kill's time in a loss run,
    # distinct photos, and requests per photo in the cache run
    cluster_concurrency: int
    cluster_seconds: float
    cluster_loss_at: float
    cluster_images: int
    cluster_repeats: int

    def held_out_count(self, weights: str) -> int:
        """How many held-out photos stages 1-2 compare variants on, for a model of these `weights` (its
        provenance): more where the agreement guard applies."""
        return self.held_out_images if weights == STAND_IN_PROVENANCE else self.guarded_held_out_images


FULL = Defaults(
    timing=Timing(),
    batch_size=32,
    held_out_images=64,
    guarded_held_out_images=512,
    bn_recalibration_images=64,
    profile_runs=20,
    calibration_images=200,
    comparison_repeats=4,
    concurrency=250,
    sequential_requests=50,
    sweep=(1, 8, 32, 64, 128, 250),
    open_loop_seconds=15.0,
    limit_images=128,
    limit_batch_sizes=BATCH_SIZES,
    limit_thread_splits=THREAD_SPLITS,
    limit_confirm_passes=CONFIRM_PASSES,
    phone_concurrency=32,
    phone_decode_rounds=5,
    soak_requests=20_000,
    soak_cache_size=256,
    soak_distinct=1024,
    soak_concurrency=16,
    ray_bench_concurrency=64,
    cluster_concurrency=16,
    cluster_seconds=60.0,
    cluster_loss_at=15.0,
    cluster_images=64,
    cluster_repeats=16,
)
QUICK = Defaults(
    timing=Timing(warmup=3, iters=10, batch_warmup=1, batch_iters=3, turn_warmup_s=0.01),
    batch_size=8,
    held_out_images=16,
    guarded_held_out_images=16,
    # As FULL's: the model stage 1 exports is the model, whatever the mode, so a smoke run on the default
    # artifacts/ keeps the stage-2 files built from it (a model of its own would have them removed).
    bn_recalibration_images=FULL.bn_recalibration_images,
    profile_runs=3,
    calibration_images=16,
    comparison_repeats=1,
    concurrency=8,
    sequential_requests=8,
    sweep=(1, 8),
    open_loop_seconds=2.0,
    limit_images=16,
    limit_batch_sizes=(1, 8),
    limit_thread_splits=THREAD_SPLITS[:2],
    limit_confirm_passes=1,
    phone_concurrency=4,
    phone_decode_rounds=2,
    soak_requests=400,
    soak_cache_size=32,
    soak_distinct=128,
    soak_concurrency=4,
    ray_bench_concurrency=8,
    cluster_concurrency=8,
    cluster_seconds=30.0,
    cluster_loss_at=10.0,
    cluster_images=16,
    cluster_repeats=8,
)


def defaults(args) -> Defaults:
    return QUICK if args.quick else FULL


def fill_unset(args, **values):
    """Set each of `values` whose flag the user left unset (None); returns `args`."""
    for name, value in values.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    return args


def summary(docstring: str) -> str:
    """An entry point's --help description: its docstring's first paragraph (argparse reflows the lines)."""
    return docstring.strip().split("\n\n")[0]


def full_and_quick(name: str) -> str:
    """'default X; --quick Y' for a flag's help."""
    full, quick = getattr(FULL, name), getattr(QUICK, name)
    if isinstance(full, tuple):
        full, quick = list(full), list(quick)
    return f"default {full}; --quick {quick}"


def bounded(kind: type, minimum: float, maximum: float = math.inf, *, above: bool = False, what: str):
    """An argparse type: a finite `kind` (int or float) from `minimum` (exclusive if `above`) to `maximum`.
    Anything else is argparse's one-line error, "argument --flag: '0' is not <what>", and exit 2 (a plain
    ValueError would say "invalid <function name> value" instead)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and (value > minimum if above else value >= minimum) and value <= maximum):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value

    return parse


positive_int = bounded(int, 1, what="a whole number of at least 1")
non_negative_int = bounded(int, 0, what="a whole number of at least 0")
positive_float = bounded(float, 0, above=True, what="a number above 0")
non_negative_float = bounded(float, 0, what="a number of at least 0")
fraction = bounded(float, 0, 1, what="a fraction from 0 to 1")


# ---------------------------------------------------------------------------------------- flags


def check_writable(folder: Path, flag: str) -> list[Path]:
    """`folder` exists (made if need be) and takes a new file, or UsageError naming `flag`. Returns the folders
    it made, innermost first."""
    fix = "pass a folder you can write to"
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{flag} {folder} is a file; {fix}")
    made = [path for path in (folder, *folder.absolute().parents) if not path.exists()]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-"):
            pass
    except OSError as exc:  # a file in the way further up, a read-only file system, no permission
        raise UsageError(f"{flag} {folder}: cannot write there ({exc.strerror or exc}); {fix}") from None
    return made


def remove_if_empty(folders: list[Path]) -> None:
    """Remove those of `folders` that are empty, innermost first: a refused run leaves no trace of a
    mistyped path, and never a file it wrote."""
    for folder in sorted(folders, key=lambda path: len(path.absolute().parts), reverse=True):
        with contextlib.suppress(OSError):  # not empty (or gone): kept
            folder.rmdir()


def add_common_args(parser, artifacts_help: str):
    """The flags every entry point takes: where things go, and --quick."""
    parser.add_argument(
        "--artifacts-dir", type=Path, default=ARTIFACTS_DIR, help=f"{artifacts_help} (default %(default)s)"
    )
    parser.add_argument(
        "--results-dir",
        type=Path,
        default=RESULTS_DIR,
        help="where CSVs, plots and summary.md go (default %(default)s)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small counts (mnv3/cli.py QUICK): a smoke run of seconds to a minute or two",
    )
    return parser


def add_model_stage_args(parser, artifacts_help: str):
    """Stages 1-2: the common flags, how hard to measure, optional labels."""
    add_common_args(parser, artifacts_help)
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=DEFAULT_INTRA_OP_THREADS,
        help="intra-op threads for onnxruntime and torch (recorded in the results)",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=None,
        help=f"batch for per-image throughput ({full_and_quick('batch_size')})",
    )
    parser.add_argument(
        "--labels", default=None, help="folder-per-class tree or CSV of file,class_id: adds true top-1/top-5 accuracy"
    )
    parser.add_argument(
        "--labels-count",
        type=positive_int,
        default=None,
        help="score only this many --labels photos, spread evenly over them (default: all; every variant "
        "scores each one, so a 50,000-photo validation set takes hours on a few cores)",
    )
    return parser


def labelled_photos(args, class_names: list[str], held_out_count: int) -> tuple[list[Path], np.ndarray] | None:
    """Stages 1-2's --labels: the photos and their class ids, --labels-count of them, once the stage has said
    what they score (accuracy, and agreement with FP32 on `held_out_count` of them); None without --labels."""
    if not args.labels:
        return None
    labelled = load_labels(args.labels, class_names)
    scored = spread_labelled(labelled, args.labels_count)
    print(labelled_summary(args.labels, labelled, scored, held_out_count))
    return scored


def add_load_args(parser, concurrency_help: str, requests_help: str):
    """What a load test drives: the model to serve, how many senders, how many requests."""
    parser.add_argument(
        "--model",
        type=Path,
        help="model to serve, ONNX or an OpenVINO IR (default: the static INT8 model stage 2 recorded)",
    )
    parser.add_argument("--concurrency", type=positive_int, help=f"concurrent requests ({concurrency_help})")
    parser.add_argument("--requests", type=positive_int, help=f"requests per closed-loop run ({requests_help})")
    return parser


def add_load_test_args(
    parser,
    concurrency_help: str = full_and_quick("concurrency"),
    requests_help: str = f"default {REQUESTS_PER_SENDER}x concurrency",
):
    """Stages 3-5 and the soak: the common flags, the load, and the server's tuning flags (defaults:
    the server's own, except a deadline as long as the client waits)."""
    add_common_args(parser, "where stages 1-2 wrote models")
    add_load_args(parser, concurrency_help, requests_help)
    parser.add_argument(
        "--intra-op-threads",
        type=positive_int,
        default=ServerConfig.intra_op_threads,
        help="server's intra-op threads: every onnxruntime call, OpenVINO's single images (default %(default)s)",
    )
    parser.add_argument(
        "--inter-op-threads",
        type=positive_int,
        default=ServerConfig.inter_op_threads,
        help="server's ORT inter-op threads (default %(default)s)",
    )
    parser.add_argument(
        "--batch-threads",
        type=positive_int,
        help="server's OpenVINO threads for a batch of more than one image (default: server's: what stage 2 "
        "measured for this engine, else half of --intra-op-threads)",
    )
    parser.add_argument(
        "--preprocess-threads", type=positive_int, help="server's decode/preprocess threads (default: server's)"
    )
    parser.add_argument(
        "--deadline-ms",
        type=positive_float,
        default=1000 * REQUEST_TIMEOUT_S,
        help="server's per-request deadline; as long as the client waits, so a load test "
        "measures throughput, not load shedding (default %(default)s)",
    )
    parser.add_argument(
        "--start-timeout",
        type=positive_float,
        default=START_TIMEOUT_S,
        help="seconds to wait for /readyz (default %(default)s)",
    )
    return parser


def fill_load_defaults(args, **stage_values):
    """--concurrency and --requests if unset (REQUESTS_PER_SENDER per sender), then a stage's own. A
    concurrency above the requests is lowered to them, and says so: no more can ever be in flight."""
    fill_unset(args, concurrency=defaults(args).concurrency)
    fill_unset(args, requests=REQUESTS_PER_SENDER * args.concurrency, **stage_values)
    if args.requests < args.concurrency:
        print(
            f"--concurrency {args.concurrency} is more than --requests {args.requests}: "
            f"measuring at concurrency {args.requests}"
        )
        args.concurrency = args.requests
    return args


def server_options(args, **overrides) -> dict:
    """Server flags from the load-test tuning flags, then a stage's own settings (cache, batching)."""
    return {
        "intra_op_threads": args.intra_op_threads,
        "inter_op_threads": args.inter_op_threads,
        "batch_threads": args.batch_threads,
        "preprocess_threads": args.preprocess_threads,
        "deadline_ms": args.deadline_ms,
    } | overrides


# ---------------------------------------------------------------------------------------- running a stage


def serving_model(args) -> tuple[Path, str]:
    """(model to serve, weights provenance): --model, else the static INT8 model stage 2 recorded."""
    if args.model is not None:
        if not args.model.exists():
            raise MissingArtifact(f"--model {args.model} not found")
        model = args.model
    else:
        model = static_int8_model(args.artifacts_dir, args.results_dir)
    return model, weights_provenance(model.parent)


def static_int8_model(artifacts_dir: Path, results_dir: Path = RESULTS_DIR) -> Path:
    """The static INT8 model stage 2 recorded as shipped (stage 2, if it has not run, with these folders)."""
    recorded = read_manifest(artifacts_dir).get("static_int8", {})  # stage 2: {"path": file name, ...}
    return require(artifacts_dir / recorded.get("path", STATIC_INT8_ONNX), 2, artifacts_dir, results_dir)


def environment_row(model: Path, provenance: str) -> dict:
    """What a reader needs to judge the numbers: which model (its weights, arch and classes, as stage 1 recorded
    them beside it; empty for a model without that record), which images, which machine and libraries."""
    width, height = LOAD_IMAGE_SIZE
    recorded = read_manifest(model.parent).get("model", {})
    return {
        "model": model.name,
        "weights": provenance,
        "arch": recorded.get("arch", ""),
        "classes": recorded.get("classes", ""),
        "model_id": recorded.get("id", ""),
        "load_image_size": f"{width}x{height}",
        "load_image_quality": LOAD_IMAGE_QUALITY,
        **report.machine_columns(),
    }


def write_results(results_dir: Path, csv_name: str, rows: list[dict], require_answers: bool = True) -> Path:
    """`rows` as `csv_name`, and the summary again; with `require_answers`, rows of a load test none of whose
    requests was answered are refused (check_answered), leaving the last run's results as they were."""
    if require_answers:
        check_answered(csv_name, rows)
    path = report.write_csv(Path(results_dir) / csv_name, rows)
    print(f"wrote {path}")
    print(f"wrote {report.write_summary(results_dir)}")
    return path


def check_answered(csv_name: str, rows: list[dict]) -> None:
    """UsageError if `rows` are a load test's (an `ok` column) and no request of it was answered: its numbers
    measure nothing, and would replace the last run's."""
    load_tests = [row for row in rows if "ok" in row]
    if load_tests and not any(int(row["ok"]) for row in load_tests):
        raise UsageError(
            f"no request was answered (errors by status: {load_tests[0]['errors_by_status']}), so {csv_name} is "
            "not written: a --deadline-ms too short for this machine, or a server refusing every request"
        )


def run_stage(run, args, user_errors: tuple = (), writes: tuple[str, ...] = ()):
    """`run(args)`, returning what it returns. An error the user can fix (a missing input, flag values that
    cannot work, a folder in `writes` (args' names: "results_dir", ...) it cannot write to, a server that will
    not start or that refuses the key, or one of `user_errors`) is one line on stderr and exit code 2; the
    folders are checked first, so a run never does its work to fail at writing it down. Ctrl-C exits 130
    and SIGTERM (`kill`, a CI job cancelled) 143, each with one line, as a shell reports them, once the servers
    the run started are stopped. Either way the folders in `writes` it made are removed if still empty.
    A stage that writes models (`writes` has "artifacts_dir") holds that folder for the run: a second one
    there is refused at once, as two would interleave their models and manifest. A disk that fills up or a
    file system that turns read-only midway is one line too."""
    made: list[Path] = []
    held: list[int] = []
    python_format, warnings.formatwarning = warnings.formatwarning, _format_warning
    on_sigterm = _stop_on_sigterm()
    try:
        check_flag_pairs(args)
        for name in writes:
            made += check_writable(getattr(args, name), flag(name))
        if "artifacts_dir" in writes:
            held.append(hold_folder(args.artifacts_dir, flag("artifacts_dir")))
            remove_leftover_partials(args.artifacts_dir)
        return run(args)
    except (MissingArtifact, UnreadableManifest, ServerStartError, KeyRefused, UsageError, *user_errors) as exc:
        remove_if_empty(made)
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
            raise
        remove_if_empty(made)
        # The file it was writing is left as it was: every model, manifest and table is written beside it first.
        print(
            f"error: {exc.strerror}: {exc.filename or 'writing a file'}: free space, or pass another folder",
            file=sys.stderr,
        )
        sys.exit(2)
    except (KeyboardInterrupt, Terminated) as exc:  # what the user asked for, not a traceback
        remove_if_empty(made)
        print("interrupted" if isinstance(exc, KeyboardInterrupt) else "terminated", file=sys.stderr)
        sys.exit(130 if isinstance(exc, KeyboardInterrupt) else 128 + signal.SIGTERM)
    finally:
        for descriptor in held:
            os.close(descriptor)  # and with it the lock
        warnings.formatwarning = python_format
        if on_sigterm is not None:
            signal.signal(signal.SIGTERM, on_sigterm)


def hold_folder(folder: Path, flag: str) -> int:
    """An exclusive lock on `folder` (flock on the folder itself, so no lock file is left in it, and the kernel
    lets go when the process ends however it ends), held until the returned descriptor is closed; UsageError
    when another process holds it."""
    try:
        descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:  # a folder one may write to but not read (mode 0333)
        raise UsageError(f"{flag} {folder}: cannot open it to hold it ({exc.strerror}); make it readable") from None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        raise UsageError(
            f"another stage is writing models to {flag} {folder}; wait for it to finish, or give this run a "
            f"{flag} of its own"
        ) from None
    return descriptor


# A flag that means nothing without another one: (flag, the flag it needs, what it does with it).
_FLAG_NEEDS = (("labels_count", "labels", "counts --labels photos"),)


def check_flag_pairs(args) -> None:
    """UsageError for a flag given without the one it works on, before the stage loads anything: ignoring it
    would run a different measurement than the one asked for."""
    for name, needed, what in _FLAG_NEEDS:
        if getattr(args, name, None) is not None and not getattr(args, needed, None):
            raise UsageError(f"{flag(name)} {what}: pass {flag(needed)} FILE too, or leave it out")


class Terminated(BaseException):
    """SIGTERM, raised where the stage is, as Ctrl-C's KeyboardInterrupt is: Python's default would end the
    process at once, leaving the servers it started running."""


def _stop_on_sigterm():
    """Make SIGTERM raise Terminated (once: a second one while the servers stop is ignored); returns the
    handler it replaced, or None off the main thread, where Python cannot set one."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def terminated(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated()

    return signal.signal(signal.SIGTERM, terminated)


def _format_warning(message, category, filename, lineno, line=None) -> str:
    """A plain UserWarning (the stages' own, e.g. the random-init stand-in or a model without class names)
    as one line, as the stages' errors are, not with the file, line and source that led to it."""
    if category is UserWarning:
        return f"warning: {message}\n"
    return _PYTHON_FORMAT_WARNING(message, category, filename, lineno, line)


_PYTHON_FORMAT_WARNING = warnings.formatwarning
