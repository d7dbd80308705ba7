"""The middleware Ray's proxy runs (mnv3.ray_serve.proxy_middlewares), on stand-in ASGI apps shaped like
Ray's proxy: its plain-text errors, a request whose replica died (no response at all), a retried request."""

import hashlib
import json

import pytest

# Ray's own function that wraps its proxy app in the callback's middlewares, so the order is Ray's.
http_util = pytest.importorskip(
    "ray.serve._private.http_util", reason="Ray Serve is optional: pip install -r requirements-ray.txt"
)

from starlette.middleware import Middleware  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from mnv3 import ray_serve  # noqa: E402
from mnv3.errors import RETRY_AFTER_S  # noqa: E402

pytestmark = pytest.mark.unit


class StandInProxy:
    """An ASGI app answering like Ray's proxy: `outcomes` in turn, one per call; each call reads the body."""

    def __init__(self, *outcomes):
        self.outcomes, self.bodies, self.routing_keys = list(outcomes), [], []

    async def __call__(self, scope, receive, send):
        self.routing_keys.append(dict(scope["headers"]).get(ray_serve.ROUTING_KEY_HEADER.encode()))
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.bodies.append(body)
        outcome = self.outcomes.pop(0)
        if outcome == "replica lost":  # Ray's proxy sends nothing when the replica died holding the request
            return
        status, content_type, text = outcome
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", content_type)]})
        await send({"type": "http.response.body", "body": text})


def client_for(proxy: StandInProxy, middlewares: list | None = None) -> TestClient:
    # Wrapped by Ray's own function, in Ray's order (the last middleware is outermost).
    app = http_util._apply_middlewares(proxy, ray_serve.proxy_middlewares() if middlewares is None else middlewares)
    return TestClient(app, raise_server_exceptions=False)


ANSWER = (200, b"application/json", b'{"predictions": []}')


def test_a_request_whose_replica_died_is_sent_once_more_with_its_body():
    proxy = StandInProxy("replica lost", ANSWER)
    response = client_for(proxy).post("/predict", content=b"image bytes", headers={"content-type": "image/jpeg"})
    assert response.status_code == 200 and response.json() == {"predictions": []}
    assert response.headers[ray_serve.RETRIED_HEADER] == "1"
    assert proxy.bodies == [b"image bytes", b"image bytes"]


def test_a_second_loss_is_a_json_502_not_a_plain_text_500():
    proxy = StandInProxy("replica lost", "replica lost")
    response = client_for(proxy).post("/predict", content=b"image bytes", headers={"content-type": "image/jpeg"})
    assert response.status_code == 502
    assert response.headers["content-type"] == "application/json"
    assert "lost" in response.json()["detail"]
    assert response.headers["retry-after"] == str(RETRY_AFTER_S)
    assert len(proxy.bodies) == 2  # one retry, no more


def test_answered_requests_are_not_retried_and_rays_plain_text_errors_become_json():
    proxy = StandInProxy((503, b"text/plain; charset=utf-8", b"Request dropped due to backpressure"), ANSWER)
    response = client_for(proxy).post("/predict", content=b"x", headers={"content-type": "image/jpeg"})
    assert response.status_code == 503
    assert response.json() == {"detail": "Request dropped due to backpressure"}
    assert ray_serve.RETRIED_HEADER not in response.headers and len(proxy.bodies) == 1
    ok = client_for(StandInProxy(ANSWER)).post("/predict", content=b"x", headers={"content-type": "image/jpeg"})
    assert ok.status_code == 200 and json.loads(ok.content) == {"predictions": []}


def test_a_body_over_the_upload_limit_is_not_kept_for_a_retry():
    proxy = StandInProxy("replica lost", ANSWER)
    client = client_for(
        proxy, [Middleware(ray_serve.RetryLostReplica, max_body_bytes=4), Middleware(ray_serve.JsonErrors)]
    )
    response = client.post("/predict", content=b"more than four", headers={"content-type": "image/jpeg"})
    assert response.status_code == 502 and len(proxy.bodies) == 1


def test_the_routing_key_is_the_images_hash_whatever_the_multipart_boundary():
    proxy = StandInProxy(ANSWER, ANSWER, ANSWER, ANSWER)
    client = client_for(proxy)
    for boundary in ("one-boundary", "another-boundary"):
        body = (
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.jpg"\r\n'
            f"Content-Type: image/jpeg\r\n\r\nimage bytes\r\n--{boundary}--\r\n"
        ).encode()
        client.post("/predict", content=body, headers={"content-type": f"multipart/form-data; boundary={boundary}"})
    client.post("/predict", content=b"image bytes", headers={"content-type": "image/jpeg"})
    client.post("/predict", content=b"other image", headers={"content-type": "image/jpeg"})
    multipart_a, multipart_b, raw, other = proxy.routing_keys
    assert multipart_a == multipart_b and multipart_a is not None
    assert raw == hashlib.sha256(b"image bytes").hexdigest().encode()  # the cache's own key for a raw body
    assert other != raw
    assert proxy.bodies[2:] == [b"image bytes", b"other image"]  # the body still reaches Ray's proxy whole
