"""HTTP/1.1 framing shared by the fake engine and the load client: chunked bodies, SSE events.

Both sides run on raw asyncio Protocols, so they parse bytes themselves; this module keeps
that parsing in one place and cheap (no per-byte Python loops, one ``find`` per boundary).

An SSE event the engine sends starts with ``data: {"t":NS,`` where ``NS`` is the engine's
``time.monotonic_ns()`` when it wrote the event. ``CLOCK_MONOTONIC`` is one clock for every
process on a Linux host (``bench.run`` checks this at start), so the client subtracts it from
its own receive time to get the event's delivery latency over the path.
"""

from __future__ import annotations

EVENT_PREFIX = b'data: {"t":'
DONE_EVENT = b"data: [DONE]"
HEAD_END = b"\r\n\r\n"


class ChunkedDecoder:
    """Incremental decoder of one ``Transfer-Encoding: chunked`` body.

    :meth:`feed` takes any slice of the wire bytes and returns the body bytes decoded so far;
    once the last chunk (``0\\r\\n\\r\\n``, trailers not supported) is read, :attr:`done` is
    true and :attr:`rest` holds the bytes after it (the next response on a keep-alive
    connection).
    """

    __slots__ = ("_buf", "_need", "done", "rest")

    def __init__(self) -> None:
        self._buf = b""
        self._need = -1  # -1: reading a size line; > 0: payload bytes left; 0: the CRLF after it
        self.done = False
        self.rest = b""

    def feed(self, data: bytes) -> bytes:
        buf = self._buf + data if self._buf else data
        pos = 0
        out: list[bytes] = []
        end = len(buf)
        while pos < end:
            need = self._need
            if need > 0:
                take = min(need, end - pos)
                out.append(buf[pos:pos + take])
                pos += take
                self._need = need - take
            elif need == 0:
                if end - pos < 2:
                    break
                pos += 2
                self._need = -1
            else:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    break
                size = int(buf[pos:eol].split(b";", 1)[0], 16)
                if size == 0:
                    if end - eol < 4:
                        break  # the final CRLF is not here yet: re-read "0\r\n" next time
                    self.done = True
                    self.rest = buf[eol + 4:]
                    self._buf = b""
                    return b"".join(out)
                pos = eol + 2
                self._need = size
        self._buf = buf[pos:]
        return b"".join(out)


def parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    """A request or response head (without the final CRLF CRLF) -> (first line's first word,
    second word, lower-cased header fields)."""
    lines = head.split(b"\r\n")
    first = lines[0].split(b" ", 2)
    fields: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        fields[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
    return first[0].decode("latin-1"), first[1].decode("latin-1"), fields
