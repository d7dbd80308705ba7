"""Phone-size photos and JPEG draft decoding: the generator makes what a phone uploads, and the draft
decode stays close to a full decode where it applies and changes nothing where it does not."""

import io

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from conftest import EVERY_DECODING, decoding_id, post_file, wait_until
from mnv3.backend_choice import explicit
from mnv3.config import ServerConfig, parse_args
from mnv3.engine import Engine
from mnv3.phone_benchmark import compare_decodes
from mnv3.photos import (
    EXIF_ORIENTATION_TAG,
    HELD_OUT_SOURCES,
    PHONE_ORIENTATIONS,
    PHONE_PHOTO_SIZE,
    phone_photo,
    phone_photos,
    source_photos,
)
from mnv3.preprocess import (
    DEFAULT_PREPROCESSING,
    EXACT_DECODING,
    JPEG_DRAFT_MARGIN,
    RESIZE_SIZE,
    Decoding,
    ImageTooLarge,
    Preprocessing,
    decode_and_preprocess,
    decode_image,
    jpeg_draft_reduction,
    open_image,
    preprocess,
)
from mnv3.server import create_app
from test_preprocess import SIZES as EQUALITY_TEST_SIZES

# How far a draft decode's preprocessed tensor may be from the full decode's, in normalised units (one
# grey level is 1/(255*std) ~ 0.017): about 8 grey levels at most, half a grey level on average.
# Measured on the 64 phone photos of make bench: at most 5 grey levels, 0.2 on average.
DRAFT_MAX_ABS_DIFF = 0.15
DRAFT_MEAN_ABS_DIFF = 0.01
SMALLEST_DRAFTED_SIDE = 2 * JPEG_DRAFT_MARGIN * RESIZE_SIZE
WIDTH, HEIGHT = PHONE_PHOTO_SIZE

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def oriented():
    """The same view of one photo stored as a phone held upright (1), upside down (3) and in portrait (6)."""
    [photo] = source_photos(HELD_OUT_SOURCES[:1])
    return {orientation: phone_photo(photo, orientation, np.random.default_rng(0)) for orientation in (1, 3, 6)}


def encode(image: Image.Image, format: str, **params) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=format, **params)
    return buffer.getvalue()


def photo_of_size(width: int, height: int) -> Image.Image:
    [photo] = source_photos(HELD_OUT_SOURCES[1:2])
    return photo.resize((width, height), Image.BILINEAR)


@pytest.mark.slow
def test_phone_photos_are_distinct_12_megapixel_jpegs_of_2_to_4_mb():
    bodies = phone_photos(4, seed=5)
    assert len(set(bodies)) == 4
    for body in bodies:
        assert 2_000_000 <= len(body) <= 4_000_000
        image = Image.open(io.BytesIO(body))
        assert (image.format, image.size) == ("JPEG", PHONE_PHOTO_SIZE)
        assert image.getexif()[EXIF_ORIENTATION_TAG] in PHONE_ORIENTATIONS
    assert phone_photos(2, seed=5) == bodies[:2]  # seeded: a rerun measures the same photos


def test_exif_orientation_is_applied_to_a_draft_decode(oriented):
    portrait = decode_image(oriented[6])
    assert portrait.size == (HEIGHT // 4, WIDTH // 4)  # stored landscape, reduced 4x, turned upright
    upright, upside_down = (preprocess(decode_image(oriented[o])) for o in (1, 3))
    # The same view stored upside down with its tag says so comes out as the upright one (JPEG blocks aside).
    assert np.abs(upright - upside_down).mean() < DRAFT_MEAN_ABS_DIFF
    assert np.abs(upright - preprocess(decode_image(oriented[3], jpeg_draft=False))).mean() < DRAFT_MEAN_ABS_DIFF


@pytest.mark.parametrize("orientation", [1, 6])
def test_draft_decode_of_a_phone_photo_is_close_to_the_full_decode(oriented, orientation):
    body = oriented[orientation]
    drafted, full = decode_image(body, jpeg_draft=True), decode_image(body, jpeg_draft=False)
    assert full.size in (PHONE_PHOTO_SIZE, PHONE_PHOTO_SIZE[::-1])
    assert min(drafted.size) == min(full.size) // 4 >= JPEG_DRAFT_MARGIN * RESIZE_SIZE  # reduced, not below the margin
    difference = np.abs(preprocess(drafted) - preprocess(full))
    assert 0 < difference.max() <= DRAFT_MAX_ABS_DIFF  # close, and not equal: the draft path really ran
    assert difference.mean() <= DRAFT_MEAN_ABS_DIFF


def test_draft_reduction_keeps_the_margin():
    assert jpeg_draft_reduction(WIDTH, HEIGHT) == 4  # 3024 // 8 = 378 < 512 <= 3024 // 4 = 756
    assert jpeg_draft_reduction(SMALLEST_DRAFTED_SIDE, SMALLEST_DRAFTED_SIDE) == 2
    assert jpeg_draft_reduction(SMALLEST_DRAFTED_SIDE - 1, 10_000) == 1
    assert jpeg_draft_reduction(8000, 8 * SMALLEST_DRAFTED_SIDE // 2) == 8
    assert jpeg_draft_reduction(4000, 3000, resize_size=1024) == 1  # a model that resizes to more needs more


# Every size the torchvision equality test uses is among them: draft decoding never reaches it.
@pytest.mark.parametrize("width, height", [(SMALLEST_DRAFTED_SIDE - 1, 1400), *EQUALITY_TEST_SIZES])
def test_draft_changes_nothing_for_a_jpeg_under_twice_the_margin(width, height):
    body = encode(photo_of_size(width, height), "JPEG", quality=90)
    drafted, full = decode_image(body, jpeg_draft=True), decode_image(body, jpeg_draft=False)
    assert drafted.size == full.size == (width, height)
    assert np.array_equal(np.asarray(drafted), np.asarray(full))


def test_draft_starts_at_twice_the_margin():
    body = encode(photo_of_size(SMALLEST_DRAFTED_SIDE, 1400), "JPEG", quality=90)
    assert decode_image(body).size == (SMALLEST_DRAFTED_SIDE // 2, 700)


@pytest.mark.parametrize("format", ["PNG", "WEBP"])
def test_draft_changes_nothing_for_other_formats(format):
    body = encode(photo_of_size(2048, 1536), format)
    drafted, full = decode_image(body, jpeg_draft=True), decode_image(body, jpeg_draft=False)
    assert drafted.size == full.size == (2048, 1536)
    assert np.array_equal(np.asarray(drafted), np.asarray(full))


def test_draft_applies_to_a_phone_mpo_too():
    image = photo_of_size(2048, 1536)
    body = encode(image, "MPO", save_all=True, append_images=[image.resize((1024, 768))])
    assert Image.open(io.BytesIO(body)).format == "MPO"
    assert decode_image(body).size == (1024, 768)
    assert decode_image(body, jpeg_draft=False).size == (2048, 1536)


def test_pixel_limit_is_checked_from_the_header_before_any_draft_decode(oriented):
    header_only = oriented[1][:4096]  # no image data: anything that decoded would fail as truncated
    with pytest.raises(ImageTooLarge, match=f"{WIDTH}x{HEIGHT}"):
        decode_image(header_only, max_pixels=WIDTH * HEIGHT - 1, jpeg_draft=True)
    assert decode_image(oriented[1], max_pixels=WIDTH * HEIGHT).size == (WIDTH // 4, HEIGHT // 4)


@pytest.mark.parametrize("name", ["jpeg_draft", "resize_crop_only"])
def test_the_decoding_shortcuts_are_server_settings(name):
    flag, variable = f"--{name.replace('_', '-')}", f"MNV3_{name.upper()}"
    assert getattr(parse_args(["--model", "m.onnx"], environ={}), name) == 1
    assert getattr(parse_args(["--model", "m.onnx"], environ={variable: "0"}), name) == 0
    assert getattr(parse_args(["--model", "m.onnx"], environ={variable: "0"}).decoding, name) is False
    with pytest.raises(SystemExit):
        parse_args(["--model", "m.onnx", flag, "2"], environ={})


# A model trained with a resize of 512 needs twice the margin of it, 1024 rows: the draft at 256 (half) is too small.
LARGER_RESIZE = Preprocessing(resize=512, crop=448)
DRAFTED_AT_256_ONLY = (1500, 1100)


@pytest.fixture(scope="module")
def drafted_at_256_only():
    """A JPEG just large enough for a half-scale draft at the default resize, and too small for one at 512."""
    assert jpeg_draft_reduction(*DRAFTED_AT_256_ONLY) == 2
    assert jpeg_draft_reduction(*DRAFTED_AT_256_ONLY, resize_size=LARGER_RESIZE.resize) == 1
    return encode(photo_of_size(*DRAFTED_AT_256_ONLY), "JPEG", quality=90)


def test_decode_and_preprocess_takes_the_shortcuts_its_decoding_says_at_the_models_resize(drafted_at_256_only):
    # What each upload goes through, in the fast tier (a slow test checks it through the server): the decoding
    # settings are passed on (not every decode drafted, or resized the crop only), and the model's resize (not a
    # draft for 256 given a model that resizes to 512)
    body = drafted_at_256_only
    full = decode_image(body, jpeg_draft=False)
    for preprocessing in (DEFAULT_PREPROCESSING, LARGER_RESIZE):
        exact = preprocess(full, preprocessing, resize_crop_only=False)
        actual = decode_and_preprocess(body, decoding=EXACT_DECODING, preprocessing=preprocessing)
        np.testing.assert_array_equal(actual, exact)
        drafted = decode_and_preprocess(body, decoding=Decoding(resize_crop_only=False), preprocessing=preprocessing)
        assert np.array_equal(drafted, exact) is (preprocessing.resize == 512)  # a half-scale draft at 256 only
        crop_only = decode_and_preprocess(body, decoding=Decoding(jpeg_draft=False), preprocessing=preprocessing)
        np.testing.assert_array_equal(crop_only, preprocess(full, preprocessing, resize_crop_only=True))
        assert not np.array_equal(crop_only, exact)


def test_a_local_file_is_decoded_as_an_upload_for_its_models_resize(drafted_at_256_only, tmp_path):
    (tmp_path / "large.jpg").write_bytes(drafted_at_256_only)
    assert open_image(tmp_path / "large.jpg").size == (750, 550)
    opened = open_image(tmp_path / "large.jpg", LARGER_RESIZE)
    assert opened.size == DRAFTED_AT_256_ONLY
    assert np.array_equal(np.asarray(opened), np.asarray(decode_image(drafted_at_256_only, jpeg_draft=False)))


@pytest.mark.slow
@pytest.mark.parametrize("decoding", EVERY_DECODING, ids=decoding_id)
def test_the_server_decodes_as_its_settings_say(fp32_model_path, oriented, decoding):
    body = oriented[6]
    expected = {setting: decode_and_preprocess(body, decoding=setting) for setting in EVERY_DECODING}
    assert len({array.tobytes() for array in expected.values()}) == len(EVERY_DECODING)  # the four decodes differ
    engine = Engine.load(fp32_model_path)
    inputs = []  # what the engine is asked to classify, after the warm-up
    predict = engine.predict
    settings = {name: int(value) for name, value in decoding.record().items()}
    with TestClient(create_app(ServerConfig(model=fp32_model_path, cache_size=0, **settings), engine)) as client:
        wait_until(lambda: client.get("/readyz").status_code == 200, "warm-up")
        engine.predict = lambda batch: inputs.append(batch.copy()) or predict(batch)
        response = post_file(client, body)
        preprocessing = client.get("/model").json()["preprocessing"]
    assert response.status_code == 200
    [batch] = inputs
    np.testing.assert_array_equal(batch, expected[decoding][None])
    assert {name: preprocessing[name] for name in settings} == decoding.record()


@pytest.mark.slow
def test_decode_comparison_measures_the_draft_against_the_full_decode(fp32_model_path, oriented):
    bodies = [oriented[1], oriented[6]]
    on_onnxruntime = explicit(fp32_model_path, "onnxruntime")
    comparison = compare_decodes(on_onnxruntime, bodies, rounds=1, reference=on_onnxruntime)
    row = comparison.as_row()
    assert (row["photos"], row["decode_rounds"], row["draft_decoded_size"]) == (2, 1, f"{WIDTH // 4}x{HEIGHT // 4}")
    assert 0 < row["tensor_mean_abs_diff"] <= row["tensor_max_abs_diff"] <= DRAFT_MAX_ABS_DIFF
    # one round: the ratio is that round's full time over its draft time
    assert row["full_to_draft_time_ratio"] == pytest.approx(
        row["full_decode_ms_per_image"] / row["draft_decode_ms_per_image"], rel=0.01
    )
    # The reference is the served model itself here: the same comparison, and full agreement with itself.
    for name in ("top1_agreement", "top5_agreement", "sqnr_db"):
        assert row[f"fp32_draft_vs_full_{name}"] == row[f"draft_vs_full_{name}"]
    assert (row["served_vs_fp32_top1_agreement"], row["served_vs_fp32_sqnr_db"]) == (1.0, float("inf"))
    assert np.isfinite(row["draft_vs_full_sqnr_db"])  # the draft did change the logits


@pytest.mark.slow
def test_decode_comparison_runs_the_served_engine_beside_fp32_on_onnxruntime(fp32_model_path, oriented):
    pytest.importorskip("openvino", reason="optional backend: pip install -r requirements-openvino.txt")
    served = explicit(fp32_model_path, "openvino", "f32")
    comparison = compare_decodes(served, [oriented[1]], rounds=1, reference=explicit(fp32_model_path, "onnxruntime"))
    row = comparison.as_row()
    assert (row["served_variant"], row["reference_variant"]) == ("openvino_fp32_f32", "onnxruntime_fp32")
    # The same network in two runtimes: close, but not the bit-identical logits one runtime gives twice.
    assert 60 < row["served_vs_fp32_sqnr_db"] < float("inf") and row["served_vs_fp32_top1_agreement"] == 1.0


@pytest.mark.slow
def test_decode_comparison_uses_the_served_models_preprocessing(fp32_model_path, oriented):
    # A model trained with a larger resize needs a larger draft: a quarter-size decode no longer keeps twice it.
    preprocessing = Preprocessing(resize=400, crop=224, std=(0.5, 0.5, 0.5))
    comparison = compare_decodes(
        explicit(fp32_model_path, "onnxruntime"), [oriented[1]], rounds=1, preprocessing=preprocessing
    )
    row = comparison.as_row()
    assert row["draft_decoded_size"] == f"{WIDTH // 2}x{HEIGHT // 2}"
    # Grey levels are the tensor difference scaled back with this model's std, not ImageNet's.
    assert row["pixel_max_abs_diff_levels"] == pytest.approx(row["tensor_max_abs_diff"] * 255 * 0.5, abs=0.05)
