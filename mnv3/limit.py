"""The in-process limit: how many images/s this machine classifies with no HTTP, no queue, no JSON.

The same work the server does per image (preprocess.decode_and_preprocess with the preprocessing the
manifest beside the model records and the server's --jpeg-draft and --resize-crop-only settings, then
one run of the engine per batch), on the same JPEG bodies, in one process. Decoding the next batch runs in
a thread pool while the engine runs the current one, as the server's preprocessing overlaps its inference.
The engine is opened as the server opens it (engine.open_session, from a backend_choice.Choice: file,
engine, precision, streams), with the threads of the configuration tried for batches too (a server gives
OpenVINO's batches --batch-threads), so the limit of `--backend auto`'s choice is the ceiling stage 5 holds
the batched server to: server req/s / limit images/s is the serving overhead. The limits of other engines
show what the choice gains.
"""

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import NamedTuple

import numpy as np

from mnv3.artifacts import model_preprocessing
from mnv3.backend_choice import Choice
from mnv3.engine import open_session
from mnv3.latency import turn_order
from mnv3.preprocess import Decoding, Preprocessing, decode_and_preprocess
from mnv3.progress import progress_bar
from mnv3.runtime import DEFAULT_INTER_OP_THREADS
from mnv3.thread_cpu import PREPROCESS, PREPROCESS_THREADS, cpu_seconds_by_role

BATCH_SIZES = (1, 8, 16, 32, 64)
# (engine intra-op threads, decode threads): on 2 cores, each side gets one core, or shares both.
THREAD_SPLITS = ((1, 1), (2, 1), (1, 2), (2, 2))
CONFIRM_PASSES = 4
FINALISTS = 3  # the grid's fastest configurations, measured again in turns to choose the limit's
FINAL_ROUNDS = 4  # passes each in those turns


class Run(NamedTuple):
    """One pass through the bodies, or several added up; named as LimitResult's fields."""

    seconds: float
    cpu_seconds: float  # the process's, every thread
    preprocess_cpu_seconds: float  # of which the decode threads'

    @classmethod
    def summed(cls, runs: list["Run"]) -> "Run":
        return cls(*(sum(column) for column in zip(*runs, strict=True)))


@dataclass(frozen=True)
class LimitResult:
    engine: str  # what ran: a name for the Choice (e.g. onnxruntime_fp32 or stage 2's chosen variant)
    batch_size: int
    intra_op_threads: int
    decode_threads: int
    decoding: Decoding  # the server's settings it decoded with (--jpeg-draft, --resize-crop-only)
    images: int
    seconds: float
    cpu_seconds: float  # the process's CPU time over those seconds, every thread (engine, decoding) included
    preprocess_cpu_seconds: float  # of which the decode threads' (mnv3.thread_cpu's preprocess role)

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds

    @property
    def cpu_ms_per_image(self) -> float:
        return 1000 * self.cpu_seconds / self.images

    @property
    def preprocess_cpu_ms_per_image(self) -> float:
        return 1000 * self.preprocess_cpu_seconds / self.images

    def as_row(self) -> dict:
        row: dict = {}
        for name, value in asdict(self).items():  # the decoding settings as columns of their own, in its place
            row |= value if name == "decoding" else {name: value}
        return row | {
            "seconds": round(self.seconds, 3),
            "cpu_seconds": round(self.cpu_seconds, 3),
            "images_per_s": round(self.images_per_s, 2),
            "preprocess_cpu_seconds": round(self.preprocess_cpu_seconds, 3),
            "cpu_ms_per_image": round(self.cpu_ms_per_image, 3),
            "preprocess_cpu_ms_per_image": round(self.preprocess_cpu_ms_per_image, 3),
        }


def classify_all(
    session, pool, bodies: list[bytes], batch_size: int, preprocessing: Preprocessing, decoding: Decoding
) -> Run:
    """(seconds, CPU seconds of this process, of which the decode threads') to classify every body in batches,
    decoding batch k+1 while batch k runs, each image straight into its batch's rows (two sets, used in turn),
    as the server's batcher copies each into its next batch while one runs. `pool`'s threads are named as
    mnv3.thread_cpu's preprocess ones."""
    input_name = session.get_inputs()[0].name
    batches = [bodies[i : i + batch_size] for i in range(0, len(bodies), batch_size)]
    decode = partial(decode_and_preprocess, decoding=decoding, preprocessing=preprocessing)
    rows = [np.empty((batch_size, *preprocessing.input_shape), np.float32) for _ in range(2)]

    def decode_batch(k: int) -> list[Future]:
        def decode_into(i: int, body: bytes) -> None:
            rows[k % 2][i] = decode(body)

        return [pool.submit(decode_into, i, body) for i, body in enumerate(batches[k])]

    start, cpu_start = time.perf_counter(), cpu_seconds_by_role()
    pending = decode_batch(0)
    for k in range(len(batches)):
        for future in pending:
            future.result()
        if k + 1 < len(batches):
            pending = decode_batch(k + 1)
        session.run(None, {input_name: rows[k % 2][: len(batches[k])]})
    seconds, cpu = time.perf_counter() - start, cpu_seconds_by_role()
    return Run(seconds, sum(cpu.values()) - sum(cpu_start.values()), cpu[PREPROCESS] - cpu_start[PREPROCESS])


@contextmanager
def limit_runner(
    served: Choice,
    decoding: Decoding,
    batch_size: int,
    intra_op_threads: int,
    decode_threads: int,
    warm_up: list[bytes],
) -> Iterator[Callable[[list[bytes]], Run]]:
    """`classify(bodies) -> (seconds, CPU seconds, of which decoding's)` for one configuration: the engine
    opened as the server opens it, a pool of `decode_threads`, decoding as a server with `decoding` (its
    --jpeg-draft and --resize-crop-only) does; `warm_up` classified once, untimed (the engine allocates for
    its batch size)."""
    # No spinning, as the server runs by default: decoding shares the cores with the engine here too.
    session = open_session(
        served.path,
        served.backend,
        intra_op_threads,
        DEFAULT_INTER_OP_THREADS,
        max_batch_size=batch_size,
        allow_spinning=False,
        precision=served.precision,
        streams=served.streams,
        part_size=served.part_size,
    )
    preprocessing = model_preprocessing(served.path.parent)  # as the server serving this file does
    with ThreadPoolExecutor(max_workers=decode_threads, thread_name_prefix=PREPROCESS_THREADS) as pool:

        def classify(bodies: list[bytes]) -> Run:
            return classify_all(session, pool, bodies, batch_size, preprocessing, decoding)

        classify(warm_up)
        yield classify


def measure_limit(
    engine: str,
    served: Choice,
    bodies: list[bytes],
    decoding: Decoding,
    batch_size: int,
    intra_op_threads: int,
    decode_threads: int,
    passes: int = 1,
) -> LimitResult:
    """Images/s of one configuration over `passes` runs through `bodies`, after an untimed warm-up batch,
    decoding as a server with `decoding` does."""
    configuration = (served, decoding, batch_size, intra_op_threads, decode_threads, bodies[:batch_size])
    with limit_runner(*configuration) as classify:
        runs = [classify(bodies) for _ in range(passes)]
    return LimitResult(
        engine, batch_size, intra_op_threads, decode_threads, decoding, passes * len(bodies), *Run.summed(runs)
    )


def run_limit(
    engine: str,
    served: Choice,
    bodies: list[bytes],
    decoding: Decoding,
    batch_sizes=BATCH_SIZES,
    thread_splits=THREAD_SPLITS,
    confirm_passes: int = CONFIRM_PASSES,
    desc: str | None = "in-process limit",
) -> tuple[LimitResult, list[LimitResult], list[LimitResult]]:
    """(the limit, every configuration tried, the finalists). Each configuration is one short pass, so the
    fastest of them is partly the luckiest: the fastest few are measured again in turns (`run_off`), and the
    limit is the finalists' fastest measured once more, `confirm_passes` times longer, which is an unbiased
    figure for it. Every run decodes as a server with `decoding` does: pass the settings of the server the
    limit is compared with."""
    grid, finalists = try_configurations(engine, served, bodies, decoding, batch_sizes, thread_splits, desc)
    return measure_again(fastest(finalists), served, bodies, confirm_passes), grid, finalists


def try_configurations(
    engine: str,
    served: Choice,
    bodies: list[bytes],
    decoding: Decoding,
    batch_sizes=BATCH_SIZES,
    thread_splits=THREAD_SPLITS,
    desc: str | None = "in-process limit",
) -> tuple[list[LimitResult], list[LimitResult]]:
    """(every batch size x thread split, one short pass each; the fastest few of those measured again in
    turns, `run_off`): the configurations `run_limit` chooses from."""
    configurations = [(b, t, d) for t, d in thread_splits for b in batch_sizes]
    grid = [
        measure_limit(engine, served, bodies, decoding, batch_size, intra_op_threads, decode_threads)
        for batch_size, intra_op_threads, decode_threads in progress_bar(configurations, desc)
    ]
    return grid, run_off(grid, served, bodies)


def run_off(
    grid: list[LimitResult], served: Choice, bodies: list[bytes], finalists: int = FINALISTS, rounds: int = FINAL_ROUNDS
) -> list[LimitResult]:
    """The `finalists` fastest configurations of `grid`, each measured again over `rounds` passes through
    `bodies` taken in turns, all open at once, in mirrored order (1, 2, 3, 3, 2, 1, ...), so that a drift in
    the machine's speed lands on all alike; each its passes pooled. A configuration that won the grid by one
    lucky pass has to win again here to be chosen."""
    chosen = sorted(grid, key=lambda r: r.images_per_s, reverse=True)[:finalists]
    runs: list[list[Run]] = [[] for _ in chosen]
    with ExitStack() as stack:
        classifiers = [
            stack.enter_context(
                limit_runner(
                    served, r.decoding, r.batch_size, r.intra_op_threads, r.decode_threads, bodies[: r.batch_size]
                )
            )
            for r in chosen
        ]
        for turn in range(1, rounds + 1):
            for i in turn_order(range(len(chosen)), turn):
                runs[i].append(classifiers[i](bodies))
    return [
        replace(
            r,
            images=rounds * len(bodies),
            **Run.summed(passes)._asdict(),
        )
        for r, passes in zip(chosen, runs, strict=True)
    ]


def fastest(grid: list[LimitResult]) -> LimitResult:
    return max(grid, key=lambda r: r.images_per_s)


def measure_again(limit: LimitResult, served: Choice, bodies: list[bytes], passes: int) -> LimitResult:
    """`limit`'s configuration (batch size, threads, decoding) measured anew over `passes` runs through `bodies`."""
    return measure_limit(
        limit.engine,
        served,
        bodies,
        limit.decoding,
        limit.batch_size,
        limit.intra_op_threads,
        limit.decode_threads,
        passes,
    )


def pooled(first: LimitResult, *more: LimitResult) -> LimitResult:
    """Measurements of one configuration as one: their images, seconds and CPU seconds added up."""
    runs = (first, *more)
    return replace(
        first,
        images=sum(r.images for r in runs),
        seconds=sum(r.seconds for r in runs),
        cpu_seconds=sum(r.cpu_seconds for r in runs),
        preprocess_cpu_seconds=sum(r.preprocess_cpu_seconds for r in runs),
    )
