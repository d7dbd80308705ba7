"""Real photos for calibration, accuracy and load tests, taken from files that installed packages ship.

Nothing is downloaded and no binary is committed: the sources are scikit-image's `skimage/data` and
matplotlib's `sample_data/grace_hopper.jpg`. Deterministic augmentations (random resized crop, flip,
colour jitter) turn the ~14 sources into as many distinct images as a stage needs. Calibration and
held-out images come from disjoint source photos, so accuracy is never measured on what calibrated.
`phone_photos` makes 12-megapixel JPEGs the size a phone uploads, generated when a run needs them.
"""

import io
import os
import re
from concurrent.futures import ThreadPoolExecutor
from importlib.resources import files
from pathlib import Path

import numpy as np
from PIL import Image, ImageChops, ImageEnhance

# (package, path inside it). Near-duplicates (the motorcycle stereo pair) stay in one split.
CALIBRATION_SOURCES = (
    ("skimage", "data/astronaut.png"),
    ("skimage", "data/coffee.png"),
    ("skimage", "data/rocket.jpg"),
    ("skimage", "data/motorcycle_left.png"),
    ("skimage", "data/motorcycle_right.png"),
    ("skimage", "data/hubble_deep_field.jpg"),
    ("skimage", "data/ihc.png"),
    ("skimage", "data/camera.png"),
    ("skimage", "data/coins.png"),
)
HELD_OUT_SOURCES = (
    ("skimage", "data/chelsea.png"),
    ("matplotlib", "mpl-data/sample_data/grace_hopper.jpg"),
    ("skimage", "data/retina.jpg"),
    ("skimage", "data/moon.png"),
    ("skimage", "data/gravel.png"),
)
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".gif"}
LOAD_IMAGE_SIZE = (500, 375)  # a typical ImageNet validation photo
LOAD_IMAGE_QUALITY = 90
PHONE_PHOTO_SIZE = (4032, 3024)  # 12 megapixels, 4:3, as the sensor stores it whichever way the phone is held
PHONE_PHOTO_QUALITY = 90
# Sensor-like grain, +-N grey levels, drawn per photo: an upscaled sample photo alone is so smooth that
# it compresses to a fraction of a phone JPEG's 2-4 MB, and decoding cost grows with the bytes.
PHONE_GRAIN_LEVELS = (6, 11)
# EXIF orientation as phones write it (1 upright, 6 held upright in portrait, 3 upside down, 8 the other
# portrait), with the transpose that turns what the viewer sees into what the sensor stored.
PHONE_ORIENTATIONS = {
    1: None,
    6: Image.Transpose.ROTATE_90,
    3: Image.Transpose.ROTATE_180,
    8: Image.Transpose.ROTATE_270,
}
PHONE_ORIENTATION_SHARES = (0.5, 0.3, 0.1, 0.1)
EXIF_ORIENTATION_TAG = 0x0112


def source_photos(sources) -> list[Image.Image]:
    photos = []
    for package, path in sources:
        with (files(package) / path).open("rb") as f:
            photos.append(Image.open(f).convert("RGB"))
    return photos


def augment(photo: Image.Image, rng: np.random.Generator, size=None) -> Image.Image:
    """A RandomResizedCrop(scale 0.3-1, ratio 3/4-4/3) + horizontal flip + colour jitter view."""
    w, h = photo.size
    for _ in range(10):
        area = w * h * rng.uniform(0.3, 1.0)
        ratio = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
        cw, ch = int(round(np.sqrt(area * ratio))), int(round(np.sqrt(area / ratio)))
        if 0 < cw <= w and 0 < ch <= h:
            break
    else:
        cw, ch = min(w, h), min(w, h)
    left, top = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
    image = photo.crop((left, top, left + cw, top + ch))
    if rng.random() < 0.5:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    for enhancer in (ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color):
        image = enhancer(image).enhance(rng.uniform(0.7, 1.3))
    if size is not None:
        image = image.resize(size, Image.Resampling.BILINEAR)
    return image


def augmented_views(sources, count: int, seed: int, size=None) -> list[Image.Image]:
    """`count` distinct augmented views, cycling through the source photos."""
    photos = source_photos(sources)
    rng = np.random.default_rng(seed)
    return [augment(photos[i % len(photos)], rng, size) for i in range(count)]


def held_out_images(count: int = 64, seed: int = 1) -> list[Image.Image]:
    return augmented_views(HELD_OUT_SOURCES, count, seed)


def spread(items: list, count: int) -> list:
    """`count` of `items`, evenly spaced in their order (all of them if there are no more): of a dataset's
    photos listed a folder per class, each class gets its share, where the first `count` would be the first
    classes'."""
    return [items[i * len(items) // count] for i in range(count)] if len(items) > count else list(items)


def list_images(folder, recursive: bool = False) -> list[Path]:
    """The images in `folder` (and, if `recursive`, in the folders within it, symbolic links followed as
    ImageFolder follows them, each folder once: a link back up the tree is not a loop), in path order."""
    if recursive:
        paths, seen = [], set()
        for top, folders, files in os.walk(folder, followlinks=True):
            real = os.path.realpath(top)
            if real in seen:  # reached again through a link: walked already
                folders.clear()
                continue
            seen.add(real)
            paths += [Path(top) / name for name in files]
    else:
        paths = list(Path(folder).iterdir())
    return sorted(p for p in paths if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())


GENERATED_PREFIX = "generated_"  # the calibration photos fill_calibration_dir writes (git-ignored)
GENERATED_NAME = re.compile(rf"{GENERATED_PREFIX}\d{{4,}}\.jpg")  # exactly the names it writes


def is_generated(path) -> bool:
    """Whether `path` is a calibration photo fill_calibration_dir wrote (generated_0000.jpg, ...), not one a
    user put there, whatever the user's is called (generated_by_sdxl_001.png is the user's)."""
    return GENERATED_NAME.fullmatch(Path(path).name) is not None


def fill_calibration_dir(folder, count: int = 200, seed: int = 0) -> list[Path]:
    """Return the images in the folder and the folders within it (a dataset's folder per class); if there
    are none, first write `count` generated ones into it.

    Images a user put there are used as they are. Generated files are named generated_0000.jpg, ... (git-ignored).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    existing = list_images(folder, recursive=True)
    if existing:
        return existing
    for i, image in enumerate(augmented_views(CALIBRATION_SOURCES, count, seed)):
        image.thumbnail((400, 400))  # calibration resizes to 256 anyway; keep the folder small
        image.save(folder / f"{GENERATED_PREFIX}{i:04d}.jpg", quality=LOAD_IMAGE_QUALITY)
    return list_images(folder)


def encode_jpeg(image: Image.Image, quality: int = LOAD_IMAGE_QUALITY) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def load_images(count: int, seed: int = 2, size=LOAD_IMAGE_SIZE, quality=LOAD_IMAGE_QUALITY) -> list[bytes]:
    """`count` distinct JPEG bodies for load tests: every one is a cache miss."""
    sources = CALIBRATION_SOURCES + HELD_OUT_SOURCES
    return [encode_jpeg(image, quality) for image in augmented_views(sources, count, seed, size)]


def phone_photo(photo: Image.Image, orientation: int, rng: np.random.Generator) -> bytes:
    """A 12-megapixel JPEG of an augmented view of `photo`, with grain, stored as a phone held in
    `orientation` (a key of PHONE_ORIENTATIONS) stores it."""
    width, height = PHONE_PHOTO_SIZE
    view = augment(photo, rng, (height, width) if orientation in (6, 8) else (width, height))
    stored = PHONE_ORIENTATIONS[orientation]
    if stored is not None:
        view = view.transpose(stored)
    levels = int(rng.integers(*PHONE_GRAIN_LEVELS, endpoint=True))
    grain = rng.integers(128 - levels, 128 + levels, size=(height, width), dtype=np.uint8, endpoint=True)
    grain_image = Image.fromarray(grain)
    view = ImageChops.add(view, Image.merge("RGB", (grain_image,) * 3), offset=-128)  # luminance grain, clipped
    exif = Image.Exif()
    exif[EXIF_ORIENTATION_TAG] = orientation
    buffer = io.BytesIO()
    view.save(buffer, format="JPEG", quality=PHONE_PHOTO_QUALITY, exif=exif.tobytes())
    return buffer.getvalue()


def phone_photos(count: int, seed: int = 3, threads: int = 2) -> list[bytes]:
    """`count` distinct phone-size JPEG bodies (2-4 MB each), cycling through every source photo, in
    PHONE_ORIENTATION_SHARES of the orientations.

    Made in memory when a run needs them (never written to the repository); Pillow releases the GIL
    while it resizes and encodes, so `threads` make them in parallel, each from its own seed.
    """
    photos = source_photos(CALIBRATION_SOURCES + HELD_OUT_SOURCES)

    def make(i):
        rng = np.random.default_rng([seed, i])
        orientation = int(rng.choice(list(PHONE_ORIENTATIONS), p=PHONE_ORIENTATION_SHARES))
        return phone_photo(photos[i % len(photos)], orientation, rng)

    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(make, range(count)))
