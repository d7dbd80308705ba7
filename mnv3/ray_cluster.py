"""A Ray cluster of several nodes on one machine, started the way the README's cluster section says, and
the benchmarks that need one (replica and node loss under load).

    python -m mnv3.ray_cluster --bench-loss [--quick]   -> results/07_ray_cluster_loss.csv

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
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from mnv3.loadtest import free_port
from mnv3.ray_serve import APP_NAME, PROXY_CALLBACK, PROXY_CALLBACK_ENV, REPO_ROOT

SERVE_CONFIG = REPO_ROOT / "serve_config.yaml"
DEPLOYMENT_NAME = "MobileNetV3"
REPLICA_ACTOR_CLASS = f"ServeReplica:{APP_NAME}:{DEPLOYMENT_NAME}"
NODE_START_TIMEOUT_S = 120  # `ray start` on a busy 2-core machine takes 10-30 s per node
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
    the token); RAY_AUTH_TOKEN is the token itself (or put it in ~/.ray/auth_token). Ray's processes must
    import mnv3 (PYTHONPATH), and the proxy's callback gives Ray's own errors the app's JSON body.
    """
    python_path = os.pathsep.join(filter(None, (str(REPO_ROOT), os.environ.get("PYTHONPATH"))))
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, "PYTHONPATH": python_path,
            PROXY_CALLBACK_ENV: PROXY_CALLBACK, "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": str(DRAIN_TIMEOUT_S)}


def write_serve_config(path: Path, model: Path, http_port: int, application_args: dict | None = None,
                       deployment_options: dict | None = None, source: Path = SERVE_CONFIG) -> Path:
    """A copy of serve_config.yaml with an absolute model path, the proxy's port, and any overrides."""
    config = yaml.safe_load(source.read_text())
    config["http_options"]["port"] = http_port
    application = config["applications"][0]
    application["args"] |= {"model": str(Path(model).resolve())} | (application_args or {})
    application["deployments"][0] |= deployment_options or {}
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
        self.address = None  # HEAD_IP:PORT, as the head wrote it
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

    def __exit__(self, *exc_info):
        self.stop()

    def _start_node(self, name: str, *options: str) -> subprocess.Popen:
        temp_dir = self.root / name
        log = open(self.root / f"{name}.log", "wb")
        # Its own session: SIGKILL to the process group reaches the node's Ray processes, and only them.
        process = subprocess.Popen(
            [ray_command("ray"), "start", "--block", "--num-cpus", str(self.cpus_per_node), "--temp-dir",
             str(temp_dir), "--dashboard-agent-listen-port", str(free_port()), "--disable-usage-stats", *options],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=REPO_ROOT,
            start_new_session=True)
        log.close()
        self.nodes.append(process)
        return process

    def start_head(self) -> None:
        self._start_node("head", "--head", "--port", str(self.gcs_port), "--dashboard-host", "127.0.0.1",
                         "--dashboard-port", str(self.dashboard_port), "--ray-client-server-port", str(free_port()))
        address_file = self.root / "head" / "ray_current_cluster"  # the head writes HEAD_IP:PORT here
        self._wait(lambda: address_file.exists() and address_file.read_text().strip(), NODE_START_TIMEOUT_S,
                   "the head node did not start")
        self.address = address_file.read_text().strip()
        self.wait_for_nodes(1)

    def add_worker_node(self) -> None:
        self._start_node(f"worker{len(self.nodes)}", "--address", self.address)
        self.wait_for_nodes(self.alive_node_count() + 1)

    def kill_node(self, index: int) -> None:
        """SIGKILL a worker node's Ray processes: the node is lost as a crashed machine would be."""
        if index == 0:
            raise ValueError("node 0 is the head; killing it ends the cluster")
        os.killpg(self.nodes[index].pid, signal.SIGKILL)
        self.nodes[index].wait(NODE_STOP_TIMEOUT_S)
        self.killed.append(self.nodes[index])

    def alive_node_count(self) -> int:
        return sum(node["state"] == "ALIVE" for node in self.ray_list("nodes"))

    def wait_for_nodes(self, count: int, timeout_s: float = NODE_START_TIMEOUT_S) -> None:
        self._wait(lambda: self.alive_node_count() == count, timeout_s, f"{count} nodes not alive")

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
            done = subprocess.run([ray_command(program), *args], env=self.env, cwd=REPO_ROOT, capture_output=True,
                                  text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as exc:
            raise ClusterError(f"`{program} {' '.join(args)}` did not finish within {timeout_s:.0f} s") from exc
        if done.returncode != 0:
            raise ClusterError(f"`{program} {' '.join(args)}` failed: {done.stderr.strip()[-2000:]}")
        return done.stdout

    def ray_list(self, resource: str, *filters: str) -> list[dict]:
        """The state API (`ray list nodes|actors ...`) as dicts."""
        options = [item for f in filters for item in ("--filter", f)]
        return json.loads(self.run("ray", "list", resource, "--address", self.dashboard_url, "--detail",
                                   "--format", "json", "--limit", "1000", *options))

    def deploy(self, config: Path) -> None:
        self.run("serve", "deploy", str(config), "--address", self.dashboard_url)

    def serve_status(self) -> dict:
        return yaml.safe_load(self.run("serve", "status", "--address", self.dashboard_url))

    def replicas(self) -> dict[str, dict]:
        """Live replicas of the app: {replica id (as in the x-mnv3-replica header): {node_id, pid}}."""
        actors = self.ray_list("actors", f"class_name={REPLICA_ACTOR_CLASS}", "state=ALIVE")
        # Actor names are SERVE_REPLICA::<app>#<deployment>#<replica id>.
        return {actor["name"].rsplit("#", 1)[1]: {"node_id": actor["node_id"], "pid": actor["pid"]}
                for actor in actors}

    def running_replica_count(self) -> int:
        """Replicas `serve status` reports RUNNING, 0 before the app exists."""
        deployment = (self.serve_status().get("applications", {}).get(APP_NAME, {})
                      .get("deployments", {}).get(DEPLOYMENT_NAME, {}))
        return deployment.get("replica_states", {}).get("RUNNING", 0)

    def wait_for_replicas(self, count: int, timeout_s: float = NODE_START_TIMEOUT_S) -> None:
        self._wait(lambda: self.running_replica_count() == count, timeout_s, f"{count} replicas not running")


def ray_command(program: str) -> str:
    """The `ray`/`serve` executable beside this Python, so the cluster runs the Ray this code imports."""
    return str(Path(sys.executable).with_name(program))
