"""Where inference time goes, from onnxruntime's own profiler (a Chrome-trace JSON of per-node kernel times)."""

import json
from collections import defaultdict
from pathlib import Path

from tqdm import tqdm

from mnv3.runtime import make_session, ort_runner


def profile_model(model_path, batch, runs: int, threads: int, trace_path) -> Path:
    """Run `batch` through a profiling session `runs` times and save the raw trace at `trace_path`."""
    trace_path = Path(trace_path)
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    session = make_session(model_path, threads, profile_prefix=str(trace_path.with_suffix("")))
    run = ort_runner(session)
    for _ in tqdm(range(runs), desc="profiling", leave=False):
        run(batch)
    return Path(session.end_profiling()).replace(trace_path)


def op_type_summary(trace_path, runs: int) -> list[dict]:
    """Kernel time per op type, largest share first. Session set-up and fences are not counted."""
    micros: defaultdict[str, float] = defaultdict(float)
    calls: defaultdict[str, int] = defaultdict(int)
    for event in json.loads(Path(trace_path).read_text()):
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            op_type = event["args"]["op_name"]
            micros[op_type] += event["dur"]
            calls[op_type] += 1
    total = sum(micros.values())
    return [
        {
            "op_type": op_type,
            "share_pct": round(100 * us / total, 2),
            "ms_per_run": round(us / runs / 1000, 3),
            "calls_per_run": calls[op_type] // runs,
        }
        for op_type, us in sorted(micros.items(), key=lambda item: -item[1])
    ]
