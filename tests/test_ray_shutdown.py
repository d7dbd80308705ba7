"""SIGTERM to `python -m mnv3.ray_serve`: every request its proxy took in is answered, new ones are refused.

Its own local Ray cluster (the process's), so it is a module of its own: no other cluster is up meanwhile.
The drain's parts without a cluster are tests/test_ray_drain.py.
"""

import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from conftest import WAIT_S, post, wait_until
from mnv3.config import ServerConfig
from mnv3.loadtest import ServerProcess
from mnv3.photos import load_images
from mnv3.server import create_app
from test_auth_server import ROUTE_SCOPES, app_routes

pytest.importorskip("ray.serve", reason="Ray Serve is optional: pip install -r requirements-ray.txt")
from mnv3.ray_drain import CUT_OFF, REFUSED, is_mnv3_path  # noqa: E402

pytestmark = pytest.mark.e2e

REQUESTS = 400  # more than one replica on one CPU answers in the drain, with batches of one
SHUTDOWN_TIMEOUT_S = 1


def test_the_drain_covers_every_path_of_the_app_and_no_other():
    assert set(app_routes(create_app(ServerConfig(model="unused.onnx")))) == set(ROUTE_SCOPES)
    for _, template in ROUTE_SCOPES:
        assert is_mnv3_path(template.replace("{", "").replace("}", "")), template
    assert not is_mnv3_path("/other-app/predict") and not is_mnv3_path("/-/healthz")


def test_sigterm_answers_what_the_proxy_took_in_refuses_new_requests_and_exits_0(fp32_model_path):
    images = load_images(REQUESTS, seed=7)
    server = ServerProcess(
        fp32_model_path,
        module="mnv3.ray_serve",
        replicas=1,
        num_cpus=1,
        max_batch_size=1,
        cache_size=0,
        shutdown_timeout_s=SHUTDOWN_TIMEOUT_S,
    )
    with server as url, ThreadPoolExecutor(REQUESTS) as pool:
        host, port = url.removeprefix("http://").split(":")
        # An upload that stalls halfway: still in flight when the drain runs out, whatever the CPU's speed.
        stalled = socket.create_connection((host, int(port)))
        head = "POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\nContent-Length: 100000\r\n\r\n"
        stalled.sendall(head.encode() + images[0][:1000])

        def timed(body):
            try:
                response = post(url, body)
            except requests.ConnectionError:  # what Ray's own shutdown gives every request in flight
                return "no answer", "", time.monotonic()
            return response.status_code, response.json().get("detail", ""), time.monotonic()

        futures = [pool.submit(timed, body) for body in images]
        wait_until(lambda: any(future.done() for future in futures), "a first answer")
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)

        def refused() -> bool:  # a request the proxy took in before it learnt of the drain is answered instead
            status, detail, _ = timed(images[0])
            return status == 503 and detail == REFUSED

        wait_until(refused, "a new request to be refused")
        outcomes = [future.result() for future in futures]
        stalled.settimeout(WAIT_S)
        stalled_answer = b"".join(iter(lambda: stalled.recv(65536), b"")).decode()  # until the proxy closes
        stalled.close()
        assert server.process.wait(WAIT_S) == 0
    # Some of the requests may reach the proxy only after the signal: those are refused, not lost either.
    kinds = {(status, detail) for status, detail, _ in outcomes}
    assert kinds <= {(200, ""), (503, CUT_OFF), (503, REFUSED)}, kinds
    assert any(status == 200 and done > signalled for status, _, done in outcomes), "none answered in the drain"
    assert stalled_answer.startswith("HTTP/1.1 503") and CUT_OFF in stalled_answer
