"""Connection-level limits uvicorn does not set: what a hostile or broken client can hold.

* **Header timeout**: uvicorn waits forever for the first request on a new connection (its
  keep-alive timer starts only after a response), and a client that sends half a request line
  cancels that timer. :class:`GuardedH11Protocol` closes a connection on which no request has
  started within ``header_timeout_s`` of the connection opening or of the previous response,
  so idle or slowloris connections cost a socket for that long, not forever.
* **Header size**: h11 refuses a request head larger than ``max_header_bytes``; the answer is
  a 431 (a 400 for other malformed HTTP) with an OpenAI-style JSON error body.
* **Send buffer**: each connection's kernel send buffer is capped (``SO_SNDBUF``), so a client
  that stops reading a stream blocks the server's writes after a bounded amount of data, and
  the stream's send timeout (see ``streaming.RunStreamingResponse``) then ends the request.
* **File descriptors**: :func:`raise_fd_limit` lifts the soft RLIMIT_NOFILE to the hard limit
  (as vLLM does), so thousands of idle connections do not starve new ones of descriptors.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from fitserve.server.errors import error_body

log = logging.getLogger("fitserve.server")

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_MAX_HEADER_BYTES = 64 * 1024
DEFAULT_SEND_BUFFER_BYTES = 256 * 1024


def raise_fd_limit() -> tuple[int, int] | None:
    """Raise the soft open-file limit to the hard one; returns (old, new) soft limits."""
    try:
        import resource
    except ImportError:  # not POSIX
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft >= hard:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        return soft, soft
    return soft, hard


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header timeout, a JSON 431/400 and a capped send buffer."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    send_buffer_bytes: int | None = DEFAULT_SEND_BUFFER_BYTES

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=self.max_header_bytes)
        self._header_timer: asyncio.TimerHandle | None = None

    @classmethod
    def configured(cls, *, header_timeout_s: float, max_header_bytes: int,
                   send_buffer_bytes: int | None) -> type[GuardedH11Protocol]:
        """A subclass with these limits (uvicorn instantiates the class it is given)."""
        return type("GuardedH11Protocol", (cls,), {
            "header_timeout_s": header_timeout_s, "max_header_bytes": max_header_bytes,
            "send_buffer_bytes": send_buffer_bytes,
        })

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if self.send_buffer_bytes and sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer_bytes)
        self._arm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        # NOTE: the cycle in progress now identifies "no new request since": uvicorn makes a
        # new RequestResponseCycle for every request head it parses.
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_deadline, self.cycle)

    def _header_deadline(self, cycle: Any) -> None:
        self._header_timer = None
        if self.cycle is not cycle or (cycle is not None and not cycle.response_complete):
            return  # a request started (its own body/stream timeouts apply)
        if not self.transport.is_closing():
            log.debug("closing a connection that sent no request within %.0f s", self.header_timeout_s)
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        # NOTE: h11 bounds only a head that is still incomplete; one that arrives whole in a
        # single read is parsed whatever its size, so the head is measured here first.
        if self.conn.their_state is h11.IDLE:
            buffered = self.conn.trailing_data[0] + data
            end = buffered.find(b"\r\n\r\n")
            size = end + 4 if end >= 0 else len(buffered)
            if size > self.max_header_bytes:
                self._refuse(431, f"the request head is larger than {self.max_header_bytes} bytes")
                return
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        if len(self.conn.trailing_data[0]) > self.max_header_bytes:
            self._refuse(431, f"the request head is larger than {self.max_header_bytes} bytes")
        else:
            self._refuse(400, "invalid HTTP request")

    def _refuse(self, status: int, text: str) -> None:
        """Answer a request h11 could not (or must not) parse with an OpenAI-style error, then close."""
        if self.transport.is_closing():
            return
        body = json.dumps(error_body(status, text)).encode()
        reason = "Request Header Fields Too Large" if status == 431 else "Bad Request"
        head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
        # NOTE: written raw: h11 cannot send a response to a request it never parsed
        self.transport.write(head + body)
        self.transport.close()
