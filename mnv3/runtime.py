"""The one place onnxruntime sessions are made, with the thread settings serving and measuring share, and
the CPUs a process has to run those threads on.

Every session is CPU-only and has explicit intra-/inter-op thread counts, so what ran is what the
results and `/model` record. Serving imports this module, never the benchmark harness.
"""

import os
from pathlib import Path

DEFAULT_INTRA_OP_THREADS = 2  # the machines this project is measured on have 2 cores
DEFAULT_INTER_OP_THREADS = 1
CGROUP_ROOT = Path("/sys/fs/cgroup")  # a container's own cgroup, as its runtime mounts it


def available_cpus(cgroup_root: Path = CGROUP_ROOT) -> float:
    """The CPUs this process may run on: its affinity (`taskset`, a cpuset; all of them where the OS has no
    affinity, as macOS), or fewer under a CPU quota (a container's CPU limit: cgroup v2's cpu.max, v1's
    cpu.cfs_quota_us, as a container sees its own cgroup at the mount's root), which may be a fraction. A quota
    set on a cgroup further down, as seen from a host's cgroup namespace, is not looked for."""
    affinity = getattr(os, "sched_getaffinity", None)
    cpus: float = len(affinity(0)) if affinity else os.cpu_count() or 1
    for quota, period in (_cgroup_v2_quota(cgroup_root), _cgroup_v1_quota(cgroup_root)):
        if quota > 0 and period > 0:  # no limit: "max" (v2), -1 (v1)
            cpus = min(cpus, quota / period)
    return cpus


def _cgroup_v2_quota(cgroup_root: Path) -> tuple[int, int]:
    """cpu.max's quota and period in microseconds ("150000 100000": 1.5 CPUs); (0, 0) for none or no file."""
    try:
        quota, period = (cgroup_root / "cpu.max").read_text().split()
        return (0 if quota == "max" else int(quota)), int(period)
    except (OSError, ValueError):  # no such cgroup here, not readable, or not as the kernel writes it
        return 0, 0


def _cgroup_v1_quota(cgroup_root: Path) -> tuple[int, int]:
    """cpu.cfs_quota_us and cpu.cfs_period_us (-1: no limit); (0, 0) for no files."""
    try:
        quota = int((cgroup_root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((cgroup_root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return 0, 0
    return quota, period


def make_session(
    model_path,
    intra_op_threads: int = DEFAULT_INTRA_OP_THREADS,
    inter_op_threads: int = DEFAULT_INTER_OP_THREADS,
    profile_prefix: str | None = None,
    allow_spinning: bool = True,
):
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
    return ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])


def ort_runner(session):
    """`run(batch) -> logits` for a single-input, single-output session."""
    input_name = session.get_inputs()[0].name
    return lambda batch: session.run(None, {input_name: batch})[0]
