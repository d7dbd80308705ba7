"""A Ray cluster of several nodes on one machine, started the way the README's cluster section says, and
the benchmarks that need one: replica and node loss under load, the cache across replicas, autoscaling.

    python -m mnv3.ray_cluster --bench-loss [--quick]       -> results/08_ray_cluster_loss.csv
    python -m mnv3.ray_cluster --bench-cache [--quick]      -> results/09_ray_cluster_cache.csv
    python -m mnv3.ray_cluster --bench-autoscale [--quick]  -> results/10_ray_cluster_autoscale.csv

`LocalCluster` runs one `ray start --block` process per node (a real head and real worker raylets, each
with its own temp dir, ports and `--num-cpus`), with token authentication on: every `ray`/`serve`
command, on every node, gets the cluster's token through the environment (`node_environment`). It
deploys with `serve deploy`, reads placement with `serve status` and `ray list actors`, and stops only
its own processes: SIGTERM to each `ray start --block` (which stops that node's Ray processes, and the
actors on it with them), SIGKILL to its process group if that has not ended within its time.

Ray on Linux gives a multi-node cluster the machine's own address, not 127.0.0.1: `ray start` turns a
loopback `--node-ip-address` into it (only its single-node mode stays on loopback, and that mode refuses
worker nodes). So the GCS and raylets are reachable on that address, behind the token; the HTTP proxy
and the dashboard listen on 127.0.0.1.
"""

import argparse
import asyncio
import hashlib
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import requests
import yaml  # type: ignore[import-untyped]  # no stubs installed
from fastapi.testclient import TestClient

from mnv3 import cli, loadtest
from mnv3.artifacts import RAY_CLUSTER_AUTOSCALE_CSV, RAY_CLUSTER_CACHE_CSV, RAY_CLUSTER_LOSS_CSV
from mnv3.config import ServerConfig
from mnv3.loadtest import free_port
from mnv3.photos import load_images
from mnv3.ray_serve import (
    APP_NAME,
    IMAGE_ROUTER,
    LOAD_ROUTER,
    PROXY_CALLBACK,
    PROXY_CALLBACK_ENV,
    REPLICA_HEADER,
    REPO_ROOT,
    RETRIED_HEADER,
)
from mnv3.server import create_app

SERVE_CONFIG = REPO_ROOT / "serve_config.yaml"
DEPLOYMENT_NAME = "MobileNetV3"
NODE_START_TIMEOUT_S = 120  # `ray start` per node: generous, a busy small machine starts a node slowly
COMMAND_TIMEOUT_S = 120  # one `ray`/`serve` CLI call
NODE_STOP_TIMEOUT_S = 30  # after SIGTERM, before SIGKILL
# Ray drains a node for up to 30 s on SIGTERM; the actors here hold no state worth waiting for.
DRAIN_TIMEOUT_S = 5
POLL_S = 1.0


class ClusterError(RuntimeError):
    """A node did not start, a command failed, or the cluster did not reach a state in time."""


def node_environment(token: str) -> dict:
    """What every node, and every `ray`/`serve` command, needs in its environment.

    RAY_AUTH_MODE=token turns token authentication on (the head then refuses nodes and clients without
    the token); RAY_AUTH_TOKEN is the token itself (or put it in ~/.ray/auth_token). The proxy's callback
    gives Ray's own errors the app's JSON body (Ray's processes import mnv3 as the installed package).
    """
    return {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": token,
        PROXY_CALLBACK_ENV: PROXY_CALLBACK,
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": str(DRAIN_TIMEOUT_S),
        # Several nodes: not Ray's loopback-only single-node mode, which mnv3.ray_serve's local cluster sets
        # in its own process (a test run may have started one) and which refuses worker nodes.
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
    }


def write_serve_config(
    path: Path,
    model: Path,
    http_port: int,
    application_args: dict | None = None,
    deployment_options: dict | None = None,
    source: Path = SERVE_CONFIG,
) -> Path:
    """A copy of serve_config.yaml with an absolute model path, the proxy's port, and any overrides (a
    deployment option set to None is removed, leaving Ray's default)."""
    config = yaml.safe_load(source.read_text())
    config["http_options"]["port"] = http_port
    application = config["applications"][0]
    application["args"] |= {"model": str(Path(model).resolve())} | (application_args or {})
    deployment = application["deployments"][0] | (deployment_options or {})
    application["deployments"][0] = {key: value for key, value in deployment.items() if value is not None}
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


class LocalCluster:
    """`with LocalCluster(nodes=2) as cluster:` a head and nodes-1 worker nodes on this machine, stopped on exit.

    Every port is a free one and every node has its own temp dir, so it runs beside other Ray clusters
    on the machine and stops none of them.
    """

    def __init__(self, nodes: int = 2, cpus_per_node: int = 1, root: Path | None = None):
        self.cpus_per_node = cpus_per_node
        self.root = Path(root or tempfile.mkdtemp(prefix="mnv3-ray-"))  # short: Ray's socket paths live here
        self.env = os.environ | node_environment(secrets.token_hex(32))
        self.gcs_port, self.dashboard_port = free_port(), free_port()
        self.dashboard_url = f"http://127.0.0.1:{self.dashboard_port}"
        self.address = ""  # HEAD_IP:PORT, as the head wrote it
        self.nodes: list[subprocess.Popen] = []  # one `ray start --block` per node, head first
        self.killed: list[subprocess.Popen] = []  # nodes lost on purpose (kill_node)
        self._node_count = nodes

    # ------------------------------------------------------------------ nodes

    def __enter__(self) -> "LocalCluster":
        try:
            self.start_head()
            for _ in range(self._node_count - 1):
                self.add_worker_node()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, exc_type, *exc_info):
        self.stop()
        if exc_type is None:  # kept after a failure: the nodes' logs are there
            shutil.rmtree(self.root, ignore_errors=True)

    def _start_node(self, name: str, *options: str) -> subprocess.Popen:
        temp_dir = self.root / name
        log = open(self.root / f"{name}.log", "wb")
        # Its own session: SIGKILL to the process group reaches the node's Ray processes, and only them.
        process = subprocess.Popen(
            [
                ray_command("ray"),
                "start",
                "--block",
                "--num-cpus",
                str(self.cpus_per_node),
                "--temp-dir",
                str(temp_dir),
                "--dashboard-agent-listen-port",
                str(free_port()),
                "--disable-usage-stats",
                *options,
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=REPO_ROOT,
            start_new_session=True,
        )
        log.close()
        self.nodes.append(process)
        return process

    def start_head(self) -> None:
        self._start_node(
            "head",
            "--head",
            "--port",
            str(self.gcs_port),
            "--dashboard-host",
            "127.0.0.1",
            "--dashboard-port",
            str(self.dashboard_port),
            "--ray-client-server-port",
            str(free_port()),
        )
        address_file = self.root / "head" / "ray_current_cluster"  # the head writes HEAD_IP:PORT here
        self._wait(
            lambda: address_file.exists() and address_file.read_text().strip(),
            NODE_START_TIMEOUT_S,
            "the head node did not start",
        )
        self.address = address_file.read_text().strip()
        self._wait(lambda: self.alive_node_count() == 1, NODE_START_TIMEOUT_S, "the head node did not start")

    def add_worker_node(self) -> None:
        known = {node["node_id"] for node in self.ray_list("nodes")}
        self._start_node(f"worker{len(self.nodes)}", "--address", self.address)
        self._wait(
            lambda: any(node["node_id"] not in known and node["state"] == "ALIVE" for node in self.ray_list("nodes")),
            NODE_START_TIMEOUT_S,
            "the new node did not join",
        )

    def kill_node(self, index: int) -> None:
        """SIGKILL a worker node's Ray processes: the node is lost as a crashed machine would be."""
        if index == 0:
            raise ValueError("node 0 is the head; killing it ends the cluster")
        os.killpg(self.nodes[index].pid, signal.SIGKILL)
        self.nodes[index].wait(NODE_STOP_TIMEOUT_S)
        self.killed.append(self.nodes[index])

    def node_of(self, pid: int) -> int:
        """Index of the node whose `ray start` started process `pid` (Ray's workers are its raylet's children)."""
        node_pids = {process.pid: index for index, process in enumerate(self.nodes)}
        while pid > 1:
            if pid in node_pids:
                return node_pids[pid]
            try:
                pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])  # its parent
            except FileNotFoundError:
                break
        raise ClusterError("the process is gone or belongs to none of this cluster's nodes")

    def alive_node_count(self) -> int:
        return sum(node["state"] == "ALIVE" for node in self.ray_list("nodes"))

    def stop(self) -> None:
        """Stop every node this cluster started, workers first, and only those."""
        for process in reversed(self.nodes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in reversed(self.nodes):
            try:
                process.wait(DRAIN_TIMEOUT_S + NODE_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
            try:  # whatever of the node is left: its session's processes
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait(NODE_STOP_TIMEOUT_S)

    def _wait(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(process.poll() is not None for process in self.nodes if process not in self.killed):
                raise ClusterError(f"{what}: a `ray start` exited; see the logs in {self.root}")
            try:
                if ready():
                    return
            except ClusterError:
                pass  # the CLI could not answer yet
            time.sleep(POLL_S)
        raise ClusterError(f"{what} within {timeout_s:.0f} s; see the logs in {self.root}")

    # ------------------------------------------------------------------ the CLIs

    def run(self, program: str, *args: str, timeout_s: float = COMMAND_TIMEOUT_S) -> str:
        """`ray ...` or `serve ...` with the cluster's environment; its standard output."""
        try:
            done = subprocess.run(
                [ray_command(program), *args],
                env=self.env,
                cwd=REPO_ROOT,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as exc:
            raise ClusterError(f"`{program} {' '.join(args)}` did not finish within {timeout_s:.0f} s") from exc
        if done.returncode != 0:
            raise ClusterError(f"`{program} {' '.join(args)}` failed: {done.stderr.strip()[-2000:]}")
        return done.stdout

    def ray_list(self, resource: str, *filters: str) -> list[dict]:
        """The state API (`ray list nodes|actors ...`) as dicts."""
        options = [item for f in filters for item in ("--filter", f)]
        return json.loads(
            self.run(
                "ray",
                "list",
                resource,
                "--address",
                self.dashboard_url,
                "--detail",
                "--format",
                "json",
                "--limit",
                "1000",
                *options,
            )
        )

    def deploy(self, config: Path) -> None:
        self.run("serve", "deploy", str(config), "--address", self.dashboard_url)

    def serve_status(self) -> dict:
        return yaml.safe_load(self.run("serve", "status", "--address", self.dashboard_url))

    def serve_shutdown(self) -> None:
        """Delete every Serve app and Serve itself (the next deploy starts it again): fresh replicas."""
        self.run("serve", "shutdown", "--yes", "--address", self.dashboard_url)
        self._wait(
            lambda: not self.serve_details().get("applications"), NODE_START_TIMEOUT_S, "Serve did not shut down"
        )

    def serve_details(self) -> dict:
        """Serve's REST API on the dashboard (what `serve status` reads), with the cluster's token."""
        try:
            response = requests.get(
                self.dashboard_url + "/api/serve/applications/",
                timeout=COMMAND_TIMEOUT_S,
                headers={"Authorization": f"Bearer {self.env['RAY_AUTH_TOKEN']}"},
            )
            response.raise_for_status()
        except requests.RequestException as exc:
            raise ClusterError(f"Serve's REST API did not answer: {exc}") from exc
        return response.json()

    def replicas(self) -> dict[str, dict]:
        """RUNNING replicas of the app: {replica id (as in the x-mnv3-replica header): {node_id, pid, ...}}."""
        deployment = (
            self.serve_details()["applications"].get(APP_NAME, {}).get("deployments", {}).get(DEPLOYMENT_NAME, {})
        )
        return {
            replica["replica_id"]: replica
            for replica in deployment.get("replicas", [])
            if replica["state"] == "RUNNING"
        }

    def wait_for_replicas(self, count: int, timeout_s: float = NODE_START_TIMEOUT_S) -> None:
        self._wait(lambda: len(self.replicas()) == count, timeout_s, f"{count} replicas not running")


def ray_command(program: str) -> str:
    """The `ray`/`serve` executable beside this Python, so the cluster runs the Ray this code imports."""
    return str(Path(sys.executable).with_name(program))


# ---------------------------------------------------------------------------------------- loss under load

RECOVERY_TIMEOUT_S = 180  # a loss run ends this long after the kill, recovered or not
AFTER_RECOVERY_S = 5  # load kept on after the replicas are back, to see the rate come back too
RECOVERED_FRACTION = 0.8  # throughput counts as back once a second answers this share of the steady rate
PROBABILITY_RTOL = 1e-4  # batch composition and thread count change the float rounding, not the answer


@dataclass(frozen=True)
class Sample:
    """One request of a load run, as the client saw it."""

    start: float  # time.monotonic() at send
    end: float
    status: str  # HTTP status, or the client exception's name
    payload: dict | None  # the JSON answer, or the JSON error; None if the body was not JSON
    digest: str  # sha256 of the image sent
    replica: str | None
    retried: bool  # the proxy sent it again after its replica was lost (ray_serve.RetryLostReplica)


class RecordingClient(loadtest.PredictClient):
    """PredictClient that keeps every request: when, what came back (error bodies too), which replica."""

    def __init__(self, base_url: str, timeout_s: float):
        super().__init__(base_url, timeout_s)
        self.samples: list[Sample] = []  # appended on the client loop only

    async def __call__(self, body: bytes) -> tuple[str, dict | None]:
        start = time.monotonic()
        try:
            async with self._session.post(
                "/predict", data=self._form.body(body), headers=self._upload_headers
            ) as response:
                status, replica = str(response.status), response.headers.get(REPLICA_HEADER)
                retried = RETRIED_HEADER in response.headers
                try:
                    payload = await response.json(content_type=None)
                except ValueError:
                    payload = None
        except Exception as exc:  # aiohttp errors: reset, timeout, refused; recorded, never raised
            status, payload, replica, retried = type(exc).__name__, None, None, False
        sample = Sample(start, time.monotonic(), status, payload, hashlib.sha256(body).hexdigest(), replica, retried)
        self.samples.append(sample)
        return status, payload if status == "200" else None


def plain_answers(config: ServerConfig, bodies: list[bytes]) -> dict[str, list[dict]]:
    """{sha256 of body: predictions} from the plain app in this process: what each photo's answer must be."""
    with TestClient(create_app(config)) as client:
        return {
            hashlib.sha256(body).hexdigest(): client.post(
                "/predict", files={"file": ("image.jpg", body, "image/jpeg")}
            ).json()["predictions"]
            for body in bodies
        }


def is_right_answer(predictions: list[dict], expected: list[dict]) -> bool:
    """Same top-1 as the plain answer for this photo (or a class tied with it within rounding), same scores."""
    top = expected[0]["probability"]
    tied = {p["class_id"] for p in expected if p["probability"] >= top * (1 - PROBABILITY_RTOL)}
    return predictions[0]["class_id"] in tied and np.allclose(
        [p["probability"] for p in predictions], [p["probability"] for p in expected], rtol=PROBABILITY_RTOL
    )


class ReplicaMonitor:
    """Polls Serve's REST API in a thread: (seconds since `origin`, RUNNING replicas, their ids)."""

    def __init__(self, cluster: LocalCluster, origin: float, interval_s: float = POLL_S / 2):
        self.cluster, self.origin, self.interval_s = cluster, origin, interval_s
        self.log: list[tuple[float, int, frozenset]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            try:
                ids = frozenset(self.cluster.replicas())
                self.log.append((time.monotonic() - self.origin, len(ids), ids))
            except ClusterError:
                pass  # the dashboard is briefly unreachable while a node goes away
            self._stop.wait(self.interval_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc_info):
        self._stop.set()
        self._thread.join(COMMAND_TIMEOUT_S)


def summarize_loss(
    scenario: str,
    samples: list[Sample],
    origin: float,
    event_s: float,
    monitor_log: list,
    target_replicas: int,
    lost_replica: str,
    expected: dict,
    deadline_s: float,
) -> dict:
    """One CSV row: what the clients saw around the loss at `event_s`, and when replicas and rate came back."""
    statuses = Counter(sample.status for sample in samples)
    failures = [sample for sample in samples if sample.status != "200"]
    wrong = sum(
        not (sample.payload and is_right_answer(sample.payload["predictions"], expected[sample.digest]))
        for sample in samples
        if sample.status == "200"
    )
    waits = [sample.end - sample.start for sample in samples]
    # Answers per second, by when they came back; the steady rate is the mean before the loss.
    ends = np.array([sample.end - origin for sample in samples if sample.status == "200"])
    seconds = np.arange(0, int(np.ceil(ends.max())) + 1) if len(ends) else np.arange(1)
    per_second = np.histogram(ends, bins=np.append(seconds, seconds[-1] + 1))[0]
    steady = per_second[1 : int(event_s)].mean() if int(event_s) > 1 else float("nan")
    recovered = [
        t
        for t in seconds
        if t >= event_s
        and per_second[t] >= RECOVERED_FRACTION * steady
        and t + 1 < len(per_second)
        and per_second[t + 1] >= RECOVERED_FRACTION * steady
    ]
    back = [
        t for t, running, ids in monitor_log if t >= event_s and running == target_replicas and lost_replica not in ids
    ]
    return {
        "scenario": scenario,
        "sent": len(samples),
        "answered": statuses["200"],
        "failed": len(failures),
        "retried_by_proxy": sum(sample.retried for sample in samples),
        "failed_by_status": ";".join(f"{s}:{n}" for s, n in sorted(statuses.items()) if s != "200"),
        "failed_http_without_json_detail": sum(
            sample.status.isdigit() and not (isinstance(sample.payload, dict) and "detail" in sample.payload)
            for sample in failures
        ),
        "example_failure": next((f"{sample.status} {json.dumps(sample.payload)}" for sample in failures), ""),
        "wrong_answers": wrong,
        "longest_wait_s": round(max(waits), 3),
        "over_deadline": sum(wait > deadline_s for wait in waits),
        "deadline_s": deadline_s,
        "loss_at_s": round(event_s, 1),
        "steady_req_per_s": round(float(steady), 1),
        "replicas_back_after_s": round(back[0] - event_s, 1) if back else float("nan"),
        "throughput_back_after_s": round(float(recovered[0] - event_s), 1) if recovered else float("nan"),
        "replica_log": " ".join(
            f"{t:.1f}s:{running}"
            for i, (t, running, ids) in enumerate(monitor_log)
            if i == 0 or ids != monitor_log[i - 1][2]
        ),
    }


def closed_loop_until(send, bodies: list[bytes], concurrency: int, done) -> None:
    """`concurrency` senders, each sending its next body as soon as its last one returned, until `done()`.

    mnv3.loadtest.run_closed_loop sends a fixed count; a loss run must instead go on until the cluster has
    recovered, however long that takes on the machine at hand.
    """

    async def sender(offset: int):
        i = offset
        while not done():
            await send(bodies[i % len(bodies)])
            i += concurrency

    async def load():
        await asyncio.gather(*(sender(offset) for offset in range(concurrency)))

    loadtest.on_client_loop(load())


def run_loss(
    cluster: LocalCluster,
    url: str,
    scenario: str,
    bodies: list[bytes],
    expected: dict,
    concurrency: int,
    seconds: float,
    loss_at_s: float,
    deadline_s: float,
    target_replicas: int,
) -> dict:
    """A closed-loop load; at `loss_at_s` one replica process (scenario "replica") or the worker node holding
    one (scenario "node", then replaced by a new node) is SIGKILLed. The load goes on for at least `seconds`
    and until `target_replicas` run again without the lost one, plus AFTER_RECOVERY_S (RECOVERY_TIMEOUT_S at most)."""
    # A replica on a worker node: the head can be lost only with the whole cluster.
    victim_id, victim = next(
        (replica_id, replica)
        for replica_id, replica in cluster.replicas().items()
        if cluster.node_of(replica["pid"]) != 0
    )
    origin = time.monotonic()

    def lose():
        time.sleep(loss_at_s)
        print(f"{time.monotonic() - origin:6.1f} s  SIGKILL {scenario} (replica {victim_id})", flush=True)
        if scenario == "replica":
            os.kill(victim["pid"], signal.SIGKILL)
        else:
            cluster.kill_node(cluster.node_of(victim["pid"]))
            cluster.add_worker_node()  # a replacement node, as an autoscaler or an operator would add
            print(f"{time.monotonic() - origin:6.1f} s  replacement node joined", flush=True)

    with ReplicaMonitor(cluster, origin) as monitor, RecordingClient(url, deadline_s) as send:

        def done() -> bool:
            elapsed = time.monotonic() - origin
            back = [
                t
                for t, running, ids in monitor.log
                if t > loss_at_s and running == target_replicas and victim_id not in ids
            ]
            return elapsed > loss_at_s + RECOVERY_TIMEOUT_S or (
                elapsed > seconds and bool(back) and elapsed > back[0] + AFTER_RECOVERY_S
            )

        killer = threading.Thread(target=lose, daemon=True)
        killer.start()
        closed_loop_until(send, bodies, concurrency, done)
        killer.join(COMMAND_TIMEOUT_S + NODE_START_TIMEOUT_S)
    row = summarize_loss(
        scenario, send.samples, origin, loss_at_s, monitor.log, target_replicas, victim_id, expected, deadline_s
    )
    print(f"{scenario:>8} loss: {row}", flush=True)
    return row


def bench_loss(args) -> list[dict]:
    """Replica loss, then node loss, under a closed-loop load on a 2-node cluster with 2 replicas."""
    config = ServerConfig(model=args.model, cache_size=0)  # every request runs the model
    bodies = load_images(args.images)
    print("plain answers for each photo ...", flush=True)
    expected = plain_answers(config, bodies)
    port = free_port()
    rows = []
    with LocalCluster(nodes=2, cpus_per_node=1) as cluster:
        config_path = write_serve_config(
            cluster.root / "serve_config.yaml",
            args.model,
            port,
            {"cache_size": 0, "deadline_ms": 1000 * args.deadline_s},
            {"num_replicas": 2, "autoscaling_config": None},
        )
        cluster.deploy(config_path)
        cluster.wait_for_replicas(2)
        url = f"http://127.0.0.1:{port}"
        for scenario in ("replica", "node"):
            rows.append(
                run_loss(
                    cluster,
                    url,
                    scenario,
                    bodies,
                    expected,
                    args.concurrency,
                    args.seconds,
                    args.loss_at,
                    args.deadline_s,
                    target_replicas=2,
                )
            )
    environment = cli.environment_row(args.model, args.provenance)
    cli.write_results(args.results_dir, RAY_CLUSTER_LOSS_CSV, [row | environment for row in rows])
    return rows


# ---------------------------------------------------------------------------------------- cache across replicas


def bench_cache(args) -> list[dict]:
    """Cache hit rate on a repeated-image workload: 1 replica, then 2 replicas routed by load (Ray's default
    router), then 2 replicas routed by image (ImageAffinityRouter). Each setup starts with empty caches."""
    distinct = load_images(args.images, seed=11)
    workload = [body for body in distinct for _ in range(args.repeats)]
    random.Random(0).shuffle(workload)
    best_hit_rate = 1 - len(distinct) / len(workload)  # every image's first request is a miss
    port, rows = free_port(), []
    with LocalCluster(nodes=2, cpus_per_node=1) as cluster:
        for replicas, router in ((1, LOAD_ROUTER), (2, LOAD_ROUTER), (2, IMAGE_ROUTER)):
            config = write_serve_config(
                cluster.root / "serve_config.yaml",
                args.model,
                port,
                {"cache_size": 4 * len(distinct)},
                {
                    "num_replicas": replicas,
                    "autoscaling_config": None,
                    "request_router_config": {"request_router_class": router},
                },
            )
            cluster.deploy(config)
            cluster.wait_for_replicas(replicas)
            with RecordingClient(f"http://127.0.0.1:{port}", args.deadline_s) as send:
                loadtest.run_closed_loop(send, workload, args.concurrency)
            answered = [sample for sample in send.samples if sample.status == "200"]
            hits = sum(sample.payload["cache_hit"] for sample in answered)
            row = {
                "replicas": replicas,
                "routing": "image hash" if router == IMAGE_ROUTER else "load (Ray's default)",
                "requests": len(workload),
                "distinct_images": len(distinct),
                "answered": len(answered),
                "cache_hits": hits,
                "hit_rate": round(hits / len(workload), 4),
                "best_possible_hit_rate": round(best_hit_rate, 4),
                "replicas_answering": len({sample.replica for sample in answered}),
                "concurrency": args.concurrency,
            }
            print(row, flush=True)
            rows.append(row)
            cluster.serve_shutdown()
    single = rows[0]["hit_rate"]
    for row in rows:
        row["hit_rate_vs_1_replica"] = round(row["hit_rate"] / single, 3) if single else float("nan")
    environment = cli.environment_row(args.model, args.provenance)
    cli.write_results(args.results_dir, RAY_CLUSTER_CACHE_CSV, [row | environment for row in rows])
    return rows


# ---------------------------------------------------------------------------------------- autoscaling

# Ray's defaults wait 30 s to scale up and 600 s to scale down, over a 30 s window: shortened for the bench.
BENCH_AUTOSCALING = {
    "min_replicas": 1,
    "max_replicas": 2,
    "target_ongoing_requests": 2,
    "upscale_delay_s": 3,
    "downscale_delay_s": 10,
    "look_back_period_s": 5,
}
SCALE_TIMEOUT_S = 180  # each phase of the ramp waits this long at most for the replica count it expects
LOW_PHASE_S = 10  # the ramp's first phase, one client on the one replica, lasts at least this long


def bench_autoscale(args) -> list[dict]:
    """A load ramp on a 2-node cluster: one client for LOW_PHASE_S on the one replica, `concurrency` clients
    until Ray has scaled to 2, then none until it is back to 1. Every change of the replica count is a
    timestamped row."""
    bodies = load_images(args.images, seed=13)
    port = free_port()
    with LocalCluster(nodes=2, cpus_per_node=1) as cluster:
        config = write_serve_config(
            cluster.root / "serve_config.yaml",
            args.model,
            port,
            {"cache_size": 0},
            {"autoscaling_config": BENCH_AUTOSCALING},
        )
        cluster.deploy(config)
        cluster.wait_for_replicas(1)
        origin, phases = time.monotonic(), []
        with ReplicaMonitor(cluster, origin) as monitor:

            def reached(count: int, since: float):
                return lambda: (
                    time.monotonic() - since > SCALE_TIMEOUT_S
                    or any(t > since - origin and running == count for t, running, _ in monitor.log)
                )

            for phase, clients, target in (("low", 1, 1), ("ramp", args.concurrency, 2), ("idle", 0, 1)):
                start = time.monotonic()
                phases.append((phase, clients, start - origin))
                print(f"{start - origin:6.1f} s  {phase}: {clients} clients, until {target} replica(s)", flush=True)
                with RecordingClient(f"http://127.0.0.1:{port}", args.deadline_s) as send:
                    if clients:
                        closed_loop_until(
                            send, bodies, clients, reached(target, start + (phase == "low") * LOW_PHASE_S)
                        )
                    else:
                        wait_until(reached(target, start))
    rows = []
    for i, (t, running, _) in enumerate(monitor.log):
        if i == 0 or running != monitor.log[i - 1][1]:
            phase, clients, _ = [p for p in phases if p[2] <= t][-1] if any(p[2] <= t for p in phases) else phases[0]
            rows.append(
                {
                    "seconds": round(t, 1),
                    "time_utc": time.strftime("%H:%M:%S", time.gmtime(time.time() - (time.monotonic() - origin - t))),
                    "running_replicas": running,
                    "phase": phase,
                    "clients": clients,
                    **{f"autoscaling_{k}": v for k, v in BENCH_AUTOSCALING.items()},
                }
            )
            print(f"{rows[-1]['time_utc']}  {t:6.1f} s  {running} replica(s) running  ({phase}, {clients} clients)")
    environment = cli.environment_row(args.model, args.provenance)
    cli.write_results(args.results_dir, RAY_CLUSTER_AUTOSCALE_CSV, [row | environment for row in rows])
    counts = [row["running_replicas"] for row in rows]
    if not (1 in counts and 2 in counts and counts[-1] == 1 and counts.index(2) < len(counts) - 1):
        raise ClusterError(f"autoscaling did not go 1 -> 2 -> 1 replicas: {counts}")
    return rows


def wait_until(done, poll_s: float = POLL_S) -> None:
    while not done():
        time.sleep(poll_s)


# ---------------------------------------------------------------------------------------- command line


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mnv3.ray_cluster",
        add_help=add_help,
        description="Benchmarks on a Ray cluster of 2 nodes on this machine (1 CPU each, token auth on).",
    )
    cli.add_common_args(parser, "where stages 1-2 wrote models")
    parser.add_argument(
        "--model",
        type=Path,
        help="model to serve, ONNX or an OpenVINO IR (default: the static INT8 model stage 2 recorded)",
    )
    parser.add_argument(
        "--bench-loss",
        action="store_true",
        help="kill a replica, then a worker node, under load -> results/" + RAY_CLUSTER_LOSS_CSV,
    )
    parser.add_argument(
        "--bench-cache",
        action="store_true",
        help="cache hit rate, 1 vs 2 replicas, routed by load vs by image -> results/" + RAY_CLUSTER_CACHE_CSV,
    )
    parser.add_argument(
        "--bench-autoscale",
        action="store_true",
        help="a load ramp: 1 -> 2 -> 1 replicas, timestamped -> results/" + RAY_CLUSTER_AUTOSCALE_CSV,
    )
    parser.add_argument(
        "--concurrency",
        type=cli.positive_int,
        help=f"closed-loop clients ({cli.full_and_quick('cluster_concurrency')})",
    )
    parser.add_argument(
        "--seconds",
        type=cli.positive_float,
        help=f"--bench-loss: seconds of load at least ({cli.full_and_quick('cluster_seconds')})",
    )
    parser.add_argument(
        "--loss-at",
        type=cli.positive_float,
        help=f"--bench-loss: when the kill comes ({cli.full_and_quick('cluster_loss_at')})",
    )
    parser.add_argument(
        "--images", type=cli.positive_int, help=f"distinct photos ({cli.full_and_quick('cluster_images')})"
    )
    parser.add_argument(
        "--repeats",
        type=cli.positive_int,
        help=f"--bench-cache: requests per photo ({cli.full_and_quick('cluster_repeats')})",
    )
    parser.add_argument(
        "--deadline-s",
        type=cli.positive_float,
        default=30.0,
        help="each request's deadline, the server's and the client's (default %(default)s)",
    )
    return parser


def run_benchmarks(args) -> None:
    if not (args.bench_loss or args.bench_cache or args.bench_autoscale):
        raise cli.UsageError("nothing to do: pass --bench-loss, --bench-cache and/or --bench-autoscale")
    args.model, args.provenance = cli.serving_model(args)
    if args.bench_loss:
        bench_loss(args)
    if args.bench_cache:
        bench_cache(args)
    if args.bench_autoscale:
        bench_autoscale(args)


def main(args) -> int:
    defaults = cli.defaults(args)
    cli.fill_unset(
        args,
        concurrency=defaults.cluster_concurrency,
        seconds=defaults.cluster_seconds,
        loss_at=defaults.cluster_loss_at,
        images=defaults.cluster_images,
        repeats=defaults.cluster_repeats,
    )
    cli.run_stage(run_benchmarks, args, (ClusterError,), writes=("results_dir",))
    return 0


if __name__ == "__main__":
    sys.exit(main(get_args_parser().parse_args()))
