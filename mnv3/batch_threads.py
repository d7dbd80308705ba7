"""How many threads OpenVINO's batches get in a server under load (--batch-threads), chosen by measurement.

Under load a server decodes the next images while a batch runs. With the batch on half the threads, the other
half decode beside it; on every thread, the batch and the decoding share all the cores. Which answers more
depends on the CPU: where a batch takes much longer per image than decoding does, the decoding half runs out
of work and its cores idle, and where the two are close, a batch on every core takes them from the decoding in
bursts. So stage 2 measures it for the engine it chose: the batching server (cache off) once per candidate,
all up at once, in rounds of turns (mirrored order) on the same distinct photos at its load concurrency, and
records the one that answered more requests in the manifest, which `--batch-threads 0` serves.
"""

from contextlib import ExitStack
from pathlib import Path

from mnv3.backend_choice import default_batch_threads
from mnv3.latency import turn_order
from mnv3.loadtest import LoadResult, PredictClient, ServerProcess, run_closed_loop, run_with_metrics, warm_up

ROUNDS = 2  # of turns: each candidate measured in the first half and again in the second


def candidates(threads: int) -> list[int]:
    """The batch threads worth measuring on `threads` intra-op threads: the default (half) and all of them."""
    return sorted({default_batch_threads(threads), threads})


def measure(
    model: Path,
    threads: int,
    bodies: list[bytes],
    concurrency: int,
    requests: int,
    rounds: int = ROUNDS,
) -> list[tuple[int, int, LoadResult]]:
    """(batch threads, turn from 1, its run) per turn: each candidate's server (batching as by default, cache
    off, `threads` intra-op threads) answering `requests` of `bodies` at `concurrency`, all servers up at
    once, in `rounds` of turns."""
    with ExitStack() as stack:
        urls = {
            batch_threads: stack.enter_context(
                ServerProcess(model, cache_size=0, intra_op_threads=threads, batch_threads=batch_threads)
            )
            for batch_threads in candidates(threads)
        }
        for url in urls.values():
            warm_up(url, bodies, concurrency)
        return [
            (
                batch_threads,
                turn,
                run_with_metrics(
                    urls[batch_threads],
                    lambda send: run_closed_loop(send, bodies, concurrency, count=requests),
                    PredictClient,
                ),
            )
            for turn in range(1, 2 * rounds + 1)
            for batch_threads in turn_order(list(urls), turn)
        ]


def choose(turns: list[tuple[int, int, LoadResult]], streams: int = 1) -> tuple[dict, str]:
    """The manifest keys for the candidate whose turns, pooled, answered the most requests a second, and why.
    `streams`: the chosen engine's, as its row was timed alone; its batches get no more streams than threads
    (mnv3.openvino_backend), which the reason then says: the engine table's figures are not what serves."""
    pooled = {
        batch_threads: round(LoadResult.pooled(*(run for threads, _, run in turns if threads == batch_threads)).rps, 1)
        for batch_threads in dict.fromkeys(threads for threads, _, _ in turns)
    }
    best = max(pooled, key=pooled.__getitem__)  # on a tie, the first timed
    rates = ", ".join(f"{threads} thread(s) {rate} req/s" for threads, rate in pooled.items())
    tied = sum(rate == pooled[best] for rate in pooled.values()) > 1
    return {"batch_threads": best, "batch_threads_req_per_s": {str(k): v for k, v in pooled.items()}}, (
        f"a server's batches on {best} thread(s), which answered {'as many as any' if tied else 'the most'} of "
        f"{rates}, "
        f"its batching server timed in turns at concurrency {turns[0][2].concurrency}"
        + (
            f"; so its batches run on {best} stream(s), not the {streams} its row was timed on alone"
            if best < streams
            else ""
        )
    )
