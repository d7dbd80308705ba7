"""What a connection may cost before its request is known: the HTTP protocol the server runs under uvicorn.

uvicorn's httptools protocol bounds neither the size of a request's head (request line and headers) nor the
time it takes to arrive: one client sending a 100 MB header held the event loop for seconds, stalling every
other client, and grew the process by the header's size; a connection that sends nothing, or a head a line
every few seconds, was held open for good, each one a file descriptor until the process had none left.
`BoundedHeadProtocol` is that protocol with both bounds:

- a head over MAX_HEAD_BYTES, or of more than MAX_HEADERS fields, is answered 431 and the connection closed,
  before the parser buffers or parses more (a URL over MAX_URL_BYTES, which uvicorn cannot parse, 414): the
  parser calls Python once a field, so a head of many tiny fields held the event loop; so do a chunked body's
  trailer fields, and a chunked body of more than MAX_BODY_CHUNKS chunks (one-byte chunks: a Python call a
  byte) is answered 413;
- at most MAX_PIPELINED requests wait behind the one being answered on a connection (HTTP/1.1 pipelining):
  uvicorn parses a whole read at once and queues every request in it, so a read of pipelined GETs grew the
  process by far more than its own size. The requests past that are not read: the connection closes once
  those queued are answered, and the client sends the rest again on a new one, as pipelining clients do;
- a head not complete HEAD_TIMEOUT_S after its first byte is answered 408 and the connection closed; a new
  connection that sends nothing in that time is closed without an answer, as uvicorn's keep-alive timeout
  closes an idle one between requests;
- the rest of a body answered before it arrived (a 415, a busy server: `uploads.CloseUnreadBody` keeps such a
  connection when the rest can be dropped as it arrives) must arrive within UNREAD_BODY_TIMEOUT_S, or the
  connection is closed, as a body the app reads is bounded by --body-timeout-s.

Each answer is in the shape of the server's other refusals: `{"detail": ...}`, or, refusing a /v2 request
once its request line has come, the Open Inference Protocol's `{"error": ...}`. Bodies are bounded elsewhere
(`mnv3.uploads`: --max-upload-bytes, --body-timeout-s). How many connections a process holds at once is the
file-descriptor limit's to bound (the server raises its soft limit to the hard one, at most 65,536); a server facing the
open internet belongs behind a proxy that limits connections per client.
"""

import asyncio
import json
import logging
from collections.abc import Callable
from urllib.parse import unquote

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from mnv3.auth import route_path
from mnv3.errors import body_for_path, detail_body
from mnv3.uploads import note_body_refused

# Far above any real head (browsers and HTTP clients send a few KB; nginx's default limit is 32 KB) and above
# one read of the socket (256 KB), so counting whole reads never refuses a real head.
MAX_HEAD_BYTES = 1024 * 1024
HEAD_TIMEOUT_S = 10.0
MAX_URL_BYTES = 65_535  # the longest URL uvicorn can parse: httptools.parse_url counts in 16 bits
MAX_HEADERS = 100  # Apache's LimitRequestFields default; browsers and HTTP clients send far fewer
MAX_PIPELINED = 32  # requests waiting on one connection; pipelining clients send far fewer
# Chunks of a chunked body: the parser calls Python for each, so one-byte chunks cost a call a byte; clients
# that send real chunks send far fewer. (A body of known length is not chunked, and not counted.)
MAX_BODY_CHUNKS = 65_536
# After an answer sent before its request's body arrived (uploads.CloseUnreadBody kept the connection: the
# rest is dropped as it arrives), the rest must arrive within this, as a body read by the app must within
# --body-timeout-s (its default); trickled, it would hold the connection for good.
UNREAD_BODY_TIMEOUT_S = 30.0

log = logging.getLogger("uvicorn.error")


class BoundedHeadProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with bounds on a request head's size and on the time it takes to arrive, and
    on the time the rest of a body answered before it arrived may take."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.head_bytes = 0
        self.reading_head = True  # the first request's head; a connection that sends nothing times out too
        self.head_timer: asyncio.TimerHandle | None = self.loop.call_later(HEAD_TIMEOUT_S, self.head_timed_out)
        self.body_timer: asyncio.TimerHandle | None = None  # the rest of a body answered before it arrived
        self.stopped_parsing: tuple[int, str] | None = None  # why a parser callback stopped the parser
        self.body_chunks = 0  # of the request being read

    def connection_lost(self, exc: Exception | None) -> None:
        self.stop_head_timer()
        self.stop_body_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.reading_head and self.head_timer is None:
            self.head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self.head_timed_out)
        super().data_received(data)
        # Still in a head after the whole read: it all counts (a read that ended the last request and began
        # this head counts whole, which MAX_HEAD_BYTES leaves room for).
        if self.reading_head and not self.transport.is_closing():
            self.head_bytes += len(data)
            if self.head_bytes > MAX_HEAD_BYTES:
                self.refuse(431, f"the request's headers are over {MAX_HEAD_BYTES} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(self.headers) >= MAX_HEADERS:
            self.stop_parsing(431, f"the request has more than {MAX_HEADERS} header fields")
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if len(self.pipeline) >= MAX_PIPELINED:
            # Logged, never sent: answers are still under way, so the connection closes after them (refuse).
            self.stop_parsing(503, f"more than {MAX_PIPELINED} pipelined requests wait on the connection")
        # First: uvicorn parses the URL here, and one it refuses (send_400_response) is this head's refusal, not
        # the body of the request before it on the connection.
        super().on_headers_complete()
        self.reading_head, self.head_bytes, self.body_chunks = False, 0, 0
        self.stop_head_timer()

    def on_chunk_header(self) -> None:  # httptools calls it for each chunk of a chunked body, if defined
        self.body_chunks += 1
        if self.body_chunks > MAX_BODY_CHUNKS:
            self.stop_parsing(413, f"the request's chunked body came in more than {MAX_BODY_CHUNKS} chunks")

    def stop_parsing(self, status: int, detail: str) -> None:
        """Stop the parser in the middle of a read (a callback's exception ends `feed_data`, which uvicorn
        answers through `send_400_response`): the rest of the read is neither parsed nor queued."""
        self.stopped_parsing = (status, detail)
        raise ValueError(detail)

    def on_message_complete(self) -> None:
        self.stop_body_timer()
        super().on_message_complete()
        self.reading_head = True  # the next request's head, timed from its first byte

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.cycle is not None and self.cycle.more_body and not self.transport.is_closing():
            self.body_timer = self.loop.call_later(UNREAD_BODY_TIMEOUT_S, self.transport.close)

    def stop_body_timer(self) -> None:
        if self.body_timer is not None:
            self.body_timer.cancel()
            self.body_timer = None

    def head_timed_out(self) -> None:
        self.head_timer = None
        if not self.reading_head or self.transport.is_closing():
            return
        if self.head_bytes == 0:
            # Nothing of a request came: closed without an answer, as an idle keep-alive connection is. An
            # answer nobody asked for could be read as the answer to a request a pooled client sends just then.
            self.transport.close()
        else:
            self.refuse(408, f"the request's headers did not arrive within {HEAD_TIMEOUT_S:g} s")

    def stop_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request its parser refuses (duplicate Content-Length, a bad request line, ...),
        in the server's error shape instead of plain text."""
        if self.stopped_parsing is not None:
            self.refuse(*self.stopped_parsing)
            return
        if len(getattr(self, "url", b"")) > MAX_URL_BYTES:  # httptools.parse_url's offsets are 16-bit
            self.refuse(414, f"the URL is over {MAX_URL_BYTES} bytes: send long data in the request's body")
            return
        self.refuse(400, f"{msg.rstrip('.')}: the request is not valid HTTP/1.1")  # a chunk's framing, too

    def refuse(self, status: int, detail: str) -> None:
        """Answer `status` and close, unless an answer to an earlier request on the connection is still being
        written (a pipelined head): then only close once it and those queued behind it are done."""
        self.stop_head_timer()
        if self.cycle is not None and not self.reading_head:
            # In the body or trailers of the request under way, which can then never end: answered now, if its
            # answer has not begun (nor been sent: an early refusal that kept the connection) and no earlier one
            # is still being written, else the connection is just closed.
            log.warning("%s to %s: %s; closing the connection", status, self.peer(), detail)
            if self.pipeline or self.cycle.response_started or self.cycle.response_complete:
                self.transport.close()
            else:
                self.write_and_close(status, detail, body_for_path(route_path(self.cycle.scope)))
            note_body_refused(self.cycle.scope["state"], status, detail)  # the app reading it sees the connection end
            return
        if self.cycle is not None and not self.cycle.response_complete:
            log.warning("%s to %s: %s; closing the connection after the answers under way", status, self.peer(), detail)
            self.cycle.keep_alive = False  # the newest cycle: the last queued, or the one being answered
            self.flow.pause_reading()
            return
        log.warning("%s to %s: %s; closing the connection", status, self.peer(), detail)
        self.write_and_close(status, detail, self.head_shape())

    def peer(self) -> str:
        """The client, as the access log names it (host:port): a refusal before any route is known is in no
        access log line, and its own line said nothing of who was refused."""
        return f"{self.client[0]}:{self.client[1]}" if self.client else "an unknown client"

    def head_shape(self) -> Callable[[str], dict]:
        """The error shape of a refusal in a request's head: its path's, once the request line has come (the
        path of a URL too long to parse is what comes before its query)."""
        path = getattr(self, "url", b"").partition(b"?")[0]
        return body_for_path(unquote(path.decode("latin-1"))) if path else detail_body

    def write_and_close(self, status: int, detail: str, shape: Callable[[str], dict] = detail_body) -> None:
        body = json.dumps(shape(detail)).encode()
        self.transport.write(
            STATUS_LINE[status]
            + b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body)
            + body
        )
        self.transport.close()
