"""The README's Ray cluster path, run as written: two Ray nodes on this machine (two `ray start`, token
authentication on), `serve deploy serve_config.yaml`, replicas on both nodes and both answering, and
repeats of a photo routed to the replica whose cache has it.

Slow (two raylets, two replicas): the e2e tier. It starts and stops only its own Ray processes.
"""

import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is optional: pip install -r requirements-ray.txt")

import requests  # noqa: E402

from mnv3 import ray_cluster  # noqa: E402
from mnv3.loadtest import free_port  # noqa: E402
from mnv3.photos import load_images  # noqa: E402
from mnv3.ray_serve import REPLICA_HEADER  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REQUESTS = 16
TIMEOUT_S = 60
STOP_TIMEOUT_S = 15


def test_serve_deploy_places_a_replica_on_each_node_and_both_answer(fp32_model_path, tmp_path):
    with ray_cluster.LocalCluster(nodes=2, cpus_per_node=1) as cluster:
        # A worker joined with the token; without it the head refuses the node (InvalidAuthToken).
        assert cluster.alive_node_count() == 2
        port = free_port()
        # The shipped config, with what the README says to change on a cluster: an absolute model path.
        # Its autoscaling floor is raised to one replica per node, so both nodes serve from the start.
        config = ray_cluster.write_serve_config(
            tmp_path / "serve_config.yaml",
            fp32_model_path,
            port,
            {},
            {"autoscaling_config": {"min_replicas": 2, "max_replicas": 2, "target_ongoing_requests": 32}},
        )
        cluster.deploy(config)
        cluster.wait_for_replicas(2)

        status = cluster.serve_status()["applications"]["mnv3"]
        assert status["status"] == "RUNNING"
        assert status["deployments"]["MobileNetV3"]["replica_states"] == {"RUNNING": 2}
        replicas = cluster.replicas()
        nodes = {node["node_id"] for node in cluster.ray_list("nodes", "state=ALIVE")}
        assert len(replicas) == 2 and {r["node_id"] for r in replicas.values()} == nodes, (replicas, nodes)

        url = f"http://127.0.0.1:{port}"
        bodies = load_images(REQUESTS, seed=7)
        first, again = post_all(url, bodies), post_all(url, bodies)
        assert [r.status_code for r in first + again] == [200] * 2 * REQUESTS, [r.text for r in first + again]
        assert {r.headers[REPLICA_HEADER] for r in first} == set(replicas)
        # Routed by image (the config's ImageAffinityRouter): each photo again reaches the replica that has it.
        assert [r.headers[REPLICA_HEADER] for r in again] == [r.headers[REPLICA_HEADER] for r in first]
        assert [r.json()["cache_hit"] for r in again] == [True] * REQUESTS
        pids = [process.pid for process in cluster.nodes] + [r["pid"] for r in replicas.values()]

    # Stopped: its `ray start` processes and the replicas on its nodes are gone (others' Ray is not touched).
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive(pids), alive(pids)


def post_all(url: str, bodies: list[bytes]) -> list[requests.Response]:
    with ThreadPoolExecutor(4) as pool:
        return list(
            pool.map(
                lambda body: requests.post(
                    url + "/predict", files={"file": ("image.jpg", body, "image/jpeg")}, timeout=TIMEOUT_S
                ),
                bodies,
            )
        )


def alive(pids: list[int]) -> list[int]:
    running = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            running.append(pid)
        except ProcessLookupError:
            pass
    return running
