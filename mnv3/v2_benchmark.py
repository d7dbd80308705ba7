"""Stage 5's rows for the Open Inference Protocol: its binary path against /predict, and two models side by
side in one server.

`/v2` vs `/predict`: one batching server (cache off), the same distinct photos at the same concurrency
through each path, taken in turns with a fresh client per turn, the order mirrored from one pair of
turns to the next (predict, v2, v2, predict, ...), so drift on a shared machine lands on both paths
alike: a machine slowing steadily through the run would otherwise slow every turn of the path that
always goes second. A path's throughput is its answers over the
seconds of its turns. The `/v2` client sends what Triton's HTTP client sends for one encoded photo
(`V2Client`, `v2_request`); every request body is built before the timed loops, as /predict's
uploads are encoded before theirs, so client-side encoding is not charged to the server.

Side by side: two models in one server (e.g. FP32 and static INT8), mixed traffic through
`/predict?model=`, every photo sent to both, alternating; throughput per model over the whole run, and
the top-1 agreement of the two models on the photos both answered.
"""

import json
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from mnv3 import loadtest
from mnv3.artifacts import FP32_ONNX, MissingArtifact, require
from mnv3.batching_benchmark import closed_loop
from mnv3.cli import UsageError, static_int8_model
from mnv3.config import ModelSpec
from mnv3.latency import turn_order
from mnv3.loadtest import REQUEST_TIMEOUT_S, LoadResult, PredictClient
from mnv3.v2_protocol import HEADER_LENGTH, IMAGE_INPUT, PROBABILITIES_OUTPUT

PREDICT, V2_BINARY = "predict", "v2_binary"
TURNS = 2  # per path: both paths are measured in the run's first half and again in its second
TOP_K = 5  # what /predict answers by default: /v2 asks the classification extension for as many
MIXED = "mixed"


# ---------------------------------------------------------------------------------------- the /v2 client


@dataclass(frozen=True)
class V2Request:
    """An infer request body with the binary tensor data extension, and its JSON header's length."""

    body: bytes
    header_length: int


def v2_request(photo: bytes, top_k: int = TOP_K) -> V2Request:
    """One encoded photo as tritonclient.http sends it, byte for byte: input IMAGE, BYTES [1, 1], in
    binary (a 4-byte little-endian length, then the JPEG). The output is PROBABILITIES through the
    classification extension (Triton's image_client asks for its classes so), the top `top_k` as
    "probability:index:label" strings: the answer /predict gives. They come back in JSON, not binary:
    five short strings gain nothing from binary, and JSON needs no length-prefixed parsing."""
    element = struct.pack("<I", len(photo)) + photo
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": IMAGE_INPUT,
                    "shape": [1, 1],
                    "datatype": "BYTES",
                    "parameters": {"binary_data_size": len(element)},
                }
            ],
            "outputs": [{"name": PROBABILITIES_OUTPUT, "parameters": {"classification": top_k, "binary_data": False}}],
        },
        separators=(",", ":"),
    ).encode()
    return V2Request(header + element, len(header))


class V2Client(PredictClient):
    """`await send(V2Request) -> (status, JSON or None)` for POST /v2/models/{model}/infer: PredictClient's
    connections and answer, the Open Inference Protocol's request."""

    def __init__(self, base_url: str, model: str, timeout_s: float = REQUEST_TIMEOUT_S):
        super().__init__(base_url, timeout_s)
        self._path = f"/v2/models/{model}/infer"

    async def __call__(self, request: V2Request) -> tuple[str, dict | None]:  # type: ignore[override]
        return await self.post(
            self._path,
            data=request.body,
            headers={"Content-Type": "application/octet-stream", HEADER_LENGTH: str(request.header_length)},
        )


def predict_top_classes(answer: dict) -> list[int]:
    """The class ids of a /predict answer, most probable first."""
    return [prediction["class_id"] for prediction in answer["predictions"]]


# ---------------------------------------------------------------------------------------- /v2 vs /predict


@dataclass(frozen=True)
class V2VsPredictResult:
    concurrency: int
    turns: list[tuple[str, int, LoadResult]]  # (path, turn from 1, its closed-loop run), in the order taken
    settings: dict  # what the server said it ran with (GET /model)

    def total(self, path: str) -> LoadResult:
        """The path's turns, pooled."""
        return LoadResult.pooled(*[result for name, _, result in self.turns if name == path])

    def rps(self, path: str) -> float:
        return self.total(path).rps

    @property
    def ratio(self) -> float:
        """/v2's throughput over /predict's: the goal is within 5%."""
        return loadtest.ratio(self.rps(V2_BINARY), self.rps(PREDICT), digits=3)

    def turn_ratios(self) -> list[float]:
        """/v2's req/s over /predict's in each pair of turns (the same turn number): apart, they show how far
        the ratio moved in the run."""
        rates = {(path, turn): result.rps for path, turn, result in self.turns}
        return [loadtest.ratio(rates[V2_BINARY, turn], rates[PREDICT, turn], digits=3) for turn in range(1, TURNS + 1)]

    def rows(self, environment: dict) -> list[dict]:
        """A row per turn (a /v2 turn carries its pair's ratio), then one per path over all its turns (the /v2
        one carries the ratio)."""
        pair_ratio = dict(enumerate(self.turn_ratios(), 1))
        rows = [
            {"configuration": path, "turn": turn}
            | result.as_row()
            | self.settings
            | ({"v2_to_predict_ratio": pair_ratio[turn]} if path == V2_BINARY else {})
            for path, turn, result in self.turns
        ]
        rows += [
            {"configuration": path, "turn": "all"}
            | self.total(path).as_row()
            | self.settings
            | ({"v2_to_predict_ratio": self.ratio} if path == V2_BINARY else {})
            for path in (PREDICT, V2_BINARY)
        ]
        return [row | environment for row in rows]

    def summary(self) -> str:
        return (
            f"at concurrency {self.concurrency}, in {TURNS} turns each: /predict {self.rps(PREDICT):.1f} req/s, "
            f"/v2 binary {self.rps(V2_BINARY):.1f} req/s: /v2 / /predict = {self.ratio} (goal >= 0.95; per pair of "
            f"turns {' / '.join(map(str, self.turn_ratios()))})"
        )


def run_v2_vs_predict(
    model: Path,
    photos: list[bytes],
    concurrency: int,
    requests_per_turn: int,
    server_options: dict,
    start_timeout_s: float,
) -> V2VsPredictResult:
    """TURNS closed-loop runs of `requests_per_turn` through each path, taken in turns, on one server."""
    v2_requests = [v2_request(photo) for photo in photos]  # before any timed loop, like `photos` themselves
    with loadtest.ServerProcess(model, start_timeout_s, **server_options) as url:
        settings = loadtest.server_settings(url)
        # The name /v2/models/{name} takes: the server names a model given as a plain path as the config does.
        v2_client = partial(V2Client, model=ModelSpec.parse(model).name)
        paths: dict[str, tuple[Callable, list]] = {
            PREDICT: (PredictClient, photos),
            V2_BINARY: (v2_client, v2_requests),
        }
        for client, bodies in paths.values():
            loadtest.warm_up(url, bodies, concurrency, client)
        turns = [
            (path, turn, closed_loop(url, bodies, concurrency, requests_per_turn, f"{path} turn {turn}", client))
            for turn in range(1, TURNS + 1)
            for path, (client, bodies) in turn_order(list(paths.items()), turn)
        ]
    return V2VsPredictResult(concurrency, turns, settings)


# ---------------------------------------------------------------------------------------- side by side


class MixedTraffic:
    """`await send((model, photo index, photo))`: POST /predict?model=..., keeping every answer and each
    model's (status, latency, answer) samples. One per run; closing it closes its clients."""

    def __init__(self, base_url: str, models: tuple[str, ...]):
        self.clients = {model: PredictClient(base_url, model=model) for model in models}
        self.samples: dict[str, list] = {model: [] for model in models}
        self.answers: dict[tuple[str, int], dict | None] = {}

    async def __call__(self, item: tuple[str, int, bytes]) -> tuple[str, dict | None]:
        model, index, photo = item
        start = time.perf_counter()
        status, answer = await self.clients[model](photo)
        self.samples[model].append((status, time.perf_counter() - start, answer))
        self.answers[(model, index)] = answer
        return status, answer

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        for client in self.clients.values():
            client.__exit__()


@dataclass(frozen=True)
class SideBySideResult:
    models: tuple[ModelSpec, ModelSpec]
    total: LoadResult  # the whole mixed run
    per_model: dict[str, LoadResult]  # each model's requests, over the whole run's seconds
    answers: dict[tuple[str, int], dict | None]  # (model name, photo index) -> /predict's answer, None if none
    photos: int
    settings: dict

    @property
    def agreement(self) -> tuple[int, int]:
        """(photos whose top-1 class the two models agree on, photos both models answered)."""
        first, second = (spec.name for spec in self.models)
        pairs = [(self.answers.get((first, i)), self.answers.get((second, i))) for i in range(self.photos)]
        both = [(a, b) for a, b in pairs if a is not None and b is not None]
        return sum(predict_top_classes(a)[0] == predict_top_classes(b)[0] for a, b in both), len(both)

    @property
    def top1_agreement(self) -> float:
        agreeing, compared = self.agreement
        return round(agreeing / compared, 4) if compared else float("nan")

    def rows(self, environment: dict) -> list[dict]:
        """One row per model, then the whole run with the agreement; `model` names the file(s) served."""
        agreeing, compared = self.agreement
        rows = [
            {"configuration": MIXED, "served_model": spec.name}
            | self.per_model[spec.name].as_row()
            | self.settings
            | environment
            | {"model": spec.path.name}
            for spec in self.models
        ]
        rows.append(
            {"configuration": MIXED, "served_model": "all"}
            | self.total.as_row()
            | self.settings
            | {"top1_agreement": self.top1_agreement, "photos_compared": compared, "photos_agreeing": agreeing}
            | environment
            | {"model": "+".join(spec.path.name for spec in self.models)}
        )
        return rows

    def summary(self) -> str:
        per_model = ", ".join(f"{name} {result.rps:.1f} req/s" for name, result in self.per_model.items())
        agreeing, compared = self.agreement
        return (
            f"side by side, mixed traffic at concurrency {self.total.concurrency}: {per_model} "
            f"({self.total.rps:.1f} req/s in all); top-1 agreement {self.top1_agreement} "
            f"({agreeing} of {compared} photos)"
        )


def side_by_side_models(texts: list[str] | None, artifacts_dir: Path) -> tuple[ModelSpec, ModelSpec]:
    """The two models to serve together, as [NAME=]PATH[@BACKEND] each; default stage 1's FP32 and stage 2's
    static INT8 in `artifacts_dir`, both on onnxruntime: `--backend auto` could serve one chosen engine for
    both files, and the row compares the two networks."""
    if texts is None:
        texts = [
            f"fp32={require(artifacts_dir / FP32_ONNX, 1, artifacts_dir)}@onnxruntime",
            f"static_int8={static_int8_model(artifacts_dir)}@onnxruntime",
        ]
    first, second = map(ModelSpec.parse, texts)
    for spec in (first, second):
        if not spec.path.exists():
            raise MissingArtifact(f"--side-by-side-models: {spec.path} not found")
    if first.name == second.name:
        raise UsageError(f"--side-by-side-models: both models are named {first.name!r}; name them NAME=PATH")
    return first, second


# server_settings' columns of the default model's engine, not of the server.
DEFAULT_MODELS_OWN = (
    "server_model",
    "server_backend",
    "server_backend_reason",
    "server_providers",
    "server_batch_threads",
)


def run_side_by_side(
    models: tuple[ModelSpec, ModelSpec],
    photos: list[bytes],
    concurrency: int,
    server_options: dict,
    start_timeout_s: float,
) -> SideBySideResult:
    """Both models in one server; every photo to each, alternating models, through one closed loop."""
    first, second = (spec.text() for spec in models)
    server = loadtest.ServerProcess(first, start_timeout_s, extra_models=(second,), **server_options)
    names = tuple(spec.name for spec in models)
    items = [(name, index, photo) for index, photo in enumerate(photos) for name in names]
    with server as url:
        # GET /model describes the default model alone: its file, engine and engine threads would mislabel the
        # other's rows, which name their file in `model`; the server's own settings hold for both.
        settings = {key: value for key, value in loadtest.server_settings(url).items() if key not in DEFAULT_MODELS_OWN}
        for name in names:
            loadtest.warm_up(url, photos, concurrency, partial(PredictClient, model=name))
        with MixedTraffic(url, names) as send:
            total = loadtest.run_closed_loop(send, items, concurrency, desc="side by side")
    per_model = {
        name: LoadResult.from_samples("closed", concurrency, samples, total.seconds)
        for name, samples in send.samples.items()
    }
    result = SideBySideResult(models, total, per_model, send.answers, len(photos), settings)
    print(result.summary())
    return result
