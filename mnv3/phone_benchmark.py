"""Stage 5's phone-photo rows: 12-megapixel JPEG uploads, where their time goes, and what draft
decoding changes.

A phone photo costs far more to decode than the model costs to run, so this measures, on the same
distinct photos (`mnv3.photos.phone_photos`):
  1. decoding in process, full vs JPEG draft (`mnv3.preprocess.decode_image`): both decode + preprocess
     every photo in turns, over several rounds, and the ratio is taken per round, so the machine's
     drift cancels; and how far the draft's preprocessed tensors and the served engine's logits are from
     the full decode's (max/mean |difference|, top-1/top-5 agreement, SQNR). The served engine is what
     `--backend auto` serves for the model, as the servers below do (file, runtime, precision). When it is
     anything but the FP32 file beside the model on onnxruntime, that reference's logits are compared too,
     with the served engine's own agreement with it as the yardstick: a random-init stand-in amplifies any
     perturbation of its input, and INT8 or bf16 rounding amplifies it further;
  2. the batching server under phone uploads at one concurrency, with draft decoding on and then off:
     req/s, and each request's round trip split into decode + preprocess, queue and inference (what the
     server reported for that request), reading the upload inside the endpoint, and HTTP (the rest).
"""

import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from mnv3 import loadtest
from mnv3.accuracy import agreement, array_batches, predict
from mnv3.artifacts import FP32_ONNX, model_preprocessing
from mnv3.backend_choice import Choice, explicit, resolve_auto
from mnv3.engine import open_session
from mnv3.latency import turn_order
from mnv3.loadtest import LoadResult, metrics_row
from mnv3.photos import PHONE_PHOTO_QUALITY, PHONE_PHOTO_SIZE
from mnv3.preprocess import DEFAULT_PREPROCESSING, Decoding, Preprocessing, decode_and_preprocess, decode_image
from mnv3.runtime import ort_runner

FULL, DRAFT = "full", "draft"
# Draft vs full JPEG decoding; both resize as the server does by default.
DECODINGS = {FULL: Decoding(jpeg_draft=False), DRAFT: Decoding(jpeg_draft=True)}
BATCH_SIZE = 8  # for the logits comparison only
# A request's round trip, in the order it happens to it (the columns sum to the mean round trip).
TIME_PARTS = ("upload_read_ms", "decode_preprocess_ms", "queue_ms", "inference_ms", "http_ms")


@dataclass(frozen=True)
class PhonePlan:
    concurrency: int
    requests: int
    decode_rounds: int
    server_options: dict  # the batching server's flags but jpeg_draft, which run_phone_benchmark sets
    start_timeout_s: float


@dataclass(frozen=True)
class DecodeComparison:
    photos: int
    photo_bytes: tuple[int, int, float]  # min, max, mean
    draft_size: tuple[int, int]  # of the first photo, as decoded (after EXIF orientation)
    seconds: dict[str, list[float]]  # per image, per round, FULL and DRAFT
    tensor_diff: np.ndarray  # |draft - full| over every preprocessed value
    served_variant: str  # the engine whose logits were compared (stage 2's name for it)
    logits: dict  # agreement(full logits, draft logits) of the served engine
    reference_logits: dict  # the same for the FP32 reference, and the served engine vs it on full decodes
    preprocessing: Preprocessing  # the served model's, which both decodes went through

    @property
    def time_ratio(self) -> float:
        """Full decode time / draft decode time: the median of the per-round ratios."""
        return float(np.median(np.array(self.seconds[FULL]) / np.array(self.seconds[DRAFT])))

    def as_row(self) -> dict:
        std = np.reshape(self.preprocessing.std, (3, 1, 1))
        grey_levels = self.tensor_diff * (255 * std)  # back to 0-255 pixel values
        low, high, mean = self.photo_bytes
        return (
            {
                "configuration": "phone_decode",
                "photos": self.photos,
                "photo_mb_min": round(low / 1e6, 2),
                "photo_mb_max": round(high / 1e6, 2),
                "photo_mb_mean": round(mean / 1e6, 2),
                "draft_decoded_size": "x".join(map(str, self.draft_size)),
                "decode_rounds": len(self.seconds[FULL]),
                "full_decode_ms_per_image": round(1000 * float(np.median(self.seconds[FULL])), 2),
                "draft_decode_ms_per_image": round(1000 * float(np.median(self.seconds[DRAFT])), 2),
                "full_to_draft_time_ratio": round(self.time_ratio, 2),
                "tensor_max_abs_diff": round(float(self.tensor_diff.max()), 4),
                "tensor_mean_abs_diff": round(float(self.tensor_diff.mean()), 5),
                "pixel_max_abs_diff_levels": round(float(grey_levels.max()), 2),
                "pixel_mean_abs_diff_levels": round(float(grey_levels.mean()), 3),
                "pixel_p99_abs_diff_levels": round(float(np.percentile(grey_levels, 99)), 2),
            }
            | {"served_variant": self.served_variant}
            | {f"draft_vs_full_{name}": value for name, value in self.logits.items()}
            | self.reference_logits
        )

    def summary(self) -> str:
        row = self.as_row()
        return (
            f"phone photos: {self.photos} distinct {'x'.join(map(str, PHONE_PHOTO_SIZE))} JPEGs, "
            f"{row['photo_mb_min']}-{row['photo_mb_max']} MB; draft decodes them to {row['draft_decoded_size']}, "
            f"{row['full_to_draft_time_ratio']}x cheaper than a full decode (decode + preprocess, "
            f"median of {row['decode_rounds']} rounds in turns)\n"
            f"draft vs full decode: preprocessed tensor max |diff| {row['tensor_max_abs_diff']} "
            f"({row['pixel_max_abs_diff_levels']} grey levels), mean {row['tensor_mean_abs_diff']} "
            f"({row['pixel_mean_abs_diff_levels']}); the served engine's ({self.served_variant}) top-1 agreement "
            f"{self.logits['top1_agreement']}, top-5 {self.logits['top5_agreement']}, "
            f"logits SQNR {self.logits['sqnr_db']} dB"
            + (
                f"; FP32's {row['fp32_draft_vs_full_top1_agreement']} / {row['fp32_draft_vs_full_sqnr_db']} dB "
                f"(served vs FP32, both full decodes: {row['served_vs_fp32_top1_agreement']} / "
                f"{row['served_vs_fp32_sqnr_db']} dB)"
                if self.reference_logits
                else ""
            )
        )


def decode_seconds(bodies: list[bytes], rounds: int, preprocessing: Preprocessing) -> dict[str, list[float]]:
    """Seconds per image of decode + preprocess, full and draft, in turns (alternating which goes first)."""
    seconds: dict[str, list[float]] = {FULL: [], DRAFT: []}
    for turn in range(1, rounds + 1):
        for name in turn_order((FULL, DRAFT), turn):
            start = time.perf_counter()
            for body in bodies:
                decode_and_preprocess(body, decoding=DECODINGS[name], preprocessing=preprocessing)
            seconds[name].append((time.perf_counter() - start) / len(bodies))
    return seconds


def compare_decodes(
    served: Choice,
    bodies: list[bytes],
    rounds: int,
    reference: Choice | None = None,
    preprocessing: Preprocessing = DEFAULT_PREPROCESSING,
) -> DecodeComparison:
    """Draft vs full decode of `bodies` with the served model's `preprocessing`: cost (in turns), preprocessed
    tensors, and the `served` engine's logits (and those of `reference`, the FP32 model on onnxruntime, if
    given)."""
    tensors = {
        name: np.stack(
            [decode_and_preprocess(body, decoding=DECODINGS[name], preprocessing=preprocessing) for body in bodies]
        )
        for name in (FULL, DRAFT)
    }

    def logits(engine: Choice) -> dict[str, np.ndarray]:
        session = open_session(
            engine.path,
            engine.backend,
            max_batch_size=BATCH_SIZE,
            precision=engine.precision,
            streams=engine.streams,
            part_size=engine.part_size,
        )
        run = ort_runner(session)  # OpenVINO's session answers the same calls
        return {name: predict(run, array_batches(batch, BATCH_SIZE)) for name, batch in tensors.items()}

    served_logits = logits(served)
    reference_logits = {}
    if reference is not None:
        fp32 = logits(reference)
        reference_logits = (
            {"reference_variant": reference.variant}
            | {f"fp32_draft_vs_full_{k}": v for k, v in agreement(fp32[FULL], fp32[DRAFT]).items()}
            | {f"served_vs_fp32_{k}": v for k, v in agreement(fp32[FULL], served_logits[FULL]).items()}
        )
    sizes = [len(body) for body in bodies]
    return DecodeComparison(
        photos=len(bodies),
        photo_bytes=(min(sizes), max(sizes), float(np.mean(sizes))),
        draft_size=decode_image(bodies[0], jpeg_draft=True, resize_size=preprocessing.resize).size,
        seconds=decode_seconds(bodies, rounds, preprocessing),
        tensor_diff=np.abs(tensors[DRAFT] - tensors[FULL]),
        served_variant=served.variant,
        logits=agreement(served_logits[FULL], served_logits[DRAFT]),
        reference_logits=reference_logits,
        preprocessing=preprocessing,
    )


def time_breakdown(result: LoadResult) -> dict:
    """Mean ms per request of each part of its round trip (TIME_PARTS, which sum to the round trip).

    Decode + preprocess (including the wait for a decode thread), queue and inference (its batch's whole
    call) are what the server reported in each response; the server's request-latency histogram covers
    the endpoint from arrival, so the endpoint time not in those three is reading and parsing the upload
    (and the cache lookup), and the round trip not in the endpoint is HTTP: sending, the connection,
    HTTP parsing, the response and the client's own work.
    """
    if result.latency is None:  # no request succeeded: no round trip to split
        return {f"time_{name}": float("nan") for name in TIME_PARTS}
    server = result.server
    parts = {
        "decode_preprocess_ms": server["mean_preprocess_ms"],
        "queue_ms": server["mean_queue_ms"],
        "inference_ms": server["mean_inference_ms"],
    }
    endpoint_ms = metrics_row(result.metrics)["metrics_request_ms"]
    parts |= {"upload_read_ms": endpoint_ms - sum(parts.values()), "http_ms": result.latency.mean_ms - endpoint_ms}
    return {f"time_{name}": round(parts[name], 2) for name in TIME_PARTS}


@dataclass(frozen=True)
class PhoneResult:
    plan: PhonePlan
    decode: DecodeComparison
    loads: dict[bool, LoadResult]  # jpeg_draft -> the batching server under phone uploads
    settings: dict[bool, dict]

    def rows(self, environment: dict) -> list[dict]:
        """The decode comparison, then one row per server (draft on, off); each ends with `environment`."""
        # The environment's load-image columns name the 500x375 photos of the other stage-5 rows: not these.
        photos = {"load_image_size": "x".join(map(str, PHONE_PHOTO_SIZE)), "load_image_quality": PHONE_PHOTO_QUALITY}
        rows = [self.decode.as_row()]
        rows += [
            {"configuration": "phone_upload", "jpeg_draft": int(draft)}
            | result.as_row()
            | time_breakdown(result)
            | self.settings[draft]
            for draft, result in self.loads.items()
        ]
        rows[1]["draft_speedup"] = loadtest.ratio(self.loads[True].rps, self.loads[False].rps)
        return [row | environment | photos for row in rows]

    def summary(self) -> str:
        lines = [self.decode.summary()]
        for draft, result in self.loads.items():
            parts = time_breakdown(result)
            lines.append(
                f"phone uploads, jpeg_draft {int(draft)}: {result.summary()}; mean round trip "
                f"{sum(parts.values()):.0f} ms = "
                + " + ".join(
                    f"{name.removesuffix('_ms').replace('_', ' ')} {parts[f'time_{name}']:.0f}" for name in TIME_PARTS
                )
                + " ms"
            )
        return "\n".join(lines)


def run_phone_benchmark(model: Path, bodies: list[bytes], plan: PhonePlan) -> PhoneResult:
    """The decode comparison in process, then the batching server with draft decoding on, then off.
    The decode comparison runs what those servers serve for `model` (`--backend auto`), and the FP32 model
    beside `model` on onnxruntime as the reference, unless that is what is served."""
    served = resolve_auto(model)
    reference = explicit(model.parent / FP32_ONNX, "onnxruntime")
    decode = compare_decodes(
        served,
        bodies,
        plan.decode_rounds,
        reference if reference.path.is_file() and reference.variant != served.variant else None,
        model_preprocessing(model.parent),
    )
    print(decode.summary())
    loads, settings = {}, {}
    for draft in (True, False):
        with loadtest.ServerProcess(model, plan.start_timeout_s, **plan.server_options, jpeg_draft=int(draft)) as url:
            settings[draft] = loadtest.server_settings(url)
            loadtest.warm_up(url, bodies, plan.concurrency)
            loads[draft] = loadtest.run_with_metrics(
                url,
                partial(
                    loadtest.run_closed_loop,
                    bodies=bodies,
                    concurrency=plan.concurrency,
                    count=plan.requests,
                    desc=f"phone photos, jpeg_draft {int(draft)}",
                ),
            )
    return PhoneResult(plan, decode, loads, settings)
