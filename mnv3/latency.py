"""The latency harness every stage uses (the seed's method) and the one place ORT sessions are made."""
import time
from dataclasses import asdict, dataclass

import numpy as np
from tqdm import tqdm

WARMUP_CALLS = 10
TIMED_CALLS = 100
DEFAULT_INTRA_OP_THREADS = 2  # the machines this project is measured on have 2 cores
DEFAULT_INTER_OP_THREADS = 1


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


def measure_latency(call, warmup: int = WARMUP_CALLS, iters: int = TIMED_CALLS, desc: str | None = None) -> LatencyStats:
    """Run `call()` `warmup` times untimed, then `iters` times timed one by one."""
    for _ in range(warmup):
        call()
    seconds = []
    for _ in tqdm(range(iters), desc=desc, leave=False, disable=desc is None):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return LatencyStats.from_seconds(seconds)


def make_session(model_path, intra_op_threads: int = DEFAULT_INTRA_OP_THREADS,
                 inter_op_threads: int = DEFAULT_INTER_OP_THREADS, profile_prefix: str | None = None,
                 optimized_model_path: str | None = None):
    """A CPU onnxruntime session with explicit (and therefore recordable) thread settings."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = inter_op_threads
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    if profile_prefix:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    if optimized_model_path:
        options.optimized_model_filepath = str(optimized_model_path)
    return ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
