"""mnv3.preprocess (numpy/Pillow) must match torchvision's own transforms for the weights we ship."""
import numpy as np
import pytest
from torchvision.models import MobileNet_V3_Large_Weights

from mnv3.photos import HELD_OUT_SOURCES, source_photos
from mnv3.preprocess import preprocess

pytestmark = pytest.mark.unit

PHOTOS = source_photos(HELD_OUT_SOURCES[:2])
# (width, height): landscape, portrait, square, tall and thin, smaller than the crop, already 256 short side.
SIZES = [(640, 480), (375, 500), (300, 300), (1200, 260), (200, 150), (256, 341)]


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("photo_index", range(len(PHOTOS)))
def test_preprocess_matches_torchvision_transforms(photo_index, size):
    image = PHOTOS[photo_index].resize(size)
    expected = MobileNet_V3_Large_Weights.IMAGENET1K_V1.transforms()(image).numpy()
    actual = preprocess(image)
    assert actual.shape == expected.shape == (3, 224, 224)
    assert actual.dtype == np.float32
    assert np.abs(actual - expected).max() <= 1e-3
