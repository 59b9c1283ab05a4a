"""Raw-socket HTTP/1.x for tests that must see the wire: exact request bytes out, and responses
read without a client library normalising them (repeated headers, chunk framing, whether a body
ended with its terminating chunk, a clean EOF or a TCP reset).

Every read is bounded by the caller's guard timeout (``asyncio.timeout`` around the call).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal

Ending = Literal["complete", "eof", "reset"]


@dataclass
class RawResponse:
    """One response as it came off the wire.

    ``headers`` keeps order and repeats; ``body`` is de-chunked when the response was chunked;
    ``ending`` says how the body ended: ``complete`` (terminating 0-chunk or full Content-Length),
    ``eof`` (the peer closed cleanly: FIN) or ``reset`` (TCP RST).
    """

    version: str
    status: int
    reason: str
    headers: list[tuple[str, str]]
    body: bytes = b""
    ending: Ending = "complete"
    chunks: list[bytes] = field(default_factory=list)

    def get(self, name: str) -> str | None:
        values = self.getall(name)
        return values[0] if values else None

    def getall(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k.lower() == name.lower()]

    @property
    def chunked(self) -> bool:
        return (self.get("Transfer-Encoding") or "").lower() == "chunked"


@contextlib.asynccontextmanager
async def connect(port: int) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """A TCP connection to 127.0.0.1:``port``, closed (or already reset) on exit."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def request_bytes(method: str, target: str, headers: list[tuple[str, str]] | None = None,
                  body: bytes = b"", version: str = "HTTP/1.1") -> bytes:
    """A request head (with ``Host`` first unless given) and body, byte for byte."""
    headers = list(headers or [])
    if not any(k.lower() == "host" for k, _ in headers):
        headers.insert(0, ("Host", "client.example"))
    head = f"{method} {target} {version}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers)
    return head.encode("latin-1") + b"\r\n" + body


def reader_of(raw: bytes) -> asyncio.StreamReader:
    """A reader holding ``raw`` and then its end: bytes already taken off the wire (e.g. a
    response recorded whole) read with :func:`read_head` and :func:`read_body`."""
    reader = asyncio.StreamReader()
    reader.feed_data(raw)
    reader.feed_eof()
    return reader


async def read_head(reader: asyncio.StreamReader) -> RawResponse:
    """Read a status line and headers; interim 1xx responses are returned like any other."""
    raw = await reader.readuntil(b"\r\n\r\n")
    lines = raw.decode("latin-1").split("\r\n")[:-2]
    version, status, *reason = lines[0].split(" ", 2)
    headers = [(k, v.strip()) for k, _, v in (line.partition(":") for line in lines[1:])]
    return RawResponse(version, int(status), reason[0] if reason else "", headers)


async def read_body(reader: asyncio.StreamReader, head: RawResponse,
                    method: str = "GET") -> RawResponse:
    """Read the body ``head`` announces (chunked, Content-Length or close-delimited) into it."""
    length = head.get("Content-Length")
    try:
        if method == "HEAD" or head.status in (204, 304) or 100 <= head.status < 200:
            return head
        if head.chunked:
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    await reader.readuntil(b"\r\n")  # no trailers from the sidecar
                    head.ending = "complete"
                    return head
                chunk = await reader.readexactly(size + 2)
                if chunk[-2:] != b"\r\n":
                    raise ValueError(f"a {size}-byte chunk not followed by CRLF: {chunk[-2:]!r}")
                head.chunks.append(chunk[:-2])
                head.body += chunk[:-2]
        elif length is not None:
            head.body = await reader.readexactly(int(length))
            head.ending = "complete"
        else:
            while chunk := await reader.read(65536):
                head.chunks.append(chunk)
                head.body += chunk
            head.ending = "eof"
    except asyncio.IncompleteReadError as exc:
        head.body += exc.partial
        head.ending = "eof"
    except ConnectionResetError:
        head.ending = "reset"
    return head


async def exchange(port: int, raw_request: bytes, method: str = "GET") -> RawResponse:
    """Send ``raw_request`` on a new connection and read one whole response (skipping 1xx)."""
    async with connect(port) as (reader, writer):
        writer.write(raw_request)
        await writer.drain()
        head = await read_head(reader)
        while 100 <= head.status < 200:
            head = await read_head(reader)
        return await read_body(reader, head, method)


def dechunk(raw: bytes) -> bytes:
    """A chunked HTTP/1.1 body (the response head first, if any) without its framing: the
    data of every chunk up to the terminating 0-chunk (chunk extensions ignored)."""
    if raw.startswith(b"HTTP/") and b"\r\n\r\n" in raw:
        raw = raw.partition(b"\r\n\r\n")[2]
    out = b""
    while raw:
        size_line, _, rest = raw.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out, raw = out + rest[:size], rest[size + 2:]
    return out
