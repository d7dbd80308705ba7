"""perf_analyzer's data file: each photo as base64 of what goes on the wire, a uint32 LE length then the bytes."""

import base64
import struct

import pytest

from mnv3.perf_analyzer_setup import photos_data
from mnv3.v2_protocol import IMAGE_INPUT

pytestmark = pytest.mark.unit


def test_each_photo_is_length_prefixed_as_a_binary_bytes_element():
    photos = [b"\xff\xd8first photo", bytes(range(256)) * 2]
    steps = photos_data(photos)["data"]
    assert len(steps) == len(photos)
    for step, photo in zip(steps, photos, strict=True):
        wire = base64.b64decode(step[IMAGE_INPUT]["b64"])
        assert struct.unpack_from("<I", wire)[0] == len(photo) and wire[4:] == photo
