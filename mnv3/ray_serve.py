"""Optional: the same FastAPI app as a Ray Serve application, one batcher, cache and engine per replica.

    python -m mnv3.ray_serve --model artifacts/static_int8.onnx --replicas 2     # a local, loopback-only cluster
    serve run serve_config.yaml                                                 # or `serve deploy` to a cluster
    python -m mnv3.ray_serve --bench [--quick]     # plain vs Ray Serve, 1 and 2 replicas -> results/06_ray_serve.csv

Each replica builds its app with `mnv3.server.create_app`, so the endpoints, errors, cache and dynamic
batcher are the plain server's code, and Ray runs the app's lifespan (model load, warm-up, batcher
start) inside the replica. Ray adds an HTTP proxy in front that routes each request to a replica with
free capacity, queues up to `max_queued_requests` when all are busy, and refuses beyond that with 503.

With `api_keys` (a key file, in the config file's `args:` or as --api-keys) every replica protects its app
as the plain server does (`mnv3.auth`); the file is read once when the application is built (and every model
opened once), so a bad one fails the build, not the replicas, and each replica reads it again for its own
rate-limit buckets.

On SIGTERM or Ctrl-C, `python -m mnv3.ray_serve` answers what its proxy took in before it stops (`mnv3.ray_drain`).

Ray is an optional dependency (requirements-ray.txt): only mnv3.ray_cluster, Ray's other module, imports this one.
"""

import argparse
import hashlib
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica
from starlette.middleware import Middleware

from mnv3 import cli, loadtest, server
from mnv3.artifacts import RAY_SERVE_CSV
from mnv3.auth import KeyFileError, exposure_warning, load_key_file
from mnv3.config import ServerConfig, command_name
from mnv3.config import parse_args as parse_server_args
from mnv3.engine import Engine, ModelLoadError
from mnv3.errors import RETRY_AFTER_S
from mnv3.photos import load_images
from mnv3.ray_drain import RefuseWhileDraining, drain, start_flag

logger = logging.getLogger("ray.serve")  # in Ray's proxy: its log files
PROG = "python -m mnv3.ray_serve"  # how its errors begin, the server flags' too
APP_NAME = "mnv3"
REPLICA_HEADER = "x-mnv3-replica"  # which replica answered: lets a client (and the test) see the spread
RETRIED_HEADER = "x-mnv3-retried"  # set on an answer that took a second try after its replica was lost
# Ray's proxy puts this header's value in each request's routing metadata (multiplexed_model_id): the one
# per-request value a request router can read. The proxy middleware sets it to the image's hash.
ROUTING_KEY_HEADER = "serve_multiplexed_model_id"
BENCH_REQUESTS_PER_SENDER = 8
IMAGE_ROUTER = "mnv3.ray_serve:ImageAffinityRouter"
LOAD_ROUTER = RequestRouterConfig().request_router_class  # Ray's default: power of two choices by queue length
# The proxy is a separate Ray process; Ray calls this (from its environment) for middleware to wrap it in.
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "mnv3.ray_serve:proxy_middlewares"
REPO_ROOT = Path(__file__).resolve().parent.parent
# A batch fills only if a replica may hold that many requests at once: allow one batch running and one
# filling. Autoscaling aims at one full batch in flight per replica.
DEFAULT_MAX_ONGOING_REQUESTS = 2 * ServerConfig.max_batch_size
DEFAULT_TARGET_ONGOING_REQUESTS = ServerConfig.max_batch_size
DEFAULT_MAX_QUEUED_REQUESTS = ServerConfig.queue_limit  # Ray's proxy-side queue, beyond the replicas'


class ImageAffinityRouter(RequestRouter):
    """Request router: the same image goes to the same replica, whose cache then has it.

    Each replica keeps its own result cache, so with load-based routing a repeated image reaches a replica
    that has it cached only about 1/N of the time. Here each request's key (the image hash the proxy
    middleware put in its routing metadata) ranks the replicas by rendezvous hashing: the top one first,
    then the rest, so a full replica's requests still go elsewhere. Adding or losing a replica moves only
    the keys that replica ranked first. Requests without a key go to any replica.
    """

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        key = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        if not key or len(candidate_replicas) < 2:
            return [candidate_replicas]
        ranked = sorted(
            candidate_replicas,
            reverse=True,
            key=lambda replica: hashlib.sha256(f"{key}:{replica.replica_id.unique_id}".encode()).digest(),
        )
        return [ranked[:1], ranked[1:]]


def sized_to(config: ServerConfig, cpus: int) -> ServerConfig:
    """`config` with its threads sized to the CPUs Ray reserved for a replica (ray_actor_options num_cpus), so N
    replicas on a machine do not each spread over all of its cores: inference and preprocessing on `cpus`,
    OpenVINO's batches on --batch-threads if it fits (else `cpus`; unset, its default: stage 2's measurement
    for `cpus` intra-op threads, else half of them)."""
    batch_threads = min(config.batch_threads, cpus)  # 0 stays 0: the default
    return replace(config, intra_op_threads=cpus, preprocess_threads=cpus, batch_threads=batch_threads)


@serve.deployment(
    ray_actor_options={"num_cpus": 1},
    max_ongoing_requests=DEFAULT_MAX_ONGOING_REQUESTS,
    max_queued_requests=DEFAULT_MAX_QUEUED_REQUESTS,
    # Ray's own rejection gets the plain server's status and Retry-After; proxy_middlewares gives it its body.
    backpressure_config={"status_code": 503, "retry_after_s": RETRY_AFTER_S},
    # Repeats of an image reach the replica whose cache has it (the key comes from proxy_middlewares).
    request_router_config={"request_router_class": IMAGE_ROUTER},
)
@serve.ingress()  # no app here: each replica builds its own in __serve_build_asgi_app__, with its own threads
class MobileNetV3:
    def __init__(self, config: ServerConfig):
        self.config = config

    def __serve_build_asgi_app__(self):
        cpus = max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1)))
        app = server.create_app(sized_to(self.config, cpus))
        app.add_middleware(ReplicaHeader, replica_id=serve.get_replica_context().replica_id.unique_id)
        return app


class ReplicaHeader:
    """ASGI middleware: every response names the replica that produced it."""

    def __init__(self, app, replica_id: str):
        self.app = app
        self.header = (REPLICA_HEADER.encode(), replica_id.encode())

    async def __call__(self, scope, receive, send):
        async def send_with_header(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self.header]
            await send(message)

        await self.app(scope, receive, send_with_header)


class JsonErrors:
    """ASGI middleware for Ray's proxy: its own errors get the app's `{"detail": "..."}` body. Ray answers
    backpressure (503), timeouts (408) and unavailable deployments (503) in plain text; a request whose
    replica died while holding it gets no answer from Ray at all (uvicorn would send a plain-text 500):
    that becomes a JSON 502, the proxy's upstream having failed. Replies from the app pass through."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        held, started = {}, []

        async def send_json_errors(message):
            if message["type"] == "http.response.start":
                started.append(True)
                content_type = dict(message.get("headers", [])).get(b"content-type", b"")
                if message["status"] >= 400 and content_type.startswith(b"text/plain"):
                    held["start"], held["body"] = message, b""
                    return
            elif "start" in held:  # a held plain-text error: collect its body, then send it as JSON
                held["body"] += message.get("body", b"")
                if message.get("more_body"):
                    return
                start = held.pop("start")
                await send_json(send, start["status"], held["body"].decode(errors="replace"), start.get("headers", []))
                return
            await send(message)

        try:
            await self.app(scope, receive, send_json_errors)
        except Exception as exc:  # Ray's proxy failed on this request: still one JSON answer
            if not started:
                await send_json(send, 500, f"the Ray proxy failed on this request: {type(exc).__name__}: {exc}")
            raise
        if not started:
            await send_json(
                send,
                502,
                "the replica handling this request was lost before it answered (Ray restarts it); retry the request",
                [(b"retry-after", str(RETRY_AFTER_S).encode())],
            )


async def send_json(send, status: int, detail: str, headers=()) -> None:
    body = json.dumps({"detail": detail}).encode()
    headers = [(k, v) for k, v in headers if k.lower() not in (b"content-type", b"content-length")]
    headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class RetryLostReplica:
    """ASGI middleware for Ray's proxy: a request whose replica died before answering is sent once more.

    Ray's router already retries a request that never reached a live replica (it reserves a slot on a
    replica before sending, and picks another when that replica is dead). A request already on a replica
    that then dies gets no answer; Ray does not resend it, because it cannot know whether resending is
    safe. Here it is: POST /predict is a pure function of the upload. So the body is kept as the proxy
    reads it (up to the default --max-upload-bytes: the proxy cannot know the app's) and, if no response
    started, replayed once to another replica.
    """

    def __init__(self, app, max_body_bytes: int = ServerConfig.max_upload_bytes):
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body, started, disconnected = [], [], []
        size = 0

        async def recording_receive():
            nonlocal size
            message = await receive()
            if message["type"] == "http.request":
                size += len(message.get("body", b""))
                if size <= self.max_body_bytes:
                    body.append(message)
            elif message["type"] == "http.disconnect":
                disconnected.append(True)
            return message

        async def tracking_send(message):
            if message["type"] == "http.response.start":
                started.append(True)
            await send(message)

        await self.app(scope, recording_receive, tracking_send)
        complete = body and not body[-1].get("more_body") and size <= self.max_body_bytes
        if started or disconnected:  # answered, or nobody to answer (a client gone; one the drain cut off)
            return
        if not complete:
            logger.warning(
                "mnv3: not retrying a request whose replica was lost: its body was not all read or is over the limit"
            )
            return
        logger.warning("mnv3: retrying a request whose replica was lost")
        replay = iter(body)

        async def replaying_receive():  # the recorded body, then the client's own (disconnect)
            return next(replay, None) or await receive()

        async def send_marked(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (RETRIED_HEADER.encode(), b"1")]
            await send(message)

        await self.app(scope, replaying_receive, send_marked)


class ImageRoutingKey:
    """ASGI middleware for Ray's proxy: reads a request's body first (up to the default --max-upload-bytes) and puts
    a hash of the image in ROUTING_KEY_HEADER, for ImageAffinityRouter. A raw image body's hash is the
    cache's own key; a multipart body is hashed without its boundary, which changes from request to
    request, so the same file sent the same way gets the same key. Larger bodies pass through unkeyed."""

    def __init__(self, app, max_body_bytes: int = ServerConfig.max_upload_bytes):
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            size += len(message.get("body", b""))
            if message["type"] != "http.request" or not message.get("more_body") or size > self.max_body_bytes:
                break
        if message["type"] == "http.request" and not message.get("more_body"):
            scope = {
                **scope,
                "headers": [
                    *[(k, v) for k, v in scope["headers"] if k != ROUTING_KEY_HEADER.encode()],
                    (ROUTING_KEY_HEADER.encode(), routing_key(scope, messages).encode()),
                ],
            }
        buffered = iter(messages)

        async def replaying_receive():
            return next(buffered, None) or await receive()

        await self.app(scope, replaying_receive, send)


def routing_key(scope, messages: list) -> str:
    body = b"".join(message.get("body", b"") for message in messages)
    content_type = dict(scope["headers"]).get(b"content-type", b"")
    if content_type.startswith(b"multipart/") and b"boundary=" in content_type:
        boundary = content_type.split(b"boundary=", 1)[1].split(b";", 1)[0].strip(b'"')
        body = body.replace(boundary, b"")
    return hashlib.sha256(body).hexdigest()


def proxy_middlewares() -> list:
    """What Ray's proxy calls via RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=mnv3.ray_serve:proxy_middlewares.

    Ray wraps its app in these in list order, so the LAST is outermost (Starlette's own list is the other
    way round): the retry sits next to Ray's app, the routing key is set before it, JsonErrors, outside
    both, answers a request still unanswered after its one retry, and RefuseWhileDraining, outermost, keeps
    count of every request the proxy takes in (`mnv3.ray_drain`).
    """
    return [
        Middleware(RetryLostReplica),
        Middleware(ImageRoutingKey),
        Middleware(JsonErrors),
        Middleware(RefuseWhileDraining),
    ]


def build(
    config: ServerConfig,
    replicas: int = 1,
    num_cpus: float = 1,
    min_replicas: int | None = None,
    max_replicas: int | None = None,
    target_ongoing_requests: float = DEFAULT_TARGET_ONGOING_REQUESTS,
    max_ongoing_requests: int = DEFAULT_MAX_ONGOING_REQUESTS,
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS,
) -> serve.Application:
    """The application: `replicas` fixed replicas, or autoscaling between min and max if max_replicas is set."""
    scaling: dict[str, object]
    if max_replicas is not None:
        scaling = {
            "autoscaling_config": {
                "min_replicas": replicas if min_replicas is None else min_replicas,
                "max_replicas": max_replicas,
                "target_ongoing_requests": target_ongoing_requests,
            }
        }
    else:
        scaling = {"num_replicas": replicas}
    config = with_absolute_paths(config)
    # Opened here, once, where `serve deploy` can still refuse the update: found only by the replicas, a
    # missing or unloadable model stopped the running version's replicas (Ray replaces them before it starts
    # the new ones on a full cluster) and left none; under mnv3-ray-serve it was Ray's page of tracebacks.
    for spec in config.models:
        Engine.load(spec.path, config.backend_of(spec), intra_op_threads=1)
    if config.api_keys:
        load_key_file(config.api_keys)  # a KeyFileError here, once, rather than in every replica
    # serve.deployment made the class a Deployment, which mypy cannot see through the decorator.
    return MobileNetV3.options(  # type: ignore[attr-defined]
        ray_actor_options={"num_cpus": num_cpus},
        max_ongoing_requests=max_ongoing_requests,
        max_queued_requests=max_queued_requests,
        **scaling,
    ).bind(config)


def with_absolute_paths(config: ServerConfig) -> ServerConfig:
    """`config` with every model's file (each NAME=PATH@BACKEND keeps its name and backend) and the key file
    absolute: replicas may run in another directory, or on another node with the same layout. Links are kept
    (not resolved): a linked model file is served with the class names and manifest beside the link."""
    model, *extra_models = (spec.text(spec.path.absolute()) for spec in config.models)
    api_keys = str(Path(config.api_keys).absolute()) if config.api_keys else config.api_keys
    return replace(config, model=Path(model), extra_models=tuple(extra_models), api_keys=api_keys)


def build_app(args: dict) -> serve.Application:
    """For serve_config.yaml / `serve run mnv3.ray_serve:build_app model=PATH`: `args` are ServerConfig fields.

    Replica count, autoscaling, CPUs and queue limits are Ray's own deployment options: set them in the
    config file's `deployments:` section, which Ray applies on top of the defaults here. `extra_models` is
    a list in the config file, or comma-separated on the command line.
    """
    types: dict[str, Any] = {f.name: f.type for f in fields(ServerConfig)}
    unknown = sorted(set(args) - set(types))
    if unknown:
        raise ValueError(f"unknown mnv3 server options {unknown}; known: {sorted(types)}")
    if isinstance(args.get("extra_models"), str):
        args = args | {"extra_models": [text.strip() for text in args["extra_models"].split(",") if text.strip()]}
    return build(ServerConfig(**{name: typed(name, types[name], value) for name, value in args.items()}))


def typed(name: str, kind, value):
    """A config file's or `serve run ... key=value`'s value (strings from the command line) as the field's type,
    or an error naming the field: `int('lots')` alone names neither, and int(2.9) would be a silent 2."""
    if kind is int and isinstance(value, float) and not value.is_integer():
        raise ValueError(f"{name}: {value} is not a whole number")
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"{name}: {value!r} is not {'a whole number' if kind is int else 'a ' + kind.__name__}"
        ) from None


# ---------------------------------------------------------------------------------------- local cluster


def start_local_cluster(
    num_cpus: int | None = None, host: str = "127.0.0.1", port: int = 8000, log_to_driver: bool = True
) -> None:
    """A one-machine Ray cluster that listens on 127.0.0.1 only, with Serve's HTTP proxy on host:port."""
    # Ray's single-machine mode (its default on macOS/Windows) binds and advertises loopback only; on
    # Linux it would listen on every interface. Its processes read the variable; this one already has.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray._private.ray_constants.ENABLE_RAY_CLUSTER = False
    # Ray's processes inherit this environment: the proxy imports mnv3 (installed) for its middleware.
    os.environ[PROXY_CALLBACK_ENV] = PROXY_CALLBACK
    sigterm = signal.getsignal(signal.SIGTERM)
    ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, log_to_driver=log_to_driver)
    # ray.init's own handler exits with status 15 at once, skipping the caller's way of stopping (the --bench
    # run's cli.Terminated: its cluster and servers stopped, exit 143)
    if callable(sigterm) and threading.current_thread() is threading.main_thread():  # a handler of this program's
        signal.signal(signal.SIGTERM, sigterm)
    serve.start(http_options={"host": host, "port": port})


def stop_local_cluster() -> None:
    serve.shutdown()
    ray.shutdown()


def deploy(app: serve.Application, base_url: str, timeout_s: float = loadtest.START_TIMEOUT_S) -> None:
    """Deploy (or replace) the app and wait until /readyz answers 200 through the proxy."""
    serve.run(app, name=APP_NAME, route_prefix="/")
    if not loadtest.wait_until_ready(base_url, timeout_s):
        raise loadtest.ServerStartError(f"Ray Serve app not ready at {base_url} after {timeout_s:.0f} s")


# ---------------------------------------------------------------------------------------- benchmark


def bench(model: Path, provenance: str, results_dir: Path, concurrency: int, count: int) -> list[dict]:
    """Closed-loop load (stage 5's): the plain server, Ray Serve with 1 then 2 replicas, the plain server again.

    The cache is off and the bodies distinct, so every request is decoded and classified. The machine's
    cores are split between replicas (2 cores: 1 replica x 2 threads, 2 replicas x 1 thread).
    """
    cores = os.cpu_count() or 1
    bodies = load_images(count)
    config = ServerConfig(model=model, cache_size=0)
    environment = cli.environment_row(model, provenance)
    rows = []

    def measure(url: str, setup: dict) -> None:
        with loadtest.PredictClient(url) as send:
            loadtest.run_closed_loop(send, bodies, concurrency, count=concurrency)  # warm connections and batches
            result = loadtest.run_closed_loop(send, bodies, concurrency, count, desc=setup["setup"])
        print(f"{setup['setup']:>22}: {result.summary()}", flush=True)
        rows.append(setup | result.as_row() | environment)

    def measure_plain(when: str) -> None:
        with loadtest.ServerProcess(model, cache_size=0, intra_op_threads=cores, preprocess_threads=cores) as url:
            measure(url, {"setup": f"plain_{when}_ray", "replicas": 1, "cpus_per_replica": cores})

    # The plain server with no Ray processes on the machine, before and after: on a shared machine the
    # two plain rows show how much the load from elsewhere moved while Ray was measured.
    measure_plain("before")
    port = loadtest.free_port()
    start_local_cluster(cores, port=port, log_to_driver=False)
    try:
        for replicas in (1, 2):
            cpus = max(1, cores // replicas)
            deploy(build(config, replicas=replicas, num_cpus=cpus), f"http://127.0.0.1:{port}")
            measure(
                f"http://127.0.0.1:{port}",
                {
                    "setup": f"ray_serve_{replicas}_replica{'s' * (replicas > 1)}",
                    "replicas": replicas,
                    "cpus_per_replica": cpus,
                },
            )
            # Delete, not redeploy: a rolling update would start the new replicas while the old one
            # still holds every CPU, and wait for each other forever.
            serve.delete(APP_NAME)
    finally:
        stop_local_cluster()
    measure_plain("after")
    cli.write_results(results_dir, RAY_SERVE_CSV, rows)
    return rows


# ---------------------------------------------------------------------------------------- command line


def get_args_parser():
    parser = argparse.ArgumentParser(
        prog=command_name(PROG),
        description="Serve the mnv3 app with Ray Serve (a local cluster on 127.0.0.1, or --address), or --bench it.",
        epilog="Every `python -m mnv3.server` flag is accepted too (--cache-size, --max-batch-size, ...; "
        "`python -m mnv3.server --help` lists them); "
        "--host/--port are where Ray's HTTP proxy listens; --shutdown-delay-s is refused (SIGTERM drains through "
        "Ray's proxy). Engine and preprocess threads per replica = --num-cpus (rounded down, at least 1).",
    )
    cli.add_common_args(parser, "where stages 1-2 wrote models")
    cli.add_load_args(
        parser,
        concurrency_help=f"--bench: {cli.full_and_quick('ray_bench_concurrency')}",
        requests_help=f"--bench: default {BENCH_REQUESTS_PER_SENDER}x concurrency",
    )
    parser.add_argument(
        "--replicas",
        type=cli.positive_int,
        default=1,
        help="replicas (with --max-replicas: the initial and minimum; default %(default)s)",
    )
    parser.add_argument(
        "--num-cpus", type=cli.positive_float, default=1, help="CPUs Ray reserves per replica (default %(default)s)"
    )
    parser.add_argument("--min-replicas", type=cli.positive_int, help="autoscaling floor (default --replicas)")
    parser.add_argument("--max-replicas", type=cli.positive_int, help="autoscale between --min-replicas and this")
    parser.add_argument(
        "--target-ongoing-requests",
        type=cli.positive_float,
        default=DEFAULT_TARGET_ONGOING_REQUESTS,
        help="autoscaling aims at this many requests in flight per replica (default %(default)s)",
    )
    parser.add_argument(
        "--max-ongoing-requests",
        type=cli.positive_int,
        default=DEFAULT_MAX_ONGOING_REQUESTS,
        help="requests one replica holds at once (needs >= --max-batch-size for full batches; default %(default)s)",
    )
    parser.add_argument(
        "--max-queued-requests",
        type=int,
        default=DEFAULT_MAX_QUEUED_REQUESTS,
        help="requests Ray queues for busy replicas; beyond it: 503 + Retry-After (default %(default)s; -1: no limit)",
    )
    parser.add_argument("--address", help="an existing Ray cluster (e.g. auto); default: start a local one")
    parser.add_argument("--bench", action="store_true", help="plain vs Ray Serve (1, 2 replicas) -> " + RAY_SERVE_CSV)
    return parser


def parse_args(argv=None):
    """This module's flags; every other flag is a `python -m mnv3.server` one, kept in `args.server_flags`."""
    args, server_flags = get_args_parser().parse_known_args(argv)
    args.server_flags = server_flags
    return args


def server_config(args) -> ServerConfig:
    """The replicas' ServerConfig from --model (or stage 2's) and the server flags."""
    model, _ = cli.serving_model(args)
    config = parse_server_args(["--model", str(model), *args.server_flags], prog=command_name(PROG))
    if config.shutdown_delay_s:  # the plain server's uvicorn holds its port open meanwhile; Ray's proxy is Ray's
        raise cli.UsageError(
            "--shutdown-delay-s (or MNV3_SHUTDOWN_DELAY_S) is the plain server's (python -m mnv3.server): under "
            "Ray Serve, SIGTERM drains through Ray's proxy as this command's README section says"
        )
    if args.max_replicas is None and args.min_replicas is not None:
        raise cli.UsageError("--min-replicas is autoscaling's floor: give --max-replicas too")
    floor = args.replicas if args.min_replicas is None else args.min_replicas
    if args.max_replicas is not None and floor > args.max_replicas:
        raise cli.UsageError(f"--max-replicas {args.max_replicas} is below the autoscaling floor {floor}")
    most, flag = (args.max_replicas, "--max-replicas") if args.max_replicas else (args.replicas, "--replicas")
    if not (args.address or args.bench) and most * args.num_cpus > os.cpu_count():
        # Ray would wait forever for CPUs this machine does not have (autoscaling: for replicas it never starts).
        raise cli.UsageError(
            f"{flag} {most} x --num-cpus {args.num_cpus:g} is more than this "
            f"machine's {os.cpu_count()} CPUs; lower --num-cpus (fractions such as 0.5 work)"
        )
    return config


def run_bench(args) -> list[dict]:
    model, provenance = cli.serving_model(args)
    return bench(model, provenance, args.results_dir, args.concurrency, args.requests)


def serve_forever(args, config: ServerConfig) -> None:
    # Built before any Ray process starts: a bad key file is a KeyFileError now, not a cluster to clean up.
    app = build(
        config,
        args.replicas,
        args.num_cpus,
        args.min_replicas,
        args.max_replicas,
        args.target_ongoing_requests,
        args.max_ongoing_requests,
        args.max_queued_requests,
    )
    if args.address:
        ray.init(address=args.address)
        serve.start(http_options={"host": config.host, "port": config.port})
        if taken := app_name_taken(args.address):
            ray.shutdown()
            raise cli.UsageError(taken)
    else:
        server.check_can_listen(config.host, config.port)  # Ray's proxy would share a busy port (SO_REUSEPORT)
        start_local_cluster(host=config.host, port=config.port)
    if not config.api_keys and (warning := exposure_warning(config.host)):
        print(f"WARNING: {warning}", file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # while deploying: stop the same way as on Ctrl-C
    flag, signals = start_flag(), StopSignals()
    try:
        url = f"http://{config.host}:{config.port}"
        deploy(app, url)
        signals.install()
        print(f"mnv3 on Ray Serve at {url} (Ctrl-C stops it)", flush=True)
        while not signals.stop:
            time.sleep(0.2)
    finally:
        stop(flag, signals, config.shutdown_timeout_s, leave_cluster=bool(args.address))


class StopSignals:
    """SIGINT and SIGTERM once serving: the first asks to stop, any later one to end the drain's wait. Plain
    flags, polled: an exception from a second signal could land between any two steps of the drain, and a
    lock taken in a handler (threading.Event's) could be the one the interrupted code holds."""

    def __init__(self):
        self.stop = self.skip = False

    def install(self) -> None:
        signal.signal(signal.SIGINT, self._received)
        signal.signal(signal.SIGTERM, self._received)

    def _received(self, signum, frame) -> None:
        if self.stop:
            self.skip = True
        self.stop = True


def stop(flag, signals: StopSignals, timeout_s: float, leave_cluster: bool) -> None:
    """Answer what the proxies have taken in (at most `timeout_s`; a second Ctrl-C or SIGTERM cuts it short:
    what is left then gets a 503), then delete the app (a further signal abandons that), and stop the local
    cluster unless `leave_cluster` (and others' apps) is to go on."""
    signals.stop = True  # also when deploying failed or was interrupted: a signal from now on ends the wait
    signals.install()
    print(f"stopping: answering the requests in flight (at most {timeout_s:g} s; Ctrl-C again to skip)", flush=True)
    try:
        if left := drain(flag, timeout_s, lambda: signals.skip):
            print(f"{left} requests were still in flight: those not yet answering got a 503", flush=True)
    except Exception as exc:  # the flag out of reach: what is in flight is lost, but the app must still go
        print(f"could not drain: {type(exc).__name__}: {exc}", flush=True)
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        print("deleting the app and stopping (Ctrl-C again to abandon)", flush=True)
        serve.delete(APP_NAME)
    except KeyboardInterrupt:
        print(f"not waiting for the app {APP_NAME} to be deleted: Serve goes on deleting it", flush=True)
    finally:
        if leave_cluster:
            ray.shutdown()
        else:
            stop_local_cluster()


def app_name_taken(address: str) -> str | None:
    """With --address, why this app cannot be deployed there: the cluster's Serve already runs an app of its
    name (`serve deploy`ed, or another mnv3-ray-serve), which deploying would replace and leaving delete."""
    if APP_NAME not in serve.status().applications:
        return None
    return (
        f"the Ray cluster at {address} already runs an app named {APP_NAME}: update it with serve deploy, or "
        f"remove it first (serve delete {APP_NAME}); --host/--port apply only where Serve is not running yet"
    )


def main(args=None) -> int:
    """`args` from parse_args; the command line's without (the `mnv3-ray-serve` command calls it so)."""
    args = parse_args() if args is None else args
    config = cli.run_stage(server_config, args)
    if args.bench:
        cli.fill_unset(args, concurrency=cli.defaults(args).ray_bench_concurrency)
        cli.fill_unset(args, requests=BENCH_REQUESTS_PER_SENDER * args.concurrency)
        cli.run_stage(run_bench, args, writes=("results_dir",))
        return 0
    cli.run_stage(
        lambda args: serve_until_stopped(args, config),
        args,
        user_errors=(KeyFileError, ModelLoadError, server.CannotListen),
    )
    return 0


def serve_until_stopped(args, config: ServerConfig) -> None:
    try:
        serve_forever(args, config)
    except KeyboardInterrupt:  # Ctrl-C is how a served app is stopped: a success
        pass


if __name__ == "__main__":
    sys.exit(main())
