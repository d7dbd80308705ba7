"""The server's HTTP protocol bounds a request head's size and the time it takes to arrive (mnv3.connections);
HEAD is answered as GET without a body. A real uvicorn with the protocol `python -m mnv3.server` runs."""

import logging
import socket
import time
from contextlib import contextmanager

import pytest
import requests
from fastapi import FastAPI, Request

from conftest import WAIT_S, uvicorn_in_thread
from mnv3 import connections
from mnv3.loadtest import ServerProcess
from mnv3.server import HeadAsGet

pytestmark = pytest.mark.integration


@contextmanager
def bounded_server(monkeypatch, head_timeout_s: float = 5.0):
    """An app behind the connection bounds; a head must arrive within `head_timeout_s` (the 408 test's short
    one only: a large head sent to a server in this process, which shares its GIL, may take a while)."""
    monkeypatch.setattr(connections, "HEAD_TIMEOUT_S", head_timeout_s)
    app = FastAPI()
    app.add_middleware(HeadAsGet)

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.post("/echo")
    @app.post("/v2/models/echo/infer")
    async def echo(request: Request):
        return {"bytes": len(await request.body())}

    with uvicorn_in_thread(app, log_level="error", http=connections.BoundedHeadProtocol) as port:
        yield port


def answer(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:  # closed with our unsent head still arriving
        pass
    return received


def test_a_head_over_the_limit_is_a_431_and_the_connection_closes(monkeypatch, caplog):
    with bounded_server(monkeypatch) as port, socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        client_port = sock.getsockname()[1]
        monkeypatch.setattr(connections.log, "handlers", [caplog.handler])  # uvicorn's logger does not propagate
        caplog.set_level(logging.WARNING, logger=connections.log.name)  # the server in this test logs errors only
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ")
        try:
            for _ in range(2 * connections.MAX_HEAD_BYTES // 65536):
                sock.sendall(b"a" * 65536)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before the client was done: what the bound is for
        response = answer(sock)
    assert response.startswith(b"HTTP/1.1 431 ") and b"connection: close" in response
    assert response.endswith(b'{"detail": "the request\'s headers are over 1048576 bytes"}')
    # in no access log line (no route was reached): its own line says whom it refused
    assert f"431 to 127.0.0.1:{client_port}: the request's headers are over" in caplog.text


def test_a_head_of_too_many_fields_is_a_431(monkeypatch):
    # 200,000 fields of 5 bytes fit the size bound and cost the event loop 90 ms, a Python call a field
    fields = b"".join(b"X-%d: y\r\n" % i for i in range(connections.MAX_HEADERS))  # with Host, one too many
    with bounded_server(monkeypatch) as port, socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + fields + b"\r\n")
        response = answer(sock)
    assert response.startswith(b"HTTP/1.1 431 ") and b"connection: close" in response
    assert response.endswith(b'{"detail": "the request has more than 100 header fields"}')
    with bounded_server(monkeypatch) as port, socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        sock.sendall(b"GET /v2/health/ready?x=1 HTTP/1.1\r\nHost: x\r\n" + fields + b"\r\n")  # the path is known
        assert answer(sock).endswith(b'{"error": "the request has more than 100 header fields"}')
    with bounded_server(monkeypatch) as port:  # exactly the bound: served
        headers = {f"X-{i}": "y" for i in range(connections.MAX_HEADERS - 5)}  # requests adds a few of its own
        assert requests.get(f"http://127.0.0.1:{port}/healthz", headers=headers, timeout=WAIT_S).status_code == 200


def test_pipelined_requests_past_the_bound_are_not_read(monkeypatch):
    # uvicorn parsed a whole read and queued every request in it: 250 KB of pipelined GETs grew it by 14 MB
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    with bounded_server(monkeypatch) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
            sock.sendall(request * 10)  # within the bound: every one answered, and the connection kept
            received = b""
            while received.count(b"HTTP/1.1 200 ") < 10:
                chunk = sock.recv(65536)
                assert chunk, f"closed after {received.count(b'HTTP/1.1 200 ')} answers"
                received += chunk
            sock.sendall(request)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
            try:
                sock.sendall(request * 1000)  # 34 KB: on loopback, a read or two of the server's
            except (BrokenPipeError, ConnectionResetError):
                pass
            received = answer(sock)
    # the one answered first, the queue behind it, then the connection closed: the rest were never parsed
    assert received.count(b"HTTP/1.1 200 ") == 1 + connections.MAX_PIPELINED
    assert received.count(b"HTTP/1.1") == 1 + connections.MAX_PIPELINED


def test_a_chunked_body_of_too_many_chunks_is_a_413(monkeypatch):
    # One-byte chunks cost the event loop a Python call a byte
    monkeypatch.setattr(connections, "MAX_BODY_CHUNKS", 100)
    head = b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    with bounded_server(monkeypatch) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
            sock.sendall(head + b"1\r\nx\r\n" * 99 + b"0\r\n\r\n")  # within the bound: served
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
            # a body of known length in many small reads is not chunks: served
            sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 300\r\n\r\n")
            for _ in range(150):
                sock.sendall(b"xx")
                time.sleep(0.001)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
            started = time.monotonic()
            sock.sendall(head + b"1\r\nx\r\n" * 200 + b"0\r\n\r\n")
            response = answer(sock)
    assert response.startswith(b"HTTP/1.1 413 ") and b"more than 100 chunks" in response
    assert response.count(b"HTTP/1.1") == 1 and time.monotonic() - started < WAIT_S / 2
    assert response.endswith(b'{"detail": "the request\'s chunked body came in more than 100 chunks"}')
    with bounded_server(monkeypatch) as port, socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        # under /v2, in the Open Inference Protocol's shape, which Triton's clients read
        sock.sendall(head.replace(b"/echo", b"/v2/models/echo/infer") + b"1\r\nx\r\n" * 200 + b"0\r\n\r\n")
        response = answer(sock)
    assert response.startswith(b"HTTP/1.1 413 ")
    assert response.endswith(b'{"error": "the request\'s chunked body came in more than 100 chunks"}')
    with bounded_server(monkeypatch) as port, socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        # answered before its body (an unknown path), then over the bound: closed, with no second answer
        sock.sendall(head.replace(b"/echo", b"/nowhere"))
        time.sleep(0.2)
        try:
            sock.sendall(b"1\r\nx\r\n" * 200 + b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        response = answer(sock)
    assert response.startswith(b"HTTP/1.1 404 ") and response.count(b"HTTP/1.1") == 1


def test_too_many_trailer_fields_are_a_prompt_431(monkeypatch):
    # The body had arrived, but the request never ended: it waited out the body timeout, a 408 after 30 s
    trailers = b"".join(b"X-%d: y\r\n" % i for i in range(connections.MAX_HEADERS + 1))
    head = b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    with bounded_server(monkeypatch) as port, socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        started = time.monotonic()
        sock.sendall(head + b"5\r\nhello\r\n0\r\n" + trailers + b"\r\n")
        response = answer(sock)
    assert response.startswith(b"HTTP/1.1 431 ") and time.monotonic() - started < WAIT_S / 2


def test_a_head_that_does_not_arrive_in_time_is_a_408_and_an_idle_connection_is_closed(monkeypatch):
    with bounded_server(monkeypatch, head_timeout_s=0.5) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as idle:  # opened, nothing sent
            start = time.monotonic()
            response = answer(idle)
        # closed without an answer to a request never made (a pooled client's next request could read it)
        assert response == b"" and time.monotonic() - start < WAIT_S / 2
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as trickled:
            trickled.sendall(b"GET /healthz HTTP/1.1\r\n")
            try:
                for i in range(20):  # a header line every 0.1 s: each resets no timer
                    time.sleep(0.1)
                    trickled.sendall(f"X-{i}: y\r\n".encode())
            except (BrokenPipeError, ConnectionResetError):
                pass
            response = answer(trickled)
        assert response.startswith(b"HTTP/1.1 408 "), response


def test_requests_within_the_bounds_are_served_and_keep_their_connection(monkeypatch):
    with bounded_server(monkeypatch) as port, socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        time.sleep(1)  # longer than the head timeout between requests: uvicorn's keep-alive applies there
        large = b"b" * (connections.MAX_HEAD_BYTES // 2)  # a large head, within the bound
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Mid: " + large + b"\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        head = requests.head(f"http://127.0.0.1:{port}/healthz", timeout=WAIT_S)
    # HEAD answers as GET does, with no body
    assert head.status_code == 200 and head.headers["content-length"] == "15" and head.content == b""


def test_a_url_longer_than_uvicorn_parses_is_a_414_not_a_bad_request(monkeypatch):
    # A head under MAX_HEAD_BYTES with a URL over 64 KiB was "not valid HTTP/1.1", as if the client were broken.
    query = b"q=" + b"a" * connections.MAX_URL_BYTES
    with bounded_server(monkeypatch) as port, socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        sock.sendall(b"GET /healthz?" + query + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        response = answer(sock)
    assert response.startswith(b"HTTP/1.1 414 ") and b"content-type: application/json" in response
    assert response.endswith(b'{"detail": "the URL is over 65535 bytes: send long data in the request\'s body"}')
    with bounded_server(monkeypatch) as port, socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        sock.sendall(b"GET /v2/models/m?" + query + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        assert answer(sock).endswith(b'{"error": "the URL is over 65535 bytes: send long data in the request\'s body"}')
    with bounded_server(monkeypatch) as port, socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        # on a kept-alive connection, after an answered request: refused as this head, not as the last one's body
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        sock.sendall(b"GET /healthz?" + query + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        assert answer(sock).startswith(b"HTTP/1.1 414 ")
    with bounded_server(monkeypatch) as port:  # just under: served
        assert requests.get(f"http://127.0.0.1:{port}/healthz?" + "q" * 60_000, timeout=WAIT_S).status_code == 200


def test_a_request_the_parser_refuses_is_a_json_400(monkeypatch):
    with bounded_server(monkeypatch) as port, socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        sock.sendall(b"POST /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab")
        response = answer(sock)
    assert response.startswith(b"HTTP/1.1 400 ") and b"content-type: application/json" in response
    assert response.endswith(b'{"detail": "Invalid HTTP request received: the request is not valid HTTP/1.1"}')


def test_the_rest_of_a_body_answered_before_it_arrived_cannot_be_trickled_for_good(monkeypatch):
    monkeypatch.setattr(connections, "UNREAD_BODY_TIMEOUT_S", 0.5)
    with bounded_server(monkeypatch) as port, socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        sock.sendall(b"POST /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\nab")
        assert sock.recv(65536).startswith(b"HTTP/1.1 405 ")  # answered before its body: the rest is dropped
        start = time.monotonic()
        try:
            for _ in range(40):  # a byte every 0.1 s: each resets uvicorn's keep-alive timer, not this one
                time.sleep(0.1)
                sock.sendall(b"x")
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert answer(sock) == b"" and time.monotonic() - start < 3


def test_keep_alive_s_sets_how_long_an_idle_connection_stays_open(fp32_model_path):
    # Behind a load balancer that keeps idle connections longer than the server, a request sent as the server
    # closes one gets its client a 502: --keep-alive-s lets an operator set it above the balancer's.
    with ServerProcess(fp32_model_path, keep_alive_s=0.5) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
            sent = time.monotonic()  # the idle time starts after the answer, so at least 0.5 s after this
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            response = b""
            while not response.endswith(b"}"):  # the head and the JSON body may come in two reads
                response += sock.recv(65536)
            assert response.startswith(b"HTTP/1.1 200")
            assert sock.recv(1) == b""  # closed by the server, idle
            assert 0.45 < time.monotonic() - sent < 4  # not uvicorn's 5 s
