"""The sidecar's error tree.

Library exceptions (aiohttp, asyncio, pydantic) are translated into this tree at one boundary
each, with ``raise ... from exc``::

    SidecarError
    ├── ConfigError                  bad YAML, schema or cross-reference; carries every problem
    ├── ListenError                  a configured address cannot be listened on (exit 1)
    ├── DownstreamError              the client's request broke a limit (mapped to 4xx)
    │   ├── RequestBodyTooLarge      body over downstream.max_body_bytes         -> 413
    │   └── RequestBodyTimeout       (also a TimeoutError) no body bytes within
    │                                downstream.body_timeout_s                   -> 408
    └── UpstreamError                the engine could not give a response (mapped to 502/504)
        ├── UpstreamConnectError     connection refused / unreachable            -> 502
        ├── UpstreamProtocolError    malformed response headers                  -> 502
        │   └── UpstreamDisconnected the engine closed/reset before the headers  -> 502
        └── UpstreamTimeoutError     (also a TimeoutError)                       -> 504
            ├── UpstreamConnectTimeout      no connection within connect_timeout_s
            ├── UpstreamFirstByteTimeout    no response headers within first_byte_timeout_s
            └── UpstreamReadTimeout         no body byte within read_timeout_s (headers already
                                            relayed: the client's response ends abnormally)

``engine_may_hold_request`` says whether the engine may still hold the whole request when the
error is raised, because the sidecar is the one giving up on a connection the engine keeps (a
timeout, a malformed response): the proxy then aborts the engine. Where the engine never got the
request (connect errors) or closed the connection itself (:class:`UpstreamDisconnected`, death
mid-stream) nothing is aborted.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass


class SidecarError(Exception):
    """Root of every error the sidecar raises on purpose."""


@dataclass(frozen=True)
class ConfigProblem:
    """One located problem in a config file.

    ``location`` is dotted (``engines.local.abort.timeout_s``), ``value`` the offending input
    rendered for humans (secrets masked), ``expected`` what would be accepted.
    """

    location: str
    message: str
    value: str | None = None

    def __str__(self) -> str:
        got = f" (got {self.value})" if self.value is not None else ""
        return f"{self.location or '<root>'}: {self.message}{got}"


class ConfigError(SidecarError):
    """A config file that cannot be used. ``problems`` lists every problem found, in order."""

    def __init__(self, source: str, problems: list[ConfigProblem]) -> None:
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid config {source}: {len(problems)} problem(s)\n{lines}")


class ListenError(SidecarError):
    """A listener could not be opened (address in use, unknown host, no permission)."""


class DownstreamError(SidecarError):
    """The client's request broke a downstream limit. ``status`` is what the client gets; the
    engine never had the whole request, so nothing is aborted."""

    status = 400
    error_type = "invalid_request"


class RequestBodyTooLarge(DownstreamError):
    """A request body over ``downstream.max_body_bytes``: by its Content-Length (nothing went
    upstream) or while it was being relayed (the upstream request is closed)."""

    status = 413
    error_type = "request_too_large"


class RequestBodyTimeout(DownstreamError, TimeoutError):
    """No request body bytes from the client for ``downstream.body_timeout_s`` seconds."""

    status = 408
    error_type = "request_timeout"


class UpstreamError(SidecarError):
    """The upstream (engine) gave no usable response. ``status`` and ``client_message`` are
    what the client gets: the exception's own message (the engine's address, the OS error,
    upstream bytes) goes only to the log."""

    status = 502
    error_type = "upstream_error"
    client_message = "The engine gave no usable response"
    engine_may_hold_request = False


def detail(exc: BaseException) -> str:
    """``exc``'s message for a log line, with its cause's when that adds something (``raise ...
    from``: the OS or TLS error is usually quoted in the message already)."""
    text, cause = str(exc), exc.__cause__
    if cause is None:
        return text
    said, name = str(cause), type(cause).__name__
    if not said:
        return f"{text} ({name})"
    return text if said in text else f"{text} ({name}: {said})"


class UpstreamConnectError(UpstreamError):
    """No connection to the engine (refused, unreachable, reset while connecting, a TLS handshake
    or certificate that failed)."""

    error_type = "upstream_unreachable"

    @property
    def client_message(self) -> str:  # type: ignore[override]
        """Which step failed, from the cause (``raise ... from``): TCP or TLS."""
        if isinstance(self.__cause__, ssl.SSLCertVerificationError):
            return "The engine's TLS certificate could not be verified"
        if isinstance(self.__cause__, ssl.SSLError):
            return "The TLS handshake with the engine failed"
        return "The engine could not be reached"


class UpstreamProtocolError(UpstreamError):
    """The engine answered with response headers that do not parse (bad status line or field).

    Its side of the connection is still open when the sidecar closes it: it may be generating.
    """

    error_type = "upstream_protocol_error"
    client_message = "The engine's response could not be parsed"
    engine_may_hold_request = True


class UpstreamDisconnected(UpstreamProtocolError):
    """The engine closed or reset the connection before complete response headers (after the
    one re-send a stale pooled connection gets). Its side of the request is gone.
    ``answered``: part of a response head had arrived (the engine had the request): never
    re-sent."""

    client_message = "The engine closed the connection before a complete response head"
    engine_may_hold_request = False
    answered = False
    stale = False  # the loss looks like a stale pooled connection's (sidecar.upstream)


class UpstreamTimeoutError(UpstreamError, TimeoutError):
    """A bounded wait for the engine ran out."""

    status = 504
    error_type = "upstream_timeout"
    client_message = "The engine did not answer in time"


class UpstreamConnectTimeout(UpstreamTimeoutError):
    """No connection to the engine within ``upstream.connect_timeout_s``."""

    client_message = "No connection to the engine within the connect timeout"


class UpstreamFirstByteTimeout(UpstreamTimeoutError):
    """No response headers from the engine within ``upstream.first_byte_timeout_s``."""

    client_message = "No response from the engine within the first-byte timeout"
    engine_may_hold_request = True


class UpstreamReadTimeout(UpstreamTimeoutError):
    """No response body byte from the engine within ``upstream.read_timeout_s`` (seconds) of the
    relay asking for one. Raised mid-body, after the response headers went to the client, so the
    client's response is ended abnormally rather than answered with a 504."""

    engine_may_hold_request = True
