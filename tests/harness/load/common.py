"""Shared pieces of the load tests: sizes from the environment, raw-socket clients, the exact
bytes the fake engine streams, and percentiles."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
import time
from asyncio import StreamWriter
from contextlib import suppress

CHAT = "/v1/chat/completions"


def size_from_env(name: str, default: int) -> int:
    """A positive int from environment variable ``name``, else ``default``."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{name} must be a positive integer; got {value!r}")
    return int(value)


def chat_request(query: str, tag: str, body_extra: int = 0) -> tuple[bytes, bytes]:
    """A streaming chat request to the fake engine: (head, body). ``tag`` goes into the body
    (the fake engine records it with the generation); ``body_extra`` pads the body."""
    body = json.dumps({"messages": [], "stream": True, "tag": tag,
                       "pad": "x" * body_extra}).encode()
    head = (f"POST {CHAT}?{query} HTTP/1.1\r\nHost: sidecar\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode("latin-1"), body


def expected_stream(sidecar_id: str, tokens: int) -> bytes:
    """The SSE body the fake engine sends for a stream of ``tokens`` events (de-chunked)."""
    events = [json.dumps({"id": sidecar_id, "choices": [{"text": f"t{i}"}]},
                         separators=(",", ":")) for i in range(tokens)]
    return b"".join(f"data: {e}\n\n".encode() for e in [*events, "[DONE]"])


def reset(writer: StreamWriter) -> None:
    """Cut the connection with a TCP reset (SO_LINGER 0, then abort)."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


class LoopLag:
    """Measures how late this process's event loop runs a 1 ms timer, to tell how much of a
    latency measured here (the clients and the fake engine share this loop) is this loop being
    busy rather than the sidecar. Use as ``async with LoopLag() as lag:``."""

    TICK_S = 0.001

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []  # (when, seconds late)
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            due = time.monotonic() + self.TICK_S
            await asyncio.sleep(self.TICK_S)
            now = time.monotonic()
            self.samples.append((now, max(0.0, now - due)))

    def worst(self, start: float, end: float) -> float:
        """The longest the loop was late for a timer that fired between ``start`` and ``end``."""
        return max((late for at, late in self.samples if start <= at <= end), default=0.0)

    async def __aenter__(self) -> LoopLag:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="loop lag probe")
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with suppress(asyncio.CancelledError):
            await self._task
