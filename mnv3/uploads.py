"""Reading an uploaded image from a request: bounded in size and in time, streamed.

`read_upload` returns the bytes of a multipart field 'file' or of a raw image/* body, `read_body` a whole
body of any type (the Open Inference Protocol's JSON or binary requests). Either never holds
more than `limit` bytes of a body (a Content-Length over it is refused before reading; a chunked or
lying one is cut off as it arrives) and never waits past `timeout_s` for them, so one slow or huge
client cannot hold memory or an admission slot for long. Every refusal is a `BadUpload` subclass from
`mnv3.errors`, which gives its status.
"""

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable

from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request

from mnv3.errors import BadUpload, BodyTooLarge, SlowUpload, UnsupportedMediaType


async def read_upload(request: Request, limit: int, timeout_s: float) -> bytes:
    """The image bytes of a multipart 'file' field or a raw image/* body, never reading past `limit` bytes
    nor waiting past `timeout_s` for them: a stalled client would otherwise hold its slot forever."""
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


async def _read_body(request: Request, limit: int) -> bytes:
    _check_declared_length(request, limit)
    return b"".join([chunk async for chunk in _bounded(request.stream(), limit)])


def declared_length(request: Request) -> int | None:
    """The body's length as its Content-Length says, None without one (chunked) or with a malformed one."""
    declared = request.headers.get("content-length", "")
    return int(declared) if declared.isdigit() else None


def _check_declared_length(request: Request, limit: int) -> None:
    declared = declared_length(request)
    if declared is not None and declared > limit:
        raise BodyTooLarge(f"body of {declared} bytes is over the limit of {limit}")


async def _read_upload(request: Request, limit: int) -> bytes:
    content_type = request.headers.get("content-type", "")
    media_type = content_type.partition(";")[0].strip().lower()
    if media_type != "multipart/form-data" and not media_type.startswith("image/"):
        raise UnsupportedMediaType(
            f"content type {content_type or '(none)'!r} not accepted: send multipart/form-data "
            "with the image in field 'file', or the raw image with an image/* content type"
        )
    if media_type.startswith("image/"):
        return await _read_body(request, limit)
    _check_declared_length(request, limit)
    body = _bounded(request.stream(), limit)
    try:
        form = await MultiPartParser(request.headers, body, max_files=1, max_fields=16).parse()
    except MultiPartException as exc:
        raise BadUpload(f"malformed multipart body: {exc.message}") from exc
    try:
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise BadUpload(f"expected the image as multipart file field 'file'; got fields {sorted(form.keys())}")
        return await upload.read()
    finally:
        await form.close()


async def _bounded(stream: AsyncIterator[bytes], limit: int) -> AsyncGenerator[bytes, None]:
    # Content-Length can be absent (chunked) or lie, so the limit is also enforced on what arrives.
    received = 0
    async for chunk in stream:
        received += len(chunk)
        if received > limit:
            raise BodyTooLarge(f"body is over the limit of {limit} bytes")
        yield chunk
