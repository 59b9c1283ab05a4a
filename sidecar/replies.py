"""What the sidecar itself writes to a client: its error bodies, its refusals and the endings of
the requests it ends.

Every error the sidecar answers has OpenAI's error shape (:func:`error_response`:
``{"error": {"message", "type", "param", "code"}}``), with the sidecar's ``X-Request-Id`` and
the client's own as ``X-Client-Request-Id`` when it has them (:mod:`sidecar.headers`)::

    refused: framing or target not trusted        closing_error (Connection: close)
    refused: by the proxy's admission checks      error_response (door.refuse: + access line)
    the body broke a downstream limit (413, 408)  body_error (the connection closed)
    the engine gave no usable response (502, 504) upstream_error (its cause: to the log only)
    the sidecar ends it (cancel API, deadline)    an Ending: ending_response before the head;
                                                  end_begun after (SSE error event, else cut)
    a client a write found gone                   gone_client (never sent)

When to send them, and what to count and log, is the caller's: :mod:`sidecar.proxy`,
:mod:`sidecar.cancellation`, :mod:`sidecar.tunnel`, :mod:`sidecar.downstream`,
:mod:`sidecar.app`, :mod:`sidecar.cancel`.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from dataclasses import dataclass, field

from aiohttp import web

from sidecar.errors import DownstreamError, UpstreamError
from sidecar.headers import CLIENT_REQUEST_ID, REQUEST_ID, SHOULD_RETRY

CANCEL_WRITE_S = 5.0  # how long ending a cancelled response may wait for a slow client
_LINGER_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST


@dataclass(frozen=True, slots=True)
class Ending:
    """Why the sidecar ends a request itself, and how the client is told: ``status`` and an
    OpenAI-style JSON error before the response head (:func:`ending_response`), else mid-SSE
    the final ``event``, whose JSON has ``"error"`` (the openai SDK raises ``APIError`` on it:
    openai/_streaming.py, Stream.__stream__; :func:`end_begun`). ``reason`` goes to the log and
    the access line's ``cancel_reason``."""

    reason: str
    status: int
    status_reason: str
    error_type: str
    message: str
    event: bytes = field(init=False)

    def __post_init__(self) -> None:
        error = {"message": self.message, "type": self.error_type, "param": None, "code": None}
        object.__setattr__(self, "event", b"data: " + json.dumps({"error": error}).encode()
                           + b"\n\n")


# The cancel API (sidecar.cancel). 499: a 4xx no SDK retries (openai: 408/409/429/5xx).
CANCELLED = Ending("cancelled via API", 499, "Request Cancelled", "cancelled",
                   "request cancelled")
# The request's deadline passed. 504: what a gateway answers for an upstream that took too long.
DEADLINE = Ending("deadline exceeded", 504, "Gateway Timeout", "deadline_exceeded",
                  "deadline exceeded")


def error_response(status: int, message: str, error_type: str,
                   request_id: str | None = None,
                   client_request_id: str | None = None) -> web.Response:
    """An OpenAI-style JSON error: ``{"error": {"message", "type", "param", "code"}}``, with the
    sidecar's ``X-Request-Id`` and the client's own as ``X-Client-Request-Id``, if given."""
    body = {"error": {"message": message, "type": error_type, "param": None, "code": status}}
    response = web.json_response(body, status=status)
    if request_id is not None:
        response.headers[REQUEST_ID] = request_id
    if client_request_id is not None:
        response.headers[CLIENT_REQUEST_ID] = client_request_id
    return response


def closing_error(status: int, reason: str, error_type: str) -> web.Response:
    """The proxy's OpenAI-style JSON error for a request whose framing or form it does not
    trust, with ``Connection: close``: what follows on the connection is not read."""
    response = error_response(status, reason, error_type)
    response.headers["Connection"] = "close"
    response.force_close()
    return response


def body_error(exc: DownstreamError, request_id: str,
               client_request_id: str | None) -> web.Response:
    """The reply to a request whose body broke a ``downstream`` limit (413, 408: ``exc``'s
    status, type and message), closing the connection: the rest of the body is never read."""
    response = error_response(exc.status, str(exc), exc.error_type, request_id,
                              client_request_id)
    response.force_close()
    return response


def upstream_error(exc: UpstreamError, request_id: str,
                   client_request_id: str | None = None) -> web.Response:
    """The reply to a request the engine gave no usable response to: ``exc``'s status
    (502/504), type and ``client_message``; the exception's own message (the engine's address,
    the OS error, upstream bytes) is for the log only."""
    return error_response(exc.status, exc.client_message, exc.error_type, request_id,
                          client_request_id)


def ending_response(ending: Ending, request_id: str,
                    client_request_id: str | None) -> web.Response:
    """``ending`` told before the response head: its status and reason phrase, its JSON error,
    and ``X-Should-Retry: false``."""
    response = error_response(ending.status, ending.message, ending.error_type, request_id,
                              client_request_id)
    response.set_status(ending.status, ending.status_reason)
    # The openai SDKs retry a 5xx (max_retries 2 by default) unless told not to
    # (openai-python _base_client.py, _should_retry: "x-should-retry: false" wins): a
    # retried deadline would run the request again, to the same deadline, for nothing.
    response.headers[SHOULD_RETRY] = "false"
    return response


async def end_begun(request: web.BaseRequest, response: web.StreamResponse, ending: Ending,
                    tail: bytes) -> int:
    """End ``response``, already begun, as ``ending`` says: mid-SSE at an event boundary
    (``tail``: the last bytes relayed; empty: none yet), its error event and the end of the
    stream; else (a JSON body begun, mid-event, or a client that does not take it within
    ``CANCEL_WRITE_S`` seconds, or is gone) cut short (:func:`cut`). Returns the body bytes it
    wrote."""
    written = 0
    try:
        async with asyncio.timeout(CANCEL_WRITE_S):
            sse = response.content_type == "text/event-stream"
            if sse and (not tail or tail.endswith((b"\n\n", b"\r\n\r\n"))):
                await response.write(ending.event)
                written = len(ending.event)
                await response.write_eof()
                return written
    except (TimeoutError, ConnectionResetError):
        pass  # a client that does not read (or is gone): cut below
    cut(request, response)
    return written


def cut(request: web.BaseRequest, response: web.StreamResponse) -> None:
    """End a response that has begun so the client sees it incomplete: a chunked or
    length-delimited body by closing the connection (no final chunk, too few bytes); a
    close-delimited one (HTTP/1.0) with a TCP reset, since a FIN reads as its complete end."""
    transport = request.transport
    if transport is not None:
        delimited = (response.headers.get("Transfer-Encoding") == "chunked"
                     or response.content_length is not None)
        if delimited:
            transport.close()
        else:
            # abort() alone sends a FIN, which reads as a complete body: force a reset.
            sock = transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
            transport.abort()


def gone_client() -> web.Response:
    """What a handler returns for a client a write found gone: never sent (the connection is
    lost); 499 is nginx's "client closed request"."""
    return web.Response(status=499)
