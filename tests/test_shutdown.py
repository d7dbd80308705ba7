"""SIGTERM: stop accepting, answer every request already accepted, exit 0."""

import json
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from conftest import WAIT_S, metric, post, wait_until
from mnv3.loadtest import ServerProcess
from mnv3.photos import load_images
from mnv3.server import FORCED_STOP

pytestmark = pytest.mark.integration

REQUESTS = 48


def in_flight(url: str) -> float:
    return metric(url, "mnv3_in_flight ")


def accepts(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=WAIT_S).close()
    except ConnectionRefusedError:
        return False
    return True


def test_sigterm_answers_every_accepted_request_then_exits_0(fp32_model_path):
    images = load_images(REQUESTS, seed=7)
    # One core for decoding and one for inference, no batching: the requests take a while to get through.
    server = ServerProcess(fp32_model_path, cache_size=0, max_batch_size=1, intra_op_threads=1, preprocess_threads=1)
    with server as url, ThreadPoolExecutor(REQUESTS) as pool:

        def timed(body):
            response = post(url, body)
            return response.status_code, time.monotonic()

        futures = [pool.submit(timed, body) for body in images]
        # Answered ones counted first: if all the rest are in flight after that, none is still unsent.
        wait_until(lambda: sum(f.done() for f in futures) + in_flight(url) == REQUESTS, "every request to be accepted")
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)

        def refused() -> bool:  # in the moment before the listener closes, a new request is still answered
            try:
                requests.get(url + "/healthz", timeout=WAIT_S)
            except requests.ConnectionError:
                return True
            return False

        wait_until(refused, "new connections to be refused")

        outcomes = [future.result() for future in futures]
        assert server.process.wait(WAIT_S) == 0
    assert [status for status, _ in outcomes] == [200] * REQUESTS
    answered_after = sum(done > signalled for _, done in outcomes)
    assert answered_after > 0, "the signal came too late to test the drain"


@pytest.mark.parametrize(
    "path, shape, drain_s",
    [("/predict", "detail", 1), ("/v2/models/fp32/infer", "error", 1), ("/predict", "detail", 0)],
)
def test_a_request_still_running_when_the_drain_runs_out_answers_503(fp32_model_path, path, shape, drain_s):
    """uvicorn cancels what is left after --shutdown-timeout-s: that is a 503 with a reason in the path's shape,
    not uvicorn's plain-text 500 and an 'Exception in ASGI application' traceback. With no drain at all, after
    one SIGTERM, the reason is still the drain's, not a second Ctrl-C's."""
    server = ServerProcess(fp32_model_path, shutdown_timeout_s=drain_s, body_timeout_s=WAIT_S)
    with server as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as stalled:
            head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\nContent-Length: 1000\r\n\r\n"
            stalled.sendall(head.encode() + b"\xff\xd8" * 50)  # a tenth of the body, then nothing
            wait_until(lambda: in_flight(url) == 1, "the upload to be admitted")
            server.process.send_signal(signal.SIGTERM)
            stalled.settimeout(WAIT_S)
            answer = b"".join(iter(lambda: stalled.recv(65536), b""))  # until the server closes
        assert server.process.wait(WAIT_S) == 0
        log = server.output_tail()
    status_line, _, rest = answer.decode().partition("\r\n")
    headers, _, body = rest.partition("\r\n\r\n")
    assert status_line == "HTTP/1.1 503 Service Unavailable"
    assert "retry-after: 1" in headers.lower().splitlines()
    assert json.loads(body) == {shape: "the server stopped before this request finished (--shutdown-timeout-s)"}
    assert "Exception in ASGI application" not in log


def test_a_second_ctrl_c_quits_at_once_without_a_traceback(fp32_model_path):
    """uvicorn's force quit skipped the app's shutdown, which asyncio.run then cancelled: Starlette logged a
    CancelledError traceback as a failed shutdown. A request still in flight is answered 503 either way."""
    server = ServerProcess(fp32_model_path, body_timeout_s=WAIT_S, shutdown_timeout_s=WAIT_S)
    with server as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as stalled:
            head = "POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\nContent-Length: 1000\r\n\r\n"
            stalled.sendall(head.encode() + b"\xff\xd8" * 50)  # a tenth of the body, then nothing
            wait_until(lambda: in_flight(url) == 1, "the upload to be admitted")
            server.process.send_signal(signal.SIGINT)  # waits for the upload, up to --shutdown-timeout-s
            wait_until(lambda: not accepts(host, int(port)), "the first Ctrl-C to close the port")
            server.process.send_signal(signal.SIGINT)
            stalled.settimeout(WAIT_S)
            answer = b"".join(iter(lambda: stalled.recv(65536), b""))
        assert server.process.wait(WAIT_S) == 0
        log = server.output_tail()
    assert answer.startswith(b"HTTP/1.1 503 ")
    assert json.loads(answer.partition(b"\r\n\r\n")[2]) == {"detail": FORCED_STOP}  # not the drain's timeout
    assert "Traceback" not in log and "ERROR" not in log, log


HUNG_WARM_UP = """
import sys, threading
from mnv3.engine import Engine
Engine.warm_up = lambda engine, batch_sizes: threading.Event().wait()  # a runtime that never returns
from mnv3.server import main
main(sys.argv[1:])
"""


def test_sigterm_stops_a_server_whose_warm_up_never_returns(fp32_model_path):
    # The warm-up ran in asyncio's default executor, which the event loop's close joins: the process said
    # "Finished server process" and lived on, through a second SIGTERM too.
    server = subprocess.Popen(
        [sys.executable, "-c", HUNG_WARM_UP, "--model", str(fp32_model_path), "--port", "0"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in server.stderr:
            if "Application startup complete" in line:  # the warm-up has begun and hangs
                break
        server.send_signal(signal.SIGTERM)
        assert server.wait(WAIT_S) == 0
    finally:
        server.kill()
        server.communicate()
