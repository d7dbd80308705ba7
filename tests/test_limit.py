"""The in-process limit decodes each body as the server it is compared with does: with that server's
jpeg_draft setting, not a default of its own."""

import io
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from mnv3 import limit
from mnv3.backend_choice import explicit
from mnv3.preprocess import DEFAULT_PREPROCESSING, JPEG_DRAFT_MARGIN, decode_and_preprocess

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
    pixels = np.random.default_rng(0).integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


@pytest.mark.parametrize("jpeg_draft", [False, True])
def test_the_limit_decodes_with_the_jpeg_draft_setting_it_is_given(sessions, tmp_path, jpeg_draft):
    body = large_jpeg()
    decoded = {draft: decode_and_preprocess(body, jpeg_draft=draft) for draft in (False, True)}
    assert not np.array_equal(decoded[False], decoded[True])  # large enough for the setting to matter

    # No manifest beside the model: the limit preprocesses as torchvision does, as decode_and_preprocess above.
    confirmed, grid = limit.run_limit(
        "recording",
        explicit(tmp_path / "model.onnx", "onnxruntime"),
        [body],
        jpeg_draft,
        batch_sizes=(1,),
        thread_splits=((1, 1),),
        confirm_passes=1,
        desc=None,
    )

    batches = [batch for session in sessions for batch in session.batches]
    assert len(batches) == 4  # the one configuration's warm-up and pass, then the confirming warm-up and pass
    for batch in batches:
        np.testing.assert_array_equal(batch, decoded[jpeg_draft][None])
    assert [result.jpeg_draft for result in [*grid, confirmed]] == [jpeg_draft, jpeg_draft]
