"""The upstream (engine) side of a hop: one pooled client session, the request body relay, and
the translation of aiohttp's exceptions into :mod:`sidecar.errors`.

Pooling rules: idle connections are kept ``keepalive_timeout_s`` (below the engine's own idle
timeout); a response cut short is closed, never put back (the caller calls
``ClientResponse.close()``); a request that fails on a stale pooled connection before any response
byte arrived is sent once more on a fresh connection if every body byte read so far was kept
(``replay_buffer_bytes``): the kept bytes are replayed, then the rest is relayed. The session
never decompresses, never follows redirects, keeps no cookies and ignores proxy environment
variables: it is a transparent hop.

The request body is read from the client under the ``downstream`` limits (size, time between
chunks); a broken limit is raised inside aiohttp's body writer, which hands it to the pending
``session.request`` wrapped or not depending on its type: :func:`open_upstream` re-raises the
body's own :class:`~sidecar.errors.DownstreamError` instead, before any re-send decision.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping

import aiohttp
from multidict import CIMultiDict
from yarl import URL

from sidecar.config import DownstreamSettings, UpstreamSettings
from sidecar.errors import (
    DownstreamError,
    RequestBodyTimeout,
    RequestBodyTooLarge,
    UpstreamConnectError,
    UpstreamConnectTimeout,
    UpstreamDisconnected,
    UpstreamFirstByteTimeout,
    UpstreamProtocolError,
    UpstreamReadTimeout,
)

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 65536
# How much of a response the upstream session buffers (aiohttp pauses reading the engine's
# socket at twice this): with the downstream write buffer, what one stream may hold in memory.
READ_BUFFER_BYTES = 65536
_NO_LIMITS = DownstreamSettings(body_timeout_s=None, max_body_bytes=0)

# aiohttp adds these to every request unless told not to; a transparent hop must not.
_SKIP_AUTO_HEADERS = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")


def make_session(settings: UpstreamSettings, *, fresh: bool = False) -> aiohttp.ClientSession:
    """The upstream client session. ``fresh=True`` gives one whose connections are never reused
    (for the single re-send after a stale pooled connection)."""
    connector = aiohttp.TCPConnector(
        limit=settings.max_connections,
        limit_per_host=0,
        keepalive_timeout=None if fresh else settings.keepalive_timeout_s,
        force_close=fresh,
        enable_cleanup_closed=False,
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=settings.connect_timeout_s),
        auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar(),
        skip_auto_headers=_SKIP_AUTO_HEADERS,
        trust_env=False,
        # The same header limits as the downstream side (aiohttp's default is 8190 bytes).
        max_line_size=MAX_HEADER_BYTES,
        max_field_size=MAX_HEADER_BYTES,
        read_bufsize=READ_BUFFER_BYTES,
    )


async def read_body_chunk(content: aiohttp.StreamReader, limits: DownstreamSettings,
                          received: int) -> bytes:
    """The next chunk of a request body (``b""`` at its end), ``received`` bytes having been
    read before it. Raises :class:`RequestBodyTimeout` if the client sends nothing for
    ``limits.body_timeout_s`` seconds, :class:`RequestBodyTooLarge` if the body grows past
    ``limits.max_body_bytes``."""
    timeout_s = limits.body_timeout_s
    if timeout_s is None:
        chunk = await content.readany()
    else:
        try:
            async with asyncio.timeout(timeout_s):
                chunk = await content.readany()
        except TimeoutError as exc:
            raise RequestBodyTimeout(
                f"no request body bytes for {timeout_s:g}s after {received} bytes") from exc
    if limits.max_body_bytes and received + len(chunk) > limits.max_body_bytes:
        raise RequestBodyTooLarge(
            f"request body over the limit of {limits.max_body_bytes} bytes")
    return chunk


class RequestBody:
    """Relays the downstream request body upstream chunk by chunk, keeping a bounded copy.

    The copy (at most ``keep_limit`` bytes) serves the re-send after a stale connection and the
    engine adapter's id derivation. ``complete`` turns true once the last byte went upstream.
    ``limits`` bounds reading the client (:func:`read_body_chunk`); a broken limit is kept as
    ``failure`` and raised into aiohttp's body writer, which stops the upload.
    """

    def __init__(self, content: aiohttp.StreamReader | None, keep_limit: int,
                 prefix: list[bytes] | None = None,
                 limits: DownstreamSettings | None = None) -> None:
        self._content = content
        self._kept: list[bytes] | None = list(prefix or ())
        self._kept_bytes = self._received = sum(map(len, self._kept))
        self._keep_limit = keep_limit
        self._limits = limits or _NO_LIMITS
        self.complete = content is None or content.at_eof()
        # time.monotonic() when the last byte was handed upstream (None: complete from the
        # start, e.g. in memory; it goes out when the upstream request is sent)
        self.sent_at: float | None = None
        self.failure: DownstreamError | None = None

    @classmethod
    def of(cls, body: bytes) -> RequestBody:
        """A body already complete in memory (e.g. rewritten by an engine adapter)."""
        return cls(None, len(body), [body])

    @property
    def replayable(self) -> bool:
        """True if the whole body was read and kept, so it can be sent again."""
        return self.complete and self._kept is not None

    @property
    def resendable(self) -> bool:
        """True if every byte read so far was kept: a re-send replays those, then relays the
        rest. (A write that failed on a stale connection may stop before the relay saw EOF.)"""
        return self._kept is not None

    def copy(self) -> bytes | None:
        """The whole body if it was read completely and fit the limit, else ``None``."""
        return b"".join(self._kept) if self.replayable and self._kept is not None else None

    def drop_copy(self) -> None:
        self._kept = None

    def payload(self) -> AsyncIterator[bytes] | None:
        """What to hand aiohttp as ``data``: ``None`` without a body, else a chunk iterator.
        Once the body is complete, a further call replays the kept copy."""
        if self.complete:
            return self._replay() if self._kept else None
        assert self._content is not None
        return self._relay(self._content)

    async def _replay(self) -> AsyncIterator[bytes]:
        for chunk in self._kept or ():
            yield chunk

    async def _relay(self, content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
        for chunk in list(self._kept or ()):  # a re-send: what the failed attempt already read
            yield chunk
        while True:
            try:
                chunk = await read_body_chunk(content, self._limits, self._received)
            except DownstreamError as exc:
                self.failure = exc
                raise
            if not chunk:
                break
            self._received += len(chunk)
            if self._kept is not None:
                self._kept_bytes += len(chunk)
                if self._kept_bytes <= self._keep_limit:
                    self._kept.append(chunk)
                else:
                    self._kept = None
            yield chunk
        self.complete = True
        self.sent_at = time.monotonic()


async def open_upstream(
    sessions: tuple[aiohttp.ClientSession, aiohttp.ClientSession],
    settings: UpstreamSettings,
    method: str,
    url: URL,
    headers: CIMultiDict[str],
    body: RequestBody,
    request_id: str,
    wanted: Callable[[], bool] = lambda: True,
) -> aiohttp.ClientResponse:
    """Send the request upstream and return once its response headers arrived.

    ``sessions`` is (pooled, fresh). ``wanted()`` False (the client left) forbids the re-send
    after a dropped connection: the engine would get the request again for nobody. Raises
    :class:`UpstreamConnectError`, :class:`UpstreamConnectTimeout`,
    :class:`UpstreamFirstByteTimeout`, :class:`UpstreamProtocolError` (headers that do not
    parse) or :class:`UpstreamDisconnected`
    (closed or reset before complete headers, after the one re-send);
    :class:`~sidecar.errors.RequestBodyTooLarge` or :class:`~sidecar.errors.RequestBodyTimeout`
    if the client's body broke a limit first (never re-sent). Cancellation propagates untouched;
    aiohttp then closes the half-used connection itself.
    """
    pooled, fresh = sessions
    session = pooled
    while True:
        try:
            async with asyncio.timeout(settings.first_byte_timeout_s):
                return await _send(session, method, url, headers, body)
        except DownstreamError:
            raise
        except aiohttp.ConnectionTimeoutError as exc:
            raise UpstreamConnectTimeout(
                f"no connection to {url.origin()} within {settings.connect_timeout_s}s") from exc
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamConnectError(f"cannot connect to {url.origin()}: {exc.os_error}") from exc
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            if session is pooled and body.resendable and wanted():
                log.info("request %s: upstream connection dropped before the response (%s); "
                         "sending again on a fresh connection", request_id, exc)
                session = fresh
                continue
            raise UpstreamDisconnected(
                f"{url.origin()} closed the connection before responding: {exc}") from exc
        except aiohttp.ClientResponseError as exc:
            raise UpstreamProtocolError(
                f"{url.origin()} sent a malformed response") from exc
        except TimeoutError as exc:
            raise UpstreamFirstByteTimeout(
                f"no response from {url.origin()} within {settings.first_byte_timeout_s}s"
            ) from exc


class ReadDeadline:
    """Bounds each wait for the next response body chunk to ``timeout_s`` seconds.

    The relay calls :meth:`reading` before each ``readany()`` and :meth:`done` after it: a clock
    read and two attribute stores per chunk. One timer, re-armed at most once per ``timeout_s``,
    checks the mark, so a steady stream costs no timer per chunk. (aiohttp's ``sock_read``
    re-arms a timer on every socket read, about 1.9 us against 0.05 us here on uvloop, and also
    bounds the wait for the response headers, which is ``first_byte_timeout_s``'s job.) Time the
    relay spends writing to a slow client is not counted. On expiry the pending read raises
    :class:`UpstreamReadTimeout`, set on ``content``. ``timeout_s=None``: no bound, no timer.
    Call :meth:`cancel` when the relay ends, however it ends.
    """

    __slots__ = ("_content", "_handle", "_loop", "_origin", "_timeout", "since")

    def __init__(self, content: aiohttp.StreamReader, timeout_s: float | None,
                 origin: str) -> None:
        self._content = content
        self._timeout = timeout_s
        self._origin = origin
        self._loop = asyncio.get_running_loop()
        self.since: float | None = None  # loop time the pending read began; None: not reading
        self._handle = (None if timeout_s is None
                        else self._loop.call_later(timeout_s, self._check, timeout_s))

    def reading(self) -> None:
        self.since = self._loop.time()

    def done(self) -> None:
        self.since = None

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _check(self, timeout_s: float) -> None:
        now, since = self._loop.time(), self.since
        if since is None:  # writing downstream: the upstream is not being waited for
            self._handle = self._loop.call_later(timeout_s, self._check, timeout_s)
        elif now - since < timeout_s - _CLOCK_RESOLUTION_S:
            self._handle = self._loop.call_at(since + timeout_s, self._check, timeout_s)
        elif not self._content.is_eof():
            self._handle = None
            self._content.set_exception(UpstreamReadTimeout(
                f"no response body byte from {self._origin} within {timeout_s}s"))


_CLOCK_RESOLUTION_S = 0.001  # uvloop's clock and timers count milliseconds


async def _send(session: aiohttp.ClientSession, method: str, url: URL,
                headers: CIMultiDict[str], body: RequestBody) -> aiohttp.ClientResponse:
    """One attempt. aiohttp's body writer hands an exception from the body iterator to the
    response reader: an ``OSError`` (our :class:`RequestBodyTimeout` is a ``TimeoutError``) as
    is, anything else wrapped in ``ClientConnectionError`` (``client_reqrep.write_bytes``); it
    then closes the connection. Either way the body's own failure is what is raised."""
    try:
        return await session.request(method, url, headers=headers, data=body.payload(),
                                     allow_redirects=False, compress=None)
    except (aiohttp.ClientError, OSError) as exc:
        failure = body.failure
        if failure is None or isinstance(exc, DownstreamError):
            raise
        raise failure from failure.__cause__  # not from exc: its cause is the failure itself


def origin_form(raw_target: str, rel_path_qs: str) -> str | None:
    """The request target to send upstream: the path and query, bytes unchanged.

    ``raw_target`` is the request line's target, ``rel_path_qs`` aiohttp's parsed relative form
    of it. An absolute-form target (``GET http://host/path``, RFC 9112 section 3.2.2) keeps only
    its path and query: the sidecar never lets a request choose the upstream host. ``None`` for a
    target with no path (asterisk-form ``*``, authority-form): the caller answers 400.
    """
    if raw_target.startswith("/"):
        return raw_target
    return rel_path_qs if rel_path_qs.startswith("/") and raw_target != "*" else None


def upstream_url(base_url: str, target: str) -> URL:
    """``base_url`` (an origin) + an origin-form ``target`` from :func:`origin_form`."""
    return URL(base_url + target, encoded=True)


def content_length(headers: Mapping[str, str]) -> int | None:
    """The response's Content-Length as an int, or ``None`` if absent or malformed."""
    value = headers.get("Content-Length")
    return int(value) if value is not None and value.isdigit() else None
