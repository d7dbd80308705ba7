"""The settings of one server, and the command line and environment that set them.

`ServerConfig` is the one list of settings: each field carries its default, its help and its bounds,
and is also the flag `--<name>` and the variable `MNV3_<NAME>` (the flag wins over the variable, the
variable over the default). A config is checked when it is built, from code or from `parse_args`, so a
value out of bounds is a one-line error before any model is loaded, never a server that fails later.

One server serves one model or several: `--model` may be repeated, each as `PATH`, `NAME=PATH`,
`PATH@BACKEND` or `NAME=PATH@BACKEND` (`ModelSpec`); the first is the default model. `MNV3_MODEL`
gives one. The batching and cache settings apply to each model (each has its own batcher and cache of
`--cache-size` entries); the rest are the server's: one address, log, key file, `--max-in-flight` and
decode pool (`--preprocess-threads`) for every model.
"""

import argparse
import difflib
import math
import os
import re
import sys
from dataclasses import dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import Any, NoReturn, cast

from mnv3.auth import GRAMMAR as KEY_FILE_GRAMMAR
from mnv3.engine import BACKEND_CHOICES
from mnv3.preprocess import DEFAULT_DECODING, DEFAULT_MAX_PIXELS, MAX_IMAGE_SIDE, PILLOW_MAX_PIXELS, Decoding
from mnv3.runtime import DEFAULT_INTER_OP_THREADS, DEFAULT_INTRA_OP_THREADS

# Pillow's decode/resize and numpy's normalisation release the GIL, so two threads keep both cores
# of the target machine busy while the event loop stays free; more would only fight ORT's intra-op
# threads for the same two cores. Raise it with the core count.
DEFAULT_PREPROCESS_THREADS = 2
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
MAX_BATCH_SIZE = 256
# The longest wait a time setting may ask for. Longer is a typo, and past threading's TIMEOUT_MAX (about
# 292 years) a batch window made every batch fail and a shutdown delay never ended.
LONGEST_WAIT_S = 24 * 3600


PROG = "python -m mnv3.server"  # how its errors begin, from argparse or from loading a model


def command_name(module_command: str) -> str:
    """How the running command was started, for its usage and errors: as one of the package's console scripts
    (pyproject.toml's mnv3-serve, mnv3-ray-serve), its name; else `module_command` (python -m ...)."""
    started = Path(sys.argv[0]).name
    return started if started.startswith("mnv3-") else module_command


# A model's name is a URL path segment (/v2/models/NAME) and a query value (?model=NAME): nothing to escape.
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# What follows a model file's '@' when it was meant as a backend: a word, no file suffix or folder.
BACKEND_LIKE = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")
ORIGIN = re.compile(r"https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?")  # what a browser sends in Origin: no path
ROOT_PATH = re.compile(r"(/[A-Za-z0-9._~-]+)+")  # a URL path of one or more segments, no trailing slash


def flag(name: str) -> str:
    """The command-line flag of a setting: `cache_size` -> `--cache-size`."""
    return "--" + name.replace("_", "-")


def variable(name: str) -> str:
    """The environment variable of a setting: `cache_size` -> `MNV3_CACHE_SIZE`."""
    return f"MNV3_{name.upper()}"


class SettingError(ValueError):
    """A setting out of its bounds or choices, named by its flag (`setting`: the field)."""

    def __init__(self, setting: str, problem: str):
        super().__init__(f"{flag(setting)} {problem}")
        self.setting = setting


def _option(default, help: str, minimum=None, maximum=None, choices=None, read=None):
    """A setting; `read` turns its flag's or variable's text into its value (else its type does)."""
    return field(
        default=default,
        metadata={"help": help, "minimum": minimum, "maximum": maximum, "choices": choices, "read": read},
    )


@dataclass(frozen=True)
class ModelSpec:
    """One model to serve: its name in URLs, its file, and its backend (None: the server's --backend)."""

    name: str
    path: Path
    backend: str | None = None

    @classmethod
    def parse(cls, text: str | os.PathLike) -> "ModelSpec":
        """`PATH`, `NAME=PATH`, `PATH@BACKEND` or `NAME=PATH@BACKEND`; the name defaults to the file's stem.
        Text before `=` that looks like a directory, or after `@` that is no backend, belongs to the path."""
        spec, backend = str(text), None
        head, at, tail = spec.rpartition("@")
        if at and tail in BACKEND_CHOICES:
            spec, backend = head, tail
        name, equals, path = spec.partition("=")
        if not equals or os.sep in name:
            name, path = Path(spec).stem, spec
        return cls(name, Path(path), backend)

    def text(self, path: Path | None = None) -> str:
        """`NAME=PATH[@BACKEND]`, what `parse` reads back as this spec (with `path` in place of its own)."""
        return f"{self.name}={path or self.path}" + (f"@{self.backend}" if self.backend else "")

    def check(self) -> None:
        head, at, tail = str(self.path).rpartition("@")
        if at and BACKEND_LIKE.fullmatch(tail) and not self.path.exists():  # a typo, not a file named so
            raise ValueError(
                f"unknown backend {tail!r} after the '@' of {self.path}: one of {', '.join(BACKEND_CHOICES)}"
            )
        if not MODEL_NAME.fullmatch(self.name):
            rule = "a letter or digit, then up to 63 letters, digits, '.', '_' or '-'"
            if self.name == self.path.stem:  # taken from the file's name: give it one
                raise ValueError(
                    f"model name {self.name!r} is not URL-safe: name the model with NAME={self.path} ({rule})"
                )
            raise ValueError(f"model name {self.name!r} is not URL-safe: a name is {rule}")


@dataclass(frozen=True)
class ServerConfig:
    """Every setting of one server. Each field is also a CLI flag and an MNV3_<NAME> variable."""

    model: Path = field(
        metadata={
            "help": "model file (ONNX, or an OpenVINO IR .xml) as PATH, NAME=PATH or NAME=PATH@BACKEND "
            "(name: the file's stem; backend: --backend); repeat --model to serve several, the first is "
            "the default; class_names.json and manifest.json beside it give its class "
            "names and preprocessing",
            "metavar": "[NAME=]PATH[@BACKEND]",
        }
    )
    # Not a flag of its own: every --model after the first.
    extra_models: tuple[str, ...] = field(default=(), metadata={"help": "models served besides --model"})
    host: str = _option("127.0.0.1", "address to bind")
    # uvloop binds a port past 65535 modulo 65536 (99999 -> 34463) while the log names the one asked for.
    port: int = _option(8000, "port to bind", minimum=0, maximum=65535)
    backend: str = _option(
        "auto", "inference runtime; auto: what stage 2 measured fastest here, else onnxruntime", choices=BACKEND_CHOICES
    )
    cache_size: int = _option(1024, "result cache entries; 0 disables the cache", minimum=0)
    batch_window_ms: float = _option(
        20.0, "how long a batch waits for more requests after its first", minimum=0, maximum=LONGEST_WAIT_S * 1000
    )
    # Bounded: each place in a batch holds two preprocessed rows (1.2 MB) from the first request on, and on
    # a CPU a batch past a few dozen images adds latency, not throughput.
    max_batch_size: int = _option(
        32, "largest batch; 1 runs every request alone, with no window wait", minimum=1, maximum=MAX_BATCH_SIZE
    )
    max_in_flight: int = _option(
        512,
        "requests admitted at once (uploading, decoding, queued or running); more get 503 before their body is read",
        minimum=1,
    )
    queue_limit: int = _option(512, "requests waiting for inference before new ones get 503", minimum=1)
    deadline_ms: float = _option(
        10_000.0,
        "per request, from when its body has arrived; past it: 504, and unrun work is dropped",
        minimum=1,
        maximum=LONGEST_WAIT_S * 1000,
    )
    intra_op_threads: int = _option(
        DEFAULT_INTRA_OP_THREADS,
        "threads within an operator: every onnxruntime call, and OpenVINO's for a single image",
        minimum=1,
    )
    inter_op_threads: int = _option(DEFAULT_INTER_OP_THREADS, "onnxruntime threads across operators", minimum=1)
    batch_threads: int = _option(
        0,
        "OpenVINO threads for a batch of more than one image (a single image gets --intra-op-threads); "
        "0: what stage 2 measured fastest under load for the engine --backend auto serves (with these "
        "--intra-op-threads), else half of them, at least 1, as under load the other cores decode the next "
        "images. onnxruntime runs every call on --intra-op-threads",
        minimum=0,
    )
    # Off by default: spinning intra-op threads steal the cores that decoding needs, so under many
    # concurrent clients a server with spinning on answers fewer requests per second, not more.
    ort_spinning: int = _option(
        0, "1 lets idle onnxruntime threads busy-wait (faster only on otherwise idle cores)", choices=(0, 1)
    )
    preprocess_threads: int = _option(
        DEFAULT_PREPROCESS_THREADS, "threads that decode and preprocess images", minimum=1
    )
    max_upload_bytes: int = _option(10 * 1024 * 1024, "largest request body in bytes (413 above)", minimum=1)
    max_pixels: int = _option(
        DEFAULT_MAX_PIXELS,
        f"largest image, width x height, checked before decoding (413); at most {PILLOW_MAX_PIXELS}, "
        f"past which Pillow refuses every image (a side over {MAX_IMAGE_SIDE} is refused too)",
        minimum=1,
        maximum=PILLOW_MAX_PIXELS,
    )
    # On by default: it makes a phone photo's decode several times cheaper and moves its preprocessed
    # pixels by a few grey levels at most (README, "Limits and errors"); a JPEG whose shorter side is under
    # four times the model's resize size (preprocess.jpeg_draft_reduction), and every other format, decodes
    # exactly as with 0.
    jpeg_draft: int = _option(
        int(DEFAULT_DECODING.jpeg_draft),
        "1 decodes large JPEGs at a reduced DCT scale (1/2-1/8) that still leaves twice the "
        "resize size; 0 always decodes in full",
        choices=(0, 1),
    )
    # On by default: the resize is the costliest step of decoding an ordinary photo, and this computes only
    # the pixels the crop keeps, moving about one preprocessed value in a thousand by one grey level (README,
    # "Limits and errors"). With both this and --jpeg-draft at 0, preprocessing equals torchvision's.
    resize_crop_only: int = _option(
        int(DEFAULT_DECODING.resize_crop_only),
        "1 resizes only the part of the image the centre crop keeps; 0 resizes the whole image, then crops",
        choices=(0, 1),
    )
    body_timeout_s: float = _option(
        30.0,
        "seconds to receive a whole request body; a slower or stalled upload gets 408",
        minimum=0.001,
        maximum=LONGEST_WAIT_S,
    )
    shutdown_delay_s: float = _option(
        0.0,
        "on SIGTERM, how long to go on serving with /readyz answering 503 before the port closes, so a load "
        "balancer stops sending first (Kubernetes: a few seconds, a preStop sleep's job)",
        minimum=0,
        maximum=LONGEST_WAIT_S,
    )
    shutdown_timeout_s: float = _option(
        30.0,
        "on SIGTERM, how long in-flight requests may take before they are cancelled",
        minimum=0,
        maximum=LONGEST_WAIT_S,
    )
    # uvicorn's own default. A load balancer that keeps connections open longer (AWS ALB: 60 s idle) can send
    # a request down one the server is closing just then, and answers its client 502.
    keep_alive_s: float = _option(
        5.0,
        "seconds an idle kept-alive connection stays open for the client's next request; behind a load "
        "balancer that reuses connections, set it above the balancer's idle timeout",
        minimum=0.001,
        maximum=LONGEST_WAIT_S,
    )
    top_k: int = _option(5, "predictions per response", minimum=1)
    max_request_images: int = _option(0, "images in one /v2 infer request (400 above); 0: --max-batch-size", minimum=0)
    log_level: str = _option(
        "info",
        "logging level; info includes uvicorn's access log, a line a request; debug adds a line a batch",
        choices=LOG_LEVELS,
        read=str.lower,  # LOG_LEVEL=INFO, as containers are often configured
    )
    api_keys: str = _option(
        "",
        f"key file (one '{KEY_FILE_GRAMMAR}' a line; python -m mnv3.auth makes one): every path but the "
        "probes, the page and the docs then needs a key; empty: no keys",
    )
    cors_origins: str = _option(
        "",
        "origins whose web pages may call the API from a browser (comma-separated, e.g. "
        "https://app.example.com, or * for any); empty: only pages the server serves itself",
    )

    # Behind a reverse proxy that serves the app under a prefix and strips it (nginx: location /mnv3/ {
    # proxy_pass http://backend/; }), the API docs' URLs need the prefix; the page's are relative already.
    root_path: str = _option(
        "", "the path prefix a reverse proxy serves the app under and strips, e.g. /mnv3 (for the API docs' URLs)"
    )
    forwarded_allow_ips: str = _option(
        "",
        "addresses of proxies whose X-Forwarded-For and X-Forwarded-Proto are trusted, so the access log "
        "names the client (comma-separated IPs or networks, or *); empty: uvicorn's FORWARDED_ALLOW_IPS, "
        "else 127.0.0.1",
    )

    def __post_init__(self):
        object.__setattr__(self, "log_level", self.log_level.lower())  # INFO too, from code or a Ray config file
        if not self.host.strip():  # uvicorn would try to resolve "": "cannot listen on :8000", naming no setting
            raise SettingError(
                "host", f"must be an address or a host name (0.0.0.0: every IPv4 interface), got {self.host!r}"
            )
        if self.root_path and not ROOT_PATH.fullmatch(self.root_path):
            raise SettingError(
                "root_path", f"{self.root_path!r} is not a path prefix: write /NAME[/NAME...], e.g. /mnv3"
            )
        for f in fields(self):
            value, minimum, maximum = getattr(self, f.name), f.metadata.get("minimum"), f.metadata.get("maximum")
            # NaN passes every comparison below (NaN < 1 is False), and infinity is no duration or size.
            if isinstance(value, float) and not math.isfinite(value):
                raise SettingError(f.name, f"must be a finite number, got {value}")
            if minimum is not None and value < minimum:
                raise SettingError(f.name, f"must be at least {minimum}, got {value}")
            if maximum is not None and value > maximum:
                raise SettingError(f.name, f"must be at most {maximum}, got {value}")
            choices = f.metadata.get("choices")
            if choices is not None and value not in choices:
                raise SettingError(f.name, f"must be one of {', '.join(map(str, choices))}, got {value!r}")
        for origin in self.cors_origin_list:
            if origin != "*" and not ORIGIN.fullmatch(origin):
                raise SettingError(
                    "cors_origins",
                    f"{origin!r} is not an origin: write scheme://host[:port], e.g. https://app.example.com",
                )
        names = set()
        for spec in self.models:
            spec.check()
            if spec.name in names:
                raise ValueError(f"two models are named {spec.name!r}: name each --model with NAME=PATH")
            names.add(spec.name)

    @property
    def cors_origin_list(self) -> list[str]:
        return [origin.strip().rstrip("/") for origin in self.cors_origins.split(",") if origin.strip()]

    @property
    def models(self) -> tuple[ModelSpec, ...]:
        """Every model to serve, the default first."""
        texts: tuple[str | Path, ...] = (self.model, *self.extra_models)
        return tuple(ModelSpec.parse(text) for text in texts)

    def backend_of(self, spec: ModelSpec) -> str:
        return spec.backend or self.backend

    @cached_property  # read for every request's decode
    def decoding(self) -> Decoding:
        """--jpeg-draft and --resize-crop-only: how this server turns an upload into the model's input."""
        return Decoding(bool(self.jpeg_draft), bool(self.resize_crop_only))

    @property
    def images_per_request(self) -> int:
        """The most images one /v2 infer request may carry."""
        return self.max_request_images or self.max_batch_size


class OneLineErrors(argparse.ArgumentParser):
    """Its errors are one line, `PROG: error: ...`, exit 2: the usage block of two dozen flags would bury it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


# The key a client sends (mnv3.loadtest reads it): an MNV3_ variable, but none of the server's settings.
API_KEY_ENV = "MNV3_API_KEY"


# Kubernetes gives a pod variables for every Service in its namespace (service links, on by default): a Service
# named mnv3 brings MNV3_SERVICE_HOST, MNV3_SERVICE_PORT, MNV3_PORT_8000_TCP_ADDR and the like, and MNV3_PORT set to
# tcp://IP:PORT, which read as --port refused to start the pod. One named mnv3-api brings MNV3_API_SERVICE_HOST...
SERVICE_LINK_NAME = re.compile(
    r"MNV3(_\w+)?_(SERVICE_HOST|SERVICE_PORT(_\w+)?|PORT_\d+_(TCP|UDP|SCTP)(_(PROTO|PORT|ADDR))?)"
)
SERVICE_LINK_ADDRESS = re.compile(r"MNV3(_\w+)?_PORT")  # with a value such as tcp://10.96.0.12:8000
SERVICE_LINK_VALUE = re.compile(r"(tcp|udp|sctp)://\S*")


def without_service_links(environ) -> dict[str, str]:
    """`environ` without the variables Kubernetes' service links set, which are not this server's settings."""
    return {
        name: value
        for name, value in environ.items()
        if not SERVICE_LINK_NAME.fullmatch(name)
        and not (SERVICE_LINK_ADDRESS.fullmatch(name) and SERVICE_LINK_VALUE.fullmatch(value))
    }


def unknown_variables(environ=os.environ) -> list[str]:
    """A warning for each MNV3_ variable in `environ` that sets nothing, naming the closest setting's: a
    misspelt flag is refused, a misspelt variable would be ignored without a word. Kubernetes' service links
    are not warned about: a pod has them whatever its spec says."""
    known = [variable(f.name) for f in fields(ServerConfig) if f.name != "extra_models"] + [API_KEY_ENV]
    warnings = []
    environ = without_service_links(environ)
    for name in sorted(env for env in environ if env.startswith("MNV3_") and env not in known):
        close = difflib.get_close_matches(name, known, n=1)
        warnings.append(f"{name} sets nothing, ignored" + (f" (did you mean {close[0]}?)" if close else ""))
    return warnings


def parse_args(argv=None, environ=os.environ, prog: str = PROG) -> ServerConfig:
    """The server's settings from `argv` (flags) and `environ` (MNV3_<FLAG>, but for Kubernetes' service links);
    `prog` begins its errors."""
    environ = without_service_links(environ)
    parser = OneLineErrors(
        prog=prog,
        description="Serve a MobileNetV3 classifier (ONNX, or an OpenVINO IR) over HTTP.",
        epilog="Each flag can also be set as MNV3_<FLAG> (e.g. MNV3_CACHE_SIZE=0); the flag wins.",
    )
    from_environment = {}  # setting -> (what reads it, its variable's text), read below for settings no flag gives
    for f in fields(ServerConfig):
        env = variable(f.name)
        if f.name == "extra_models":
            continue
        if f.name == "model":  # repeatable; argparse would append to a default, so the variable is read below
            parser.add_argument(
                "--model",
                type=Path,
                action="append",
                metavar=f.metadata["metavar"],
                help=f"{f.metadata['help']} [{env}: one model]",
            )
            continue
        read = f.metadata["read"] or cast(type, f.type)  # int, float or str
        if env in environ:
            from_environment[f.name] = (read, environ[env])
        parser.add_argument(
            flag(f.name),
            type=read,
            default=argparse.SUPPRESS,  # absent from the parsed flags unless given
            choices=f.metadata.get("choices"),
            # argparse formats help with %: a variable's value holding one must not break --help
            help=f"{f.metadata['help']} [{env}; {str(environ.get(env, f.default)).replace('%', '%%')}]",
        )
    args = vars(parser.parse_args(argv))
    models = args.pop("model") or ([Path(environ["MNV3_MODEL"])] if environ.get("MNV3_MODEL") else [])
    if not models:
        parser.error("the following arguments are required: --model (or MNV3_MODEL)")
    # A variable counts only where no flag was given (the flag wins, even over a variable that is no number).
    settings: dict[str, Any] = {}
    for name, (kind, text) in from_environment.items():
        if name in args:
            continue
        try:
            settings[name] = kind(text)
        except ValueError:
            parser.error(f"{variable(name)}={text!r} is not a valid {kind.__name__} (it sets {flag(name)})")
    try:
        return ServerConfig(**settings | args, model=models[0], extra_models=tuple(map(str, models[1:])))
    except SettingError as exc:
        # the variable's text as the user wrote it (a setting's `read` may have changed it, as log_level's lowers it)
        given_by = (
            f" (from {variable(exc.setting)}={from_environment[exc.setting][1]})" if exc.setting in settings else ""
        )
        parser.error(f"{exc}{given_by}")
    except ValueError as exc:
        parser.error(str(exc))
