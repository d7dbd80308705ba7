"""Image decoding and preprocessing in numpy/Pillow only (the serving path has no torch).

`preprocess` reproduces torchvision's `ImageClassification` transform on PIL images: shorter side to
`resize` (bilinear, antialiased as Pillow always is), centre crop `crop`, /255, `mean`/`std`, channels
first. DEFAULT_PREPROCESSING is what torchvision's MobileNetV3 ImageNet weights were trained with (256,
224, ImageNet mean/std); a fine-tuned model's own values are set at stage 1 and travel in the manifest
beside the model. tests/test_preprocess.py holds both to torchvision's transforms.
Two shortcuts, each on unless told not to (`Decoding`, the server's --jpeg-draft and --resize-crop-only):
`decode_image` decodes a JPEG at least four times the resize size on its shorter side at a reduced DCT
scale (`jpeg_draft`): close to a full decode, not equal to it; smaller JPEGs and every other format decode
in full (tests/test_phone_photos.py holds it to both). `resize_and_crop` resamples only the part of the
image the centre crop keeps (`crop_only`): the same filter over the same source pixels, but Pillow
computes its weights from that box, so about one value in a thousand lands one grey level off the full resize
then crop; with both off, preprocessing equals torchvision's (tests/test_preprocess.py holds it to both).
"""

import io
import math
import re
import struct
import sys
import warnings
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

RESIZE_SIZE = 256
CROP_SIZE = 224
MEAN = (0.485, 0.456, 0.406)  # ImageNet's, per channel R G B
STD = (0.229, 0.224, 0.225)

# Draft decoding: libjpeg can decode a JPEG at 1/2, 1/4 or 1/8 scale straight from its DCT blocks, at
# a fraction of a full decode's cost (the resize that follows then has far fewer pixels to read too).
# The reduced image keeps a shorter side of at least JPEG_DRAFT_MARGIN x the resize size, so the resize
# is still an antialiased downscale; a JPEG smaller than 2x that is decoded in full, exactly.
JPEG_DRAFT_MARGIN = 2  # as Pillow's own reducing_gap default for thumbnail()
JPEG_DRAFT_FORMATS = ("JPEG", "MPO")  # MPO: a phone's multi-frame JPEG, whose first frame is a JPEG
JPEG_DRAFT_REDUCTIONS = (8, 4, 2)  # the DCT scalings libjpeg offers, largest first

MAX_RESIZED_SIDE = 4096  # longer side of the full resize; beyond it, resample only the crop (aspect > 16:1)
DEFAULT_MAX_PIXELS = 40_000_000  # ~ a 7300x5500 photo; larger is refused before decoding
# Longest side decoded: JPEG's and GIF's own limit. A thinner image within the pixel limit (a 114 KB PNG of 1 x
# 39M pixels) costs Pillow a row's bookkeeping per row, several times the pixels' memory and seconds of CPU.
MAX_IMAGE_SIDE = 65_535
# A progressive JPEG is decoded scan by scan, each over the whole image, so thousands of tiny scans keep a decode
# thread busy out of all proportion to the file's bytes (libjpeg's djpeg has -maxscans for it). libjpeg's
# progressive scripts write 6 (grey) to 18 (CMYK) scans, and encoders rarely write more than a few dozen.
MAX_JPEG_SCANS = 100
# Markers read before the image ends, at most: a scan brings a few (its tables, its header), so a real JPEG is far
# below; past it, reading them one by one would cost more than the bound on scans saves.
MAX_JPEG_MARKERS = 20 * MAX_JPEG_SCANS
# Scans x pixels at most: a scan of a 40 Mpixel image costs what 100 of a small one do (and the whole image's
# coefficients are held, whatever the draft scale), so a large image is allowed fewer: 30 at the pixel limit.
MAX_JPEG_SCAN_PIXELS = 30 * 40_000_000
# Bytes outside any segment before the first scan (fill bytes, junk): an encoder writes none, or a few.
MAX_JPEG_STRAY_BYTES = 4_096
# Start-of-frame markers, which give the image's size: every SOFn but DHT (C4), JPG (C8) and DAC (CC)
JPEG_START_OF_FRAME = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
# A marker: 0xFF and a code other than 0x00 (a stuffed 0xFF in coded data), 0xFF (fill) and RST0-7 (no length)
JPEG_MARKER = re.compile(rb"\xff[\x01-\xcf\xd8-\xfe]")
JPEG_END_OF_IMAGE, JPEG_START_OF_SCAN, JPEG_START_OF_IMAGE, JPEG_TEM = 0xD9, 0xDA, 0xD8, 0x01
# Pillow reads a PNG's chunks, and a GIF's blocks before its first image, one by one in Python, so an upload of
# millions of empty ones holds a decode thread for seconds. An encoder writes a handful of chunks besides its image
# data, which comes in chunks of kilobytes, or one a scanline at the finest; a GIF's first image follows a few
# extensions (its metadata: XMP takes a few hundred of their sub-blocks).
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MAX_PNG_CHUNKS_BESIDES_ROWS = 1_000  # and two a row of the image: interlaced, it has up to 15/8 scanlines a row
# Chunks Pillow inflates on opening (a megabyte each at most): a colour profile (one, says the spec) and text
PNG_COMPRESSED_CHUNKS = (b"iCCP", b"zTXt", b"iTXt")
MAX_PNG_COMPRESSED_CHUNKS = 64
# BMP's run-length encodings, which Pillow decodes in Python: a few kept for old files, larger ones refused
BMP_INFO_HEADER_SIZE, BMP_RUN_LENGTH_CODES = 40, (1, 2)  # RLE8, RLE4
MAX_BMP_RLE_BYTES = 1 << 20
MAX_GIF_BLOCKS_BEFORE_IMAGE = 10_000
GIF_EXTENSION, GIF_IMAGE_OR_END = 0x21, (0x2C, 0x3B)  # "!", and "," (an image) or ";" (the trailer)
# A TIFF lists where each strip (or tile) of its image starts, and Pillow builds and decodes each one listed: a
# tiny image listing a million strips, all of the same bytes, holds a decode thread for seconds.
# A TIFF's first directory: its byte order, then (classic) 42 and a 4-byte offset, or (BigTIFF) 43 and an 8-byte one.
TIFF_BYTE_ORDERS = {b"II": "<", b"MM": ">"}
TIFF_BIG = 43  # the header's third byte in a BigTIFF, as Pillow tells them apart (it accepts 42 written either way)
# (directory offset, entry count, entry size, value count): classic, BigTIFF
TIFF_LAYOUTS = {False: ("I", "H", 12, "I"), True: ("Q", "Q", 20, "Q")}
TIFF_WIDTH, TIFF_HEIGHT, TIFF_SAMPLES, TIFF_ROWS_PER_STRIP, TIFF_PLANAR = 256, 257, 277, 278, 284
TIFF_STRIP_OFFSETS, TIFF_TILE_WIDTH, TIFF_TILE_LENGTH, TIFF_TILE_OFFSETS = 273, 322, 323, 324
# The integer types, by TIFF's numbers: BYTE, SHORT, LONG, SBYTE, SSHORT, SLONG, LONG8, SLONG8
TIFF_INTEGER_TYPES = {1: "B", 3: "H", 4: "I", 6: "b", 8: "h", 9: "i", 16: "Q", 17: "q"}
# A directory holds tens of entries, a few hundred with a camera's private tags; Pillow reads each in Python.
MAX_TIFF_ENTRIES = 1_000
# Strips or tiles listed by a directory whose image size cannot be read here (Pillow then decides what it is)
MAX_TIFF_PARTS_OF_UNKNOWN_SIZE = 1_000
# Strips or tiles at most, whatever the size: each costs Pillow microseconds in Python, and strips of a row or the
# smallest tiles the spec allows (16 x 16) let an uncompressed image of many megapixels fit a small upload.
MAX_TIFF_PARTS = 65_536
MIN_TIFF_TILE_SIDE = 16  # the spec's: tiles are multiples of 16 pixels
# Pillow refuses an image of more than twice its MAX_IMAGE_PIXELS outright (DecompressionBombError), whatever
# the caller allows; below that, `max_pixels` alone decides: Pillow's warning at MAX_IMAGE_PIXELS is ignored.
# (None: the process turned Pillow's check off, and `max_pixels` alone decides.)
PILLOW_MAX_PIXELS = 2 * Image.MAX_IMAGE_PIXELS if Image.MAX_IMAGE_PIXELS is not None else sys.maxsize


# Raster formats only, opened by Pillow's own decoders: EPS, for one, would run Ghostscript on the upload.
# "JPEG" also opens MPO, the multi-frame JPEG many phone cameras write.
ACCEPTED_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
# HEIF's file brands (ISO/IEC 23008-12, AV1's avif/avis): what phones upload that ACCEPTED_FORMATS leaves out, told
# apart by the file's first box (`ftyp`) so its refusal can say what it is.
HEIF_BRANDS = frozenset({b"heic", b"heix", b"hevc", b"hevx", b"heim", b"heis", b"mif1", b"msf1", b"avif", b"avis"})


@dataclass(frozen=True)
class Preprocessing:
    """What a model was trained with: shorter side to `resize`, centre `crop`, then (x/255 - mean)/std."""

    resize: int = RESIZE_SIZE
    crop: int = CROP_SIZE
    mean: tuple[float, float, float] = MEAN
    std: tuple[float, float, float] = STD

    def __post_init__(self):
        if not 0 < self.crop <= self.resize:
            raise ValueError(
                f"crop {self.crop} must be positive and at most resize {self.resize} "
                "(torchvision would pad the image with zeros)"
            )
        if len(self.mean) != 3 or len(self.std) != 3 or min(self.std) <= 0:
            raise ValueError(
                f"mean and std take 3 values (R G B) and std must be positive, got mean {self.mean} std {self.std}"
            )
        if not all(math.isfinite(value) for value in (*self.mean, *self.std)):  # NaN passes the check above
            raise ValueError(f"mean and std must be finite numbers, got mean {self.mean} std {self.std}")
        if not all(0 <= value <= 1 for value in self.mean):  # the mean of values x/255 in [0, 1]
            raise ValueError(
                f"mean is of x/255, so between 0 and 1 (ImageNet's: 0.485 0.456 0.406), got {self.mean}: for values "
                "on a 0-255 scale, divide mean and std by 255"
            )

    @classmethod
    def from_record(cls, record: dict) -> "Preprocessing":
        """From `record()`'s dict, as the manifest holds it."""
        return cls(int(record["resize"]), int(record["crop"]), tuple(record["mean"]), tuple(record["std"]))

    def record(self) -> dict:
        return {"resize": self.resize, "crop": self.crop, "mean": list(self.mean), "std": list(self.std)}

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return 3, self.crop, self.crop

    @cached_property
    def scale_shift(self) -> tuple[np.ndarray, np.ndarray]:
        """(x/255 - mean)/std folded into one multiply-add per pixel: x*scale + shift."""
        mean, std = np.array(self.mean, dtype=np.float32), np.array(self.std, dtype=np.float32)
        return (1.0 / (255.0 * std)).reshape(3, 1, 1), (-mean / std).reshape(3, 1, 1)


DEFAULT_PREPROCESSING = Preprocessing()


@dataclass(frozen=True)
class Decoding:
    """The server's shortcuts from upload bytes to the model's input, each cheaper and close to, not equal
    to, torchvision's transforms: large JPEGs decoded at a reduced DCT scale (`decode_image`), and only
    the part of the image the centre crop keeps resized (`resize_and_crop`). EXACT_DECODING takes neither."""

    jpeg_draft: bool = True
    resize_crop_only: bool = True

    def record(self) -> dict:
        return asdict(self)


DEFAULT_DECODING = Decoding()
EXACT_DECODING = Decoding(jpeg_draft=False, resize_crop_only=False)


class InvalidImage(ValueError):
    """The bytes are not an image we can classify; the message says why, for the client."""


class ImageTooLarge(InvalidImage):
    """A valid header announcing more pixels than we will decode (a server answers 413, not 400)."""


def resize_and_crop(
    image: Image.Image,
    size: int = RESIZE_SIZE,
    crop: int = CROP_SIZE,
    crop_only: bool = DEFAULT_DECODING.resize_crop_only,
) -> Image.Image:
    """Shorter side to `size`, then the centre `crop` x `crop`, as torchvision does.

    With `crop_only`, only the source box that maps onto the crop is resampled: the same filter over
    the same source pixels, for the crop's pixels alone (224x224 of a 4:3 photo's 341x256 at the
    defaults), but Pillow computes the filter weights from the box's float coordinates, so about
    one value in a thousand rounds one grey level off the full resize then crop. Without it, the full
    resize then the crop, equal to torchvision's, unless the full resize would be huge (an extreme
    aspect ratio: 1x10000 -> 256x2560000, 2 GB), which is resampled by box either way.
    """
    w, h = image.size
    # Same arithmetic as torchvision's _compute_resized_output_size (truncation, not rounding).
    if w <= h:
        new_w, new_h = size, int(size * h / w)
    else:
        new_w, new_h = int(size * w / h), size
    # The shorter side is now `size` >= `crop`, so torchvision's zero padding never applies.
    top, left = int(round((new_h - crop) / 2.0)), int(round((new_w - crop) / 2.0))
    if (new_w, new_h) == (w, h):
        return image.crop((left, top, left + crop, top + crop))
    if not crop_only and max(new_w, new_h) <= MAX_RESIZED_SIDE:
        return image.resize((new_w, new_h), Image.Resampling.BILINEAR).crop((left, top, left + crop, top + crop))
    sx, sy = w / new_w, h / new_h
    box = (left * sx, top * sy, (left + crop) * sx, (top + crop) * sy)
    return image.resize((crop, crop), Image.Resampling.BILINEAR, box=box)


def preprocess(
    image: Image.Image,
    preprocessing: Preprocessing = DEFAULT_PREPROCESSING,
    resize_crop_only: bool = DEFAULT_DECODING.resize_crop_only,
) -> np.ndarray:
    """PIL image -> float32 array of shape (3, crop, crop), ready to stack into an NCHW batch; resized as
    `resize_and_crop` does with `crop_only=resize_crop_only`. Its pixels are taken as they are, in any mode
    (16-bit and float grey scaled as uploads are); its EXIF orientation is not undone: `open_image` and
    `decode_image` do that, as the server does to every upload."""
    rgb = _to_rgb(image)
    hwc = np.asarray(resize_and_crop(rgb, preprocessing.resize, preprocessing.crop, resize_crop_only))
    scale, shift = preprocessing.scale_shift
    # One pass from uint8 into the result, then one in place: no float32 copy -> transpose ->
    # multiply -> add chain allocating a full-size temporary at each step.
    chw = np.empty(preprocessing.input_shape, dtype=np.float32)
    np.multiply(hwc.transpose(2, 0, 1), scale, out=chw)
    chw += shift
    return chw


def preprocess_batch(images, preprocessing: Preprocessing = DEFAULT_PREPROCESSING) -> np.ndarray:
    """Several PIL images -> one contiguous (N, 3, crop, crop) float32 batch (N may be 0)."""
    rows = [preprocess(image, preprocessing) for image in images]
    return np.stack(rows) if rows else np.empty((0, *preprocessing.input_shape), np.float32)


def jpeg_draft_reduction(width: int, height: int, resize_size: int = RESIZE_SIZE) -> int:
    """The largest DCT reduction (8, 4 or 2; 1 = full decode) whose image keeps a shorter side of at least
    JPEG_DRAFT_MARGIN x `resize_size`."""
    needed = JPEG_DRAFT_MARGIN * resize_size
    return next((r for r in JPEG_DRAFT_REDUCTIONS if min(width, height) // r >= needed), 1)


def decode_image(
    data: bytes,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    jpeg_draft: bool = DEFAULT_DECODING.jpeg_draft,
    resize_size: int = RESIZE_SIZE,
) -> Image.Image:
    """Decode untrusted bytes into an RGB PIL image, or raise InvalidImage with a clear reason.

    - Opens only ACCEPTED_FORMATS; any image mode they carry (1-bit to 16-bit, CMYK, alpha, palette...)
      becomes RGB.
    - Refuses images over `max_pixels`, or with a side over MAX_IMAGE_SIDE, from the header alone (decompression
      bombs never decode), and, before Pillow opens them, JPEGs of more scans than `check_jpeg_scans` allows
      (each decoded over the whole image), PNGs, GIFs and TIFFs of more chunks, blocks or strips than an encoder
      writes (`check_png_chunks`, `check_gif_blocks`, `check_tiff_parts`), and large run-length encoded BMPs.
    - Animated GIF/WebP/PNG: the first frame is classified.
    - EXIF orientation is honoured, as a phone camera intends.
    - With `jpeg_draft`, a JPEG at least 2 x JPEG_DRAFT_MARGIN x `resize_size` on its shorter side is
      decoded at a reduced DCT scale (`jpeg_draft_reduction`): much cheaper, and close to, not equal to,
      the full decode once resized (README, "Limits and errors"). Other formats and smaller JPEGs
      decode in full either way.
    """
    if not data:
        raise InvalidImage(f"empty body: send an image file ({', '.join(ACCEPTED_FORMATS)})")
    claimed = _format_claimed(data)
    if claimed in PRE_CHECKS:  # before Pillow opens it: opening already walks much of what the check bounds
        PRE_CHECKS[claimed](data)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=ACCEPTED_FORMATS)
            w, h = image.size
            if w * h > max_pixels:
                raise ImageTooLarge(
                    f"image is {w}x{h} = {w * h} pixels, over the limit of {max_pixels} (refused before decoding)"
                )
            check_sides(w, h)
            if image.format in JPEG_DRAFT_FORMATS:
                reduction = jpeg_draft_reduction(w, h, resize_size) if jpeg_draft else 1
                if reduction > 1:
                    # Pillow picks the largest reduction r with size // (requested size) >= r.
                    image.draft(image.mode, (w // reduction, h // reduction))
            image.load()
            # In place: without an orientation to undo, exif_transpose would return a full copy.
            ImageOps.exif_transpose(image, in_place=True)
            return _to_rgb(image)
    except InvalidImage:
        raise
    except Image.DecompressionBombError as exc:  # over PILLOW_MAX_PIXELS: Pillow refuses it before our check
        pixels = re.search(r"\((\d+) pixels\)", str(exc))  # "Image size (N pixels) exceeds limit of ..."
        size = f"{pixels[1]} pixels" if pixels else f"over {PILLOW_MAX_PIXELS} pixels"
        raise ImageTooLarge(f"image is {size}, over the limit of {max_pixels} (refused before decoding)") from exc
    except Image.UnidentifiedImageError as exc:
        if data[4:8] == b"ftyp" and data[8:12] in HEIF_BRANDS:
            raise InvalidImage(
                f"a HEIC/AVIF image ({data[8:12].decode()}), a format not accepted here: send it as JPEG or PNG "
                "(an iPhone saves JPEG with Settings > Camera > Formats > Most Compatible); accepted: "
                f"{', '.join(ACCEPTED_FORMATS)}"
            ) from exc
        if claimed:  # its signature is one accepted, but the decoder refused it (e.g. a TIFF's pixel layout)
            raise InvalidImage(
                f"a {claimed} image the decoder cannot read (cut short, corrupt, or a variant it does not support): "
                "check the file, or save it again as JPEG or PNG"
            ) from exc
        raise InvalidImage(f"not a recognised image format; accepted: {', '.join(ACCEPTED_FORMATS)}") from exc
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise InvalidImage(f"corrupt or truncated image: {exc}") from exc


def _format_claimed(data: bytes) -> str | None:
    """The accepted format whose signature `data` begins with, by Pillow's own test of each."""
    Image.init()  # every format's test registered (at once once done; Image.open does it on first use)
    prefix = data[:16]  # what Pillow's openers look at
    for name in ACCEPTED_FORMATS:
        accept = Image.OPEN[name][1]
        if accept is not None and accept(prefix):
            return name
    return None


def check_png_chunks(data: bytes) -> None:
    """InvalidImage if the PNG `data` has more than MAX_PNG_CHUNKS_BESIDES_ROWS chunks and two a row of its image
    (its rows as declared, at most MAX_IMAGE_SIDE: the size is checked only once Pillow has read the chunks before
    the pixels), or more than MAX_PNG_COMPRESSED_CHUNKS that Pillow inflates (each up to a megabyte), counted as
    Pillow reads them for the first frame: up to IEND, or an animation's next frame (an fcTL after the image
    data, in a PNG whose acTL says it has more than one). Each chunk is skipped by its length, its data unread."""
    height = int.from_bytes(data[20:24], "big")  # IHDR's, the first chunk's; a corrupt one is Pillow's to refuse
    limit = MAX_PNG_CHUNKS_BESIDES_ROWS + 2 * min(height, MAX_IMAGE_SIDE)
    chunks = compressed = 0
    position, image_data, animated = len(PNG_SIGNATURE), False, False
    while position + 8 <= len(data):
        length, kind = int.from_bytes(data[position : position + 4], "big"), data[position + 4 : position + 8]
        if kind == b"IEND" or kind == b"fcTL" and image_data and animated:
            return
        if kind == b"acTL" and not image_data:  # its first field: the number of frames
            animated = int.from_bytes(data[position + 8 : position + 12], "big") > 1
        image_data |= kind == b"IDAT"
        chunks += 1
        compressed += kind in PNG_COMPRESSED_CHUNKS
        if chunks > limit or compressed > MAX_PNG_COMPRESSED_CHUNKS:
            what = f"{limit} chunks ({MAX_PNG_CHUNKS_BESIDES_ROWS} and two a row)"
            if compressed > MAX_PNG_COMPRESSED_CHUNKS:
                what = f"{MAX_PNG_COMPRESSED_CHUNKS} compressed text or colour-profile chunks"
            raise InvalidImage(f"a PNG of more than {what}: corrupt, or built to be slow to read; save it again")
        position += 12 + length  # length, type, data, CRC


def check_gif_blocks(data: bytes) -> None:
    """InvalidImage if the GIF `data` has more than MAX_GIF_BLOCKS_BEFORE_IMAGE blocks before its first image, the
    part Pillow reads on opening it, counted as Pillow steps through them: an extension and each of its
    sub-blocks, and each stray byte (which Pillow skips one at a time). Sub-blocks are skipped by their lengths."""
    flags = data[10] if len(data) > 10 else 0
    position = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)  # header, screen descriptor, global colours
    blocks = 0
    while position < len(data) and data[position] not in GIF_IMAGE_OR_END:
        if data[position] == GIF_EXTENSION:  # the introducer, a label, then sub-blocks up to an empty one
            position += 2
            while position < len(data) and data[position] and blocks <= MAX_GIF_BLOCKS_BEFORE_IMAGE:
                blocks += 1
                position += 1 + data[position]
        blocks += 1
        position += 1
        if blocks > MAX_GIF_BLOCKS_BEFORE_IMAGE:
            raise InvalidImage(
                f"a GIF of more than {MAX_GIF_BLOCKS_BEFORE_IMAGE} blocks before its image: corrupt, or built to be "
                "slow to read; save it again"
            )


def check_bmp_compression(data: bytes) -> None:
    """InvalidImage if the BMP `data` is run-length encoded (RLE8 or RLE4) and over MAX_BMP_RLE_BYTES: Pillow
    decodes those runs in Python, a couple of bytes at a time."""
    header_size = int.from_bytes(data[14:18], "little")
    compression = int.from_bytes(data[30:34], "little") if header_size >= BMP_INFO_HEADER_SIZE else 0
    if compression in BMP_RUN_LENGTH_CODES and len(data) > MAX_BMP_RLE_BYTES:
        raise InvalidImage(
            f"a run-length encoded BMP of over {MAX_BMP_RLE_BYTES} bytes, which this server decodes slowly: save it "
            "as PNG"
        )


def check_sides(width: int, height: int) -> None:
    if max(width, height) > MAX_IMAGE_SIDE:
        raise ImageTooLarge(
            f"image is {width}x{height}: a side over {MAX_IMAGE_SIDE} pixels, the limit (refused before decoding)"
        )


def check_tiff_parts(data: bytes) -> None:
    """InvalidImage if the TIFF `data`'s first directory has more than MAX_TIFF_ENTRIES entries, or its image lists
    more strips or tiles than MAX_TIFF_PARTS, or than its size calls for (the spec's count: one a RowsPerStrip
    rows, or a tile, per plane; strips where it lists both, as Pillow reads them), or tiles smaller than the spec
    allows; ImageTooLarge if a side is over the limit: all before Pillow
    reads the directory and builds the list on opening it. Read as Pillow reads it: either byte order, classic or
    BigTIFF, the first of a repeated tag, any integer type. A header or directory cut short is left to Pillow."""
    order = TIFF_BYTE_ORDERS[data[:2]]
    offset_format, entries_format, entry_size, count_format = TIFF_LAYOUTS[data[2:3] == bytes([TIFF_BIG])]
    values: dict[int, int] = {}
    counts: dict[int, int] = {}
    try:
        directory = struct.unpack_from(order + offset_format, data, 4 if offset_format == "I" else 8)[0]
        entries = struct.unpack_from(order + entries_format, data, directory)[0]
        if entries > MAX_TIFF_ENTRIES:
            raise InvalidImage(
                f"a TIFF directory of {entries} entries, over {MAX_TIFF_ENTRIES}: corrupt, or built to be slow to "
                "read; save it again"
            )
        start = directory + struct.calcsize(entries_format)
        value_at = 4 + struct.calcsize(count_format)  # after the tag, its type and its count
        for at in range(start, start + entries * entry_size, entry_size):
            tag, kind, count = struct.unpack_from(order + "HH" + count_format, data, at)
            if tag in counts:
                continue
            counts[tag] = count
            integer = TIFF_INTEGER_TYPES.get(kind)
            if count == 1 and integer and struct.calcsize(integer) <= entry_size - value_at:  # the value in the entry
                values[tag] = max(0, struct.unpack_from(order + integer, data, at + value_at)[0])
    except struct.error:
        return
    width, height = values.get(TIFF_WIDTH, 0), values.get(TIFF_HEIGHT, 0)
    check_sides(width, height)
    planes = values.get(TIFF_SAMPLES, 1) if values.get(TIFF_PLANAR) == 2 else 1
    tile_width, tile_length = values.get(TIFF_TILE_WIDTH, 0), values.get(TIFF_TILE_LENGTH, 0)
    rows = min(values.get(TIFF_ROWS_PER_STRIP, height), height)
    if TIFF_STRIP_OFFSETS in counts:
        listed, parts = counts[TIFF_STRIP_OFFSETS], -(-height // rows) * planes if rows else 0
    elif TIFF_TILE_OFFSETS in counts:
        if min(tile_width, tile_length) < MIN_TIFF_TILE_SIDE:
            raise InvalidImage(
                f"a TIFF of {tile_width}x{tile_length} tiles: the spec's are multiples of {MIN_TIFF_TILE_SIDE} "
                "pixels; save it again"
            )
        listed = counts[TIFF_TILE_OFFSETS]
        parts = -(-width // tile_width) * -(-height // tile_length) * planes
    else:
        return
    if listed > (parts or MAX_TIFF_PARTS_OF_UNKNOWN_SIZE):
        size = f"{width}x{height} image has {parts}" if parts else "image size cannot be read here"
        raise InvalidImage(
            f"a TIFF whose {size} but lists {listed} strips or tiles: corrupt, or built to be slow to read; save it "
            "again"
        )
    if listed > MAX_TIFF_PARTS:
        raise InvalidImage(
            f"a TIFF of {listed} strips or tiles, over {MAX_TIFF_PARTS}: save it again with larger strips or tiles"
        )


def check_jpeg_scans(data: bytes) -> None:
    """InvalidImage if the JPEG `data` begins with has more than MAX_JPEG_SCANS scans, or more scans than
    MAX_JPEG_SCAN_PIXELS allows at its size (each is decoded over the whole image), or more than MAX_JPEG_MARKERS
    markers, up to its end-of-image marker, or more than MAX_JPEG_STRAY_BYTES outside any segment before its
    first scan (Pillow steps over those one at a time on opening it). What comes after the end (a phone's
    motion-photo video, an MPO's next frame) is not this image's, and a segment's payload (an EXIF thumbnail, an
    ICC profile) is skipped by its length, so their bytes are never taken for markers."""
    scans, markers, position, stray, pixels = 0, 0, 2, 0, 0  # after the start-of-image marker
    while match := JPEG_MARKER.search(data, position):
        code, markers = match[0][1], markers + 1
        if code == JPEG_END_OF_IMAGE:
            return
        if not scans:
            stray += match.start() - position
            if stray > MAX_JPEG_STRAY_BYTES:
                raise InvalidImage(
                    f"a JPEG of more than {MAX_JPEG_STRAY_BYTES} bytes outside its segments before its image data: "
                    "corrupt, or built to be slow to read; save it again"
                )
        if markers > MAX_JPEG_MARKERS:
            raise InvalidImage(f"a JPEG of more than {MAX_JPEG_MARKERS} markers: corrupt, or built to be slow to read")
        if code in (JPEG_START_OF_IMAGE, JPEG_TEM):  # no length follows these
            position = match.end()
            continue
        if code in JPEG_START_OF_FRAME and not pixels:  # length, precision, then height and width
            pixels = int.from_bytes(data[match.end() + 3 : match.end() + 5], "big") * int.from_bytes(
                data[match.end() + 5 : match.end() + 7], "big"
            )
        scans += code == JPEG_START_OF_SCAN
        if scans > min(MAX_JPEG_SCANS, max(1, MAX_JPEG_SCAN_PIXELS // max(pixels, 1))):
            raise InvalidImage(
                f"a JPEG of more than {scans - 1} scans at {pixels} pixels (refused before decoding: each scan is "
                "decoded over the whole image, and ordinary progressive JPEGs have a few dozen at most); save it "
                "again as an ordinary JPEG"
            )
        position = match.end() + int.from_bytes(data[match.end() : match.end() + 2], "big")


# What Pillow walks in Python as it opens each format (decode_image bounds it first), by the format a file claims
PRE_CHECKS = {
    "JPEG": check_jpeg_scans,  # and MPO, which Pillow opens as JPEG
    "PNG": check_png_chunks,
    "GIF": check_gif_blocks,
    "BMP": check_bmp_compression,
    "TIFF": check_tiff_parts,
}

WIDE_GREY_MODES = ("I;16", "I;16B", "I;16L", "I", "F")
WIDE_GREY_BLOCK_PIXELS = 1 << 18  # scaled at a time, in whole rows: float32 copies of a block, never of the image


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode in WIDE_GREY_MODES:
        # 16/32-bit integer and float grayscale: Pillow's convert('RGB') clips instead of scaling, so scale to 8
        # bits, integers from 0 (or their minimum, if negative) to their peak, floats from their minimum to their
        # maximum. NaN and infinities have no place on that scale: they take its ends, the finite values keep it.
        # In float32, a block of rows at a time: whole-image float copies held several times the image's size.
        # The block's rows from its pixels, not a fixed count: a thin image would otherwise take a block a few rows.
        width, height = image.size
        block_rows = max(1, WIDE_GREY_BLOCK_PIXELS // width)
        tops = range(0, height, block_rows)

        def rows_from(top: int) -> np.ndarray:  # a copy of those rows alone, where np.asarray(image) copies all
            return np.array(image.crop((0, top, width, min(top + block_rows, height))), dtype=np.float32)

        low, high, all_finite = math.inf, -math.inf, True
        for top in tops:
            rows = rows_from(top)
            finite = np.isfinite(rows)
            if not finite.all():
                all_finite, rows = False, rows[finite]
            if rows.size:
                low, high = min(low, float(rows.min())), max(high, float(rows.max()))
        if low > high:  # no finite value at all
            low = high = 0.0
        if image.mode != "F":
            low = min(low, 0.0)
        scale = 255.0 / ((high - low) or 1.0)
        grey = np.empty((height, width), np.uint8)
        for top in tops:
            rows = rows_from(top)
            if not all_finite:
                np.nan_to_num(rows, copy=False, nan=low, posinf=high, neginf=low)
            rows -= low
            rows *= scale
            grey[top : top + len(rows)] = rows  # truncated, as astype(np.uint8) does
        image = Image.fromarray(grey, mode="L")
    return image if image.mode == "RGB" else image.convert("RGB")  # convert() copies even an RGB image


def decode_and_preprocess(
    data: bytes,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    decoding: Decoding = DEFAULT_DECODING,
    preprocessing: Preprocessing = DEFAULT_PREPROCESSING,
) -> np.ndarray:
    """What the server does to each upload before inference (and the in-process limit, to match it)."""
    image = decode_image(data, max_pixels, decoding.jpeg_draft, preprocessing.resize)
    return preprocess(image, preprocessing, decoding.resize_crop_only)


def open_image(path, preprocessing: Preprocessing = DEFAULT_PREPROCESSING) -> Image.Image:
    """A local image file decoded exactly as an upload for a model with `preprocessing` is by default (EXIF
    orientation, 16-bit scaling, limits, draft decoding), so calibration and accuracy see the pixels the
    server will see (`preprocess` resizes as its default does too)."""
    try:
        return decode_image(Path(path).read_bytes(), resize_size=preprocessing.resize)
    except (InvalidImage, OSError) as exc:
        raise InvalidImage(f"{path}: {exc}; remove or replace that file") from exc


def preprocess_files(paths, preprocessing: Preprocessing = DEFAULT_PREPROCESSING) -> np.ndarray:
    """Local image files -> one (N, 3, crop, crop) batch, each decoded as `open_image` does."""
    return preprocess_batch([open_image(path, preprocessing) for path in paths], preprocessing)
