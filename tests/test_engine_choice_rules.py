"""The rules of `--backend auto` on their own, with no model loaded: which measured variant stage 2 chooses, what
the agreement guard says, and what `resolve_auto` makes of the manifest beside a model. (test_backend_choice.py
runs them with real engines.)"""

import json
from pathlib import Path

import pytest

from conftest import REAL_WEIGHTS, engine_choice_entry
from mnv3.artifacts import FP32_ONNX, MANIFEST_JSON, STATIC_INT8_ONNX, update_manifest
from mnv3.backend_choice import MANIFEST_KEY, SERVED_KEYS, Choice, choose, guard_note, resolve_auto
from mnv3.report import cpu_info

pytestmark = pytest.mark.unit


def timed(variant: str, batch_1: float, per_image: float, top1: float | None = None) -> dict:
    """A row of stage 2's engine table: its times against ONNX FP32's and its top-1 agreement with FP32."""
    return {
        "variant": variant,
        "mean_ms_vs_onnx_fp32": batch_1,
        "per_image_ms_vs_onnx_fp32": per_image,
        "top1_agreement": "" if top1 is None else top1,
    }


def test_the_choice_is_the_fastest_by_both_sizes_and_the_guard_refuses_only_when_it_applies():
    rows = [
        timed("onnxruntime_fp32", 1.0, 1.0),  # no agreement of its own: FP32 always qualifies
        timed("fast_at_batch_1", 0.3, 0.9, top1=1.0),  # geometric mean 0.52
        timed("fast_both", 0.5, 0.5, top1=1.0),  # 0.5: fastest over both sizes
        timed("fastest_but_off", 0.2, 0.2, top1=0.98),
    ]
    assert choose(rows, 0.99, guard_applies=False) == (rows[3], {})
    chosen, refused = choose(rows, 0.99, guard_applies=True)
    assert chosen is rows[2]
    assert refused == {"fastest_but_off": "top-1 agreement with FP32 0.9800 < 0.99"}
    assert choose(rows, 0.98, guard_applies=True)[0] is rows[3]  # at the threshold it qualifies
    everything_off = [timed("off", 0.5, 0.5, top1=0.5)]
    with pytest.raises(ValueError, match="no variant"):
        choose(everything_off, 0.99, guard_applies=True)


def test_the_guard_note_names_its_photos_and_says_when_they_allow_no_disagreement():
    assert guard_note(REAL_WEIGHTS, 0.99, 512, labelled=False).endswith(">= 0.99 on the 512 held-out photos")
    few = guard_note(REAL_WEIGHTS, 0.99, 50, labelled=True)  # a user's 50 --labels photos: 0.98 is one photo
    assert "on the 50 held-out photos; of 50, a single disagreement refuses a variant" in few
    assert "single disagreement" in guard_note(REAL_WEIGHTS, 1.0, 512, labelled=False)
    assert guard_note("random-init", 0.99, 16, labelled=False).startswith("not applied")


def test_the_guard_note_of_a_users_weights_says_when_it_measured_on_the_sample_photos():
    # a fine-tune's agreement on photos outside its classes says little; nothing said so
    sample = guard_note("file:0123456789ab", 0.99, 512, labelled=False)
    assert sample.endswith(
        "on the 512 held-out photos (the sample photos scikit-image and matplotlib ship, not "
        "yours: a fine-tune's classes may not be among them; pass --labels with your labelled "
        "photos for an agreement on its own)"
    )
    assert guard_note("file:0123456789ab", 0.99, 512, labelled=True).endswith("on the 512 held-out photos")


@pytest.fixture
def models(tmp_path):
    """A folder with the two files stage 2 leaves (their contents are never read here)."""
    for name in (FP32_ONNX, STATIC_INT8_ONNX):
        (tmp_path / name).write_bytes(b"")
    return tmp_path


def test_auto_serves_the_choice_for_its_model_and_falls_back_otherwise(models):
    no_manifest = resolve_auto(models / STATIC_INT8_ONNX)
    assert (no_manifest.backend, no_manifest.fallback, no_manifest.unservable) == ("onnxruntime", True, False)
    assert "no engine choice" in no_manifest.reason and "static_quantization.py" in no_manifest.reason

    update_manifest(models, **{MANIFEST_KEY: engine_choice_entry("onnxruntime", STATIC_INT8_ONNX)})
    chosen = resolve_auto(models / STATIC_INT8_ONNX)
    assert (chosen.path, chosen.backend, chosen.fallback) == (models / STATIC_INT8_ONNX, "onnxruntime", False)
    assert chosen.reason.startswith("fastest of 3 engine x precision variants")

    other = resolve_auto(models / FP32_ONNX)  # nothing measured FP32 as the served file
    assert (other.path, other.fallback, other.unservable) == (models / FP32_ONNX, True, False)
    assert f"for {STATIC_INT8_ONNX}, not {FP32_ONNX}" in other.reason

    update_manifest(models, **{MANIFEST_KEY: engine_choice_entry("openvino", "gone.xml")})
    missing = resolve_auto(models / STATIC_INT8_ONNX)
    assert (missing.backend, missing.unservable) == ("onnxruntime", True) and "gone.xml is missing" in missing.reason


def test_a_choice_measured_on_another_machine_is_served_and_says_so(models):
    # an image built where stage 2 ran, served on another CPU: the log said "fastest ... on this machine"
    here = cpu_info()
    for elsewhere in ({"cpu": here["cpu"] + " (another)"}, {"isa": here["isa"] + " amx_fp16"}):
        update_manifest(models, **{MANIFEST_KEY: engine_choice_entry("onnxruntime", STATIC_INT8_ONNX) | elsewhere})
        choice = resolve_auto(models / STATIC_INT8_ONNX)
        assert (choice.path, choice.fallback, choice.measured_elsewhere) == (models / STATIC_INT8_ONNX, False, True)
        assert "; stage 2 ran on another kind of machine (" in choice.reason and "rerun stage 2" in choice.reason
    # the same kind of machine with more cores (os.cpu_count is a host's, whatever a container gets), an
    # unnamed CPU (aarch64 Linux, macOS: nothing tells two apart), or a manifest that records none: no claim
    for same in ({"cores": here["cores"] * 2}, {"cpu": "unknown"}, {"cpu": None}):
        entry = engine_choice_entry("onnxruntime", STATIC_INT8_ONNX) | same
        update_manifest(models, **{MANIFEST_KEY: {k: v for k, v in entry.items() if v is not None}})
        assert not resolve_auto(models / STATIC_INT8_ONNX).measured_elsewhere, same


@pytest.mark.parametrize("lacks", SERVED_KEYS)
def test_an_engine_choice_edited_by_hand_is_served_around_and_named(models, lacks):
    entry = engine_choice_entry("onnxruntime", STATIC_INT8_ONNX)
    del entry[lacks]
    update_manifest(models, **{MANIFEST_KEY: entry})
    choice = resolve_auto(models / STATIC_INT8_ONNX)  # was a KeyError's traceback at the server's start
    assert (choice.path, choice.backend, choice.unservable) == (models / STATIC_INT8_ONNX, "onnxruntime", True)
    assert f"manifest.json lacks {lacks} (rerun stage 2" in choice.reason


@pytest.mark.parametrize(("key", "value"), [("file", None), ("streams", "2"), ("streams", True), ("part_size", "16")])
def test_an_engine_choice_with_a_value_of_the_wrong_type_is_served_around_and_named(models, key, value):
    entry = engine_choice_entry("onnxruntime", STATIC_INT8_ONNX) | {key: value}
    update_manifest(models, **{MANIFEST_KEY: entry})
    choice = resolve_auto(models / STATIC_INT8_ONNX)  # file null was a TypeError; a text streams a load error
    assert (choice.path, choice.backend, choice.unservable) == (models / STATIC_INT8_ONNX, "onnxruntime", True)
    assert f"has a value of the wrong type for {key} (rerun stage 2" in choice.reason


def test_an_engine_choice_that_is_not_a_record_is_named(models):
    manifest = models / MANIFEST_JSON
    manifest.write_text(json.dumps({MANIFEST_KEY: "openvino"}))
    choice = resolve_auto(models / STATIC_INT8_ONNX)
    assert choice.unservable and f"lacks {', '.join(SERVED_KEYS)}" in choice.reason


@pytest.mark.parametrize(
    ("measured_on", "serving_on", "expected"),
    [
        (2, 2, 2),  # stage 2 measured every thread fastest for a server on 2 threads
        (2, 8, 4),  # measured on 2, not for 8: half
        (None, 1, 1),  # nothing measured, a single thread: at least 1
        (None, 8, 4),
    ],
)
def test_batches_get_the_threads_stage_2_measured_for_these_threads_else_half(measured_on, serving_on, expected):
    entry = engine_choice_entry("openvino", STATIC_INT8_ONNX) | (
        {} if measured_on is None else {"threads": measured_on, "batch_threads": measured_on}
    )
    choice = Choice(Path(STATIC_INT8_ONNX), "openvino", "f32", "auto", "test", manifest_entry=entry)
    assert choice.batch_threads(serving_on) == expected
