"""SIGTERM: stop accepting, answer every request already accepted, exit 0."""

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from conftest import WAIT_S, post, wait_until
from mnv3.loadtest import ServerProcess
from mnv3.photos import load_images

pytestmark = pytest.mark.integration

REQUESTS = 48


def in_flight(url: str) -> float:
    text = requests.get(url + "/metrics", timeout=WAIT_S).text
    return float(next(line for line in text.splitlines() if line.startswith("mnv3_in_flight ")).split()[1])


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
