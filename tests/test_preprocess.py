"""mnv3.preprocess (numpy/Pillow) must match torchvision's own transforms for the weights we ship: exactly
(up to float rounding) when it resizes the whole image, within one grey level when it resizes only the crop."""

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.models import MobileNet_V3_Large_Weights

from mnv3.photos import HELD_OUT_SOURCES, source_photos
from mnv3.preprocess import DEFAULT_PREPROCESSING, open_image, preprocess, preprocess_batch

pytestmark = pytest.mark.unit

PHOTOS = source_photos(HELD_OUT_SOURCES[:2])
# (width, height): landscape, portrait, square, tall and thin, smaller than the crop, already 256 short side, and
# resized to 343 x 256 and 256 x 343, whose centre crop starts at 59.5 (torchvision rounds it half to even, to 60).
SIZES = [(640, 480), (375, 500), (300, 300), (1200, 260), (200, 150), (256, 341), (686, 512), (512, 686)]


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("photo_index", range(len(PHOTOS)))
def test_preprocess_matches_torchvision_transforms(photo_index, size):
    image = PHOTOS[photo_index].resize(size)
    expected = MobileNet_V3_Large_Weights.IMAGENET1K_V1.transforms()(image).numpy()
    actual = preprocess(image, resize_crop_only=False)
    assert actual.shape == expected.shape == (3, 224, 224)
    assert actual.dtype == np.float32
    assert np.abs(actual - expected).max() <= 1e-3


def test_resizing_only_the_crop_stays_within_one_grey_level_of_torchvision_transforms():
    transform = MobileNet_V3_Large_Weights.IMAGENET1K_V1.transforms()
    one_level = 1 / (255 * min(DEFAULT_PREPROCESSING.std))  # a grey level, normalised
    differing, values = 0, 0
    for photo in PHOTOS:
        for size in SIZES:
            image = photo.resize(size)
            difference = np.abs(preprocess(image) - transform(image).numpy())
            assert difference.max() <= one_level + 1e-3, size
            differing += int((difference > 1e-3).sum())
            values += difference.size
    # Rounding, not another resize: about one value in a thousand, but some (else the default would be the exact path).
    assert 0 < differing <= 0.01 * values


def test_preprocessing_a_model_was_trained_with_matches_torchvision_transforms():
    # What a fine-tune trained with `transforms.Resize(160), CenterCrop(128), Normalize(0.5, 0.25)` is served with.
    from torchvision.transforms import v2

    from mnv3.preprocess import Preprocessing

    preprocessing = Preprocessing(resize=160, crop=128, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
    transform = v2.Compose(
        [
            v2.Resize(160),
            v2.CenterCrop(128),
            v2.PILToTensor(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(preprocessing.mean, preprocessing.std),
        ]
    )
    for photo in PHOTOS:
        for size in SIZES:
            image = photo.resize(size)
            actual = preprocess(image, preprocessing, resize_crop_only=False)
            assert actual.shape == (3, 128, 128)
            assert np.abs(actual - transform(image).numpy()).max() <= 1e-3


@pytest.mark.parametrize(
    "values",
    [dict(resize=224, crop=224), dict(mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))],
    ids=["crop of the whole resize", "mean 0 std 1"],
)
def test_preprocessing_at_the_edges_of_what_works_is_accepted_and_matches_torchvision_transforms(values):
    # Resize(224) + CenterCrop(224), and plain x/255 (Normalize(0, 1)), are what some fine-tunes train with: the
    # bounds on a preprocessing that cannot work take both in.
    from torchvision.transforms import v2

    from mnv3.preprocess import Preprocessing

    preprocessing = Preprocessing(**values)
    transform = v2.Compose(
        [
            v2.Resize(preprocessing.resize),
            v2.CenterCrop(preprocessing.crop),
            v2.PILToTensor(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(preprocessing.mean, preprocessing.std),
        ]
    )
    for photo in PHOTOS:
        image = photo.resize(SIZES[0])
        actual = preprocess(image, preprocessing, resize_crop_only=False)
        assert np.abs(actual - transform(image).numpy()).max() <= 1e-3


@pytest.mark.parametrize(
    "values",
    [
        dict(resize=200, crop=224),
        dict(mean=(0.5, 0.5)),
        dict(std=(0.2, 0.0, 0.2)),
        dict(mean=(float("nan"), 0.5, 0.5)),  # passed every check: the server then answered probabilities of NaN
        dict(std=(float("inf"), 0.2, 0.2)),
        dict(mean=(127.5, 127.5, 127.5), std=(127.5, 127.5, 127.5)),  # another toolkit's 0-255 scale
    ],
)
def test_preprocessing_that_cannot_work_is_refused(values):
    from mnv3.preprocess import Preprocessing

    with pytest.raises(ValueError):
        Preprocessing(**values)


@pytest.mark.parametrize("mode", ["I;16", "F"])
def test_an_image_given_as_it_is_preprocesses_as_the_server_decodes_it(mode, tmp_path):
    # preprocess(image) took a 16-bit or float image through Pillow's convert("RGB"), which clips where an
    # upload's decoding scales: the same pixels gave other inputs in a script than on the server.
    values = np.linspace(0, 60000 if mode == "I;16" else 3.5, 300 * 280).reshape(280, 300)
    image = Image.fromarray(values.astype(np.uint16 if mode == "I;16" else np.float32))
    image.save(tmp_path / "wide.tiff")
    np.testing.assert_array_equal(preprocess(image), preprocess(open_image(tmp_path / "wide.tiff")))


def test_an_empty_list_of_images_is_an_empty_batch():
    assert preprocess_batch([]).shape == (0, *DEFAULT_PREPROCESSING.input_shape)
