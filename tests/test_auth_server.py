"""Access control wired into the server: every route of the real app has a deliberate scope; a
`python -m mnv3.server --api-keys FILE` refuses before reading a body; Triton's client and the load-test
client send their keys; a bad key file is a one-line CLI error; binding to 0.0.0.0 without keys warns."""

import hashlib
import re
import signal

import numpy as np
import pytest
import requests
import tritonclient.http as triton
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from conftest import WAIT_S, serving_client, upload, wait_until
from mnv3 import server
from mnv3.auth import KeyFileError, Scope, new_key_line, required_scope
from mnv3.config import ServerConfig
from mnv3.errors import ACCESS_REFUSALS
from mnv3.loadtest import API_KEY_ENV, KeyRefused, PredictClient, ServerProcess, read_metrics, server_settings
from mnv3.photos import load_images
from mnv3.server import create_app

pytestmark = pytest.mark.integration

INFER_KEY = "infer-key-for-the-server-tests-0123"
ADMIN_KEY = "admin-key-for-the-server-tests-4567"  # in the file as its sha256 only

# Every route of the app, as (method, path template) -> the scope it needs; mounts as (None, prefix).
# A route that is not here fails test_every_route_has_a_deliberate_scope: adding an endpoint means
# deciding who may call it (and, if that is not admin, adding it to mnv3.auth.RULES).
ROUTE_SCOPES = {
    ("GET", "/healthz"): Scope.OPEN,
    ("GET", "/readyz"): Scope.OPEN,
    ("GET", "/v2/health/live"): Scope.OPEN,
    ("GET", "/v2/health/ready"): Scope.OPEN,
    ("GET", "/"): Scope.OPEN,
    (None, "/static"): Scope.OPEN,
    ("GET", "/docs"): Scope.OPEN,
    (None, "/docs"): Scope.OPEN,
    ("GET", "/redoc"): Scope.OPEN,
    (None, "/redoc"): Scope.OPEN,
    ("GET", "/openapi.json"): Scope.OPEN,
    ("HEAD", "/openapi.json"): Scope.OPEN,
    ("POST", "/predict"): Scope.INFER,
    ("POST", "/v2/models/{name}/infer"): Scope.INFER,
    ("POST", "/v2/models/{name}/versions/{version}/infer"): Scope.INFER,
    ("GET", "/stats"): Scope.INFER,
    ("GET", "/models"): Scope.INFER,
    ("GET", "/model"): Scope.INFER,
    ("GET", "/metrics"): Scope.METRICS,
    ("GET", "/v2"): Scope.INFER,
    ("GET", "/v2/models/{name}"): Scope.INFER,
    ("GET", "/v2/models/{name}/ready"): Scope.OPEN,
    ("GET", "/v2/models/{name}/config"): Scope.INFER,
    ("GET", "/v2/models/{name}/versions/{version}"): Scope.INFER,
    ("GET", "/v2/models/{name}/versions/{version}/ready"): Scope.OPEN,
    ("GET", "/v2/models/{name}/versions/{version}/config"): Scope.INFER,
}


def app_routes(app):
    """(method or None for a mount, path) of every route the app serves, through included routers."""
    for route in app.routes:
        # FastAPI >= 0.165 keeps an included router as one entry; its effective routes carry the full paths.
        for context in route.effective_route_contexts() if hasattr(route, "effective_route_contexts") else [route]:
            original = getattr(context, "original_route", context)
            methods = getattr(original, "methods", None)
            for method in sorted(methods) if methods else [None]:
                yield method, context.path or original.path  # a mount's context has no path of its own


def test_every_route_has_a_deliberate_scope():
    app = create_app(ServerConfig(model="unused.onnx"))  # the model loads only when the app starts
    routes = set(app_routes(app))
    assert routes == set(ROUTE_SCOPES), "a route was added or removed: decide its scope in ROUTE_SCOPES"
    for (method, template), scope in ROUTE_SCOPES.items():
        path = re.sub(r"\{[^}]+\}", "fp32", template)
        if method is None:  # a mount: what it serves is files under it, fetched with GET
            method, path = "GET", f"{path}/some-asset.js"
        assert required_scope(method, path) is scope, f"{method} {path}"


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "api_keys"
    path.write_text(f"{INFER_KEY} infer name=client\nsha256:{hashlib.sha256(ADMIN_KEY.encode()).hexdigest()} admin\n")
    return path


@pytest.fixture(scope="module")
def protected(fp32_model_path, key_file):
    process = ServerProcess(fp32_model_path, api_keys=key_file, max_batch_size=4, cache_size=0)
    with process as url:
        yield process, url


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_an_unauthenticated_10_mib_upload_to_the_real_server_is_refused_unread(protected):
    process, url = protected
    port = int(url.rpartition(":")[2])
    response, closed, rest_sent = upload(port, 10 * 1024 * 1024, first=65536)
    assert response.startswith(b"HTTP/1.1 401") and b"www-authenticate: bearer" in response.lower()
    assert b'"detail"' in response  # the server's own error shape off /v2
    # Answered with 10 MiB - 64 KiB never sent, and the connection closed rather than left to be drained.
    assert not rest_sent and closed
    photo = load_images(1, seed=3)[0]
    keyed = requests.post(
        url + "/predict", files={"file": ("a.jpg", photo, "image/jpeg")}, headers=bearer(INFER_KEY), timeout=WAIT_S
    )
    assert keyed.status_code == 200 and len(keyed.json()["predictions"]) == 5
    assert "binding to" not in process.output_tail()  # on 127.0.0.1: no exposure warning


def test_tritonclient_passes_the_key_in_headers(protected):
    _, url = protected
    client = triton.InferenceServerClient(
        url.removeprefix("http://"), connection_timeout=WAIT_S, network_timeout=WAIT_S
    )
    try:
        assert client.is_server_live()  # a probe: open
        # a model's readiness too, as Triton groups it: the client read the 401 as "not ready", for ever
        assert client.is_model_ready("fp32") and not client.is_model_ready("nope")
        unknown = requests.get(f"{url}/v2/models/nope/ready", timeout=WAIT_S)  # no key: the models are not listed
        assert (unknown.status_code, unknown.json()) == (404, {"error": "unknown model 'nope'"})
        listed = requests.get(f"{url}/v2/models/nope", headers=bearer(INFER_KEY), timeout=WAIT_S)
        assert listed.json() == {"error": "unknown model 'nope'; this server serves fp32"}  # as /models would
        image = triton.InferInput("IMAGE", [1], "BYTES")
        image.set_data_from_numpy(np.array(load_images(1, seed=4), dtype=object))
        with pytest.raises(InferenceServerException) as refused:
            client.infer("fp32", [image])
        assert refused.value.status() == "401" and "API key" in refused.value.message()
        result = client.infer("fp32", [image], headers=bearer(INFER_KEY))
        assert result.as_numpy("PROBABILITIES").shape[0] == 1
        # what a client reads before it infers (perf_analyzer: the model's config) needs no admin key
        assert client.get_model_metadata("fp32", headers=bearer(INFER_KEY))["name"] == "fp32"
        assert client.get_model_config("fp32", headers=bearer(INFER_KEY))["name"] == "fp32"
        with pytest.raises(InferenceServerException) as forbidden:
            client.get_model_metadata("fp32")
        assert forbidden.value.status() == "401"
        # an extension not offered: the 404 saying so, not a 403 asking for an admin key that gets the same 404
        for call in (client.get_inference_statistics, client.get_model_repository_index):
            with pytest.raises(InferenceServerException) as unoffered:
                call(headers=bearer(INFER_KEY))
            assert unoffered.value.status() == "404" and "does not offer" in unoffered.value.message(), call
        with pytest.raises(InferenceServerException) as per_model:
            client.get_inference_statistics("fp32", headers=bearer(INFER_KEY))
        assert per_model.value.status() == "404"
    finally:
        client.close()


def test_the_load_test_client_sends_the_key_from_the_environment(protected, monkeypatch):
    _, url = protected
    photo = load_images(1, seed=5)[0]
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with PredictClient(url) as send:
        assert send.request(photo) == ("401", None)
    monkeypatch.setenv(API_KEY_ENV, INFER_KEY)
    with PredictClient(url) as send:
        status, body = send.request(photo)
    assert status == "200" and len(body["predictions"]) == 5
    with pytest.raises(KeyRefused, match=f"answered 403 .*so {API_KEY_ENV} must hold a key of the admin scope"):
        read_metrics(url)  # a stage reads /metrics too: it says which key to set
    assert server_settings(url, api_key=ADMIN_KEY)["server_max_batch_size"] == 4
    assert read_metrics(url, api_key=ADMIN_KEY)[("mnv3_request_latency_seconds_count", "")] >= 1


def test_a_bad_key_file_is_one_line_and_exit_2_before_binding(fp32_model_path, tmp_path, capsys, monkeypatch):
    bad = tmp_path / "api_keys"
    bad.write_text("# a key too short to be one\ntoo-short infer\n")
    with pytest.raises(KeyFileError, match=f"^{re.escape(str(bad))}:2: a key must have 16"):
        create_app(ServerConfig(model=fp32_model_path, api_keys=str(bad)))
    monkeypatch.setattr(server, "load_engines", lambda config: pytest.fail("models loaded before the key file"))
    with pytest.raises(SystemExit) as exit_info:
        server.main(["--model", str(fp32_model_path), "--api-keys", str(bad), "--port", "0"])  # never bound
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith(f"python -m mnv3.server: error: {bad}:2: ") and "python -m mnv3.auth" in error
    assert error.count("\n") == 1 and "too-short" not in error  # nothing of the key itself


def test_sighup_reads_the_key_file_again_and_a_bad_one_leaves_the_keys_as_they_were(fp32_model_path, tmp_path):
    """Revoking a leaked key meant a restart (SIGHUP killed the server at once, mid-request)."""
    old_key, new_key = new_key_line()[0], new_key_line()[0]
    keys = tmp_path / "api_keys"
    keys.write_text(f"{old_key} infer\n")
    process = ServerProcess(fp32_model_path, api_keys=keys, log_level="info")
    with process as url:

        def status(key: str) -> int:
            return requests.get(url + "/models", headers=bearer(key), timeout=WAIT_S).status_code

        assert (status(old_key), status(new_key)) == (200, 401)
        keys.write_text(f"{new_key} infer\n")  # the old key revoked, a new one given
        process.process.send_signal(signal.SIGHUP)
        wait_until(lambda: status(new_key) == 200, "the new key to be accepted")
        assert status(old_key) == 401
        keys.write_text("too-short infer\n")  # a mistake in the file: the server keeps its keys
        process.process.send_signal(signal.SIGHUP)
        wait_until(lambda: "SIGHUP: the keys stay as they were (1)" in process.output_tail(), "the refusal logged")
        assert (status(old_key), status(new_key)) == (401, 200)
        assert process.process.poll() is None
        assert "SIGHUP: 1 keys read again from" in process.output_tail()


def test_binding_to_every_interface_without_keys_warns_naming_the_flag(fp32_model_path):
    # Bound to 0.0.0.0, but ServerProcess sends its readiness polls to 127.0.0.1 only.
    process = ServerProcess(fp32_model_path, host="0.0.0.0", max_batch_size=1)
    with process as url:
        assert requests.get(url + "/healthz", timeout=WAIT_S).status_code == 200  # a warning, not an error
        output = process.output_tail()
    line = next(line for line in output.splitlines() if "binding to 0.0.0.0 without --api-keys" in line)
    assert line.count("WARNING") == 1 and "--api-keys FILE" in line  # logged as a warning, said once


def test_access_refusals_are_counted_by_reason(protected):
    """The middleware answers them in front of the app, and /metrics and /stats (the page's "Refused" line)
    count them as every other refusal; they said "No request refused" after a run of 429s."""
    _, url = protected

    def refused(reason: str) -> float:
        text = requests.get(url + "/metrics", headers=bearer(ADMIN_KEY), timeout=WAIT_S).text
        return next(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "mnv3_rejections_total" and sample.labels == {"reason": reason}
        )

    before = {reason: refused(reason) for reason in ACCESS_REFUSALS}
    assert requests.get(url + "/model", timeout=WAIT_S).status_code == 401
    assert requests.get(url + "/model", headers=bearer("not-a-key-of-this-server"), timeout=WAIT_S).status_code == 401
    assert requests.get(url + "/metrics", headers=bearer(INFER_KEY), timeout=WAIT_S).status_code == 403
    assert requests.get(url + "/model?api_key=x", headers=bearer(ADMIN_KEY), timeout=WAIT_S).status_code == 400
    after = {reason: refused(reason) for reason in ACCESS_REFUSALS}
    assert {reason: after[reason] - before[reason] for reason in after} == {
        "key_in_url": 1,
        "no_valid_key": 2,
        "out_of_scope": 1,
        "rate_limited": 0,
        "key_in_flight": 0,
    }
    stats = requests.get(url + "/stats", headers=bearer(ADMIN_KEY), timeout=WAIT_S).json()
    assert stats["rejected"]["no_valid_key"] >= 2


PAGE = "https://app.example.com"


def preflight(client, origin: str = PAGE, path: str = "/predict", headers: str = "authorization"):
    return client.options(
        path,
        headers={"Origin": origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": headers},
    )


def test_a_listed_origins_page_may_call_a_protected_server_and_no_other(fp32_model_path, key_file):
    # A browser app on another origin needs the preflight answered, with no key (browsers send none with it),
    # and its answers marked as readable, or it cannot send the key or read the predictions.
    with serving_client(fp32_model_path, api_keys=str(key_file), cors_origins=f"{PAGE}, http://localhost:3000") as c:
        allowed = preflight(c)
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == PAGE
        assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
        photo = load_images(1, seed=6)[0]
        answer = c.post(
            "/predict", content=photo, headers={"Content-Type": "image/jpeg", "Origin": PAGE, **bearer(INFER_KEY)}
        )
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == PAGE
        exposed = answer.headers["access-control-expose-headers"].lower().split(", ")
        assert {"retry-after", "ratelimit", "ratelimit-policy"} <= set(exposed)  # a page may pace itself
        refused = c.post("/predict", content=photo, headers={"Content-Type": "image/jpeg", "Origin": PAGE})
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == PAGE  # readable
        # /v2's binary tensors (tritonclient's header giving the JSON's length) and compressed requests
        binary = preflight(c, path="/v2/models/fp32/infer", headers="inference-header-content-length,content-encoding")
        assert binary.status_code == 200, binary.text
        assert "inference-header-content-length" in exposed
        traced = preflight(c, headers="traceparent,tracestate,x-request-id")  # OpenTelemetry's browser SDK adds them
        assert traced.status_code == 200, traced.text
        other = preflight(c, "https://elsewhere.example.com")
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    with serving_client(fp32_model_path) as c:  # the default: no page but the server's own
        assert "access-control-allow-origin" not in preflight(c).headers


@pytest.mark.parametrize("origins", ["app.example.com", "https://app.example.com/page", "ftp://x"])
def test_an_origin_that_is_not_one_is_refused_at_start_up(origins):
    with pytest.raises(ValueError, match="is not an origin: write scheme://host"):
        ServerConfig(model="a.onnx", cors_origins=origins)


def test_the_api_description_says_which_operations_need_a_key(key_file):
    # Swagger UI's Authorize button, and generated clients, need the schemes; each operation says its scope.
    document = create_app(ServerConfig(model="unused.onnx", api_keys=str(key_file))).openapi()
    assert set(document["components"]["securitySchemes"]) == {"bearer", "x_api_key"}
    paths = document["paths"]
    assert paths["/predict"]["post"]["security"] == [{"bearer": []}, {"x_api_key": []}]
    assert paths["/predict"]["post"]["description"].endswith("Needs an API key of scope infer (or admin).")
    assert paths["/metrics"]["get"]["description"].endswith("Needs an API key of scope metrics (or admin).")
    assert "security" not in paths["/healthz"]["get"]
    assert {"401", "403", "429"} <= set(paths["/v2/models/{name}/infer"]["post"]["responses"])
    unprotected = create_app(ServerConfig(model="unused.onnx")).openapi()
    assert "securitySchemes" not in unprotected.get("components", {})
