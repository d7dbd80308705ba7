"""Every way a request can fail, in one table: its HTTP status, its rejection reason and its API docs.

`ERRORS` maps an exception class to (status, the `mnv3_rejections_total` reason or None, what it means).
A subclass not in the table answers as its nearest listed base. `ERROR_DOCS` is the same table as
FastAPI `responses=`, so the OpenAPI document cannot drift from what the server answers.
`error_response` builds the answer; the body's shape is a small function of the message, so a router
with another error convention reuses the table as it is.
A 503 carries Retry-After; a body too slow (408) or too large (413) closes the connection (the rest of it is
unread and unwanted; an image over --max-pixels, also 413, arrived whole and keeps it),
as does any other answer sent before its request's body arrived, unless the rest may be dropped as it
arrives (`mnv3.uploads.CloseUnreadBody`).
"""

from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.requests import ClientDisconnect

from mnv3.batcher import DeadlineExceeded, QueueFull, ShuttingDown
from mnv3.engine import InferenceError, NonFiniteOutput
from mnv3.preprocess import ImageTooLarge, InvalidImage
from mnv3.v2_protocol import error_body, is_protocol_path

RETRY_AFTER_S = 1
# What a request still running when a drain runs out is answered (503), by the plain server and by Ray's proxy.
CUT_OFF = "the server stopped before this request finished (--shutdown-timeout-s)"


class BadUpload(ValueError):
    """The request does not carry an image the way /predict takes one."""


class UnsupportedMediaType(BadUpload):
    pass


class BodyTooLarge(BadUpload):
    pass


class SlowUpload(BadUpload):
    pass


class UnknownQueryParameter(ValueError):
    """The request's query string has a parameter the endpoint does not take (a misspelt ?model= would
    otherwise be ignored, and the default model answer as if asked)."""


class UnknownModel(LookupError):
    """The request names a model this server does not serve."""


class Busy(QueueFull):
    """--max-in-flight requests are already admitted: refused before reading the body, so memory stays bounded."""


# The most fields an image upload's multipart body may have besides its file (uploads._ImageForm): here, where
# the API docs' words about it are too, since errors cannot import uploads (uploads imports errors).
MAX_FORM_FIELDS = 16

# exception -> (HTTP status, mnv3_rejections_total reason or None, what it means for the API docs)
ERRORS: dict[type[Exception], tuple[int, str | None, str]] = {
    BadUpload: (
        400,
        "bad_input",
        "no multipart field 'file' (or it came as a text field), more than one file or more than "
        f"{MAX_FORM_FIELDS} other fields, or a malformed multipart body",
    ),
    InvalidImage: (400, "bad_input", "empty body, not an image, or a corrupt/truncated image"),
    UnknownQueryParameter: (400, "bad_input", "a query parameter other than model, or model more than once"),
    SlowUpload: (408, "slow_upload", "the body did not arrive within --body-timeout-s"),
    BodyTooLarge: (
        413,
        "too_large",
        "body over --max-upload-bytes: refused by its Content-Length before reading, or cut off where it passes "
        "the limit (chunked, or inflated), closing the connection",
    ),
    ImageTooLarge: (413, "too_large", "image over --max-pixels or with a side over 65,535, or a decompression bomb"),
    UnknownModel: (404, "unknown_model", "no model of that name is served (the message lists them)"),
    UnsupportedMediaType: (
        415,
        "bad_input",
        "content type is neither multipart/form-data, image/* nor application/octet-stream, or a Content-Encoding",
    ),
    InferenceError: (500, "inference_failed", "inference failed for the batch this request ran in"),
    NonFiniteOutput: (500, "inference_failed", "the model's output for this image is not finite"),
    QueueFull: (503, "queue_full", "--queue-limit requests already wait for inference"),
    Busy: (503, "busy", "--max-in-flight requests already admitted (refused before reading the body)"),
    ShuttingDown: (503, "shutting_down", "the server is stopping"),
    DeadlineExceeded: (504, "deadline", "no result within --deadline-ms; work not yet run was dropped"),
    # nginx's code for it: only the server's log and metrics see this, the client has gone
    ClientDisconnect: (499, "disconnected", "the client closed the connection first; its work was dropped"),
}
# The refusals of --api-keys (mnv3.auth.ApiKeyAuth.decide gives each its label), as mnv3_rejections_total counts them.
ACCESS_REFUSALS = ("key_in_url", "no_valid_key", "out_of_scope", "rate_limited", "key_in_flight")
# Any other exception is a bug: answered 500 all the same, with a JSON reason, and counted under this one.
INTERNAL = "internal"
INTERNAL_DOC = "an unexpected failure (a bug: the server logs its traceback)"
REJECTION_REASONS = sorted({reason for _, reason, _ in ERRORS.values() if reason} | set(ACCESS_REFUSALS) | {INTERNAL})


class ErrorDetail(BaseModel):
    detail: str = Field(description="what was wrong, for a person to read")


# typed as FastAPI's `responses=` takes it
# 499 is only counted: its client has gone, so no answer is sent and the document lists none.
ERROR_DOCS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorDetail, "description": "; ".join(doc for s, _, doc in ERRORS.values() if s == status)}
    for status in sorted({status for status, _, _ in ERRORS.values()} - {499})
}
ERROR_DOCS[500]["description"] += f"; {INTERNAL_DOC}"
ERROR_DOCS[503]["headers"] = {
    "Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}
}


def error_entry(exc: Exception) -> tuple[int, str | None, str]:
    """The ERRORS entry of `exc`'s class or of its nearest listed base."""
    return next(ERRORS[t] for t in type(exc).__mro__ if t in ERRORS)


def detail_body(message: str) -> dict:
    """FastAPI's own error shape, `ErrorDetail`, the one /predict documents."""
    return {"detail": message}


def body_for_path(path: str) -> Callable[[str], dict]:
    """The error shape a request path answers in: the Open Inference Protocol's `{"error"}` under /v2, else
    `{"detail"}`, for answers given outside a router (a middleware's)."""
    return error_body if is_protocol_path(path) else detail_body


def internal_error_message(exc: Exception) -> str:
    return f"internal server error ({type(exc).__name__}); the server's log has its traceback"


def error_response(exc: Exception, body: Callable[[str], dict] = detail_body) -> JSONResponse:
    """The answer to `exc`: its status and headers from the table, its message in `body`'s shape."""
    status, _, _ = error_entry(exc)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else {}
    if isinstance(exc, SlowUpload):
        headers["Connection"] = "close"  # the rest of the body is unread: do not take it as the next request
    # (the rest of a body over the limit is dropped as it arrives, or the connection closed: CloseUnreadBody)
    return JSONResponse(body(str(exc) or "client disconnected"), status, headers=headers)
