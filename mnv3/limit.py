"""The in-process limit: how many images/s this machine classifies with no HTTP, no queue, no JSON.

The same work the server does per image (preprocess.decode_and_preprocess, then one ORT run per batch), on
the same JPEG bodies, in one process. Decoding the next batch runs in a thread pool while ORT runs
the current one, as the server's preprocessing overlaps its inference. The best configuration is the
ceiling stage 5 holds the batched server to: server req/s / limit images/s is the serving overhead.
"""
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import numpy as np
from tqdm import tqdm

from mnv3.latency import DEFAULT_INTER_OP_THREADS, make_session
from mnv3.preprocess import decode_and_preprocess

BATCH_SIZES = (1, 8, 16, 32, 64)
# (ORT intra-op threads, decode threads): on 2 cores, each side gets one core, or shares both.
THREAD_SPLITS = ((1, 1), (2, 1), (1, 2), (2, 2))


@dataclass(frozen=True)
class LimitResult:
    batch_size: int
    intra_op_threads: int
    decode_threads: int
    images: int
    seconds: float

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds

    def as_row(self) -> dict:
        return asdict(self) | {"seconds": round(self.seconds, 3), "images_per_s": round(self.images_per_s, 2)}


def classify_all(session, pool, bodies: list[bytes], batch_size: int) -> float:
    """Seconds to classify every body in batches, decoding batch k+1 while batch k runs."""
    input_name = session.get_inputs()[0].name
    batches = [bodies[i:i + batch_size] for i in range(0, len(bodies), batch_size)]
    start = time.perf_counter()
    pending = [pool.submit(decode_and_preprocess, body) for body in batches[0]]
    for k in range(len(batches)):
        arrays = [future.result() for future in pending]
        if k + 1 < len(batches):
            pending = [pool.submit(decode_and_preprocess, body) for body in batches[k + 1]]
        session.run(None, {input_name: np.stack(arrays)})
    return time.perf_counter() - start


def run_limit(model_path, bodies: list[bytes], batch_sizes=BATCH_SIZES, thread_splits=THREAD_SPLITS,
              desc: str | None = "in-process limit") -> list[LimitResult]:
    """One result per (thread split, batch size); the caller picks the best images/s."""
    results = []
    with tqdm(total=len(thread_splits) * len(batch_sizes), desc=desc, leave=False, disable=desc is None) as bar:
        for intra_op_threads, decode_threads in thread_splits:
            # No spinning, as the server runs by default: decoding shares the cores with ORT here too.
            session = make_session(model_path, intra_op_threads, DEFAULT_INTER_OP_THREADS, allow_spinning=False)
            with ThreadPoolExecutor(max_workers=decode_threads) as pool:
                for batch_size in batch_sizes:
                    # Untimed first run at this batch shape: ORT allocates its buffers then.
                    classify_all(session, pool, bodies[:batch_size], batch_size)
                    seconds = classify_all(session, pool, bodies, batch_size)
                    results.append(LimitResult(batch_size, intra_op_threads, decode_threads, len(bodies), seconds))
                    bar.update()
    return results
