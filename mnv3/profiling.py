"""Where inference time goes, from the runtimes' own profilers: onnxruntime's (a Chrome-trace JSON of per-node kernel
times) and OpenVINO's per-layer counters."""

import json
from collections import defaultdict
from pathlib import Path

from mnv3.progress import progress_bar
from mnv3.runtime import make_session, ort_runner


def profile_model(model_path, batch, runs: int, threads: int, trace_path) -> Path:
    """Run `batch` through a profiling session `runs` times and save the raw trace at `trace_path`."""
    trace_path = Path(trace_path)
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    session = make_session(model_path, threads, profile_prefix=str(trace_path.with_suffix("")))
    run = ort_runner(session)
    for _ in progress_bar(range(runs), desc="profiling"):
        run(batch)
    return Path(session.end_profiling()).replace(trace_path)


def op_type_summary(trace_path, runs: int) -> list[dict]:
    """Kernel time per op type, largest share first. Session set-up and fences are not counted."""
    micros: defaultdict[tuple[str], float] = defaultdict(float)
    calls: defaultdict[tuple[str], int] = defaultdict(int)
    for event in json.loads(Path(trace_path).read_text()):
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            op_type = (event["args"]["op_name"],)
            micros[op_type] += event["dur"]
            calls[op_type] += 1
    return _shares(micros, calls, runs, ("op_type",))


def openvino_layer_summary(model_path, batch, runs: int, threads: int, precision: str) -> list[dict]:
    """OpenVINO's own per-layer counters (PERF_COUNT) over `runs` runs of `batch` on the file compiled at the
    batch's size, one stream of `threads` threads, `precision` for what is not quantized: time per layer type
    and kernel (e.g. Convolution, brgconv_avx512_1x1_I8), largest share first. Layers fused into another
    or not run report no time and are left out."""
    from mnv3.openvino_backend import DEVICE, at_batch, latency_config, shared_core

    core = shared_core()
    model = at_batch(core.read_model(str(model_path)), len(batch))
    config = latency_config(threads, precision) | {"PERF_COUNT": True}
    request = core.compile_model(model, DEVICE, config).create_infer_request()
    request.infer({0: batch})  # the first run allocates; not counted
    micros: defaultdict[tuple[str, str], float] = defaultdict(float)
    calls: defaultdict[tuple[str, str], int] = defaultdict(int)
    for _ in progress_bar(range(runs), desc="profiling"):
        request.infer({0: batch})
        for layer in request.get_profiling_info():
            if layer.real_time.total_seconds() > 0:
                micros[layer.node_type, layer.exec_type] += layer.real_time.total_seconds() * 1e6
                calls[layer.node_type, layer.exec_type] += 1
    return _shares(micros, calls, runs, ("layer_type", "kernel"))


def _shares(micros: dict, calls: dict, runs: int, key_columns: tuple[str, ...]) -> list[dict]:
    """One row per key (a tuple, named by `key_columns`): its share of all the time, ms and calls per run;
    largest first."""
    total = sum(micros.values()) or 1.0  # every time 0: every share is 0
    return [
        {
            **dict(zip(key_columns, key, strict=True)),
            "share_pct": round(100 * us / total, 2),
            "ms_per_run": round(us / runs / 1000, 3),
            "calls_per_run": calls[key] // runs,
        }
        for key, us in sorted(micros.items(), key=lambda item: -item[1])
    ]
