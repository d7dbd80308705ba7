"""What a container (or `taskset`) allows this process, against what the server's settings ask of it.

The CPUs it may run on and the memory it may use are read from the process's affinity and its cgroup, as a
container sees its own cgroup at the mount's root (cgroup v2, or v1's cpu and memory controllers); a limit set
further down, as seen from the host's cgroup namespace, is not looked for. Where a file is missing or not as
the kernel writes it, that limit counts as absent: a reading never stops the server. `warnings_for(config)` says
where the settings ask for more than that, naming the flags to lower: the defaults suit the 2-core machines
this project is measured on, and nothing else here reads a pod's limits.
"""

import math
import os
from dataclasses import dataclass
from pathlib import Path

from mnv3.config import ServerConfig, flag
from mnv3.engine import rss_bytes
from mnv3.preprocess import DEFAULT_PREPROCESSING

CGROUP_ROOT = Path("/sys/fs/cgroup")  # a container's own cgroup, as its runtime mounts it


def available_cpus(cgroup_root: Path = CGROUP_ROOT) -> float:
    """The CPUs this process may run on: its affinity (`taskset`, a cpuset; all of them where the OS has no
    affinity, as macOS), or fewer under a CPU quota (a container's CPU limit: cgroup v2's cpu.max, v1's
    cpu.cfs_quota_us), which may be a fraction."""
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


# At or above it, a limit is cgroup v1's "no limit" (2**63 - 4096 on 4 KiB pages: the largest multiple of the page
# size below 2**63); no machine has this much memory.
NO_MEMORY_LIMIT = 2**62


def memory_limit(cgroup_root: Path = CGROUP_ROOT) -> int | None:
    """The bytes this process's cgroup may use (a container's memory limit: v2's memory.max, v1's
    memory.limit_in_bytes), or None for no limit."""
    for limit_file in ("memory.max", "memory/memory.limit_in_bytes"):
        try:
            text = (cgroup_root / limit_file).read_text().strip()
            limit = None if text == "max" else int(text)
        except (OSError, ValueError):
            continue
        return limit if limit is not None and 0 < limit < NO_MEMORY_LIMIT else None
    return None


def warnings_for(config: ServerConfig) -> list[str]:
    """Start-up warnings where `config` asks for more CPUs or memory than this process has; called once the
    models are loaded, so the memory they take counts."""
    found = (
        too_many_threads(config, available_cpus()),
        too_little_memory(config, memory_limit(), rss_bytes() or 0),
    )
    return [warning for warning in found if warning]


def too_many_threads(config: ServerConfig, cpus: float) -> str | None:
    """More decoding or inference threads than CPUs: they take turns on them."""
    fitting = max(1, math.floor(cpus))  # a thread at least: below 1 CPU, nothing can follow the advice
    over = [
        f"{flag(name)} {getattr(config, name)}"
        for name in ("intra_op_threads", "preprocess_threads")
        if getattr(config, name) > fitting
    ]
    if not over:
        return None
    return (
        f"{' and '.join(over)} on {cpus:g} CPU(s) (this process's affinity and CPU quota): more threads than CPUs "
        f"take turns on them, each stalling the others; set them to {fitting}"
    )


@dataclass(frozen=True)
class RequestsMemory:
    """Roughly the bytes requests may hold at once at a config's limits, besides the models and the cache (README,
    "Limits and errors"): every admitted body at its largest (a /v2 request's parsed tensors in its place), each
    decode thread on an image of the most pixels (4 bytes a pixel), and every model's queue full of preprocessed
    images (at the default crop)."""

    bodies: int
    decoding: int
    queued: int

    @classmethod
    def of(cls, config: ServerConfig) -> "RequestsMemory":
        return cls(
            bodies=config.max_in_flight * config.max_upload_bytes,
            decoding=config.preprocess_threads * config.max_pixels * 4,
            queued=len(config.models) * config.queue_limit * 4 * math.prod(DEFAULT_PREPROCESSING.input_shape),
        )

    @property
    def total(self) -> int:
        return self.bodies + self.decoding + self.queued


def too_little_memory(config: ServerConfig, limit: int | None, used: int) -> str | None:
    """Limits that let requests hold more than what the container's memory limit leaves beside the `used` bytes
    (the models, loaded): the kernel would kill the server. Says which flag values would fit."""
    held, gib = RequestsMemory.of(config), 2**30
    if limit is None or used + held.total <= limit:
        return None
    said = (
        f"at these limits requests may hold about {held.total / gib:.1f} GiB ({held.bodies / gib:.1f} of bodies: "
        f"{flag('max_in_flight')} {config.max_in_flight} x {flag('max_upload_bytes')} {config.max_upload_bytes}; "
        f"{held.decoding / gib:.1f} decoding; {held.queued / gib:.1f} queued), and the server already uses "
        f"{used / gib:.1f} GiB, above this container's memory limit of {limit / gib:.1f} GiB, where the kernel "
        "kills the server"
    )
    in_flight = (limit - used - held.decoding - held.queued) // config.max_upload_bytes
    if in_flight >= 1:
        return f"{said}: lower {flag('max_in_flight')} to {in_flight} or {flag('max_upload_bytes')}"
    return (
        f"{said}: even one body does not fit beside decoding and the queue; lower {flag('max_pixels')} "
        f"({config.max_pixels}) and {flag('queue_limit')} ({config.queue_limit}) first"
    )
