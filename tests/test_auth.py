"""Access control (mnv3.auth) in front of a small app with the server's routes: who gets through where,
what refusals say, rate limits on an injected clock, bad key files, no key material anywhere, and over a
real socket that a refused 10 MiB upload is answered without being read."""

import asyncio
import hashlib
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest
import requests
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from starlette.websockets import WebSocket, WebSocketDisconnect

from conftest import WAIT_S, upload, uvicorn_in_thread, wait_until
from mnv3 import auth
from mnv3.auth import (
    ApiKeyAuth,
    KeyFileError,
    Scope,
    Taken,
    exposure_warning,
    is_loopback,
    load_key_file,
    parse_keys,
    required_scope,
)
from mnv3.photos import load_images

pytestmark = pytest.mark.integration

INFER_KEY = "infer-key-0123456789abcdef"
ADMIN_KEY = "admin-key-0123456789abcdef"  # given in the file as its sha256 only
LIMITED_KEY = "limited-key-0123456789abcdef"
METRICS_KEY = "metrics-key-0123456789abcdef"
KEYS = (INFER_KEY, ADMIN_KEY, LIMITED_KEY, METRICS_KEY)
KEY_FILE = f"""# keys for the tests
{INFER_KEY} infer name=client
{METRICS_KEY} metrics name=prometheus

sha256:{hashlib.sha256(ADMIN_KEY.encode()).hexdigest()} admin
{LIMITED_KEY} infer rate=30/min burst=2
"""

# (method, path, what it needs), for the server's routes as the other issues add them
ROUTES = [
    ("GET", "/healthz", Scope.OPEN),
    ("GET", "/readyz", Scope.OPEN),
    ("GET", "/v2/health/live", Scope.OPEN),
    ("GET", "/v2/health/ready", Scope.OPEN),
    ("GET", "/", Scope.OPEN),
    ("GET", "/static/page.js", Scope.OPEN),
    ("GET", "/docs", Scope.OPEN),
    ("GET", "/redoc", Scope.OPEN),
    ("GET", "/openapi.json", Scope.OPEN),
    ("POST", "/predict", Scope.INFER),
    ("POST", "/v2/models/fp32/infer", Scope.INFER),
    ("POST", "/v2/models/fp32/versions/1/infer", Scope.INFER),
    ("GET", "/stats", Scope.INFER),
    ("GET", "/models", Scope.INFER),
    ("GET", "/metrics", Scope.METRICS),
    ("GET", "/model", Scope.INFER),
    ("GET", "/v2", Scope.INFER),
    ("GET", "/v2/models/fp32", Scope.INFER),
    ("GET", "/v2/models/fp32/versions/1", Scope.INFER),
    ("GET", "/v2/models/fp32/ready", Scope.OPEN),  # KServe's health API, as Triton groups it
    ("GET", "/v2/models/fp32/versions/1/ready", Scope.OPEN),
    ("GET", "/v2/models/stats", Scope.INFER),  # Triton's extensions not offered: the 404 says so
    ("GET", "/v2/models/fp32/stats", Scope.INFER),
    ("POST", "/v2/repository/index", Scope.INFER),
    ("POST", "/v2/systemsharedmemory/region/r/register", Scope.INFER),
    ("GET", "/v2/models/fp32/config", Scope.INFER),
    ("GET", "/debug/unlisted", Scope.ADMIN),  # nobody listed it: default-deny
]


def stand_in_app() -> FastAPI:
    """The server's routes, each answering 200 with what it read of the body."""
    app = FastAPI()

    async def answer(request: Request):
        return {"body_bytes": len(await request.body())}

    for method, path, _ in ROUTES:
        if path not in ("/docs", "/redoc", "/openapi.json"):  # FastAPI's own
            app.add_api_route(path, answer, methods=[method])

    @app.websocket("/ws")
    async def ws(websocket: WebSocket):
        await websocket.accept()
        await websocket.send_text("hello")

    return app


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class ReceiveCounter:
    """Outermost ASGI wrapper: counts the body bytes anything inside it took from the connection."""

    def __init__(self, app):
        self.app, self.calls, self.body_bytes = app, 0, 0

    async def __call__(self, scope, receive, send):
        async def counted():
            message = await receive()
            if message["type"] == "http.request":
                self.calls += 1
                self.body_bytes += len(message.get("body", b""))
            return message

        await self.app(scope, counted, send)


def protected_app(clock=None) -> FastAPI:
    app = stand_in_app()
    app.add_middleware(ApiKeyAuth, keys=parse_keys(KEY_FILE, clock=clock or Clock()))
    return app


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def client(clock):
    with TestClient(protected_app(clock)) as client:
        yield client


def bearer(key):
    return {"Authorization": f"Bearer {key}"}


def call(client, method, path, headers=None):
    return client.request(method, path, headers=headers, content=b"x" * 100 if method == "POST" else None)


@pytest.mark.parametrize("method, path, needed", ROUTES, ids=[f"{m} {p}" for m, p, _ in ROUTES])
def test_each_path_needs_its_scope(client, method, path, needed):
    anonymous = call(client, method, path)
    if needed is Scope.OPEN:
        assert anonymous.status_code == 200
        return
    assert anonymous.status_code == 401
    assert anonymous.headers["www-authenticate"].startswith("Bearer")
    assert "Authorization: Bearer KEY" in reason(anonymous)

    # infer and metrics apart, admin everything
    for key, scope in ((INFER_KEY, Scope.INFER), (METRICS_KEY, Scope.METRICS), (ADMIN_KEY, Scope.ADMIN)):
        answer = call(client, method, path, bearer(key))
        if needed is scope or scope is Scope.ADMIN:
            assert answer.status_code == 200, (key, answer.text)
            if method == "POST":
                assert answer.json() == {"body_bytes": 100}  # let through, body and all
        else:
            assert answer.status_code == 403 and f"scope {needed.value}" in reason(answer)
            assert f'error="insufficient_scope", scope="{needed.value}"' in answer.headers["www-authenticate"]


@pytest.mark.parametrize(
    "method, path, instead",
    [
        ("GET", "/predict", "POST /predict"),  # a wrong method on an infer path
        ("POST", "/predict/", "POST /predict"),  # a trailing slash
        ("POST", "/models", "GET /models"),
        ("GET", "/metrics", None),  # the metrics scope's own: nothing else was meant
    ],
)
def test_an_infer_key_refused_a_near_miss_is_told_what_it_may_make(client, method, path, instead):
    # Default-deny answers GET /predict with "needs admin", which sent users off changing keys.
    refused = call(client, method, path, bearer(INFER_KEY))
    assert refused.status_code == 403 and "it needs a key of scope " in reason(refused)
    if instead:
        assert reason(refused).endswith(f"; this key may make {instead}")
    else:
        assert "this key may make" not in reason(refused)


def reason(response) -> str:
    body = response.json()
    assert len(body) == 1
    return body.get("error") or body["detail"]


def test_refusals_on_v2_paths_use_the_protocols_error_shape(client):
    assert set(client.post("/v2/models/fp32/infer").json()) == {"error"}
    assert set(client.get("/v2/models/fp32/infer", headers=bearer(INFER_KEY)).json()) == {"error"}  # GET: admin
    assert set(client.get("/v2", headers=bearer("not-a-key-0123456789")).json()) == {"error"}
    assert set(client.post("/predict").json()) == {"detail"}


def test_behind_a_root_path_the_rules_apply_to_the_path_the_app_routes_on(clock):
    # Under --root-path /mnv3 the scope's path starts with the root path (uvicorn prepends it, as the test client
    # does when given one): judged on that path, probes would get a 401 and infer keys a 403.
    with TestClient(protected_app(clock), root_path="/mnv3") as client:
        assert client.get("/mnv3/healthz").status_code == 200
        assert client.get("/mnv3").status_code == 200  # the page's shell, /
        assert client.post("/mnv3/predict", headers=bearer(INFER_KEY), content=b"x").json() == {"body_bytes": 1}
        assert client.get("/mnv3/v2/models/fp32/config", headers=bearer(INFER_KEY)).status_code == 200
        refused = client.get("/mnv3/predict", headers=bearer(INFER_KEY))
        assert refused.status_code == 403 and reason(refused).endswith("; this key may make POST /predict")
        assert set(client.post("/mnv3/v2/models/fp32/infer").json()) == {"error"}  # the protocol's error shape
        # not under the root path: a sibling of the same length, and one the root path is a prefix of
        for path in ("/mnv4/healthz", "/mnv3x/healthz"):
            assert client.get(path).status_code == 401, path


def test_bearer_and_x_api_key_both_work_and_the_sha256_line_accepts_its_key(client):
    for headers in (bearer(ADMIN_KEY), {"X-API-Key": ADMIN_KEY}, {"authorization": f"bearer  {ADMIN_KEY} "}):
        assert client.get("/metrics", headers=headers).status_code == 200, headers
    # the digest itself is not a key
    digest = hashlib.sha256(ADMIN_KEY.encode()).hexdigest()
    assert client.get("/metrics", headers=bearer(f"sha256:{digest}")).status_code == 401


def test_a_key_is_matched_on_its_whole_digest():
    # A wrong key whose sha256 shares a prefix with a stored key's would be accepted.
    digest = hashlib.sha256(INFER_KEY.encode()).hexdigest()
    near = digest[:-1] + ("0" if digest[-1] != "0" else "1")  # all but the last hex digit
    assert parse_keys(f"sha256:{near} infer\n").match(INFER_KEY) is None
    keys = parse_keys(KEY_FILE)
    assert not any(keys.match(f"random-{index}-0123456789abcdef") for index in range(1000))


def test_matching_a_key_compares_every_stored_digest(monkeypatch):
    # Stopping at the matching key would let the time to answer tell how far down the file a key is.
    compared, compare = [], auth.hmac.compare_digest

    def counting(a, b):
        compared.append(1)
        return compare(a, b)

    keys = parse_keys(KEY_FILE)
    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    for presented, name in ((INFER_KEY, "client"), ("wrong-key-0123456789abcdef", None)):  # the first line's key
        compared.clear()
        assert getattr(keys.match(presented), "name", None) == name
        assert len(compared) == len(keys.keys) == 4


@pytest.mark.parametrize(
    "headers, why",
    [
        (bearer("wrong-key-0123456789abcdef"), "not valid"),
        (bearer(INFER_KEY[:-1]), "not valid"),
        ({"Authorization": f"Basic {INFER_KEY}"}, "must be 'Bearer KEY'"),
        ({"Authorization": "Bearer "}, "must be 'Bearer KEY'"),
        ({"Authorization": f"Bearer {INFER_KEY}", "X-API-Key": ADMIN_KEY}, "two different keys"),
    ],
)
def test_a_wrong_key_is_a_401_with_its_reason(client, headers, why):
    response = client.post("/predict", headers=headers, content=b"x")
    assert response.status_code == 401 and why in reason(response)
    assert response.headers["www-authenticate"].startswith("Bearer")
    assert "connection" not in response.headers  # a body of announced small length: uvicorn drops it


@pytest.mark.parametrize(
    # the names clients give keys, and any name at all for a value that is a key of the file ("model" too)
    "query",
    ["api_key", "key", "token", "access_token", "API_KEY", "auth", "Authorization", "bearer", "apiToken", "model"],
)
def test_a_key_in_the_query_string_is_refused_even_a_valid_one(client, query):
    for path in ("/predict", "/healthz"):
        response = (
            client.post(path, params={query: INFER_KEY}, headers=bearer(INFER_KEY), content=b"x")
            if path == "/predict"
            else client.get(path, params={query: INFER_KEY})
        )
        assert response.status_code == 400 and "send it as the header" in reason(response)
    assert client.post("/predict", params={"model": "fp32"}, headers=bearer(INFER_KEY)).status_code == 200


# A key may hold these; and need not hold a word such as "key", which a parameter's name is matched against.
ODD_KEYS = ("base64-key-ending-in-padding+/==", "key;with;semicolons0123456789", "Zq8vN3xTb1Lw0pRm5sYc2")


@pytest.mark.parametrize(
    ("query", "logged"),
    [
        ("{key}", "REDACTED"),
        ("{key}=1", "REDACTED"),
        ("x={key};y=1", "REDACTED"),
        ("a=1;b=2&{key}&c=3", "a=1;b=2&REDACTED&c=3"),  # the rest as sent, separators and all
        ("m={quoted}", "REDACTED"),  # percent-encoded
        ("a=1&" * 100 + "model={key}", "a=1&" * 100 + "REDACTED"),  # however many come before
        ("{padded}", "REDACTED"),  # ends in '=': the whole parameter is the key
        ("v={padded}", "REDACTED"),  # a raw '+' in it, as sent
        ("v={mixed}", "REDACTED"),  # a raw '+' and the rest percent-encoded: '+' is no space in a key
        ("model={plain}", "REDACTED"),  # long enough to be a key, under a name no key is given
        ("{plain}", "REDACTED"),
        ("{semicolons}", "REDACTED"),
        ("API_KEY=x&model=fp32", "API_KEY=REDACTED&model=fp32"),  # a name clients give keys
        ("model=fp32&x=1;token=abc", "model=fp32&REDACTED"),
        ("api_key=REDACTED", "api_key=REDACTED"),  # refused though nothing changes in the text
    ],
)
def test_a_key_anywhere_in_the_query_string_is_refused_and_blanked(query, logged):
    written = query.format(
        key=INFER_KEY,
        quoted=INFER_KEY.replace("-", "%2D"),
        padded=ODD_KEYS[0],
        mixed=ODD_KEYS[0].replace("/", "%2F").replace("=", "%3D"),
        semicolons=ODD_KEYS[1],
        plain=ODD_KEYS[2],
    )
    keys = parse_keys(KEY_FILE + "".join(f"{key} infer\n" for key in ODD_KEYS))
    scope = {"type": "http", "method": "GET", "path": "/stats", "query_string": written.encode(), "headers": []}
    refusal = ApiKeyAuth(None, keys).decide(scope).refusal
    assert refusal is not None and (refusal.status, refusal.label) == (400, "key_in_url")
    assert scope["query_string"] == logged.encode()


def test_parameters_too_short_to_be_keys_cost_no_hash(monkeypatch):
    # The scan runs before authentication, for anyone: a URL of thousands of short parameters hashes none
    keys, hashed = parse_keys(KEY_FILE), []
    monkeypatch.setattr(auth.hashlib, "sha256", lambda data: hashed.append(data) or hashlib.new("sha256", data))
    scope = {"query_string": b"&".join([b"a=" + b"x" * 12] * 4000)}
    assert not auth._blank_query_keys(scope, keys) and hashed == []
    assert scope["query_string"] == b"&".join([b"a=" + b"x" * 12] * 4000)


def test_rate_limit_hit_then_recovered(client, clock):
    limited = bearer(LIMITED_KEY)  # 30/min = one token every 2 s, burst 2
    assert [client.post("/predict", headers=limited).status_code for _ in range(2)] == [200, 200]
    refused = client.post("/predict", headers=limited)
    assert refused.status_code == 429 and refused.headers["retry-after"] == "2"
    assert "rate limit of 30/min, burst 2" in reason(refused)  # the rate as the key file has it
    assert client.post("/predict", headers=bearer(INFER_KEY)).status_code == 200  # other keys are not limited

    clock.now += 1.5  # 0.75 of a token: the wait, 0.5 s, rounds up to 1
    assert client.post("/predict", headers=limited).headers["retry-after"] == "1"
    clock.now += 0.5
    assert client.post("/predict", headers=limited).status_code == 200
    assert client.post("/predict", headers=limited).status_code == 429
    clock.now += 60  # refills to the burst, no further
    assert [client.post("/predict", headers=limited).status_code for _ in range(3)] == [200, 200, 429]


def test_a_rate_limited_key_is_told_its_budget(client, clock):
    # The IETF draft's fields: the rate as q requests each w seconds (30/min: 1 each 2 s), what the key may
    # make at once now and when its whole burst (2) is back, on answers and on the 429 alike.
    limited = bearer(LIMITED_KEY)
    first = client.post("/predict", headers=limited)
    assert first.headers["ratelimit-policy"] == '"key";q=1;w=2' and first.headers["ratelimit"] == '"key";r=1;t=2'
    assert client.post("/predict", headers=limited).headers["ratelimit"] == '"key";r=0;t=4'
    refused = client.post("/predict", headers=limited)
    assert refused.status_code == 429 and refused.headers["ratelimit"] == '"key";r=0;t=4'
    clock.now += 3  # 1.5 tokens back; the request takes one
    assert client.post("/predict", headers=limited).headers["ratelimit"] == '"key";r=0;t=3'
    assert "ratelimit" not in client.get("/metrics", headers=limited).headers  # a 403 spends nothing
    assert "ratelimit" not in client.post("/predict", headers=bearer(INFER_KEY)).headers  # a key without a rate
    assert "ratelimit" not in client.get("/healthz").headers
    for rate, policy in (("1.5/s", "q=3;w=2"), ("50/min", "q=5;w=6"), ("10/s", "q=10;w=1")):  # exact, never rounded
        key_line = f"{INFER_KEY} infer rate={rate} burst=1\n"
        (key,) = parse_keys(key_line).keys
        assert key.limit.headers(Taken(0, 1, 0))[0] == (b"ratelimit-policy", f'"key";{policy}'.encode())


def test_a_key_with_in_flight_holds_at_most_that_many_requests_at_once():
    # One key's slow or stalled uploads held every --max-in-flight slot and starved every other key.
    held = threading.Event()
    app = FastAPI()

    @app.post("/predict")
    async def predict():
        await asyncio.to_thread(held.wait, WAIT_S)  # an upload still arriving, or a long inference
        return {}

    bounded, other = "bounded-key-0123456789abcdef", "other-key-0123456789abcdef"
    keys, refusals = parse_keys(f"{bounded} infer rate=100/s in_flight=2 name=bounded\n{other} infer\n"), []
    app.add_middleware(ApiKeyAuth, keys=keys, on_refusal=refusals.append)
    with uvicorn_in_thread(app, log_config=None) as port, ThreadPoolExecutor(4) as pool:
        url = f"http://127.0.0.1:{port}/predict"
        post = partial(requests.post, url, timeout=WAIT_S)
        holding = [pool.submit(post, headers=bearer(bounded)) for _ in range(2)]
        wait_until(lambda: keys.in_flight[hashlib.sha256(bounded.encode()).digest()] == 2, "two requests in flight")
        third = post(headers=bearer(bounded))
        assert third.status_code == 429 and third.headers["retry-after"] == "1"
        assert "already has 2 requests in flight" in third.json()["detail"]
        assert third.headers["ratelimit-policy"] == '"key";q=100;w=1' and refusals == ["key_in_flight"]
        others = pool.submit(post, headers=bearer(other))  # another key is not held back
        held.set()
        assert [r.result().status_code for r in (*holding, others)] == [200, 200, 200]
        assert post(headers=bearer(bounded)).status_code == 200  # answered: its slots are free again
    assert keys.in_flight[hashlib.sha256(bounded.encode()).digest()] == 0


def test_refused_requests_do_not_spend_tokens(client, clock):
    limited = bearer(LIMITED_KEY)
    for _ in range(5):
        assert client.get("/metrics", headers=limited).status_code == 403
    assert [client.post("/predict", headers=limited).status_code for _ in range(3)] == [200, 200, 429]


def test_refusals_for_requests_in_flight_do_not_spend_tokens(clock):
    # Each 429 key_in_flight would spend a token of the key's rate, so a client retrying it would be rate-limited.
    keys = parse_keys(f"{LIMITED_KEY} infer rate=30/min burst=2 in_flight=1\n", clock=clock)
    middleware, (key,) = ApiKeyAuth(None, keys), keys.keys

    def decide():
        headers = [(b"x-api-key", LIMITED_KEY.encode())]
        scope = {"type": "http", "method": "POST", "path": "/predict", "headers": headers}
        refusal = middleware.decide(scope).refusal
        return refusal and refusal.label

    keys.in_flight[key.digest] = 1  # one request under way, its bound
    assert [decide() for _ in range(3)] == ["key_in_flight"] * 3
    keys.in_flight[key.digest] = 0
    assert [decide() for _ in range(3)] == [None, None, "rate_limited"]  # the whole burst, unspent


def test_a_path_cannot_write_a_log_line_of_its_own(client, caplog):
    caplog.set_level(logging.INFO)
    forged = "/model%0d%0a2026-12-05 07:00:00,000 INFO mnv3.auth: key ops granted admin"
    assert client.get(forged, headers=bearer(INFER_KEY)).status_code == 403
    (refusal,) = [record.getMessage() for record in caplog.records if record.name == "mnv3.auth"]
    assert "\n" not in refusal and "\r" not in refusal and "/model%0D%0A2026-12-05%2007" in refusal


def test_no_key_material_in_bodies_or_logs(client, clock, caplog):
    caplog.set_level(logging.DEBUG)
    digest = hashlib.sha256(ADMIN_KEY.encode())
    responses = [
        client.post("/predict", headers=bearer(INFER_KEY + "x")),
        client.get("/metrics", headers=bearer(INFER_KEY)),
        client.get("/metrics", headers={"X-API-Key": LIMITED_KEY}),
        client.get("/stats", params={"api_key": ADMIN_KEY}),
        client.get("/v2", headers=bearer(digest.hexdigest())),
        *[client.post("/predict", headers=bearer(LIMITED_KEY)) for _ in range(3)],
    ]
    assert [r.status_code for r in responses] == [401, 403, 403, 400, 401, 200, 200, 429]
    assert any(record.name == "mnv3.auth" for record in caplog.records)  # refusals are logged, by key name
    assert "key client" in caplog.text
    secrets = [*KEYS, digest.hexdigest(), hashlib.sha256(INFER_KEY.encode()).hexdigest()]
    # the test client's own log (httpx2) prints the URL with the key in it: which is why such URLs are refused
    server_log = [record.getMessage() for record in caplog.records if record.name != "httpx2"]
    for text in [*(r.text for r in responses), *(str(r.headers) for r in responses), *server_log]:
        assert not any(secret in text for secret in secrets)


def test_websockets_are_refused(client):
    with pytest.raises(WebSocketDisconnect), client.websocket_connect("/ws", headers=bearer(ADMIN_KEY)) as ws:
        ws.receive_text()


@pytest.mark.parametrize(
    "path",
    [
        "/static/../metrics",
        "/static/./x/../../model",
        "//metrics",
        "/docs/../model",
        "/v2/health/live/..",
        "/static/..",  # each of these four would be open, but for its dot or empty segment
        "/static/.",
        "/docs/..",
        "/static//x",
        "/predict/",
        "/PREDICT",
    ],
)
def test_odd_spellings_of_a_path_need_admin(path):
    assert required_scope("GET", path) is Scope.ADMIN
    assert required_scope("POST", path) is Scope.ADMIN


def test_open_paths_are_open_to_reads_only():
    assert required_scope("GET", "/healthz") is Scope.OPEN and required_scope("HEAD", "/") is Scope.OPEN
    assert required_scope("POST", "/healthz") is Scope.ADMIN and required_scope("DELETE", "/static/a.js") is Scope.ADMIN
    assert required_scope("GET", "/predict") is Scope.ADMIN  # only POST /predict is inference


@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", "/healthzx"),
        ("GET", "/healthz/x"),
        ("GET", "/static"),
        ("GET", "/staticx"),
        ("GET", "/docsx"),
        ("GET", "/openapi.jsonx"),
        ("GET", "/v2/models/a/b/ready"),
        ("GET", "/v2/models/a/b"),
        ("GET", "/models/x"),
        ("GET", "/statsx"),
        ("GET", "/metricsx"),
        ("POST", "/predictx"),
        ("PUT", "/predict"),
        ("POST", "/v2/models/a/b/infer"),
        ("DELETE", "/v2/repository/index"),
        ("POST", "/metrics"),
    ],
)
def test_paths_next_to_listed_ones_need_admin(method, path):
    # A rule matching more than its own paths (a prefix, a segment too many, another method) would open or
    # grant infer or metrics on paths nobody listed, where default-deny asks for admin.
    assert required_scope(method, path) is Scope.ADMIN


@pytest.mark.parametrize(
    "text, line, fix",
    [
        ("", None, "no keys: add a line KEY SCOPE"),
        ("# only a comment\n\n", None, "no keys"),
        (f"{INFER_KEY}\n", 1, "a key needs a scope"),
        (f"\n{INFER_KEY} write\n", 2, "unknown scope 'write': use one of infer, metrics, admin"),
        (f"{INFER_KEY} infer\n{ADMIN_KEY} admin\n{INFER_KEY} admin\n", 3, "the same key as line 1"),
        (
            f"sha256:{hashlib.sha256(INFER_KEY.encode()).hexdigest().upper()} admin\n{INFER_KEY} infer\n",
            2,
            "the same key as line 1",
        ),
        ("sha256:abc infer\n", 1, "64 hex digits"),
        (f"sha256:{'g' * 64} infer\n", 1, "64 hex digits"),
        ("short-key infer\n", 1, "16 to 512 characters, this one has 9"),
        (f"{INFER_KEY}\u00e9 infer\n", 1, "visible ASCII"),
        (f"{INFER_KEY} infer rate=50\n", 1, "rate=N/s or rate=N/min"),
        (f"{INFER_KEY} infer rate=0/s\n", 1, "N > 0"),
        (f"{INFER_KEY} infer rate=5/h\n", 1, "rate=N/s or rate=N/min"),
        (f"{INFER_KEY} infer burst=10\n", 1, "burst= without rate="),
        (f"{INFER_KEY} infer rate=5/s burst=0\n", 1, "at least 1"),
        (f"{INFER_KEY} infer rate=5/s rate=6/s\n", 1, "given twice"),
        (f"{INFER_KEY} infer limit=5\n", 1, "unknown option 'limit=5'"),
        (f"{INFER_KEY} infer in_flight=0\n", 1, "in_flight=0 is not a whole number of 1 to 9 digits, at least 1"),
        (f"{INFER_KEY} infer rate=5/s burst=\u00b2\n", 1, "is not a whole number"),  # a digit to str.isdigit
        (f"{INFER_KEY} infer rate=0.3333333333/s\n", 1, "up to 6 digits, and 6 decimals"),
        (f"{INFER_KEY} infer in_flight=many\n", 1, "e.g. in_flight=64"),
        (f"{INFER_KEY} infer name=a/b\n", 1, "name= takes"),
    ],
)
def test_a_bad_key_file_is_one_line_naming_the_line_and_the_fix(tmp_path, text, line, fix):
    path = tmp_path / "keys.txt"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(KeyFileError) as error:
        load_key_file(path)
    message = str(error.value)
    assert "\n" not in message and fix in message
    assert message.startswith(f"{path}:{line}: " if line else f"{path}: ")
    assert INFER_KEY not in message and ADMIN_KEY not in message


def test_an_unreadable_key_file_is_one_line(tmp_path):
    with pytest.raises(KeyFileError, match=r"^cannot read key file .*missing.*: No such file"):
        load_key_file(tmp_path / "missing")


def test_a_key_file_saved_with_a_byte_order_mark_loads(tmp_path):
    # as Notepad saves UTF-8; the mark was read as part of the first line ("only visible ASCII characters")
    path = tmp_path / "keys.txt"
    path.write_bytes(b"\xef\xbb\xbf# our keys\n" + f"{ADMIN_KEY} admin\n".encode())
    assert load_key_file(path).match(ADMIN_KEY).scope == Scope.ADMIN


def test_a_good_key_file_loads_with_its_options(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text(KEY_FILE + f"{'k' * 40} admin rate=120/min\n", encoding="utf-8")
    keys = load_key_file(path)
    assert [(k.name, k.scope, k.limit and (k.limit.rate_per_s, k.limit.burst)) for k in keys.keys] == [
        ("client", Scope.INFER, None),
        ("prometheus", Scope.METRICS, None),
        ("line 5", Scope.ADMIN, None),
        ("line 6", Scope.INFER, (0.5, 2)),
        ("line 7", Scope.ADMIN, (2.0, 2)),
    ]  # without burst=, one second's worth, at least 1
    assert keys.match(ADMIN_KEY).name == "line 5" and keys.match("k" * 39) is None
    assert not any(key in repr(keys) + repr(keys.keys) for key in KEYS)


def test_the_key_maker_prints_a_line_the_key_file_takes_with_its_options(capsys):
    auth.main(
        auth.get_args_parser().parse_args(["--scope", "admin", "--rate", "50/s", "--burst", "100", "--name", "ci"])
    )
    key_line, file_line = capsys.readouterr().out.splitlines()
    key, line = key_line.rpartition(" ")[2], file_line.removeprefix("line for the key file: ")
    assert line.endswith(" admin rate=50/s burst=100 name=ci") and key not in line
    assert len(key) >= 43  # 32 random bytes: a shorter key could be guessed
    keys = parse_keys(line)
    (made,) = keys.keys
    assert (made.name, made.scope, made.limit.rate_per_s, made.limit.burst) == ("ci", Scope.ADMIN, 50.0, 100)
    assert keys.match(key) is made  # the printed key is the one the line accepts


@pytest.mark.parametrize(
    "flags, problem",
    [
        (["--burst", "5"], "burst= without rate="),
        (["--rate", "fast"], "rate=fast is not a rate"),
        (["--name", "a b"], "without spaces"),
    ],
)
def test_the_key_maker_refuses_options_the_key_file_would(flags, problem, capsys):
    with pytest.raises(SystemExit) as exit_info:
        auth.main(auth.get_args_parser().parse_args(flags))
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and error.startswith("python -m mnv3.auth: error: ") and problem in error


@pytest.mark.parametrize(
    "host, loopback",
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("LOCALHOST", True),
        ("app.localhost", True),  # *.localhost resolves to loopback (RFC 6761)
        ("notlocalhost", False),  # a name merely ending in localhost could resolve anywhere
        ("::ffff:127.0.0.1", True),
        ("0.0.0.0", False),
        ("::", False),
        ("192.168.1.20", False),
        ("10.0.0.1", False),
        ("myhost.example", False),
        ("", False),
    ],
)
def test_is_loopback_and_the_warning_names_the_flag(host, loopback):
    assert is_loopback(host) is loopback
    warning = exposure_warning(host)
    assert (warning is None) is loopback
    if not loopback:
        assert "--api-keys FILE" in warning and f"binding to {host} " in warning and "\n" not in warning


# ------------------------------------------------------------------------------------ over a real socket


@pytest.fixture(params=["httptools", "h11"])
def live_server(request):
    """The protected stand-in app under uvicorn on 127.0.0.1 (with each of its HTTP parsers), inside a counter
    of the body bytes it took."""
    counter = ReceiveCounter(protected_app())
    # log_config=None: uvicorn's access log then reaches caplog
    with uvicorn_in_thread(counter, http=request.param, log_config=None, lifespan="off") as port:
        yield port, counter


def test_an_unauthenticated_10_mib_upload_is_refused_without_being_read(live_server):
    port, counter = live_server
    size = 10 * 1024 * 1024
    response, closed, rest_sent = upload(port, size, first=65536)
    assert response.startswith(b"HTTP/1.1 401") and b"www-authenticate: Bearer" in response
    assert not rest_sent and closed and b"connection: close" in response.lower()
    assert counter.calls == counter.body_bytes == 0  # nothing inside the server took a byte of the body

    # the same upload with a key is read, and answered once all of it is in: the counter does count
    response, closed, _ = upload(port, size, first=65536, headers=f"Authorization: Bearer {INFER_KEY}\r\n")
    assert response.startswith(b"HTTP/1.1 200") and f'{{"body_bytes":{size}}}'.encode() in response
    assert counter.body_bytes == size and not closed  # kept alive for the next request


def test_a_refused_photo_upload_keeps_its_connection_without_being_read(live_server):
    # Closing with the body still on its way would reset the connection under a client still sending it,
    # which then reports the reset instead of the 401 (aiohttp did, now and then, for a 50 KB photo).
    port, counter = live_server
    photo = load_images(1, seed=5)[0]
    half = len(photo) // 2
    request = f"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\nContent-Length: {len(photo)}\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        sock.sendall(f"{request}\r\n".encode() + photo[:half])
        response = sock.recv(65536)  # before the rest of the body is sent: refused at arrival
        assert response.startswith(b"HTTP/1.1 401") and b"connection: close" not in response.lower()
        sock.sendall(photo[half:] + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = sock.recv(65536)
    # the next request, read as one (the test app answers every open path with the body bytes it took)
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b'{"body_bytes":0}'), answer
    assert counter.body_bytes == 0  # uvicorn dropped the photo: nothing inside took a byte of it
    # a body of unknown length, or one the client waits to be invited to send, closes the connection
    for headers in ("Transfer-Encoding: chunked\r\n", f"Content-Length: {len(photo)}\r\nExpect: 100-continue\r\n"):
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
            sock.sendall(f"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\n{headers}\r\n".encode())
            response = sock.recv(65536)
        assert response.startswith(b"HTTP/1.1 401") and b"connection: close" in response.lower(), headers


def test_a_refused_request_without_a_body_keeps_its_connection(live_server):
    # A poller of /metrics with a wrong key was made to reconnect for every refusal.
    port, _ = live_server
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        for _ in range(2):
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            response = sock.recv(65536)
            assert response.startswith(b"HTTP/1.1 401") and b"connection: close" not in response.lower(), response


def test_a_key_in_the_url_does_not_reach_the_access_log(live_server, caplog):
    port, _ = live_server
    caplog.set_level(logging.INFO, logger="uvicorn.access")
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        sock.sendall(f"GET /stats?model=fp32&api_key={INFER_KEY} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert sock.recv(65536).startswith(b"HTTP/1.1 400")
    give_up = time.monotonic() + WAIT_S
    while "/stats" not in caplog.text:
        assert time.monotonic() < give_up, "no access log record"
        time.sleep(0.01)
    assert "/stats?model=fp32&api_key=REDACTED" in caplog.text and INFER_KEY not in caplog.text


def test_keys_read_again_keep_the_buckets_of_unchanged_rates_and_the_counts_of_requests_under_way():
    """SIGHUP's reload (mnv3.server): a kept key's bucket is not refilled by it, a changed rate gets a new one, and a
    request under way stays counted (its end is counted down on the keys as they are then)."""
    clock = Clock()
    first = f"{LIMITED_KEY} infer rate=1/min burst=1 in_flight=2\n{INFER_KEY} infer rate=1/min burst=1\n"
    keys = parse_keys(first, clock=clock)
    limited, other = (keys.match(key) for key in (LIMITED_KEY, INFER_KEY))
    assert keys.take(limited).wait_s == 0 and keys.take(other).wait_s == 0  # each bucket spent
    keys.in_flight[limited.digest] += 1  # a request under way
    keys.replace_with(parse_keys(f"{LIMITED_KEY} infer rate=1/min burst=1 in_flight=2\n{INFER_KEY} infer rate=2/min\n"))
    assert keys.take(keys.match(LIMITED_KEY)).wait_s > 0  # the same rate: still spent, no fresh burst
    assert keys.take(keys.match(INFER_KEY)).wait_s == 0  # another rate: a new bucket
    assert keys.in_flight[limited.digest] == 1
    keys.replace_with(parse_keys(f"{INFER_KEY} infer\n"))  # the limited key revoked while its request runs
    assert keys.match(LIMITED_KEY) is None and keys.in_flight[limited.digest] == 1
    keys.in_flight[limited.digest] -= 1  # its end, counted down without a KeyError


def test_a_key_added_by_reading_the_keys_again_is_spotted_in_the_url():
    # A key the reload added, sent as a query value under any name, would reach the access log.
    new_key = "new-key-0123456789abcdef"
    keys = parse_keys(KEY_FILE)
    keys.replace_with(parse_keys(KEY_FILE + f"{new_key} infer\n"))
    query = f"model=fp32&model={new_key}".encode()
    scope = {"type": "http", "method": "GET", "path": "/stats", "query_string": query, "headers": []}
    refusal = ApiKeyAuth(None, keys).decide(scope).refusal
    assert refusal is not None and (refusal.status, refusal.label) == (400, "key_in_url")
    assert scope["query_string"] == b"model=fp32&REDACTED"


def test_keys_read_again_keep_a_bucket_whose_rate_is_only_written_otherwise_and_count_what_a_new_bound_covers():
    clock = Clock()
    keys = parse_keys(f"{LIMITED_KEY} infer rate=60/min burst=1\n{INFER_KEY} infer\n", clock=clock)
    limited, unbounded = keys.match(LIMITED_KEY), keys.match(INFER_KEY)
    assert keys.take(limited).wait_s == 0  # its burst spent
    keys.in_flight[unbounded.digest] += 2  # two requests under way, of a key with no bound yet
    keys.replace_with(parse_keys(f"{LIMITED_KEY} infer rate=1/s burst=1\n{INFER_KEY} infer in_flight=2\n"))
    assert keys.take(keys.match(LIMITED_KEY)).wait_s > 0  # the same rate, spelt otherwise: no fresh burst
    assert keys.in_flight[unbounded.digest] == 2  # its new bound already reached
