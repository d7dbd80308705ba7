"""The in-process limit decodes each body as the server it is compared with does: with that server's
jpeg_draft and resize_crop_only settings, not defaults of its own."""

import io
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from conftest import EVERY_DECODING, decoding_id
from mnv3 import limit
from mnv3.backend_choice import explicit
from mnv3.preprocess import DEFAULT_PREPROCESSING, EXACT_DECODING, JPEG_DRAFT_MARGIN, decode_and_preprocess

pytestmark = pytest.mark.unit

SIDE = 2 * JPEG_DRAFT_MARGIN * DEFAULT_PREPROCESSING.resize  # the smallest JPEG a draft decode reduces


class RecordingSession:
    """Stands in for the engine: keeps every batch it is given."""

    def __init__(self):
        self.batches = []

    def get_inputs(self):
        return [SimpleNamespace(name="input")]

    def run(self, output_names, feeds):
        [batch] = feeds.values()
        self.batches.append(batch)
        return [np.zeros((len(batch), 10), dtype=np.float32)]


@pytest.fixture
def sessions(monkeypatch) -> list[RecordingSession]:
    """Every session the limit opens, in order."""
    opened = []

    def open_recording_session(*args, **kwargs):
        opened.append(RecordingSession())
        return opened[-1]

    monkeypatch.setattr(limit, "open_session", open_recording_session)
    return opened


def large_jpeg() -> bytes:
    # 4:3, as a photo: a square one's resize scales by a whole number, where resizing the crop alone is exact
    pixels = np.random.default_rng(0).integers(0, 256, (SIDE, SIDE * 4 // 3, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


@pytest.mark.parametrize("decoding", EVERY_DECODING, ids=decoding_id)
def test_the_limit_decodes_with_the_settings_it_is_given(sessions, tmp_path, decoding):
    body = large_jpeg()
    decoded = {setting: decode_and_preprocess(body, decoding=setting) for setting in EVERY_DECODING}
    # large enough for each setting to matter: every combination decodes it differently
    assert len({array.tobytes() for array in decoded.values()}) == len(EVERY_DECODING)

    # No manifest beside the model: the limit preprocesses as torchvision does, as decode_and_preprocess above.
    confirmed, grid, finalists = limit.run_limit(
        "recording",
        explicit(tmp_path / "model.onnx", "onnxruntime"),
        [body],
        decoding,
        batch_sizes=(1,),
        thread_splits=((1, 1),),
        confirm_passes=1,
        desc=None,
    )

    batches = [batch for session in sessions for batch in session.batches]
    # the one configuration's warm-up and pass, the run-off's warm-up and passes, the confirming warm-up and pass
    assert len(batches) == 2 + (1 + limit.FINAL_ROUNDS) + 2
    for batch in batches:
        np.testing.assert_array_equal(batch, decoded[decoding][None])
    assert [result.decoding for result in [*grid, *finalists, confirmed]] == [decoding] * 3
    row = confirmed.as_row()  # the settings as columns of their own
    assert "decoding" not in row and {name: row[name] for name in decoding.record()} == decoding.record()


def test_the_limit_says_how_much_of_its_cpu_went_to_decoding(sessions, tmp_path):
    """The decode threads' CPU, apart: the engine here does nothing, so decoding is nearly all of it."""
    result = limit.measure_limit(
        "recording",
        explicit(tmp_path / "model.onnx", "onnxruntime"),
        [large_jpeg()] * 8,
        EXACT_DECODING,
        4,
        1,
        2,
        passes=2,
    )
    assert 0.5 * result.cpu_seconds < result.preprocess_cpu_seconds <= result.cpu_seconds
    row = result.as_row()
    assert row["preprocess_cpu_ms_per_image"] == pytest.approx(1000 * result.preprocess_cpu_seconds / 16, abs=0.001)


def test_the_limit_configuration_is_chosen_in_turns_not_by_one_lucky_pass(monkeypatch, tmp_path):
    """The grid's one-pass winner (batch 1 here) is slower than the runner-up when both are measured again."""
    ran = []
    # A clock that only the inference calls move: a busy machine's scheduling noise (real sleeps) decided it.
    now = [0.0]
    monkeypatch.setattr(limit, "time", SimpleNamespace(perf_counter=lambda: now[0]))

    class TimedSession(RecordingSession):
        def __init__(self, batch_size):
            super().__init__()
            self.batch_size = batch_size

        def run(self, output_names, feeds):
            ran.append(self.batch_size)
            now[0] += 0.004 if self.batch_size == 1 else 0.001
            return super().run(output_names, feeds)

    monkeypatch.setattr(limit, "open_session", lambda *args, max_batch_size, **kwargs: TimedSession(max_batch_size))
    one_pass = {1: 0.001, 2: 0.01, 4: 1.0}  # seconds for the grid's pass of each batch size: batch 1 was lucky
    grid = [limit.LimitResult("e", b, 1, 1, EXACT_DECODING, 4, seconds, 0.0, 0.0) for b, seconds in one_pass.items()]
    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), "gray").save(buffer, format="JPEG")
    served = explicit(tmp_path / "model.onnx", "onnxruntime")

    finalists = limit.run_off(grid, served, [buffer.getvalue()] * 4, finalists=2, rounds=4)

    assert [r.batch_size for r in finalists] == [1, 2]  # the grid's two fastest
    assert all(r.images == 4 * 4 for r in finalists)
    assert limit.fastest(finalists).batch_size == 2  # batch 1 lost in turns
    # after both warm-ups, the passes in mirrored turns: 1 2, 2 1, 1 2, 2 1 (a pass is 4 batches of 1 or 2 of 2)
    assert ran[2:] == [1] * 4 + [2] * 4 + [1] * 8 + [2] * 4 + [1] * 4
