"""The upstream (engine) side of a hop: sending the request, the request body relay and the
re-send after a stale pooled connection; the response itself is read by :mod:`sidecar.relay`.

Pooling rules (:class:`sidecar.pool.UpstreamPool`): idle connections are kept
``keepalive_timeout_s`` (below the engine's own idle timeout); a response cut short is closed,
never put back; a request that fails on a connection closed or reset before any response byte
arrived (a stale pooled one) is sent once more on a fresh connection if every body byte read so
far was kept (``replay_buffer_bytes``): the kept bytes are replayed, then the rest is relayed.
Stale means a connection taken from the idle pool and lost within ``STALE_LOSS_S`` of the
request's write: one the engine had closed shows it within a round trip (its kernel resets the
bytes that arrive). A new connection, or one the engine held longer, had the request read and
worked on (a worker crashing mid-request): sending it again would run it twice.
The hop never decompresses, never follows redirects, keeps no cookies and ignores proxy
environment variables: it is transparent. The engine sees the client's header fields minus the
hop-by-hop ones (:mod:`sidecar.headers`), ``Host`` first, and the body framed as the client
framed it (its ``Content-Length``, else chunked); a body already whole goes out with the head in
one write.

The request body is read from the client under the ``downstream`` limits (size, time between
chunks); a broken limit fails the attempt with the body's own
:class:`~sidecar.errors.DownstreamError`, before any re-send decision, and closes the upstream
connection.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from sidecar.config import DownstreamSettings, UpstreamSettings
from sidecar.errors import (
    DownstreamError,
    RequestBodyTimeout,
    RequestBodyTooLarge,
    UpstreamDisconnected,
    UpstreamError,
    UpstreamFirstByteTimeout,
)
from sidecar.pool import UpstreamPool
from sidecar.relay import (
    MAX_HEADER_BYTES,
    Origin,
    UpstreamConnection,
    UpstreamResponse,
    chunk_frame,
    origin,
)
from sidecar.route import RouteTarget

__all__ = ["MAX_HEADER_BYTES", "READ_BUFFER_BYTES", "RequestBody", "open_upstream", "read_body"]

log = logging.getLogger(__name__)

# What the tunnel's upstream session buffers (sidecar.tunnel).
READ_BUFFER_BYTES = 65536
# A pooled connection lost this soon after the request's write is stale (the engine had closed
# it): a round trip on a pod's network, with room for an event loop busy in a storm.
STALE_LOSS_S = 0.5
_NO_LIMITS = DownstreamSettings(body_timeout_s=None, max_body_bytes=0)
# Methods aiohttp's client sent no ``Content-Length: 0`` for when there is no body (its
# ClientRequest.GET_METHODS): kept, so the engine sees what it saw before.
_NO_BODY_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})


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
    check_body_size(limits, received + len(chunk))
    return chunk


def check_body_size(limits: DownstreamSettings, size: int) -> None:
    """Raises :class:`RequestBodyTooLarge` if a body of ``size`` bytes so far is over
    ``limits.max_body_bytes`` (0: no limit)."""
    if limits.max_body_bytes and size > limits.max_body_bytes:
        raise RequestBodyTooLarge(
            f"request body over the limit of {limits.max_body_bytes} bytes")


async def read_body(request: web.BaseRequest, target: RouteTarget, sidecar_id: str,
                    headers: CIMultiDict[str], keep: int,
                    limits: DownstreamSettings) -> RequestBody:
    """The body of ``request`` to relay to ``target``'s engine, read under ``limits`` and kept up
    to ``keep`` bytes (``upstream.replay_buffer_bytes``). On a route that rewrites it (an engine
    adapter sets its id in the body: SGLang's ``rid``, vLLM's Responses ``request_id``) the body
    is read whole first and rewritten for ``sidecar_id`` (``headers``' ``Content-Length`` set
    to the new length); one over ``keep`` is relayed unchanged after what was read, and marked
    :attr:`RequestBody.unrewritten` (the engine then picks its own request id: it cannot be
    aborted by id). Raises :class:`RequestBodyTooLarge` at once for a Content-Length over
    ``max_body_bytes``, and any :class:`~sidecar.errors.DownstreamError` of reading."""
    if not request.body_exists:
        return RequestBody(None, keep)
    length, limit = request.content_length, limits.max_body_bytes
    if limit and length is not None and length > limit:
        raise RequestBodyTooLarge(
            f"Content-Length {length} is over the limit of {limit} bytes")
    method, path = request.method, request.path
    if not target.rewrites_body(method, path):
        return RequestBody(request.content, keep, limits=limits)
    chunks: list[bytes] = []
    size = 0
    while size <= keep and (chunk := await read_body_chunk(request.content, limits, size)):
        chunks.append(chunk)
        size += len(chunk)
    if size > keep or not request.content.at_eof():  # over, even if it came in one read
        body = RequestBody(request.content, keep, chunks, limits)
        body.unrewritten = True
        return body
    whole = b"".join(chunks)
    new = target.rewrite_body(method, path, sidecar_id, whole)
    if new is not None:
        headers["Content-Length"] = str(len(new))
    return RequestBody.of(whole if new is None else new)


class RequestBody:
    """Relays the downstream request body upstream chunk by chunk, keeping a bounded copy.

    The copy (at most ``keep_limit`` bytes) serves the re-send after a stale connection and the
    engine adapter's id derivation. ``complete`` turns true once the last byte went upstream.
    ``limits`` bounds reading the client (:func:`read_body_chunk`, :func:`check_body_size`).
    """

    # Over ``keep_limit`` on a route that rewrites the body, so relayed unrewritten
    # (:func:`read_body`): the engine picks its own request id.
    unrewritten = False

    def __init__(self, content: aiohttp.StreamReader | None, keep_limit: int,
                 prefix: list[bytes] | None = None,
                 limits: DownstreamSettings | None = None) -> None:
        self._content = content
        self._kept: list[bytes] | None = list(prefix or ())
        self._kept_bytes = self._received = sum(map(len, self._kept))
        self._keep_limit = keep_limit
        # The copy was dropped because the body went over keep_limit (not by drop_copy): ids
        # that an engine counts from the body cannot all be derived.
        self.copy_over_limit = False
        self._limits = limits or _NO_LIMITS
        self.complete = content is None or content.at_eof()
        # time.monotonic() when the last byte was handed upstream (None: complete from the
        # start, e.g. in memory; it goes out when the upstream request is sent)
        self.sent_at: float | None = None
        # Told when the last byte goes upstream (a whole body: just before its write).
        self.on_sent: Callable[[], None] | None = None

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

    def to_send(self) -> tuple[list[bytes], bool]:
        """What an attempt writes at once, and whether that is the whole body: every byte read
        so far (a re-send's replay, or a prefix read before), then what the client already sent
        and aiohttp holds, read without waiting (the whole of most bodies). Call :meth:`sent`
        once it is written if it is whole. Raises :class:`RequestBodyTooLarge` if that breaks
        ``max_body_bytes``."""
        parts = list(self._kept or ())
        content = self._content
        if content is None or self.complete:
            return parts, True
        chunk = content.read_nowait(-1)
        if chunk:
            check_body_size(self._limits, self._received + len(chunk))
            self._take(chunk)
            parts.append(chunk)
        return parts, content.at_eof()

    def sent(self) -> None:
        """The last body byte was written upstream."""
        if not self.complete:
            self.complete = True
            self.sent_at = time.monotonic()
            # Told once, then dropped: the callback is the exchange's own method, and holding it
            # would make the exchange and its body a cycle that only the collector frees.
            on_sent, self.on_sent = self.on_sent, None
            if on_sent is not None:
                on_sent()

    async def rest(self) -> AsyncIterator[bytes]:
        """The rest of the body, as the client sends it (after :meth:`to_send`)."""
        assert self._content is not None
        while True:
            chunk = await read_body_chunk(self._content, self._limits, self._received)
            if not chunk:
                break
            self._take(chunk)
            yield chunk
        self.sent()

    def _take(self, chunk: bytes) -> None:
        """Count ``chunk`` as read, and keep it while the copy stays within its limit."""
        self._received += len(chunk)
        if self._kept is not None:
            self._kept_bytes += len(chunk)
            if self._kept_bytes <= self._keep_limit:
                self._kept.append(chunk)
            else:
                self._kept = None
                self.copy_over_limit = True


async def open_upstream(
    pool: UpstreamPool,
    settings: UpstreamSettings,
    method: str,
    base_url: str,
    target: str,
    headers: CIMultiDict[str],
    body: RequestBody,
    request_id: str,
    wanted: Callable[[], bool] = lambda: True,
    sent: Callable[[UpstreamResponse], None] | None = None,
) -> UpstreamResponse:
    """Send the request to the engine at ``base_url`` (an origin) and return once its response
    head arrived; its body is then relayed with :meth:`UpstreamResponse.relay`.

    ``target`` is the origin-form path and query (:func:`origin_form`). A request whose
    connection is closed or reset before any response byte (a stale pooled connection) is sent
    once more on a fresh connection if every body byte read so far was kept, unless
    ``wanted()`` is False (the client left: the engine would get the request again for nobody);
    never after a loss on a new connection or later than ``STALE_LOSS_S`` after the write
    (module docstring).
    Raises :class:`UpstreamConnectError`, :class:`UpstreamConnectTimeout`,
    :class:`UpstreamFirstByteTimeout`, :class:`UpstreamProtocolError` (a head that does not
    parse) or :class:`UpstreamDisconnected` (closed or reset before the head, after the one
    re-send); :class:`~sidecar.errors.RequestBodyTooLarge` or
    :class:`~sidecar.errors.RequestBodyTimeout` if the client's body broke a limit first (never
    re-sent). On any failure the connection is closed, never pooled. ``sent``: told of each
    attempt's response as soon as its request is written, before its head arrives; on
    cancellation (or a first-byte timeout) that response is then the caller's to close, or to
    hand to a watcher (:meth:`UpstreamResponse.watch`: the engine's confirmation of an abort is
    read on it); without ``sent`` it is closed.
    """
    engine = origin(base_url)
    timeout_s = settings.first_byte_timeout_s
    fresh = False
    while True:
        try:
            return await _attempt(pool, engine, method, target, headers, body, fresh, sent,
                                  timeout_s)
        except DownstreamError:
            raise
        except UpstreamDisconnected as exc:
            if exc.stale and not fresh and not exc.answered and body.resendable and wanted():
                log.info("request %s: upstream connection dropped before the response (%s); "
                         "sending again on a fresh connection", request_id, exc)
                fresh = True
                # The first attempt's response keeps it (its head): its traceback holds
                # _attempt's frame, which holds that response (a cycle otherwise).
                exc.__traceback__ = None
                continue
            raise
        except UpstreamError:
            raise
        except TimeoutError as exc:  # waiting for a pool slot or a connection
            raise UpstreamFirstByteTimeout(
                f"no response from {engine} within {timeout_s}s") from exc


def request_head(method: str, target: str, origin: Origin, headers: CIMultiDict[str],
                 framing: str | None) -> bytes:
    """An HTTP/1.1 request head: ``Host`` first (as aiohttp's client sent it), the headers in
    order, then ``framing`` (``Transfer-Encoding: chunked`` or ``Content-Length: 0``) if
    given."""
    lines = [f"{method} {target} HTTP/1.1\r\nHost: {origin.host_field}\r\n"]
    lines.extend(f"{name}: {value}\r\n" for name, value in headers.items())
    if framing is not None:
        lines.append(framing + "\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("utf-8", "surrogateescape")


async def _attempt(pool: UpstreamPool, engine: Origin, method: str, target: str,
                   headers: CIMultiDict[str], body: RequestBody, fresh: bool,
                   sent: Callable[[UpstreamResponse], None] | None,
                   timeout_s: float | None) -> UpstreamResponse:
    """One attempt: the head and what is already here of the body written in one write, the
    rest of the body relayed by a task of its own (the engine may answer before it ends). The
    response head is due within ``timeout_s`` (``upstream.first_byte_timeout_s``; ``None``: no
    limit) of the request's write (the pool's :class:`~sidecar.pool.Deadlines`), else
    :class:`UpstreamFirstByteTimeout`; a wait for a pool slot or a new connection before it has
    the same limit (``TimeoutError``, which :func:`open_upstream` words the same)."""
    connection = None if fresh else pool.reuse(engine)
    if connection is None:  # a slot to wait for, or a connection to open
        async with asyncio.timeout(timeout_s):
            connection = await pool.connection(engine, fresh)
    try:
        parts, whole = body.to_send()
    except DownstreamError:
        connection.close()
        raise
    if not whole:
        framing = None if "Content-Length" in headers else "Transfer-Encoding: chunked"
    elif "Content-Length" in headers or (not parts and method in _NO_BODY_METHODS):
        framing = None
    else:
        framing = f"Content-Length: {sum(map(len, parts))}"
    chunked = framing is not None and framing.startswith("Transfer")
    head = request_head(method, target, engine, headers, framing)
    if whole:
        # Before the write: the record of in-flight work (RequestBody.on_sent) names the
        # request before the engine can have it, so a process killed in between leaves none
        # unnamed (a name the engine never had is ignored).
        body.sent()
    response = connection.send(head, [chunk_frame(p) for p in parts] if chunked else parts,
                               head_only=method == "HEAD")
    written = time.monotonic()
    if pool.first_byte is not None:  # from here: the head within first_byte_timeout_s
        pool.first_byte.set(response, connection.loop)
    if sent is not None:
        sent(response)
    if not whole:
        response.uploading = pool.tasks.spawn(_upload(connection, response, body, chunked),
                                              name=f"request body to {engine}")
    try:
        await response.head
    except UpstreamDisconnected as exc:
        exc.stale = connection.reused and time.monotonic() - written <= STALE_LOSS_S
        response.close()
        raise
    except (asyncio.CancelledError, UpstreamFirstByteTimeout):
        # The handler was cancelled (its client left, the cancel API, a deadline) or the first
        # byte timed out: whoever was told of the response (``sent``) closes it, or hands it
        # to a watcher that reads the engine's confirmation of the abort.
        if sent is None:
            response.close()
        raise
    except BaseException:
        response.close()
        raise
    finally:
        if pool.first_byte is not None:
            pool.first_byte.clear(response)
    return response


async def _upload(connection: UpstreamConnection, response: UpstreamResponse,
                  body: RequestBody, chunked: bool) -> None:
    """Relay the rest of the request body after what :func:`_attempt` wrote. A body that
    breaks a ``downstream`` limit fails the attempt with its :class:`DownstreamError` and
    closes the connection; a connection lost meanwhile ends the upload (the attempt itself
    fails with the loss)."""
    try:
        async for piece in body.rest():
            await connection.write_body(chunk_frame(piece) if chunked else piece)
        if chunked:
            await connection.write_body(b"0\r\n\r\n")
    except DownstreamError as exc:
        response.fail(exc)
        connection.close()
    except ConnectionResetError:
        pass


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


def content_length(headers: Mapping[str, str]) -> int | None:
    """The response's Content-Length as an int, or ``None`` if absent or malformed."""
    value = headers.get("Content-Length")
    return int(value) if value is not None and value.isdigit() else None
