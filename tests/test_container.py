"""What a container allows the server, against what its settings ask: CPUs and memory, read from cgroup files."""

import os

import pytest

from mnv3.config import ServerConfig
from mnv3.container import RequestsMemory, available_cpus, memory_limit, too_little_memory, too_many_threads

pytestmark = pytest.mark.unit


def test_more_threads_than_cpus_is_a_warning_naming_the_flags():
    # the defaults (2 intra-op, 2 decoding) suit 2 cores; a 1-CPU pod throttled them without a word
    config = ServerConfig(model="m.onnx")
    assert too_many_threads(config, 2) is None and too_many_threads(config, 4) is None
    warning = too_many_threads(config, 1)
    assert warning is not None and warning.startswith("--intra-op-threads 2 and --preprocess-threads 2 on 1 CPU(s)")
    assert warning.endswith("set them to 1")
    assert too_many_threads(ServerConfig(model="m.onnx", preprocess_threads=4), 2.5).startswith(
        "--preprocess-threads 4 on 2.5 CPU(s)"
    )
    one_each = ServerConfig(model="m.onnx", intra_op_threads=1, preprocess_threads=1)
    assert too_many_threads(one_each, 0.5) is None  # a pod's `cpu: 500m`: 1 thread is the least there is


def test_available_cpus_reads_a_containers_cpu_quota(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    assert available_cpus(tmp_path) == affinity  # no cgroup files: the affinity
    (tmp_path / "cpu.max").write_text("max 100000\n")  # cgroup v2, no limit
    assert available_cpus(tmp_path) == affinity
    (tmp_path / "cpu.max").write_text("50000 100000\n")  # a pod's `cpu: 500m`
    assert available_cpus(tmp_path) == 0.5
    (tmp_path / "cpu.max").write_text("0 0\n")  # not as the kernel writes it: no limit read, no crash
    assert available_cpus(tmp_path) == affinity
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()  # cgroup v1
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert available_cpus(tmp_path) == affinity
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    assert available_cpus(tmp_path) == 1


def test_memory_limit_reads_a_containers_limit(tmp_path):
    assert memory_limit(tmp_path) is None  # no cgroup files: no limit
    (tmp_path / "memory.max").write_text("max\n")  # cgroup v2, no limit
    assert memory_limit(tmp_path) is None
    (tmp_path / "memory.max").write_text("1073741824\n")  # a pod's `memory: 1Gi`
    assert memory_limit(tmp_path) == 2**30
    (tmp_path / "memory.max").unlink()
    (tmp_path / "memory").mkdir()  # cgroup v1, whose "no limit" is a number near 2**63
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert memory_limit(tmp_path) is None
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("536870912\n")
    assert memory_limit(tmp_path) == 2**29


def test_limits_that_let_requests_hold_more_than_the_memory_limit_are_a_warning():
    # 100 clients each holding a 9 MiB body took a server to 1.6 GB: under a 1 GiB limit, killed
    gib, mib = 2**30, 2**20
    defaults = ServerConfig(model="m.onnx")
    held = RequestsMemory.of(defaults)
    assert round(held.total / gib, 1) == 5.6  # README's "about 5.6 GiB at the defaults"
    assert held.bodies == 5 * gib  # and "5 GiB at the defaults" of bodies ("Limits and errors")
    two_models = ServerConfig(model="a.onnx", extra_models=("b.onnx",))
    assert RequestsMemory.of(two_models).queued == 2 * held.queued  # a queue a model
    assert too_little_memory(defaults, None, 0) is None and too_little_memory(defaults, held.total + gib, gib) is None
    warning = too_little_memory(defaults, gib, 400 * mib)
    assert warning is not None and "requests may hold about 5.6 GiB (5.0 of bodies" in warning
    assert "already uses 0.4 GiB, above this container's memory limit of 1.0 GiB" in warning
    # what fits: 1 GiB less 400 MiB in use, 305 MiB decoding and 294 MiB queued leaves 25 MiB, two 10 MiB bodies
    assert warning.endswith("lower --max-in-flight to 2 or --max-upload-bytes")
    fitting = ServerConfig(model="m.onnx", max_in_flight=2)
    assert too_little_memory(fitting, gib, 400 * mib) is None  # what the warning asked for
    cramped = too_little_memory(defaults, 512 * mib, 200 * mib)  # decoding and the queue alone do not fit
    assert cramped is not None and cramped.endswith("lower --max-pixels (40000000) and --queue-limit (512) first")
