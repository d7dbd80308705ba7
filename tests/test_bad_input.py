"""Bad and odd uploads to POST /predict: each gets a clear answer, and the server serves on.

Refused (4xx, JSON {"detail": ...}, the status documented in the OpenAPI schema): no or empty body,
not an image (text, HTML, PDF, SVG, EPS...), truncated or structurally corrupt images, images over
the pixel limit or with a side over 65,535 (bombs, huge declared sizes), bodies over the byte limit or too
slow to arrive, malformed or misnamed multipart, a wrong content type, a wrong method or path.
Accepted (200): every image mode the accepted formats carry, tiny and extreme-aspect images,
animated images (first frame), EXIF-rotated photos (turned upright), odd filenames and query strings,
and JPEG scan data that libjpeg can conceal (garbage in, garbage out, as in any viewer).
"""

import asyncio
import gzip
import http.client
import io
import socket
import struct
import tempfile
import time
import tracemalloc
import warnings
import zlib

import numpy as np
import pytest
import requests
import tifffile
from PIL import Image
from starlette.requests import Request

from conftest import WAIT_S, metric, post_file, post_raw, serving_client, wait_until
from mnv3 import connections
from mnv3.config import ServerConfig
from mnv3.errors import BodyTooLarge
from mnv3.loadtest import ServerProcess
from mnv3.photos import load_images
from mnv3.preprocess import (
    ACCEPTED_FORMATS,
    MAX_IMAGE_SIDE,
    MAX_JPEG_SCANS,
    PILLOW_MAX_PIXELS,
    PNG_SIGNATURE,
    ImageTooLarge,
    InvalidImage,
    _to_rgb,
    check_png_chunks,
    decode_image,
)
from mnv3.uploads import DROPPED_BODY_TIMES_LIMIT, read_body, read_upload

pytestmark = pytest.mark.integration

UPLOAD_LIMIT = 2_000_000
PIXEL_LIMIT = 4_000_000


@pytest.fixture(scope="module")
def client(fp32_model_path):
    # No cache: the valid request after each bad one really runs inference.
    with serving_client(
        fp32_model_path,
        max_batch_size=4,
        batch_window_ms=5,
        cache_size=0,
        max_upload_bytes=UPLOAD_LIMIT,
        max_pixels=PIXEL_LIMIT,
    ) as client:
        yield client


@pytest.fixture(scope="module")
def jpeg():
    return load_images(1, seed=3)[0]


def encode(image: Image.Image, format: str, **params) -> bytes:
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. "mode is not supported by this format"
        image.save(buffer, format=format, **params)
    return buffer.getvalue()


def photo(jpeg: bytes) -> Image.Image:
    return Image.open(io.BytesIO(jpeg)).convert("RGB")


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_declaring(width: int, height: int, pixel_data: bytes = b"") -> bytes:
    """An 8-bit grayscale PNG header announcing width x height, followed by `pixel_data` (zlib'd rows)."""
    header = png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
    return b"\x89PNG\r\n\x1a\n" + header + png_chunk(b"IDAT", pixel_data) + png_chunk(b"IEND", b"")


def decompression_bomb() -> bytes:
    """~250 KB that inflate to 10000x10000 = 100 Mpixel of zeros."""
    rows = zlib.compress(bytes(10_001) * 10_000, 9)
    return png_declaring(10_000, 10_000, rows)


def progressive_jpeg_of_scans(side: int, refinements: int) -> bytes:
    """A grey progressive JPEG: its DC scan, then `refinements` AC scans of one end-of-band run each, every
    one decoded over the whole image (a few bytes a scan that cost the decoder a pass over every block)."""

    def segment(marker: int, payload: bytes) -> bytes:
        return bytes([0xFF, marker]) + struct.pack(">H", len(payload) + 2) + payload

    def entropy(bits: str) -> bytes:
        bits += "1" * (-len(bits) % 8)  # padded with ones, as JPEG's entropy-coded data is
        data = bytes(int(bits[i : i + 8], 2) for i in range(0, len(bits), 8))
        return data.replace(b"\xff", b"\xff\x00")  # byte stuffing

    blocks = ((side + 7) // 8) ** 2
    one_code = bytes([1] + [0] * 15)  # a Huffman table of one 1-bit code
    jpeg = b"\xff\xd8" + segment(0xDB, b"\x00" + b"\x01" * 64)
    jpeg += segment(0xC2, struct.pack(">BHHB", 8, side, side, 1) + b"\x01\x11\x00")  # progressive, 1 component
    jpeg += segment(0xC4, b"\x00" + one_code + b"\x00")  # DC: difference 0
    jpeg += segment(0xC4, b"\x10" + one_code + b"\xe0")  # AC: an end-of-band run of 2^14 blocks
    jpeg += segment(0xDA, b"\x01\x01\x00\x00\x00\x00") + entropy("0" * blocks)
    ac_scan = segment(0xDA, b"\x01\x01\x00\x01\x3f\x00") + entropy("0" + "1" * 14)
    return jpeg + ac_scan * refinements + b"\xff\xd9"


def test_a_jpeg_of_too_many_scans_is_refused_before_decoding():
    # 2000 tiny scans of a 6320x6320 image kept a decode thread busy 11 s (95,000 fit the upload limit): the
    # deadline's 504 cannot stop a decode once it runs.
    assert decode_image(progressive_jpeg_of_scans(64, MAX_JPEG_SCANS - 1)).size == (64, 64)  # a real JPEG
    with pytest.raises(InvalidImage, match=f"^a JPEG of more than {MAX_JPEG_SCANS} scans at 4096 pixels"):
        decode_image(progressive_jpeg_of_scans(64, MAX_JPEG_SCANS + 1))
    # A large image is allowed fewer: 100 scans of 6144x6144 held a decode thread 2 s and 400 MB (a reviewer)
    many = progressive_jpeg_of_scans(6320, 5000)
    started = time.perf_counter()
    with pytest.raises(InvalidImage, match="^a JPEG of more than 30 scans at 39942400 pixels"):
        decode_image(many)
    assert time.perf_counter() - started < 1.0
    # Fill bytes and junk before the first scan: Pillow's opening stepped over 10 MB of them one at a time (4.4 s)
    with pytest.raises(InvalidImage, match="^a JPEG of more than 4096 bytes outside its segments before its image"):
        decode_image(b"\xff\xd8" + b"\xff" * 5_000 + progressive_jpeg_of_scans(64, 1)[2:])
    ordinary = io.BytesIO()
    Image.new("RGB", (640, 480), "teal").save(ordinary, "JPEG", progressive=True)
    assert decode_image(ordinary.getvalue()).size == (640, 480)  # Pillow's progressive JPEG: about 10 scans
    # Start-of-scan bytes that are not this image's markers: in a segment's payload (an ICC profile, an EXIF
    # thumbnail), or after its end, where a phone's motion photo keeps its video. They were counted as scans.
    in_payload = io.BytesIO()
    Image.new("RGB", (64, 48), "teal").save(in_payload, "JPEG", icc_profile=b"\xff\xda" * 30_000)
    video = np.random.default_rng(3).integers(0, 256, 8_000_000, dtype=np.uint8).tobytes()
    assert video.count(b"\xff\xda") > MAX_JPEG_SCANS
    for data in (in_payload.getvalue(), ordinary.getvalue() + video):
        assert decode_image(data).size in ((64, 48), (640, 480))
    # Markers without a length after the first scan: read one by one, they cost Python a call each
    marker_flood = progressive_jpeg_of_scans(64, 1)[:-2] + b"\xff\x01" * 5_000_000 + b"\xff\xd9"
    started = time.perf_counter()
    with pytest.raises(InvalidImage, match="more than 2000 markers"):
        decode_image(marker_flood)
    assert time.perf_counter() - started < 1.0


def test_what_follows_a_jpegs_end_is_not_counted_as_its_scans():
    # A phone's motion photo appends an MP4 (its first box's size begins 00 00) after the end-of-image marker: the
    # start-of-scan markers in it would count as this image's scans only if the walk went on past that end.
    ordinary = encode(Image.new("RGB", (640, 480), "teal"), "JPEG", progressive=True)
    video = b"\0\0\0\x18ftypmp42" + b"\xff\xda\x00\x02" * (MAX_JPEG_SCANS + 1)
    assert decode_image(ordinary + video).size == (640, 480)


def test_max_pixels_alone_decides_up_to_where_pillow_refuses_every_image():
    """Pillow warns past MAX_IMAGE_PIXELS; a server allowing more must decode such an image (it answered 413
    saying its own limit was higher), and cannot be told to allow what Pillow refuses outright."""
    image = io.BytesIO()
    Image.new("1", (10_000, 9_000)).save(image, "PNG")  # 11 KB on disk, past Pillow's warning at ~89.5 M
    assert 10_000 * 9_000 > Image.MAX_IMAGE_PIXELS
    assert decode_image(image.getvalue(), max_pixels=100_000_000).size == (10_000, 9_000)
    with pytest.raises(ImageTooLarge, match="10000x9000 = 90000000 pixels, over the limit of 89999999"):
        decode_image(image.getvalue(), max_pixels=89_999_999)
    past_pillow = png_declaring(20_000, 20_000, zlib.compress(bytes(20_001), 9))  # Pillow refuses it on opening
    with pytest.raises(ImageTooLarge, match=r"^image is 400000000 pixels, over the limit of 100000 \(refused"):
        decode_image(past_pillow, max_pixels=100_000)  # one limit named, not Pillow's besides the server's
    assert ServerConfig(model="a.onnx", max_pixels=PILLOW_MAX_PIXELS).max_pixels == PILLOW_MAX_PIXELS
    with pytest.raises(ValueError, match=f"--max-pixels must be at most {PILLOW_MAX_PIXELS}"):
        ServerConfig(model="a.onnx", max_pixels=PILLOW_MAX_PIXELS + 1)


def test_an_image_with_a_side_over_the_limit_is_refused_before_decoding():
    # A 114 KB 16-bit PNG of 1 x 39M pixels, within --max-pixels, cost a decode thread 10 s and 1.2 GB (a helper
    # reviewing the server as an attacker would): Pillow keeps a row's bookkeeping per row.
    thin = png_declaring(1, 39_000_000)  # refused from its header: no pixel data needed
    with pytest.raises(ImageTooLarge, match=r"^image is 1x39000000: a side over 65535 pixels, the limit \(refused"):
        decode_image(thin)
    longest = png_declaring(2, MAX_IMAGE_SIDE, zlib.compress(bytes(3 * MAX_IMAGE_SIDE), 9))  # 3 = filter byte + 2
    assert decode_image(longest).size == (2, MAX_IMAGE_SIDE)  # JPEG's own limit, so every JPEG is within it


def test_a_png_or_gif_of_far_more_chunks_than_an_encoder_writes_is_refused_before_decoding():
    # A helper reviewing the server as an attacker would: 800k empty chunks in a 9.6 MB PNG held a decode thread
    # 3.1 s, 1.9M comment blocks in a GIF 1.4 s and 364 MB (Pillow reads each in Python)
    small = encode(Image.new("L", (8, 8)), "PNG")
    before_pixels = small.index(b"IDAT") - 4
    empties = png_chunk(b"abCd", b"") * 140_000
    with pytest.raises(InvalidImage, match=r"^a PNG of more than 1016 chunks \(1000 and two a row\)"):
        decode_image(small[:before_pixels] + empties[: 12 * 2_000] + small[before_pixels:])
    # A row count declared in the billions allowed as many chunks: rows count up to the longest side only
    tall = png_declaring(1, 2**31 - 1)
    with pytest.raises(InvalidImage, match=r"^a PNG of more than 132070 chunks"):
        decode_image(tall[: tall.index(b"IDAT") - 4] + empties + tall[tall.index(b"IDAT") - 4 :])
    gif = encode(Image.new("P", (8, 8)), "GIF")
    first_image = gif.index(b",")
    # comments of one byte, then empty extensions and stray bytes (Pillow steps over each, one at a time)
    for blocks in (
        b"!\xfe\x01X\x00" * 20_000,
        b"!\xfe\x00" * 20_000,
        b"\x00" + b"!\xfe\x01X\x00" * 20_000,
        bytes(20_000),
    ):
        with pytest.raises(InvalidImage, match="^a GIF of more than 10000 blocks before its image"):
            decode_image(gif[:first_image] + blocks + gif[first_image:])
    # What encoders write is read: image data a chunk a row (some encoders), interlaced too, an animation's later
    # frames (Pillow reads the first only), and a few comments
    rows = np.random.default_rng(2).integers(0, 256, (3000, 4), dtype=np.uint8)
    deflated = zlib.compressobj()
    per_row = b"".join(
        png_chunk(b"IDAT", deflated.compress(b"\0" + row.tobytes()) + deflated.flush(zlib.Z_FULL_FLUSH)) for row in rows
    )
    header = png_chunk(b"IHDR", struct.pack(">IIBBBBB", 4, 3000, 8, 0, 0, 0, 0))
    png_of_rows = PNG_SIGNATURE + header + per_row + png_chunk(b"IDAT", deflated.flush()) + png_chunk(b"IEND", b"")
    assert np.array_equal(np.asarray(decode_image(png_of_rows).convert("L")), rows)
    adam7_scanlines = 2 * len(rows) - len(rows) // 8  # 15/8 a row: 5,625 chunks, one a scanline, for 3,000 rows
    assert check_png_chunks(PNG_SIGNATURE + header + png_chunk(b"IDAT", b"") * adam7_scanlines) is None
    frames = [Image.new("RGB", (16, 16), (i % 256, 0, 0)) for i in range(1_500)]
    animated = encode(frames[0], "PNG", save_all=True, append_images=frames[1:])
    assert animated.count(b"fcTL") == 1_500 and decode_image(animated).getpixel((0, 0)) == (0, 0, 0)
    assert decode_image(gif[:first_image] + b"!\xfe\x01X\x00" * 100 + gif[first_image:]).size == (8, 8)


def test_a_gifs_blocks_are_counted_from_the_end_of_its_whole_colour_table():
    # Were half the global colour table skipped, the walk would begin among its colours: a "," there would end it
    # at once, and the blocks that follow would go uncounted
    gif = encode(Image.new("P", (8, 8)), "GIF")
    table = 3 << ((gif[10] & 7) + 1)  # its flags' size: 2 colours, 6 bytes
    first_image = 13 + table
    assert gif[10] & 0x80 and gif[first_image] == 0x2C

    def with_colours(colours: bytes, blocks: bytes) -> bytes:
        return gif[:13] + colours + blocks + gif[first_image:]

    with pytest.raises(InvalidImage, match="^a GIF of more than 10000 blocks before its image"):
        decode_image(with_colours(b"," * table, b"!\xfe\x01X\x00" * 20_000))
    assert decode_image(with_colours(b"!" * table, b"!\xfe\x01X\x00" * 100)).getpixel((0, 0)) == (33, 33, 33)


def test_what_pillow_reads_slowly_is_refused_before_it_does_a_second_round():
    """A reviewer's second round: a non-animated PNG with an fcTL after its image data (Pillow reads on past it: 3 s),
    a megabyte inflated per iCCP or zTXt chunk (26-40 s extrapolated), 1x1 TIFF tiles (44 s), strips at the
    allowed maximum (2.5 s), a run-length encoded BMP of 5M one-pixel runs (3.5 s)."""
    small = encode(Image.new("L", (8, 8)), "PNG")
    end = small.index(b"IEND") - 4
    frame = png_chunk(b"fcTL", struct.pack(">IIIIIHHBB", 0, 8, 8, 0, 0, 1, 1, 0, 0))
    with pytest.raises(InvalidImage, match=r"^a PNG of more than 1016 chunks"):
        decode_image(small[:end] + frame + png_chunk(b"prIv", b"") * 2_000 + small[end:])
    profile = png_chunk(b"iCCP", b"p\0\0" + zlib.compress(b""))
    with pytest.raises(InvalidImage, match=r"^a PNG of more than 64 compressed text or colour-profile chunks"):
        decode_image(small[:end] + profile * 65 + small[end:])
    assert decode_image(small[:end] + png_chunk(b"zTXt", b"k\0\0" + zlib.compress(b"v")) * 64 + small[end:])

    def tiled(side: int, tile: int) -> bytes:
        return tiff_listing(side, side, (-(-side // tile)) ** 2, tile=tile)

    assert decode_image(tiled(64, 16)).size == (64, 64)
    with pytest.raises(InvalidImage, match=r"^a TIFF of 1x1 tiles: the spec's are multiples of 16"):
        decode_image(tiled(64, 1))
    with pytest.raises(InvalidImage, match=r"^a TIFF of 66049 strips or tiles, over 65536"):
        decode_image(tiled(4112, 16))
    rle8 = bytes([2, 0, 0, 1])  # a run of two pixels of colour 0, end of bitmap

    def bmp(pixel_data: bytes, width: int = 2, height: int = 1) -> bytes:
        info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 8, 1, len(pixel_data), 0, 0, 2, 0)
        offset = 14 + len(info) + 8
        return b"BM" + struct.pack("<IHHI", offset + len(pixel_data), 0, 0, offset) + info + bytes(8) + pixel_data

    assert decode_image(bmp(rle8)).size == (2, 1)
    with pytest.raises(InvalidImage, match="^a run-length encoded BMP of over 1048576 bytes"):
        decode_image(bmp(bytes([1, 0]) * (1 << 19) + rle8, width=2048, height=512))


def tiff_listing(
    width: int,
    height: int,
    parts: int,
    tile: int | None = None,
    size_type: int = 4,
    header: bytes = b"II*\0",
    more_entries=(),
) -> bytes:
    """A little-endian grey TIFF that lists `parts` strips of a row, or with `tile` tiles of that side, all of the
    same zero bytes; its size of TIFF type `size_type` (4 LONG, 9 SLONG...), after `header`, with `more_entries`
    (tag, type, count, value) last in its directory."""
    part = bytes(tile * tile if tile else width)
    offsets = struct.pack(f"<{parts}I", *[8] * parts)
    lengths = struct.pack(f"<{parts}I", *[len(part)] * parts)
    at_offsets, at_lengths = 8 + len(part), 8 + len(part) + len(offsets)
    if tile:  # TileWidth, TileLength, TileOffsets, TileByteCounts
        layout = [(322, 3, 1, tile), (323, 3, 1, tile), (324, 4, parts, at_offsets), (325, 4, parts, at_lengths)]
    else:  # StripOffsets, RowsPerStrip, StripByteCounts
        layout = [(273, 4, parts, at_offsets), (278, 4, 1, 1), (279, 4, parts, at_lengths)]
    sizes = [(256, size_type, 1, width), (257, size_type, 1, height)]
    grey = [(258, 3, 1, 8), (259, 3, 1, 1), (262, 3, 1, 1), (277, 3, 1, 1)]
    entries = [*sorted(sizes + grey + layout), *more_entries]
    ifd = struct.pack("<H", len(entries)) + b"".join(struct.pack("<HHII", *entry) for entry in entries) + bytes(4)
    return header + struct.pack("<I", at_lengths + len(lengths)) + part + offsets + lengths + ifd


def test_a_tiff_listing_more_strips_than_its_image_has_is_refused_before_pillow_opens_it():
    # An 8x8 image listing a million strips (8 MB) held a decode thread 10 s and was answered 200; one of 1M rows
    # took Pillow 2.6 s to open before its side was refused
    assert decode_image(tiff_listing(8, 8, 8)).size == (8, 8)  # one strip a row: what it should list
    listed = r"^a TIFF whose 8x8 image has 8 but lists 200000 strips or tiles"
    with pytest.raises(InvalidImage, match=listed):
        decode_image(tiff_listing(8, 8, 200_000))
    # Read as Pillow reads it (a reviewer got each past the first version): its size as a signed type, 42 written
    # the other way round, tiles listed besides the strips Pillow reads
    tiles = ((322, 3, 1, 16), (323, 3, 1, 16), (324, 4, 1, 8))
    for odd in ({"size_type": 9}, {"header": b"II\0*"}, {"more_entries": tiles}):
        with pytest.raises(InvalidImage, match=listed):
            decode_image(tiff_listing(8, 8, 200_000, **odd))
    # and a directory of so many entries that the strips could come after those read (Pillow reads them all)
    with pytest.raises(InvalidImage, match=r"^a TIFF directory of 1010 entries, over 1000"):
        decode_image(tiff_listing(8, 8, 8, more_entries=[(60_000 + i, 3, 1, 0) for i in range(1_001)]))
    with pytest.raises(ImageTooLarge, match=r"^image is 8x200000: a side over 65535 pixels"):
        decode_image(tiff_listing(8, 200_000, 200_000))
    # What writers make is read: strips and tiles, planes apart, BigTIFF, either byte order (tifffile writes them)
    image = np.random.default_rng(4).integers(0, 256, (3, 40, 48), dtype=np.uint8)
    for options in (
        {"rowsperstrip": 7},
        {"tile": (16, 32)},
        {"tile": (16, 16), "bigtiff": True},  # little-endian: Pillow reads no big-endian BigTIFF
        {"tile": (16, 16), "byteorder": ">"},
        {"rowsperstrip": 1, "byteorder": ">"},
    ):
        written = io.BytesIO()
        tifffile.imwrite(written, image, planarconfig="separate", photometric="rgb", **options)
        assert np.array_equal(np.asarray(decode_image(written.getvalue())), image.transpose(1, 2, 0)), options


def test_a_tiff_repeating_its_strip_list_is_bounded_by_the_first_as_pillow_reads_it():
    # Were the last of a repeated tag taken, a short StripOffsets after a long one would pass the bound, and Pillow
    # would build the first's 200,000 strips
    with pytest.raises(InvalidImage, match=r"^a TIFF whose 8x8 image has 8 but lists 200000 strips or tiles"):
        decode_image(tiff_listing(8, 8, 200_000, more_entries=[(273, 4, 8, 8)]))
    assert decode_image(tiff_listing(8, 8, 8, more_entries=[(273, 4, 200_000, 8)])).size == (8, 8)


def corrupt_huffman_table(jpeg: bytes) -> bytes:
    """Every code-length count of the first Huffman table set to 255: more codes than can exist."""
    dht = jpeg.index(b"\xff\xc4")
    counts = dht + 5  # marker (2), length (2), class/id (1)
    return jpeg[:counts] + b"\xff" * 16 + jpeg[counts + 16 :]


def corrupt_scan_data(jpeg: bytes) -> bytes:
    """The middle half of the entropy-coded data overwritten with noise (no 0xFF, so no fake markers)."""
    sos = jpeg.index(b"\xff\xda")
    start = sos + 2 + int.from_bytes(jpeg[sos + 2 : sos + 4], "big")
    length = (len(jpeg) - start) // 2
    noise = np.random.default_rng(0).integers(0, 255, length, dtype=np.uint8).tobytes()
    return jpeg[: start + length // 2] + noise + jpeg[start + length // 2 + length :]


def multipart(parts: list[tuple[str, str | None, bytes]], boundary: str = "b0undary") -> bytes:
    """A hand-made multipart body, for what an HTTP client library would not send: (field, filename, data)."""
    body = b""
    for field, filename, data in parts:
        disposition = f'form-data; name="{field}"'.encode() + (b'; filename="' + filename + b'"' if filename else b"")
        body += b"--" + boundary.encode() + b"\r\nContent-Disposition: " + disposition + b"\r\n\r\n" + data + b"\r\n"
    return body + b"--" + boundary.encode() + b"--\r\n"


def post_multipart(client, body: bytes, boundary: str = "b0undary"):
    return post_raw(client, body, f"multipart/form-data; boundary={boundary}")


# ------------------------------------------------------------------------------------------- refused

REFUSED = {
    "empty body": (lambda c, j: post_raw(c, b""), 400, "empty body"),
    "zero-byte file": (lambda c, j: post_file(c, b""), 400, "field 'file' is empty: no file was chosen"),
    "text as image": (lambda c, j: post_file(c, b"just some text\n" * 10), 400, "not a recognised image format"),
    "html as image": (
        lambda c, j: post_raw(c, b"<!DOCTYPE html><html><body><img src=x></body></html>", "image/png"),
        400,
        "not a recognised image format",
    ),
    "an iPhone's HEIC": (  # its first box, as an iPhone writes it; Pillow reads no HEIC
        lambda c, j: post_raw(c, b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic" + bytes(200), "image/heic"),
        400,
        "a HEIC/AVIF image (heic), a format not accepted here: send it as JPEG or PNG",
    ),
    "pdf as image": (
        lambda c, j: post_file(c, b"%PDF-1.7\n1 0 obj <<>> endobj\ntrailer <<>>\n%%EOF\n"),
        400,
        "not a recognised image format",
    ),
    "svg": (
        lambda c, j: post_raw(c, b'<svg xmlns="http://www.w3.org/2000/svg" width="9" height="9"/>', "image/svg+xml"),
        400,
        "not a recognised image format",
    ),
    "eps (would run ghostscript)": (
        lambda c, j: post_raw(c, encode(photo(j).resize((32, 32)), "EPS")),
        400,
        "not a recognised image format",
    ),
    "ico (not an accepted format)": (
        lambda c, j: post_raw(c, encode(photo(j), "ICO")),
        400,
        "not a recognised image format",
    ),
    "truncated jpeg": (lambda c, j: post_file(c, j[: len(j) // 2]), 400, "truncated"),
    "truncated png": (
        lambda c, j: post_file(c, (lambda p: p[: len(p) // 2])(encode(photo(j), "PNG"))),
        400,
        "corrupt or truncated",
    ),
    "jpeg header only": (lambda c, j: post_file(c, j[:20]), 400, "a JPEG image the decoder cannot read (cut short"),
    "corrupt huffman table": (lambda c, j: post_file(c, corrupt_huffman_table(j)), 400, "corrupt or truncated"),
    "decompression bomb": (lambda c, j: post_file(c, decompression_bomb()), 413, "over the limit of"),
    "huge declared dimensions": (
        lambda c, j: post_file(c, png_declaring(1_000_000, 1_000_000)),
        413,
        "over the limit of",
    ),
    "pixel limit, valid image": (lambda c, j: post_file(c, encode(Image.new("L", (2100, 2000)), "PNG")), 413, "pixels"),
    "wrong multipart field": (lambda c, j: post_file(c, j, field="image"), 400, "'file'"),
    "file sent as a text field": (
        lambda c, j: post_multipart(c, multipart([("file", None, j)])),
        400,
        "'file' came as a text field",
    ),
    "two files": (
        lambda c, j: c.post(
            "/predict", files=[("file", ("a.jpg", j, "image/jpeg")), ("file", ("b.jpg", j, "image/jpeg"))]
        ),
        400,
        "more than one file",
    ),
    "malformed multipart": (lambda c, j: post_raw(c, b"--x\r\n", "multipart/form-data"), 400, "multipart"),
    "multipart, wrong boundary": (
        lambda c, j: post_multipart(c, multipart([("file", b"a.jpg", j)]), "other"),
        400,
        "it must begin with --other, the boundary its Content-Type names",
    ),
    "multipart lines ending in a bare LF": (
        lambda c, j: post_multipart(c, multipart([("file", b"a.jpg", j)]).replace(b"\r\n", b"\n")),
        400,
        "its lines must end in CRLF",
    ),
    "multipart, a boundary longer than the one declared": (  # the parser finds no CR after "--abc": not an LF's fault
        lambda c, j: post_multipart(c, multipart([("file", b"a.jpg", j)], "abcdef"), "abc"),
        400,
        "it must begin with --abc, the boundary its Content-Type names",
    ),
    "multipart, boundary over 256 bytes": (
        lambda c, j: post_multipart(c, multipart([("file", b"a.jpg", j)], "b" * 300), "b" * 300),
        400,
        "malformed multipart body: Boundary length 300",
    ),
    "multipart part headers over the parser's limit": (  # not a boundary's fault, as the message said it was
        lambda c, j: post_multipart(c, multipart([("file", b"a" * 20_000 + b".jpg", j)])),
        400,
        "malformed multipart body (Maximum header size exceeded)",
    ),
    "multipart, cut before its closing boundary": (
        lambda c, j: post_multipart(c, multipart([("file", b"a.jpg", j)])[:-30]),
        400,
        "ends before its closing boundary",
    ),
    "multipart part without a name": (
        lambda c, j: post_multipart(c, multipart([("file", b"a.jpg", j)]).replace(b'name="file"; ', b"")),
        400,
        "has no name",
    ),
    "too many multipart fields": (
        lambda c, j: post_multipart(
            c, multipart([(f"note{i}", None, b"x") for i in range(17)] + [("file", b"a.jpg", j)])
        ),
        400,
        "more than 16 fields",
    ),
    "missing content type": (lambda c, j: post_raw(c, j, None), 415, "content type"),
    "wrong content type": (lambda c, j: post_raw(c, j, "text/plain"), 415, "content type"),
    "json content type": (lambda c, j: c.post("/predict", json={"file": "aGVsbG8="}), 415, "content type"),
    "gzip content encoding": (  # was 400 'not a recognised image format', blaming the image
        lambda c, j: c.post(
            "/predict", content=gzip.compress(j), headers={"Content-Type": "image/jpeg", "Content-Encoding": "gzip"}
        ),
        415,
        "Content-Encoding 'gzip' not accepted: send the image's bytes as they are",
    ),
    "body over the limit": (lambda c, j: post_raw(c, bytes(UPLOAD_LIMIT + 1)), 413, "over the limit"),
    "chunked body over the limit": (
        lambda c, j: post_raw(c, iter([bytes(UPLOAD_LIMIT // 2)] * 3)),
        413,
        "over the limit",
    ),
    "multipart file over the limit": (lambda c, j: post_file(c, bytes(UPLOAD_LIMIT)), 413, "over the limit"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_refused_with_a_clear_documented_4xx_and_the_server_serves_on(client, jpeg, case):
    send, status, message = REFUSED[case]
    response = send(client, jpeg)
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    assert message in response.json()["detail"]
    documented = client.get("/openapi.json").json()["paths"]["/predict"]["post"]["responses"]
    assert str(status) in documented and documented[str(status)]["description"]
    assert post_file(client, jpeg).status_code == 200


def test_an_image_over_the_pixel_limit_keeps_the_connection_a_body_far_over_the_byte_limit_does_not(client):
    # The whole image arrived before its pixels were counted: nothing is left unread on the connection.
    too_many_pixels = post_file(client, encode(Image.new("L", (2100, 2000)), "PNG"))
    assert too_many_pixels.status_code == 413 and "connection" not in too_many_pixels.headers
    # A body a little over the limit is dropped as it arrives, after its 413; one far over is not received.
    over = post_raw(client, bytes(UPLOAD_LIMIT + 1))
    assert over.status_code == 413 and "connection" not in over.headers
    far_over = post_raw(client, bytes(DROPPED_BODY_TIMES_LIMIT * UPLOAD_LIMIT + 1))
    assert far_over.status_code == 413 and far_over.headers["connection"] == "close"


def test_a_client_that_sends_all_before_it_reads_gets_its_413_not_a_reset(fp32_model_path):
    # http.client (urllib) and Java's client write the whole body first: the connection closed under them
    # with megabytes unread, and they reported a reset instead of the 413 (each of 5 tries at 11 MiB).
    with ServerProcess(fp32_model_path, max_upload_bytes=1_000_000) as url:
        host, port = url.removeprefix("http://").split(":")
        for size in (1_000_001, 7_000_000):
            connection = http.client.HTTPConnection(host, int(port), timeout=WAIT_S)
            connection.request("POST", "/predict", body=bytes(size), headers={"Content-Type": "image/jpeg"})
            answer = connection.getresponse()
            assert answer.status == 413 and b"over the limit" in answer.read(), size
            connection.close()


@pytest.mark.parametrize(
    "method, path, status, allow",
    [
        ("GET", "/predict", 405, "POST"),
        ("PUT", "/predict", 405, "POST"),
        ("DELETE", "/predict", 405, "POST"),
        ("PUT", "/healthz", 405, "GET, HEAD"),  # HEAD is answered wherever GET is, so Allow says so
        ("POST", "/v2/models/fp32", 405, "GET, HEAD"),
        ("POST", "/nowhere", 404, None),
        ("GET", "/predict/../../etc/passwd", 404, None),
    ],
)
def test_unsupported_method_or_path_is_json(client, jpeg, method, path, status, allow):
    response = client.request(method, path)
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json" and response.json()
    assert response.headers.get("allow") == allow
    if allow and "HEAD" in allow:
        assert client.head(path).status_code == 200


# ------------------------------------------------------------------------------------------ accepted


def predictions(response) -> dict[int, float]:
    assert response.status_code == 200, response.text
    return {p["class_id"]: p["probability"] for p in response.json()["predictions"]}


def same_predictions(a: dict[int, float], b: dict[int, float], rel: float = 1e-4) -> bool:
    return a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], rel=rel) for k in a)


ACCEPTED = {
    "1x1": lambda j: encode(Image.new("RGB", (1, 1), (200, 30, 30)), "PNG"),
    "aspect 1x10000": lambda j: encode(photo(j).resize((1, 10_000)), "PNG"),
    "aspect 10000x1": lambda j: encode(photo(j).resize((10_000, 1)), "PNG"),
    "cmyk jpeg": lambda j: encode(photo(j).convert("CMYK"), "JPEG"),
    "grayscale jpeg": lambda j: encode(photo(j).convert("L"), "JPEG"),
    "progressive jpeg": lambda j: encode(photo(j), "JPEG", progressive=True),
    "corrupt scan data (libjpeg conceals it)": corrupt_scan_data,
}


@pytest.mark.parametrize("case", ACCEPTED)
def test_valid_but_odd_images_work(client, jpeg, case):
    assert len(predictions(post_file(client, ACCEPTED[case](jpeg)))) == 5


def test_an_odd_filename_is_ignored_and_a_junk_query_string_refused_with_its_first_parameter(client, jpeg):
    expected = predictions(post_file(client, jpeg))
    non_utf8_name = multipart([("file", b"\xff\xfe\x00caf\xe9.jpg", jpeg)])
    assert same_predictions(predictions(post_multipart(client, non_utf8_name)), expected)
    junk = "/predict?x=%ZZ&&=&a[]=1;drop%00table&" + "q" * 2000
    answer = client.post(junk, files={"file": ("a.jpg", jpeg, "image/jpeg")})
    assert (answer.status_code, answer.json()) == (
        400,
        {"detail": "unknown query parameter 'x': /predict takes only ?model=NAME"},
    )


def test_an_image_arrives_as_upload_libraries_send_one(client, jpeg):
    # Mobile and S3-style clients send raw bytes as application/octet-stream; some send a file part typed as an
    # image but with no filename, or with only RFC 5987's filename*.
    expected = predictions(post_file(client, jpeg))
    assert same_predictions(predictions(post_raw(client, jpeg, "application/octet-stream")), expected)
    typed_part = multipart([("file", None, jpeg)]).replace(
        b'name="file"\r\n', b'name="file"\r\nContent-Type: image/jpeg\r\n'
    )
    assert same_predictions(predictions(post_multipart(client, typed_part)), expected)
    extended_name = multipart([("file", None, jpeg)]).replace(
        b'name="file"', b"name=\"file\"; filename*=UTF-8''%D1%84.jpg"
    )
    assert same_predictions(predictions(post_multipart(client, extended_name)), expected)


def test_text_fields_beside_the_multipart_file_are_ignored(client, jpeg):
    expected = predictions(post_file(client, jpeg))
    body = multipart([("note", None, b"hello"), ("file", b"a.jpg", jpeg), ("tag", None, b"x")])
    assert same_predictions(predictions(post_multipart(client, body)), expected)


def test_a_multipart_body_arriving_in_tiny_pieces_reads_the_same(jpeg):
    # Every header name, header value and boundary split across the body's messages, as a slow network
    # splits them (the TestClient would join them into one).
    body = multipart([("note", None, b"hello"), ("file", b"a.jpg", jpeg)])
    assert asyncio.run(read_upload(multipart_request(body, 3), UPLOAD_LIMIT, WAIT_S)) == jpeg


def test_a_phone_size_multipart_upload_is_read_in_memory_not_spooled_to_disk(monkeypatch):
    def no_disk(*args, **kwargs):
        raise AssertionError("the upload went to a temporary file")

    monkeypatch.setattr(tempfile, "TemporaryFile", no_disk)  # where a spooled file rolls over to disk
    photo_bytes = bytes(range(256)) * (3_000_000 // 256)  # the size of a 12-megapixel JPEG
    body = multipart([("file", b"phone.jpg", photo_bytes)])
    request = multipart_request(body, 65536)  # the size of the pieces uvicorn hands a body over in
    assert asyncio.run(read_upload(request, 2 * len(body), WAIT_S)) == photo_bytes


def multipart_request(body: bytes, piece_size: int) -> Request:
    """A request whose multipart `body` arrives as ASGI messages of `piece_size` bytes, the last one saying so."""
    pieces = [body[i : i + piece_size] for i in range(0, len(body), piece_size)]

    async def receive():
        piece = pieces.pop(0)
        return {"type": "http.request", "body": piece, "more_body": bool(pieces)}

    headers = [(b"content-type", b"multipart/form-data; boundary=b0undary")]
    return Request({"type": "http", "method": "POST", "headers": headers}, receive)


def gzip_request(body: bytes) -> Request:
    """A request whose gzip'd `body` arrives in one ASGI message."""

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    return Request({"type": "http", "method": "POST", "headers": [(b"content-encoding", b"gzip")]}, receive)


def test_a_gzip_body_is_never_inflated_past_its_limit():
    # A member inflating to exactly the limit must not leave zlib a max_length of 0, which is no limit: the next
    # member would inflate whole (16 MB here) before the size was compared, though the answer would still be 413
    limit = 100_000
    exact = gzip.compress(bytes(limit))
    assert asyncio.run(read_body(gzip_request(exact), limit, WAIT_S)) == bytes(limit)
    bomb = exact + gzip.compress(bytes(16_000_000))
    assert len(bomb) < limit
    tracemalloc.start()
    try:
        with pytest.raises(BodyTooLarge, match="^the gzip body inflates to over the limit of 100000 bytes"):
            asyncio.run(read_body(gzip_request(bomb), limit, WAIT_S))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 10 * limit, f"{peak} bytes"


def sixteen_bit_and_eight_bit(jpeg: bytes) -> tuple[bytes, bytes]:
    """The same grayscale photo as a 16-bit PNG (values x 257, full range) and an 8-bit one."""
    gray = np.asarray(photo(jpeg).convert("L"), dtype=np.uint16)
    gray[0, 0] = 255  # full range, so scaling by the peak maps 65535 back to 255
    return encode(Image.fromarray(gray * 257), "PNG"), encode(Image.fromarray(gray.astype(np.uint8)), "PNG")


def test_16_bit_png_is_scaled_not_clipped(client, jpeg):
    sixteen, eight = sixteen_bit_and_eight_bit(jpeg)
    assert Image.open(io.BytesIO(sixteen)).mode == "I;16"
    assert same_predictions(predictions(post_file(client, sixteen)), predictions(post_file(client, eight)))


@pytest.mark.parametrize("mode", ["I;16", "F"])
def test_a_wide_grey_image_is_scaled_a_block_of_rows_at_a_time(mode):
    # Whole-image float32 copies held about 13 B a pixel besides the image (0.5 GB for a 40 Mpixel upload of
    # 78 KB); numpy's allocations, which tracemalloc sees, now stay a fraction of a byte a pixel.
    side = 2000
    values = np.random.default_rng(5).random((side, side)) * 60_000
    image = Image.fromarray(values.astype(np.uint16 if mode == "I;16" else np.float32))
    assert image.mode == mode
    tracemalloc.start()
    try:
        decoded = _to_rgb(image)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert decoded.mode == "RGB" and decoded.size == (side, side)
    assert peak < 3 * side * side, f"{peak / side**2:.1f} B a pixel"  # the 8-bit result and its image: 2 B a pixel


def test_a_thin_wide_grey_image_is_scaled_in_blocks_of_pixels_not_of_rows(monkeypatch):
    # Blocks of 256 rows whatever the width took a 1-pixel-wide image ~150k blocks, each read twice in Python
    image = Image.fromarray(np.arange(60_000, dtype=np.uint16).reshape(30_000, 2))
    assert image.mode == "I;16"
    blocks = []
    crop = image.crop
    monkeypatch.setattr(image, "crop", lambda box: blocks.append(box) or crop(box))
    grey = np.asarray(_to_rgb(image).convert("L"))
    assert len(blocks) == 2  # one block of 60,000 pixels, read once for the range and once to scale
    assert grey[-1, -1] == 255 and grey[0, 0] == 0


def full_range_gray(jpeg: bytes) -> np.ndarray:
    gray = np.asarray(photo(jpeg).convert("L").resize((64, 48)))
    gray = gray.copy()
    gray[5, 5:7] = 0, 255  # the full 8-bit range, so scaling to 8 bits gives these values back
    return gray


def decoded_gray(image: Image.Image) -> np.ndarray:
    return np.asarray(decode_image(encode(image, "TIFF")).convert("L"))


def test_float_image_with_nan_or_infinity_keeps_its_picture(jpeg):
    """A NaN or infinite pixel takes an end of the scale; the finite ones keep theirs (one NaN made it all black)."""
    gray = full_range_gray(jpeg)
    floats = gray.astype(np.float32) / 255
    spoilt = floats.copy()
    spoilt[0, 0:3] = np.nan, np.inf, -np.inf
    expected = decoded_gray(Image.fromarray(floats))
    assert np.abs(expected.astype(int) - gray).max() <= 1  # float rounding
    actual = decoded_gray(Image.fromarray(spoilt))
    assert list(actual[0, 0:3]) == [0, 255, 0]
    assert np.array_equal(actual[1:], expected[1:]) and np.array_equal(actual[0, 3:], expected[0, 3:])


def test_32_bit_integer_image_with_negative_values_is_scaled_not_wrapped(jpeg):
    gray = full_range_gray(jpeg)
    shifted = Image.fromarray(gray.astype(np.int32) - 40_000)
    assert shifted.mode == "I"
    assert np.array_equal(decoded_gray(shifted), gray)  # wrapped around uint8, the mean was twice the photo's


@pytest.mark.parametrize("dtype", [np.uint16, np.int32], ids=["I;16", "I"])
def test_a_wide_grey_integer_image_is_scaled_from_0_not_stretched_from_its_minimum(dtype):
    # Integer levels count from 0: 30,000-40,000 is a light picture of little contrast, which stretching its own
    # range to 0-255 would turn into a full-contrast one
    values = np.linspace(30_000, 40_000, 64 * 48).reshape(48, 64).astype(dtype)
    grey = decoded_gray(Image.fromarray(values))
    assert (grey.min(), grey.max()) == (191, 255)  # 30000 / 40000 * 255 = 191.25: scaled to the peak, from 0
    assert np.abs(grey.astype(int) - values.astype(int) * 255 // 40_000).max() <= 1


def frames(jpeg: bytes) -> list[Image.Image]:
    first = photo(jpeg).resize((160, 120))
    return [first, first.transpose(Image.Transpose.ROTATE_180), Image.new("RGB", first.size, (0, 255, 0))]


@pytest.mark.parametrize("format, params", [("GIF", {}), ("WEBP", {"lossless": True})])
def test_animated_image_is_classified_by_its_first_frame(client, jpeg, format, params):
    first, *rest = frames(jpeg)
    animated = encode(first, format, save_all=True, append_images=rest, duration=100, loop=0, **params)
    assert getattr(Image.open(io.BytesIO(animated)), "n_frames", 1) == 3
    alone = encode(first, format, **params)
    assert same_predictions(predictions(post_file(client, animated)), predictions(post_file(client, alone)))


def test_exif_orientation_is_honoured(client, jpeg):
    upright = photo(jpeg).crop((0, 0, 480, 368))  # whole 16-px blocks: rotating re-encodes the same blocks
    stored = upright.transpose(Image.Transpose.ROTATE_270)  # as a camera held sideways writes it
    exif = Image.Exif()
    exif[0x0112] = 8  # Orientation: rotate 90 degrees counter-clockwise to display
    params = {"quality": 100, "subsampling": 0}
    tagged, untagged = encode(stored, "JPEG", exif=exif, **params), encode(stored, "JPEG", **params)
    assert decode_image(tagged).size == upright.size
    expected = predictions(post_file(client, encode(upright, "JPEG", **params)))
    assert same_predictions(predictions(post_file(client, tagged)), expected, rel=0.02)
    assert not same_predictions(predictions(post_file(client, untagged)), expected, rel=0.02)  # the check can fail


# --------------------------------------------------------- every mode Pillow can write, in every format


def image_in_mode(mode: str) -> Image.Image:
    rgb = Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8))
    if mode in ("LAB", "HSV"):
        return Image.merge(mode, rgb.split())  # no conversion from RGB; any bytes are valid channels
    if mode.startswith("I;16"):
        return Image.fromarray(np.asarray(rgb.convert("L"), dtype=np.uint16) * 257).convert(mode)
    return rgb.convert(mode)


MODES = (
    "1",
    "L",
    "LA",
    "La",
    "P",
    "PA",
    "RGB",
    "RGBA",
    "RGBa",
    "RGBX",
    "CMYK",
    "YCbCr",
    "LAB",
    "HSV",
    "I",
    "I;16",
    "I;16B",
    "I;16L",
    "F",
)
OTHER_FORMATS = ("PPM", "TGA", "PCX", "SGI", "IM", "SPIDER", "JPEG2000", "QOI", "DDS", "XBM", "MSP", "BLP")


def saved_variants() -> list[tuple[str, str, bytes]]:
    """(mode, format, bytes) for every pair Pillow can save; the format may store a converted mode."""
    variants = []
    for mode in MODES:
        for format in ACCEPTED_FORMATS + OTHER_FORMATS:
            try:
                variants.append((mode, format, encode(image_in_mode(mode), format)))
            except (OSError, ValueError, KeyError, TypeError):
                pass  # this format cannot store this mode
    return variants


VARIANTS = saved_variants()


def test_the_formats_refused_here_are_not_accepted_ones():
    # one accepted, then listed here too, would be sent twice and pass twice, and this list would go unnoticed
    assert not set(OTHER_FORMATS) & set(ACCEPTED_FORMATS)


@pytest.mark.parametrize("format", ACCEPTED_FORMATS + OTHER_FORMATS)
def test_every_mode_in_every_format_works_or_fails_cleanly(client, format):
    sent = [(mode, data) for mode, f, data in VARIANTS if f == format]
    assert sent, f"Pillow saved no mode as {format}"
    for mode, data in sent:
        response = post_raw(client, data, "image/x-anything")
        if format in ACCEPTED_FORMATS:
            assert response.status_code == 200, (mode, response.text)
        else:
            assert response.status_code == 400 and "not a recognised image format" in response.json()["detail"], mode


# ---------------------------------------------------------------------- slow, stalled and cut uploads


def raw_post(url: str, content_length: int, body: bytes) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=WAIT_S)
    sock.sendall(
        f"POST /predict HTTP/1.1\r\nHost: {host}\r\nContent-Type: image/jpeg\r\n"
        f"Content-Length: {content_length}\r\n\r\n".encode()
        + body
    )
    return sock


def read_response(sock: socket.socket) -> bytes:
    received = b""
    while chunk := sock.recv(65536):  # the server closes the connection after these errors
        received += chunk
    return received


def test_stalled_cut_and_oversized_uploads_never_hold_the_server(fp32_model_path, jpeg):
    with ServerProcess(fp32_model_path, body_timeout_s=1, max_upload_bytes=UPLOAD_LIMIT, cache_size=0) as url:
        started = time.monotonic()
        stalled = raw_post(url, len(jpeg), jpeg[:1000])  # then nothing more: a stalled or slowloris client
        oversized = raw_post(url, 10**12, b"")  # a terabyte announced; no byte of it is read
        response = read_response(oversized)
        assert response.startswith(b"HTTP/1.1 413") and b"over the limit" in response
        assert time.monotonic() - started < 1, "refused by its Content-Length, before any wait"

        cut = raw_post(url, len(jpeg), jpeg[:1000])
        cut.close()  # the client gives up mid-upload
        response = read_response(stalled)
        assert response.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in response
        assert 1 <= time.monotonic() - started < WAIT_S
        stalled.close()

        wait_until(lambda: metric(url, 'mnv3_rejections_total{reason="disconnected"}') == 1, "the cut upload to end")
        wait_until(lambda: metric(url, "mnv3_in_flight") == 0, "every upload's slot to be released")
        assert requests.post(url + "/predict", files={"file": ("a.jpg", jpeg)}, timeout=WAIT_S).status_code == 200


def rejections(url: str, reasons=("too_large", "bad_input", "disconnected")) -> dict[str, float]:
    return {reason: metric(url, f'mnv3_rejections_total{{reason="{reason}"}}') for reason in reasons}


def test_a_body_the_connection_refuses_counts_as_what_it_is_not_as_a_disconnect(fp32_model_path, jpeg):
    """The HTTP protocol answers a chunked body's bad framing, chunk count or trailers itself and closes; the app,
    reading that body, counts the refusal by its reason: the client did not leave, it was answered."""
    head = b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\nTransfer-Encoding: chunked\r\n\r\n"
    refused = {
        "too_large": b"1\r\nx\r\n" * (connections.MAX_BODY_CHUNKS + 1) + b"0\r\n\r\n",
        "bad_input": b"1\r\nx\r\nzz\r\nx\r\n0\r\n\r\n",  # a chunk size that is no number
    }
    with ServerProcess(fp32_model_path, cache_size=0) as url:
        host, port = url.removeprefix("http://").split(":")
        for reason, chunks in refused.items():
            expected = rejections(url)
            expected[reason] += 1
            with socket.create_connection((host, int(port)), timeout=WAIT_S) as sock:
                sock.sendall(head)
                time.sleep(0.2)  # the app is reading the body
                sock.sendall(chunks)
                assert read_response(sock).startswith(b"HTTP/1.1 4"), reason
            wait_until(lambda counted=expected: rejections(url) == counted, f"the {reason} refusal to be counted")
        assert requests.post(url + "/predict", files={"file": ("a.jpg", jpeg)}, timeout=WAIT_S).status_code == 200


def test_a_malformed_multipart_body_is_answered_not_logged_by_the_multipart_parser(fp32_model_path):
    # python-multipart logged each one at WARNING: any client could fill the server's log with them.
    garbage = {"Content-Type": "multipart/form-data; boundary=xx"}
    server = ServerProcess(fp32_model_path, cache_size=0)  # logging warnings and above
    with server as url:
        for _ in range(3):
            answer = requests.post(url + "/predict", data=b"garbage", headers=garbage, timeout=WAIT_S)
            assert answer.status_code == 400 and "malformed multipart body" in answer.json()["detail"]
        log = server.output_tail()
    assert "Expected boundary character" not in log, log
