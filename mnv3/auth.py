"""Access control: API keys with scopes, per-key rate limits, decided before a request's body is read.

`load_key_file(path)` reads a key file (grammar below) into `Keys`; `ApiKeyAuth(app, keys=...)` is a pure
ASGI middleware that lets a request through only with a key of the scope its path needs:

- open (no key needed): the probes `/healthz`, `/readyz`, `/v2/health/live`, `/v2/health/ready` and a
  model's `/v2/models/{m}[/versions/{v}]/ready` (KServe's health API, as Triton groups it: it tells a
  caller whether a model of that name is served and ready, nothing more); the page's shell `/` and its
  assets under `/static/`, so a browser can load the page and then ask for a key; and the API description
  `/docs`, `/redoc`, `/openapi.json` with their assets. The API description holds no data (no model, no
  predictions, no counts), only what the open-source code already says.
- `infer`: `POST /predict`, `POST /v2/models/{m}[/versions/{v}]/infer`, and what a client reads to send them:
  `GET /stats`, `/models`, `/model`, `/v2`, and a model's `/v2` metadata and `config`; and the paths of
  Triton's extensions this server does not offer, whose 404 says so.
- `metrics`: `GET /metrics` only, for a Prometheus scraper: its key can neither classify nor read anything else.
- `admin` (includes `infer` and `metrics`): everything else, any path nobody listed (default-deny: a new
  route needs admin until it is listed here).

Guarantees:
- Refusals never call `receive`: the body of a refused upload is not read. A body announced at up to
  KEEP_CONNECTION_BYTES (a phone photo) keeps its connection: uvicorn drops it as it arrives, buffering
  nothing, and reads the next request, where closing under a client still sending would reset the
  connection and the client would report the reset instead of the 401 (mnv3.uploads.refusal_keeps_connection).
  Any other body gets the connection closed, so uvicorn stops reading the socket.
- A key may arrive as `Authorization: Bearer KEY` or `X-API-Key: KEY`, never in the query string: such a
  request is refused (URLs end up in access logs and browser history) and the value is blanked in the
  request's scope, so the server's own access log does not print it.
- Keys are kept only as sha256 digests (keys are random tokens, not passwords, so a plain hash is the
  right tool: nothing to slow down against a dictionary). A presented key is hashed and compared with
  `hmac.compare_digest` against every stored digest, with no early exit.
- No key, digest or fragment of either is ever put in a response, a log record or a metric; a key is
  named by its `name=` option or its line number.
- A key's `in_flight=N` bounds the requests it has in the server at once (429 past it, before the rate is
  checked), so one key's stalled uploads cannot hold every --max-in-flight slot.
- Rate limits are token buckets per key and per process (each worker or replica has its own buckets).
  Past a limit: 429 with Retry-After, before the body is read. Every answer to a rate-limited key that gets
  past its scope (not a 403), the 429s too, carries the draft RateLimit-Policy and RateLimit fields (what is
  left, when it is whole). The event loop runs one check at a time; the lock makes a bucket safe to share
  between threads as well.

Key file: one key a line, `KEY SCOPE [rate=N/s|N/min] [burst=N] [in_flight=N] [name=LABEL]`; blank lines and lines
starting with `#` are ignored. KEY is 16 to 512 visible ASCII characters, or `sha256:` and the 64 hex
digits of its digest (`printf %s KEY | sha256sum`), so the file need not hold the key itself.
"""

import argparse
import dataclasses
import enum
import hashlib
import hmac
import ipaddress
import json
import logging
import math
import re
import secrets
import sys
import threading
import time
from collections.abc import Callable
from fractions import Fraction
from functools import cached_property, partial
from pathlib import Path
from urllib.parse import quote, unquote_to_bytes

from starlette.requests import Request

from mnv3.errors import ACCESS_REFUSALS, body_for_path
from mnv3.uploads import refusal_keeps_connection
from mnv3.v2_protocol import UNOFFERED_EXTENSIONS

log = logging.getLogger(__name__)

DIGEST_PREFIX = "sha256:"
MIN_KEY_CHARS = 16  # secrets.token_urlsafe(32) gives 43; anything this short is guessable, not a key
MAX_KEY_CHARS = 512
KEY_HEADER = b"x-api-key"
# Query parameters that clients and other servers use for keys: a request carrying one is refused.
QUERY_KEY_NAMES = frozenset(
    {"api_key", "apikey", "api-key", "key", "token", "access_token", "x-api-key", "auth", "authorization", "bearer"}
    | {"api_token", "apitoken", "access_key", "accesskey"}
)
QUERY_KEY_NAMES_BYTES = frozenset(name.encode() for name in QUERY_KEY_NAMES)
# A parameter that may hold one of those names: looked at closer
QUERY_KEY_NAME = re.compile(b"|".join(re.escape(name) for name in sorted(QUERY_KEY_NAMES_BYTES)), re.IGNORECASE)
RATE_UNITS_S = {"s": 1.0, "min": 60.0}
PLAIN_KEY = re.compile(r"[\x21-\x7e]+")  # what an HTTP header value can carry without quoting or spaces
HEX_DIGEST = re.compile(r"[0-9a-fA-F]{64}")
# ASCII digits (\d takes any script's), few enough that q and w stay within a header's 15-digit integers
RATE = re.compile(r"([0-9]{1,6}(?:\.[0-9]{1,6})?)/(s|min)")
WHOLE_NUMBER = re.compile(r"[0-9]{1,9}")
NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
GRAMMAR = "KEY SCOPE [rate=N/s|N/min] [burst=N] [in_flight=N] [name=LABEL]"
# The largest body a refused request may announce and keep its connection (uvicorn drops it as it arrives): a
# phone photo fits; more from a client without a valid key is not worth receiving, and its connection closes.
KEEP_CONNECTION_BYTES = 4 * 1024 * 1024


class Scope(enum.Enum):
    """What a path needs, and what a key was given (any but OPEN)."""

    OPEN = "open"
    INFER = "infer"
    METRICS = "metrics"
    ADMIN = "admin"


# What a key of each scope may make: infer and metrics apart (a scraper's key classifies nothing), admin both.
GRANTS = {
    Scope.INFER: frozenset({Scope.OPEN, Scope.INFER}),
    Scope.METRICS: frozenset({Scope.OPEN, Scope.METRICS}),
    Scope.ADMIN: frozenset(Scope),
}
KEY_SCOPES = {scope.value: scope for scope in GRANTS}


def allows(held: Scope, needed: Scope) -> bool:
    """Whether a key of scope `held` may make a request that needs `needed`."""
    return needed in GRANTS[held]


def keys_allowed(needed: Scope) -> str:
    """The key scopes a request that needs `needed` takes, in words."""
    return needed.value if needed is Scope.ADMIN else f"{needed.value} (or admin)"


class KeyFileError(ValueError):
    """A key file that cannot be used; the message is one line naming the file, the line and the fix."""


# ------------------------------------------------------------------------------------------- the rules

GET = frozenset({"GET", "HEAD"})
# (methods, path pattern, scope), first match wins; no match means admin.
RULES = [
    (GET, re.compile(r"/(healthz|readyz)"), Scope.OPEN),
    # KServe's health API, as Triton groups it: a model's readiness too, which probes and tritonclient's
    # is_model_ready ask without a key (the client reads a 401 there as "not ready", for ever).
    (GET, re.compile(r"/v2/health/(live|ready)|/v2/models/[^/]+(/versions/[^/]+)?/ready"), Scope.OPEN),
    (GET, re.compile(r"/|/static/.+"), Scope.OPEN),
    (GET, re.compile(r"/(docs|redoc)(/.+)?|/openapi\.json"), Scope.OPEN),
    (frozenset({"POST"}), re.compile(r"/predict"), Scope.INFER),
    (frozenset({"POST"}), re.compile(r"/v2/models/[^/]+(/versions/[^/]+)?/infer"), Scope.INFER),
    # Triton's extensions this server does not offer: an infer key's client reaches the 404 saying so, not a
    # 403 asking for an admin key, which would get the same 404.
    (GET | {"POST"}, re.compile("|".join(pattern.pattern for pattern, _, _ in UNOFFERED_EXTENSIONS)), Scope.INFER),
    # What is served, as a client needs to know it to send requests (the page, Triton's clients and
    # perf_analyzer, which read a model's metadata and config first): what /models tells an infer key anyway.
    (GET, re.compile(r"/(stats|models?)"), Scope.INFER),
    (GET, re.compile(r"/v2|/v2/models/[^/]+(/versions/[^/]+)?(/config)?"), Scope.INFER),
    (GET, re.compile(r"/metrics"), Scope.METRICS),
]


def required_scope(method: str, path: str) -> Scope:
    """The scope a request needs. A path with `.`, `..` or empty segments needs admin whatever it looks
    like, so no spelling of a protected path can pass for an open one."""
    if any(segment in ("", ".", "..") for segment in path.split("/")[1:-1]) or path.endswith(("/.", "/..")):
        return Scope.ADMIN
    for methods, pattern, scope in RULES:
        if method in methods and pattern.fullmatch(path):
            return scope
    return Scope.ADMIN


def meant_instead(method: str, path: str, held: Scope) -> str | None:
    """For a request a key of scope `held` may not make: the request it may make that this one most likely
    meant (another method on the same path, or the path without a trailing slash), if there is one. Under
    default-deny `GET /predict` needs admin; an infer key's user is better told that /predict takes POST."""
    candidates = [(other, path) for other in ("POST", "GET") if other != method]
    if path != "/" and path.endswith("/"):
        candidates.insert(0, (method, path.rstrip("/")))
    for other, to in candidates:
        needed = required_scope(other, to)
        if needed is not Scope.OPEN and allows(held, needed):
            return f"{other} {to}"
    return None


# ----------------------------------------------------------------------------------------- rate limits


class TokenBucket:
    """`burst` tokens, refilled at `rate_per_s`; one request takes one token."""

    def __init__(self, rate_per_s: float, burst: int, clock: Callable[[], float]):
        self.rate_per_s, self.burst, self.clock = rate_per_s, burst, clock
        self.tokens, self.updated = float(burst), clock()
        self.lock = threading.Lock()

    def take(self) -> "Taken":
        """A token if there is one (else nothing is taken), and the bucket as it is then."""
        return self._refill(take=True)

    def peek(self) -> "Taken":
        """The bucket as it is now, nothing taken (`wait_s` as if a request came now)."""
        return self._refill(take=False)

    def _refill(self, take: bool) -> "Taken":
        with self.lock:
            now = self.clock()
            self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate_per_s)
            self.updated = now
            wait_s = 0.0
            if self.tokens < 1:
                wait_s = (1 - self.tokens) / self.rate_per_s
            elif take:
                self.tokens -= 1
            return Taken(wait_s, int(self.tokens), (self.burst - self.tokens) / self.rate_per_s)


@dataclasses.dataclass(frozen=True)
class Taken:
    wait_s: float  # 0 if a token was taken, else the seconds until one will be there
    remaining: int  # whole tokens left: requests the key may make at once now
    full_in_s: float  # seconds until the bucket holds its whole burst again


@dataclasses.dataclass(frozen=True)
class RateLimit:
    rate_per_s: float
    burst: int
    # as the key file writes it (30/min), for messages; not compared: 60/min and 1/s are the same limit
    rate: str = dataclasses.field(compare=False)

    def __str__(self):
        return f"{self.rate}, burst {self.burst}"

    @cached_property
    def policy(self) -> bytes:
        """The IETF draft's RateLimit-Policy field (draft-ietf-httpapi-ratelimit-headers): the key's rate as q
        requests each w seconds, exactly (30/min: q=1;w=2)."""
        number, unit = self.rate.split("/")
        rate = Fraction(number) / int(RATE_UNITS_S[unit])
        return f'"key";q={rate.numerator};w={rate.denominator}'.encode()

    def headers(self, taken: Taken) -> list[tuple[bytes, bytes]]:
        """The RateLimit-Policy field and the draft's RateLimit field: what the key may make at once now and in
        how many seconds its whole burst is back, so a client (the page's live panel) can pace itself instead
        of learning the limit from 429s."""
        return [
            (b"ratelimit-policy", self.policy),
            # t within a header's 15-digit integers, however slow the rate and large the burst
            (b"ratelimit", f'"key";r={taken.remaining};t={min(math.ceil(taken.full_in_s), 10**15 - 1)}'.encode()),
        ]


# ------------------------------------------------------------------------------------------------ keys


@dataclasses.dataclass(frozen=True)
class ApiKey:
    """One line of the key file. `digest` is sha256 of the key; `name` is what logs may call it."""

    digest: bytes = dataclasses.field(repr=False)
    scope: Scope
    name: str
    limit: RateLimit | None = None
    in_flight: int | None = None  # requests the key may have in the server at once (None: no bound of its own)


class Keys:
    """The keys a server accepts, and each key's rate-limit bucket (per process)."""

    def __init__(self, keys: list[ApiKey], clock: Callable[[], float] = time.monotonic):
        self.keys = keys
        self.buckets = {
            key.digest: TokenBucket(key.limit.rate_per_s, key.limit.burst, clock) for key in keys if key.limit
        }
        # Every key's, bounded or not: a reload that gives a key a bound then knows what it has under way.
        self.in_flight = {key.digest: 0 for key in keys}  # changed on the event loop only
        self.digests = frozenset(key.digest for key in keys)  # to spot a key where none belongs, not to admit one

    def __repr__(self):
        return f"Keys({len(self.keys)} keys)"

    def replace_with(self, new: "Keys") -> None:
        """On the event loop: accept `new`'s keys from now on (a key file read again). A key kept with the same
        rate keeps its bucket (however the rate is written: 60/min is 1/s), so a reload grants no fresh burst;
        requests in flight stay counted, those of a key that went included, until they end."""
        limits = {key.digest: key.limit for key in self.keys}
        self.buckets = {
            digest: self.buckets[digest] if limits.get(digest) == key.limit else new.buckets[digest]
            for key in new.keys
            if (digest := key.digest) in new.buckets
        }
        self.in_flight = new.in_flight | {digest: count for digest, count in self.in_flight.items() if count}
        self.keys, self.digests = new.keys, new.digests

    def match(self, presented: str) -> ApiKey | None:
        digest = hashlib.sha256(presented.encode()).digest()
        found = None
        for key in self.keys:  # every digest is compared, match or not: no early exit to time
            if hmac.compare_digest(digest, key.digest):
                found = key
        return found

    def take(self, key: ApiKey) -> Taken | None:
        """None for a key without a rate limit; else whether it may make a request now (and it is counted:
        `wait_s` 0) or in how long, and its bucket then."""
        bucket = self.buckets.get(key.digest)
        return bucket.take() if bucket else None

    def peek(self, key: ApiKey) -> Taken | None:
        """As `take`, counting nothing."""
        bucket = self.buckets.get(key.digest)
        return bucket.peek() if bucket else None


def parse_keys(text: str, source: str = "key file", clock: Callable[[], float] = time.monotonic) -> Keys:
    """Keys from the text of a key file; anything wrong is a KeyFileError naming `source`, the line and the fix."""
    keys: list[ApiKey] = []
    lines_of: dict[bytes, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        error = partial(_line_error, source, number)
        if len(words) < 2:
            raise error(f"a key needs a scope: write {GRAMMAR}, SCOPE one of {', '.join(KEY_SCOPES)}")
        written, scope_word, options = words[0], words[1], words[2:]
        digest = _digest(written, error)
        if scope_word not in KEY_SCOPES:
            raise error(
                f"unknown scope {scope_word!r}: use one of {', '.join(KEY_SCOPES)} (admin includes infer and metrics)"
            )
        if digest in lines_of:
            raise error(f"the same key as line {lines_of[digest]}: give each key one line")
        lines_of[digest] = number
        name, limit, in_flight = _options(options, error)
        keys.append(ApiKey(digest, KEY_SCOPES[scope_word], name or f"line {number}", limit, in_flight))
    if not keys:
        raise KeyFileError(f"{source}: no keys: add a line {GRAMMAR}; python -m mnv3.auth makes a key and its line")
    return Keys(keys, clock)


def load_key_file(path: str | Path) -> Keys:
    try:
        text = Path(path).read_text(encoding="utf-8-sig")  # Windows editors begin UTF-8 files with a BOM
    except (OSError, UnicodeDecodeError) as exc:
        raise KeyFileError(
            f"cannot read key file {path}: {getattr(exc, 'strerror', None) or exc}; "
            f"--api-keys takes a UTF-8 text file, one {GRAMMAR} a line"
        ) from None
    return parse_keys(text, str(path))


def _line_error(source: str, number: int, problem: str) -> KeyFileError:
    return KeyFileError(f"{source}:{number}: {problem}")


def _digest(written: str, error) -> bytes:
    if written.startswith(DIGEST_PREFIX):
        hex_digest = written[len(DIGEST_PREFIX) :]
        if not HEX_DIGEST.fullmatch(hex_digest):
            raise error(
                f"{DIGEST_PREFIX} must be followed by the 64 hex digits of the key's sha256 "
                f"(got {len(hex_digest)} characters or a non-hex one): printf %s KEY | sha256sum"
            )
        return bytes.fromhex(hex_digest)
    # The messages below say what is wrong with the key, never any of its characters.
    if not PLAIN_KEY.fullmatch(written):
        raise error("a key may hold only visible ASCII characters (it travels in an HTTP header)")
    if not MIN_KEY_CHARS <= len(written) <= MAX_KEY_CHARS:
        raise error(
            f"a key must have {MIN_KEY_CHARS} to {MAX_KEY_CHARS} characters, this one has {len(written)}: "
            "make one with python -m mnv3.auth"
        )
    return hashlib.sha256(written.encode()).digest()


def _options(options: list[str], error) -> tuple[str | None, RateLimit | None, int | None]:
    given = {}
    for option in options:
        option_name, sep, value = option.partition("=")
        if not sep or option_name not in ("rate", "burst", "in_flight", "name"):
            raise error(f"unknown option {option!r}: options are rate=N/s or N/min, burst=N, in_flight=N, name=LABEL")
        if option_name in given:
            raise error(f"{option_name}= given twice: give it once")
        given[option_name] = value
    rate, burst = None, None
    if "rate" in given:
        match = RATE.fullmatch(given["rate"])
        if not match or float(match[1]) <= 0:
            raise error(
                f"rate={given['rate']} is not a rate: write rate=N/s or rate=N/min with N > 0 (up to 6 digits, "
                "and 6 decimals), e.g. rate=50/s"
            )
        rate = float(match[1]) / RATE_UNITS_S[match[2]]
    if "burst" in given:
        if not WHOLE_NUMBER.fullmatch(given["burst"]) or int(given["burst"]) < 1:
            raise error(f"burst={given['burst']} is not a whole number of 1 to 9 digits, at least 1, e.g. burst=100")
        if rate is None:
            raise error("burst= without rate=: add rate=N/s (the burst is how many requests a key may make at once)")
        burst = int(given["burst"])
    if "in_flight" in given and (not WHOLE_NUMBER.fullmatch(given["in_flight"]) or int(given["in_flight"]) < 1):
        raise error(
            f"in_flight={given['in_flight']} is not a whole number of 1 to 9 digits, at least 1, e.g. in_flight=64"
        )
    if "name" in given and not NAME.fullmatch(given["name"]):
        raise error("name= takes 1 to 64 letters, digits, '.', '_' or '-', e.g. name=ci-bot")
    # Without burst=, a key may spend one second's worth of its rate at once (at least one request).
    limit = RateLimit(rate, burst or max(1, math.ceil(rate)), given["rate"]) if rate else None
    return given.get("name"), limit, int(given["in_flight"]) if "in_flight" in given else None


# ---------------------------------------------------------------------------------------------- middleware


@dataclasses.dataclass(frozen=True)
class Refusal:
    status: int
    reason: str  # for the client
    label: str  # mnv3_rejections_total's reason: one of mnv3.errors.ACCESS_REFUSALS
    headers: list = dataclasses.field(default_factory=list)

    def __post_init__(self):
        assert self.label in ACCESS_REFUSALS, self.label  # a new label would be a metric series nobody exports


@dataclasses.dataclass(frozen=True)
class Decision:
    refusal: Refusal | None  # None: let the request in
    limit_headers: list  # the RateLimit fields its answer carries, for a key with a rate
    key: ApiKey | None = None  # the key a request let in carries


class ApiKeyAuth:
    """ASGI middleware: a request reaches `app` only with a key of the scope its path needs (see the module).
    `on_refusal(label)` is called for each request it refuses, with its mnv3.errors.ACCESS_REFUSALS label (the
    server counts them by it)."""

    def __init__(self, app, keys: Keys, on_refusal: Callable[[str], None] | None = None):
        self.app, self.keys, self.on_refusal = app, keys, on_refusal

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self.app(scope, receive, send)
        if scope["type"] != "http":  # the server has no websocket routes: nothing else is let in
            return await send({"type": "websocket.close", "code": 1008})
        decision = self.decide(scope)
        refusal, limit_headers, key = decision.refusal, decision.limit_headers, decision.key
        if refusal is None:
            if key is None:
                return await self.pass_on(scope, receive, send, limit_headers)
            self.keys.in_flight[key.digest] += 1
            try:
                return await self.pass_on(scope, receive, send, limit_headers)
            finally:
                self.keys.in_flight[key.digest] -= 1
        headers = [*refusal.headers, *limit_headers]
        if self.on_refusal is not None:
            self.on_refusal(refusal.label)
        if not refusal_keeps_connection(Request(scope), KEEP_CONNECTION_BYTES):
            headers = [(b"connection", b"close"), *headers]
        body = json.dumps(body_for_path(route_path(scope))(refusal.reason)).encode()
        await send(
            {
                "type": "http.response.start",
                "status": refusal.status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    *headers,
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def pass_on(self, scope, receive, send, limit_headers: list) -> None:
        if not limit_headers:
            return await self.app(scope, receive, send)

        async def send_with_limit(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *limit_headers]}
            await send(message)

        return await self.app(scope, receive, send_with_limit)

    def decide(self, scope) -> Decision:
        """Whether to let the request in, from its request line and headers alone."""
        if _blank_query_keys(scope, self.keys):
            reason = (
                "an API key in the URL is not accepted (URLs are written to logs): send it as the header "
                "Authorization: Bearer KEY or X-API-Key: KEY (and if that was a real key, replace it: "
                "it has been exposed)"
            )
            return Decision(Refusal(400, reason, "key_in_url"), [])
        needed = required_scope(scope["method"], route_path(scope))
        if needed is Scope.OPEN:
            return Decision(None, [])
        presented, problem = _presented_key(scope["headers"])
        if presented is None:
            return Decision(Refusal(401, problem, "no_valid_key", [(b"www-authenticate", b'Bearer realm="mnv3"')]), [])
        key = self.keys.match(presented)
        if key is None:
            challenge = b'Bearer realm="mnv3", error="invalid_token"'
            return Decision(
                Refusal(401, "the API key is not valid", "no_valid_key", [(b"www-authenticate", challenge)]), []
            )
        if not allows(key.scope, needed):
            scope_name = needed.value
            # The path percent-encoded again, as uvicorn's access log has it: decoded, a %0a in it wrote a log line
            path = quote(scope["path"], safe="/:@!$&'()*+,;=-._~")
            log.info("refused %s %s to key %s: it needs scope %s", scope["method"], path, key.name, scope_name)
            challenge = f'Bearer realm="mnv3", error="insufficient_scope", scope="{scope_name}"'.encode()
            instead = meant_instead(scope["method"], route_path(scope), key.scope)
            reason = (
                f"this API key's scope does not include this path: it needs a key of scope {keys_allowed(needed)}"
                + (f"; this key may make {instead}" if instead else "")
            )
            return Decision(Refusal(403, reason, "out_of_scope", [(b"www-authenticate", challenge)]), [])
        if key.in_flight is not None and self.keys.in_flight[key.digest] >= key.in_flight:
            # Checked before the rate, so a refusal spends no token. One key's slow or stalled uploads would
            # otherwise hold every --max-in-flight slot and starve every other key.
            log.info("key %s has %d requests in flight, its limit", key.name, key.in_flight)
            reason = (
                f"this API key already has {key.in_flight} requests in flight, its limit: retry when one is answered"
            )
            peeked = self.keys.peek(key)
            limit_headers = key.limit.headers(peeked) if key.limit and peeked else []
            return Decision(Refusal(429, reason, "key_in_flight", [(b"retry-after", b"1")]), limit_headers)
        taken = self.keys.take(key)
        if taken is None:
            return Decision(None, [], key)
        assert key.limit is not None  # a key with a bucket has a rate
        limit_headers = key.limit.headers(taken)
        if not taken.wait_s:
            return Decision(None, limit_headers, key)
        retry_after = max(1, math.ceil(taken.wait_s))
        log.info("rate-limited key %s (%s)", key.name, key.limit)
        reason = f"this API key is over its rate limit of {key.limit}: retry in {retry_after} s"
        return Decision(
            Refusal(429, reason, "rate_limited", [(b"retry-after", str(retry_after).encode())]), limit_headers
        )


KEY_REFUSALS = {  # answered in front of the app, in the error shape of the path (mnv3.errors)
    401: "no API key, or not a valid one (WWW-Authenticate: Bearer)",
    403: "the key's scope does not include this operation",
    429: "the key is over its rate limit, or has its in_flight requests under way (Retry-After)",
}
SECURITY_SCHEMES = {
    "bearer": {"type": "http", "scheme": "bearer", "description": "Authorization: Bearer KEY"},
    "x_api_key": {"type": "apiKey", "in": "header", "name": "X-API-Key"},
}


def document_keys(schema: dict) -> dict:
    """`schema` (an OpenAPI document) saying which operations need a key and of what scope, by the RULES the
    middleware applies: Swagger UI's Authorize button then sends the key with "Try it out"."""
    schema.setdefault("components", {})["securitySchemes"] = SECURITY_SCHEMES
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            needed = required_scope(method.upper(), path)
            if needed is not Scope.OPEN:
                operation["security"] = [{name: []} for name in SECURITY_SCHEMES]
                operation["description"] = (
                    operation.get("description", "") + f"\n\nNeeds an API key of scope {keys_allowed(needed)}."
                ).strip()
                for status, why in KEY_REFUSALS.items():
                    operation.setdefault("responses", {}).setdefault(str(status), {"description": why})
    return schema


def route_path(scope) -> str:
    """The path the app routes on: without the root_path a proxy mounted the app under (as Starlette does)."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and (path == root or path.startswith(root + "/")):
        return path[len(root) :] or "/"
    return path


def _presented_key(headers) -> tuple[str | None, str]:
    """The key a request carries, or None and why not."""
    bearer = other = None
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                return None, "the Authorization header must be 'Bearer KEY'"
            bearer = token.strip()
        elif name == KEY_HEADER:
            other = value.decode("latin-1").strip()
    if bearer and other and bearer != other:
        return None, "two different keys (Authorization and X-API-Key): send one"
    if not (bearer or other):
        return None, "this server needs an API key: send it as the header Authorization: Bearer KEY or X-API-Key: KEY"
    return bearer or other, ""


def _blank_query_keys(scope, keys: Keys) -> bool:
    """Whether the query string carries a key: under a name clients give keys (as sent), or as a parameter, name
    or value (split at '&', and at ';' too; as sent or percent-decoded) that is one of `keys`, so `?KEY`,
    `?x=KEY;y=1` and `?model=KEY` too; if so that parameter is blanked in `scope` (the access log reads it), the
    rest kept as sent. A key holding '&' or ';' (python -m mnv3.auth makes none) is found percent-encoded only.
    This runs before any key is checked, for anyone, so it is cheap: a parameter too short to hold a key is only
    matched against the names, and a candidate is looked up by its digest, not compared with every key."""
    query = scope.get("query_string", b"")
    if not query:
        return False
    pieces = query.split(b"&")
    blanked = [
        _blanked(piece, keys) if len(piece) >= MIN_KEY_CHARS or QUERY_KEY_NAME.search(piece) else None
        for piece in pieces
    ]
    if not any(blanked):
        return False
    scope["query_string"] = b"&".join(
        blanked_piece or piece for piece, blanked_piece in zip(pieces, blanked, strict=True)
    )
    return True


def _blanked(piece: bytes, keys: Keys) -> bytes | None:
    """A query parameter that holds a key as the access log may show it (its value blanked, under a name
    clients give keys; all of it, for a key in it anywhere), or None."""
    name = piece.partition(b"=")[0]
    if name.lower() in QUERY_KEY_NAMES_BYTES:  # a short word, never a key itself: kept, to say what was sent
        return name + b"=REDACTED"
    parts = [piece, *piece.split(b";")] if b";" in piece else [piece]
    if any(part.partition(b"=")[0].lower() in QUERY_KEY_NAMES_BYTES for part in parts[1:]):
        return b"REDACTED"
    if len(piece) >= MIN_KEY_CHARS:
        texts = {text for part in parts for text in (part, *part.partition(b"=")[::2]) if len(text) >= MIN_KEY_CHARS}
        if any(_is_key(text, keys) for text in texts):
            return b"REDACTED"
    return None


def _decoded(text: bytes) -> bytes:
    # Percent-decoding only: a '+' stays one, as a key may hold it, and form encoding's space never is in a key.
    return unquote_to_bytes(text) if b"%" in text else text


def _is_key(text: bytes, keys: Keys) -> bool:
    """Whether `text`, as sent or percent-decoded, is one of `keys`."""
    if not MIN_KEY_CHARS <= len(text) <= 3 * MAX_KEY_CHARS:  # percent-encoding triples a character at most
        return False
    decoded = _decoded(text)
    return any(
        MIN_KEY_CHARS <= len(candidate) <= MAX_KEY_CHARS and hashlib.sha256(candidate).digest() in keys.digests
        for candidate in ((text,) if decoded is text else (text, decoded))
    )


# ---------------------------------------------------------------------------------------------- start-up


def is_loopback(host: str) -> bool:
    """Whether binding to `host` keeps the server reachable from this machine only. Host names other than
    localhost count as reachable from outside: what they resolve to is not ours to know."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost" or host.lower().endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def exposure_warning(host: str) -> str | None:
    """The start-up warning for serving on `host` without keys, or None on a loopback address."""
    if is_loopback(host):
        return None
    return (
        f"binding to {host} without --api-keys: anyone who can reach this port can run inference, read /metrics "
        f"and /model and reach every model. Pass --api-keys FILE (one '{GRAMMAR}' a line), or bind to 127.0.0.1 "
        "behind a proxy that authenticates; ignore this only on a network you trust."
    )


def new_key_line(scope: str = "infer", options: tuple[str, ...] = ()) -> tuple[str, str]:
    """A fresh random key and the key-file line that accepts it without holding it (its sha256), with
    `options` ("rate=50/s", ...) after the scope; a KeyFileError if the key file would refuse them."""
    key = secrets.token_urlsafe(32)
    line = " ".join([f"{DIGEST_PREFIX}{hashlib.sha256(key.encode()).hexdigest()}", scope, *options])
    parse_keys(line, "the line")  # the same rules as the key file: what it prints, --api-keys takes
    return key, line


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mnv3.auth",
        description=(
            "Make a new API key: prints the key (give it to the client) and the line for the --api-keys file, "
            "which holds only the key's sha256."
        ),
    )
    parser.add_argument("--scope", choices=tuple(KEY_SCOPES), default="infer", help="what the key may do")
    parser.add_argument("--rate", help="requests the key may make, N/s or N/min (default: unlimited)")
    parser.add_argument(
        "--burst", help="the most requests the key may make at once (default: one second's worth of --rate, at least 1)"
    )
    parser.add_argument(
        "--in-flight", help="the most requests the key may have in the server at once (default: no bound of its own)"
    )
    parser.add_argument("--name", help="what logs and metrics call the key (default: its line number)")
    return parser


def main(args) -> None:
    given = {option: value for option in ("rate", "burst", "in_flight", "name") if (value := getattr(args, option))}
    try:
        if spaced := [
            f"--{option.replace('_', '-')} {value!r}" for option, value in given.items() if len(value.split()) != 1
        ]:
            raise KeyFileError(f"{', '.join(spaced)}: a value without spaces (they separate a key line's words)")
        key, line = new_key_line(args.scope, tuple(f"{option}={value}" for option, value in given.items()))
    except KeyFileError as exc:
        print(f"python -m mnv3.auth: error: {str(exc).removeprefix('the line:1: ')}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"key (give it to the client; it is not stored anywhere): {key}")
    print(f"line for the key file: {line}")


if __name__ == "__main__":
    main(get_args_parser().parse_args())
