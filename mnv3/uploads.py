"""Reading an uploaded image from a request: bounded in size and in time, streamed.

`read_upload` returns the bytes of a multipart field 'file' or of a raw image/* (or octet-stream) body,
`read_body` a whole body of any type (the Open Inference Protocol's JSON or binary requests; gzip or deflate
compressed too, as Triton takes them). Either never holds more than `limit` bytes of a body, compressed or
inflated (a Content-Length over it is refused before reading; a chunked or lying one is cut off as it
arrives) and never waits past `timeout_s` for them, so one slow or huge
client cannot hold memory or an admission slot for long. Every refusal is a `BadUpload` subclass from
`mnv3.errors`, which gives its status. `CloseUnreadBody` closes the connection after an answer sent before
its request's body arrived in full (a wrong content type, an unknown model, a busy server), unless the rest
may be dropped as it arrives (`refusal_keeps_connection`).

A multipart body is parsed as it streams in (python-multipart's parser, which Starlette's forms use too), and
only the 'file' part is kept, in memory: `limit` already bounds it. Starlette's form parser would spool a file
over 1 MB (any phone photo) to a temporary file on disk, written and read back chunk by chunk through a
thread pool, and hold every other field too, none of which an image upload needs.
"""

import asyncio
import re
import zlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import TYPE_CHECKING

from python_multipart import MultipartParser
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import parse_options_header
from starlette.datastructures import Headers, MutableHeaders
from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mnv3.errors import MAX_FORM_FIELDS, BadUpload, BodyTooLarge, SlowUpload, UnsupportedMediaType

if TYPE_CHECKING:
    from python_multipart.multipart import MultipartCallbacks


async def read_upload(request: Request, limit: int, timeout_s: float) -> bytes:
    """The image bytes of a multipart 'file' field or a raw image/* or octet-stream body, never reading past
    `limit` bytes nor waiting past `timeout_s` for them: a stalled client would otherwise hold its slot forever."""
    return await _within(timeout_s, _read_upload(request, limit))


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The whole body, whatever its content type, within the same limits as `read_upload`."""
    return await _within(timeout_s, _read_body(request, limit))


async def _within(timeout_s: float, reading: Awaitable[bytes]) -> bytes:
    try:
        async with asyncio.timeout(timeout_s):
            return await reading
    except TimeoutError:
        raise SlowUpload(f"the request body did not arrive within {timeout_s:g} s") from None


# Content codings a whole body (read_body: the Open Inference Protocol's requests) may come in, as Triton takes
# them (tritonclient's request_compression_algorithm), with zlib's window bits for each. HTTP's "deflate" is
# zlib's format (RFC 9110, 8.4.1.2), which is what tritonclient sends.
CONTENT_CODINGS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
# A gzip body may be several members (RFC 1952, 2.2); clients send one. Each costs a new inflater and a copy of
# what follows it in its read, so thousands of empty ones held the event loop.
MAX_GZIP_MEMBERS = 16


async def _read_body(request: Request, limit: int) -> bytes:
    _check_declared_length(request, limit)
    encoding = content_encoding(request)
    chunks = _bounded(request, limit)
    if encoding == "identity":
        return b"".join([chunk async for chunk in chunks])
    if encoding not in CONTENT_CODINGS:
        raise UnsupportedMediaType(
            f"Content-Encoding {encoding!r} not accepted: send the body as it is, gzip or deflate"
        )
    return await _inflated(chunks, encoding, limit)


async def _inflated(chunks: AsyncIterator[bytes], encoding: str, limit: int) -> bytes:
    """A gzip or deflate body decompressed, never to more than `limit` bytes: a few kilobytes of it can
    inflate to gigabytes."""
    wbits = CONTENT_CODINGS[encoding]
    inflater, members, padded = zlib.decompressobj(wbits), 1, False
    parts: list[bytes] = []
    size = 0
    try:
        async for chunk in chunks:
            if padded:  # after the last member, zeros only, each read looked at once
                if chunk.strip(b"\0"):
                    raise BadUpload(f"data follows the zero padding of the {encoding} body")
                continue
            pending = chunk
            while pending:
                part = inflater.decompress(pending, limit + 1 - size)  # one byte past the limit at most
                size += len(part)
                if size > limit:
                    raise BodyTooLarge(f"the {encoding} body inflates to over the limit of {limit} bytes")
                parts.append(part)
                pending = inflater.unconsumed_tail
                if not (inflater.eof and inflater.unused_data):
                    continue
                pending = inflater.unused_data + pending  # what this read holds past the member's end
                if wbits == CONTENT_CODINGS["deflate"]:
                    raise BadUpload("data follows the end of the deflate body")
                if not pending.strip(b"\0"):  # zero padding after the last member, which gzip(1) accepts
                    padded = True
                    break
                members += 1
                if members > MAX_GZIP_MEMBERS:
                    raise BadUpload(f"the gzip body has more than {MAX_GZIP_MEMBERS} members: compress it as one")
                inflater = zlib.decompressobj(wbits)
        if not inflater.eof:
            raise BadUpload(f"the {encoding} body ends before its compressed data does")
    except zlib.error as exc:
        raise BadUpload(f"the body is not valid {encoding} ({exc})") from None
    return b"".join(parts)


def content_encoding(request: Request) -> str:
    """The body's content coding, lower case; "identity" without one."""
    return request.headers.get("content-encoding", "identity").strip().lower()


def declared_length(request: Request) -> int | None:
    """The body's length as its Content-Length says, None without one (chunked) or with a malformed one."""
    declared = request.headers.get("content-length", "")
    return int(declared) if declared.isdigit() else None


# A 413's body, announced at up to this many times the upload limit, is received and dropped, so its client reads
# the 413; a larger one is not worth receiving. (Its client is admitted: a refusal before that, an unknown key's,
# keeps the connection only for a body within the limit.)
DROPPED_BODY_TIMES_LIMIT = 8


def refusal_keeps_connection(request: Request, limit: int) -> bool:
    """Whether an answer sent before the request's body is read may leave the connection open.

    Yes when the request has no body, or its body announces a length of at most `limit`: uvicorn then drops
    the rest of it as it arrives (nothing is buffered) and reads the connection's next request. Closing the
    connection with the body still on its way resets it under a client still sending, and clients (aiohttp,
    requests; http.client and Java's, which send all before they read) report that reset instead of the
    answer. No for a body of unknown or larger length, which is not worth receiving, or one the client waits
    to be invited to send (`Expect: 100-continue`): it may never come, and its next request would be read as
    that body."""
    if "transfer-encoding" not in request.headers and "content-length" not in request.headers:
        return True  # no body at all (RFC 9112, 6.3): a refused GET keeps its connection
    declared = declared_length(request)
    return declared is not None and declared <= limit and "expect" not in request.headers


class CloseUnreadBody:
    """ASGI middleware: an answer that starts before its request's body has arrived in full says
    `Connection: close` (so uvicorn closes after it), unless `refusal_keeps_connection` lets the rest be
    dropped as it arrives. Left open, uvicorn would go on reading the body that was never wanted: a client
    waiting for `100 Continue` sends none, and its next request on the connection is read as that body
    and never answered."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        # A request without Content-Length or Transfer-Encoding has no body (RFC 9112, 6.3).
        body_arrived = "transfer-encoding" not in headers and headers.get("content-length", "0") == "0"

        async def receive_and_note() -> Message:
            nonlocal body_arrived
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_arrived = True  # its last part, or the client gone: nothing more will be read
            return message

        async def send_closing(message: Message) -> None:
            if message["type"] == "http.response.start" and not body_arrived:
                # A 413 says the body is over the limit: a little over, it is dropped too (DROPPED_BODY_TIMES_LIMIT).
                dropped = self.limit * (DROPPED_BODY_TIMES_LIMIT if message["status"] == 413 else 1)
                if not refusal_keeps_connection(Request(scope), dropped):
                    MutableHeaders(scope=message)["connection"] = "close"
            await send(message)

        await self.app(scope, receive_and_note, send_closing)


def _check_declared_length(request: Request, limit: int) -> None:
    declared = declared_length(request)
    if declared is not None and declared > limit:
        raise BodyTooLarge(f"body of {declared} bytes is over the limit of {limit}")


def is_image_type(media_type: bytes | str) -> bool:
    """A raw body or a multipart part of this media type is taken as image bytes: image/*, or the generic
    application/octet-stream many upload libraries send (the decoder tells the format from the bytes)."""
    media_type = (media_type.decode("latin-1") if isinstance(media_type, bytes) else media_type).strip().lower()
    return media_type.startswith("image/") or media_type == "application/octet-stream"


async def _read_upload(request: Request, limit: int) -> bytes:
    encoding = content_encoding(request)
    if encoding != "identity":  # the body would reach the decoder still compressed, and fail as "not an image"
        raise UnsupportedMediaType(
            f"Content-Encoding {encoding!r} not accepted: send the image's bytes as they are (JPEG, PNG and WebP "
            "are compressed already)"
        )
    content_type = request.headers.get("content-type", "")
    media_type = content_type.partition(";")[0].strip().lower()
    if media_type != "multipart/form-data" and not is_image_type(media_type):
        raise UnsupportedMediaType(
            f"content type {content_type or '(none)'!r} not accepted: send multipart/form-data "
            "with the image in field 'file', or the raw image as image/* or application/octet-stream"
        )
    if media_type != "multipart/form-data":
        return await _read_body(request, limit)
    _check_declared_length(request, limit)
    _, params = parse_options_header(content_type)
    if not params.get(b"boundary"):
        raise BadUpload("malformed multipart body: no boundary in its content type")
    form = _ImageForm()
    try:
        parser = MultipartParser(params[b"boundary"], form.callbacks())  # refuses e.g. an over-long boundary
    except FormParserError as exc:
        raise BadUpload(f"malformed multipart body: {exc}") from exc
    try:
        async for chunk in _bounded(request, limit):
            parser.write(chunk)
    except FormParserError as exc:  # the parser's words are about characters and indices: say what to check
        reason, offset = str(exc), getattr(exc, "offset", None)
        if offset is not None and chunk[offset : offset + 1] == b"\n":  # where a CR should be
            hint = ": its lines must end in CRLF (\\r\\n), not a bare LF"
        elif "boundary" in reason.lower():
            boundary = params[b"boundary"].decode(errors="replace")
            hint = f": it must begin with --{boundary}, the boundary its Content-Type names, with no text before it"
        else:  # a part's own fault, e.g. "Maximum header size exceeded"
            hint = ""
        raise BadUpload(f"malformed multipart body ({reason}){hint}") from exc
    if not form.complete:
        raise BadUpload("malformed multipart body: it ends before its closing boundary")
    if form.file is None and "file" in form.names:
        raise BadUpload(
            "multipart field 'file' came as a text field (no filename in its Content-Disposition, no image/* "
            "Content-Type): send the image as a file, e.g. curl -F file=@photo.jpg, or in Python requests "
            "files={'file': ('photo.jpg', data)}"
        )
    if form.file is None:
        raise BadUpload(f"expected the image as multipart file field 'file'; got fields {sorted(form.names)}")
    if not form.file:  # what a browser's form sends when no file was chosen
        raise BadUpload("multipart file field 'file' is empty: no file was chosen, or the file is empty")
    return form.file


# RFC 5987's extended filename parameter in a Content-Disposition: filename*=UTF-8''%D1%84.jpg
EXTENDED_FILENAME = re.compile(rb";\s*filename\*\s*=", re.IGNORECASE)


class _ImageForm:
    """Callbacks for python-multipart's parser that keep the contents of the file part named 'file' and
    refuse a body of more than one file or of more than MAX_FIELDS other fields, as a form of one image is."""

    MAX_FIELDS = MAX_FORM_FIELDS

    def __init__(self) -> None:
        self.names: list[str] = []  # of every part so far, for the error that lists them
        self.files = 0
        self.file: bytes | None = None
        self.complete = False  # the closing boundary was read
        self._header_name = self._header_value = self._disposition = self._part_type = b""
        self._keeping: list[bytes] | None = None  # the 'file' part's chunks while it is read

    def callbacks(self) -> "MultipartCallbacks":
        return {
            "on_header_field": self.on_header_field,
            "on_header_value": self.on_header_value,
            "on_header_end": self.on_header_end,
            "on_headers_finished": self.on_headers_finished,
            "on_part_data": self.on_part_data,
            "on_part_end": self.on_part_end,
            "on_end": self.on_end,
        }

    # A header's name and value can arrive in pieces, split across the chunks of the body.
    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def on_header_end(self) -> None:
        if self._header_name.lower() == b"content-disposition":
            self._disposition = self._header_value
        elif self._header_name.lower() == b"content-type":
            self._part_type = self._header_value.partition(b";")[0]
        self._header_name = self._header_value = b""

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        named_file = b"filename" in options or EXTENDED_FILENAME.search(self._disposition) is not None
        part_type, self._disposition, self._part_type = self._part_type, b"", b""
        if b"name" not in options:
            raise BadUpload("malformed multipart body: a part's Content-Disposition has no name")
        name = options[b"name"].decode("utf-8", "replace")
        self.names.append(name)
        # A file part, as a browser or an HTTP client sends a file: with a filename (or only its RFC 5987
        # form, filename*=UTF-8''..., which parse_options_header drops), or without one but typed as image
        # bytes, as some clients send bytes.
        if named_file or is_image_type(part_type):
            self.files += 1
            if self.files > 1:
                raise BadUpload("more than one file in the multipart body: send one image, in field 'file'")
            if name == "file":
                self._keeping = []
        elif len(self.names) - self.files > self.MAX_FIELDS:
            raise BadUpload(f"more than {self.MAX_FIELDS} fields besides 'file' in the multipart body")

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self._keeping is not None:
            self._keeping.append(data[start:end])

    def on_part_end(self) -> None:
        if self._keeping is not None:
            self.file = b"".join(self._keeping)
            self._keeping = None

    def on_end(self) -> None:
        self.complete = True


async def _bounded(request: Request, limit: int) -> AsyncGenerator[bytes, None]:
    # Content-Length can be absent (chunked) or lie, so the limit is also enforced on what arrives.
    received = 0
    try:
        async for chunk in request.stream():
            received += len(chunk)
            if received > limit:
                raise BodyTooLarge(f"body is over the limit of {limit} bytes")
            yield chunk
    except ClientDisconnect:
        refused = request.scope.get("state", {}).get(_BODY_REFUSED)
        if refused is None:
            raise
        raise refused from None


# Where the server's HTTP protocol (mnv3.connections) leaves its refusal of a body being read: a chunked body's
# framing, its chunk count or its trailers. It answers and closes the connection, so the read ends as if the
# client had left; it raises the refusal instead, which counts as what it is (metrics), not as a disconnect.
_BODY_REFUSED = "mnv3.body_refused"


def note_body_refused(state: dict, status: int, detail: str) -> None:
    """Called by the protocol when it answers `status` to a request whose body the app may be reading, with
    that request's scope["state"]."""
    state[_BODY_REFUSED] = (BodyTooLarge if status == 413 else BadUpload)(detail)
