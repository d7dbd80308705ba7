"""SIGTERM to `python -m mnv3.ray_serve`: every request its proxy took in is answered, new ones are refused.

Its own local Ray cluster (the process's), so it is a module of its own: no other cluster is up meanwhile.
"""

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from conftest import WAIT_S, post, wait_until
from mnv3.loadtest import ServerProcess
from mnv3.photos import load_images

pytest.importorskip("ray.serve", reason="Ray Serve is optional: pip install -r requirements-ray.txt")
from mnv3.ray_drain import CUT_OFF, REFUSED  # noqa: E402

pytestmark = pytest.mark.e2e

REQUESTS = 400  # far more than one replica on one CPU answers in the drain, with batches of one
SHUTDOWN_TIMEOUT_S = 1


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

        late = []  # the first new request refused

        def refused():
            late.append(post(url, images[0]))
            return late[-1].status_code == 503

        wait_until(refused, "a new request to be refused")
        outcomes = [future.result() for future in futures]
        assert server.process.wait(WAIT_S) == 0
    assert late[-1].json() == {"detail": REFUSED} and late[-1].headers["retry-after"] == "1"
    # Some of the requests may reach the proxy only after the signal: those are refused, not lost either.
    kinds = {(status, detail) for status, detail, _ in outcomes}
    assert kinds <= {(200, ""), (503, CUT_OFF), (503, REFUSED)}, kinds
    drained = sum(status == 200 and done > signalled for status, _, done in outcomes)
    cut_off = sum(detail == CUT_OFF for _, detail, _ in outcomes)
    assert drained > 0, "no request was answered during the drain"
    assert cut_off > 0, f"the drain answered everything within {SHUTDOWN_TIMEOUT_S} s: nothing was cut off"
