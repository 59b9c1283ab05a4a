"""Upstream servers that speak upgraded protocols, for ``tests/test_tunnel.py``. All real servers
on 127.0.0.1, free ports.

- :class:`WsEngine`: aiohttp ``web.WebSocketResponse`` (echo, subprotocols, permessage-deflate,
  closes and resets on command, refusals 403/426, and vLLM's abort endpoint as a recorder that
  must stay silent).
- :class:`RawEngine`: a raw asyncio server that answers any ``Upgrade`` with a ``101`` by hand
  and then echoes bytes unframed, recording exactly how its connection ended (FIN: EOF; reset:
  ``ConnectionResetError``). Commands (bytes after the switch): ``RST`` resets, ``FIN`` closes,
  ``FLOOD`` writes until its transport pauses (backpressure).
- :class:`RealtimeEngine`: a fake of vLLM 0.32's ``/v1/realtime`` on uvicorn + starlette (the
  stack vLLM serves it on), written from ``vllm/entrypoints/speech_to_text/realtime/``
  (``connection.py`` ``RealtimeConnection``, ``protocol.py``): ``session.created`` on accept;
  ``session.update`` validates the model; ``input_audio_buffer.append`` queues base64 PCM16;
  ``input_audio_buffer.commit`` starts a generation under ``rt-{connection_id}-{uuid4()}``
  (``connection_id = ws-{uuid4()}``) that emits ``transcription.delta`` per audio chunk and
  ``transcription.done`` after a ``commit`` with ``final: true``; when the socket closes its
  ``cleanup`` aborts that id (recorded here with the time).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import socket
import struct
import time
import uuid
from dataclasses import dataclass, field
from typing import cast

import uvicorn
from aiohttp import WSMsgType, web
from starlette.applications import Starlette
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC11B65"  # RFC 6455 section 1.3
LINGER_RESET = struct.pack("ii", 1, 0)


def accept_key(key: str) -> str:
    """``Sec-WebSocket-Accept`` for a ``Sec-WebSocket-Key`` (RFC 6455 section 4.2.2)."""
    return base64.b64encode(hashlib.sha1(key.encode() + WS_GUID).digest()).decode()


def reset(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER_RESET)
    transport.abort()  # type: ignore[attr-defined]


@dataclass
class Session:
    """One WebSocket session as :class:`WsEngine` saw it."""

    headers: dict[str, str]
    protocol: str | None
    received: list[str | bytes] = field(default_factory=list)
    closed_at: float | None = None
    close_code: int | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)


class WsEngine:
    """aiohttp WebSocket server. ``/ws``: echo (``?protocols=a,b``, ``?compress=0``); a text
    ``close:CODE`` makes the server close with CODE, ``reset`` makes it reset its socket,
    ``send:N`` sends N binary messages of 1 KiB. ``/refuse/{status}``: that status with a body.
    ``/inference/v1/abort_requests``: records calls (none expected)."""

    def __init__(self) -> None:
        self.sessions: list[Session] = []
        self.refusals: list[dict[str, str]] = []
        self.aborts: list[bytes] = []
        self.new_session = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/ws", self._ws)
        app.router.add_get("/refuse/{status}", self._refuse)
        app.router.add_post("/inference/v1/abort_requests", self._abort)
        app.router.add_get("/health", self._health)
        self.runner = web.AppRunner(app, handle_signals=False)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = int(self.runner.addresses[0][1])

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _abort(self, request: web.Request) -> web.Response:
        self.aborts.append(await request.read())
        return web.json_response({})

    async def _refuse(self, request: web.Request) -> web.Response:
        self.refusals.append(dict(request.headers))
        status = int(request.match_info["status"])
        headers = {"Upgrade": "websocket", "Connection": "Upgrade"} if status == 426 else {}
        return web.Response(status=status, text=f"refused with {status}\n", headers=headers)

    async def _ws(self, request: web.Request) -> web.StreamResponse:
        protocols = [p for p in request.query.get("protocols", "").split(",") if p]
        ws = web.WebSocketResponse(protocols=protocols, compress=request.query.get(
            "compress", "1") == "1", max_msg_size=0)
        await ws.prepare(request)
        session = Session(dict(request.headers), ws.ws_protocol)
        self.sessions.append(session)
        self.new_session.set()
        try:
            async for msg in ws:
                if msg.type == WSMsgType.TEXT:
                    session.received.append(msg.data)
                    if msg.data.startswith("close:"):
                        await ws.close(code=int(msg.data[6:]), message=b"server closes")
                        break
                    if msg.data == "reset":
                        assert request.transport is not None
                        reset(request.transport)
                        break
                    if msg.data.startswith("send:"):
                        for i in range(int(msg.data[5:])):
                            await ws.send_bytes(bytes([i % 256]) * 1024)
                        continue
                    await ws.send_str(msg.data)
                elif msg.type == WSMsgType.BINARY:
                    session.received.append(msg.data)
                    await ws.send_bytes(msg.data)
        finally:
            session.closed_at = time.monotonic()
            session.close_code = ws.close_code
            session.done.set()
        return ws


class _RawConnection(asyncio.Protocol):
    def __init__(self, engine: RawEngine) -> None:
        self.engine = engine
        self.transport: asyncio.Transport | None = None
        self.head = b""
        self.switched = False
        self.received = bytearray()
        self.eof_at: float | None = None
        self.lost_at: float | None = None
        self.lost_with: BaseException | None = None
        self.lost = asyncio.Event()
        self.paused = asyncio.Event()
        self.resumed = asyncio.Event()
        self.flooded = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.engine.accepted.append(self)

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        if self not in self.engine.connections:
            # Listed once it sends something: the sidecar's warm abort connection never does.
            self.engine.connections.append(self)
            self.engine.new_connection.set()
        if not self.switched:
            self.head += data
            if b"\r\n\r\n" not in self.head:
                return
            head, _, rest = self.head.partition(b"\r\n\r\n")
            self.head = head
            self.engine.got_head.set()
            if self.engine.hold:
                return  # never answers
            fields = dict(line.split(": ", 1) for line in head.decode().split("\r\n")[1:])
            key = fields.get("Sec-WebSocket-Key", "")
            self.transport.write(
                b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: " + fields["Upgrade"].encode()
                + b"\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: "
                + accept_key(key).encode() + b"\r\nX-Raw-Engine: yes\r\n\r\n"
                + self.engine.greeting)
            self.switched = True
            if not self.engine.read:
                self.transport.pause_reading()
            data = rest
            if not data:
                return
        self.received += data
        if self.engine.echo:
            self.transport.write(data)
        if data.endswith(b"RST"):
            reset(self.transport)
        elif data.endswith(b"FIN"):
            self.transport.close()
        elif data.endswith(b"FLOOD"):
            self._flood()

    def _flood(self) -> None:
        """Write 64 KiB chunks until the transport says to stop."""
        assert self.transport is not None
        chunk = b"f" * 65536
        while not self.paused.is_set() and self.flooded < self.engine.flood_bytes:
            self.transport.write(chunk)
            self.flooded += len(chunk)

    def pause_writing(self) -> None:
        self.paused.set()

    def resume_writing(self) -> None:
        self.paused.clear()
        self.resumed.set()
        if self.flooded < self.engine.flood_bytes:
            self._flood()

    def eof_received(self) -> bool:
        self.eof_at = time.monotonic()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost_at = time.monotonic()
        self.lost_with = exc
        self.lost.set()


class RawEngine:
    """Answers any upgrade request with a hand-written ``101`` (a valid ``Sec-WebSocket-Accept``
    when a key is sent) followed by ``greeting``, then echoes raw bytes (``echo``); ``hold``:
    never answers; ``read=False``: stops reading once switched."""

    def __init__(self, greeting: bytes = b"", echo: bool = True,
                 flood_bytes: int = 64 * 1024 * 1024) -> None:
        self.greeting = greeting
        self.echo = echo
        self.hold = False  # True: read the head, never answer it
        self.read = True  # False: stop reading once switched (resume: resume_reading())
        self.got_head = asyncio.Event()
        self.flood_bytes = flood_bytes
        self.connections: list[_RawConnection] = []  # those that sent something, in order
        self.accepted: list[_RawConnection] = []  # every connection
        self.new_connection = asyncio.Event()
        self.server: asyncio.Server | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: _RawConnection(self), "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            for conn in self.accepted:
                if conn.transport is not None:
                    conn.transport.abort()
            await self.server.wait_closed()


# -- a fake of vLLM's /v1/realtime --------------------------------------------------------------

@dataclass
class RealtimeRecord:
    connections: list[str] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)
    aborted: list[tuple[str, float]] = field(default_factory=list)  # (request id, when)
    closed_at: list[float] = field(default_factory=list)  # the server noticed the close
    cleaned: asyncio.Event = field(default_factory=asyncio.Event)
    generating: asyncio.Event = field(default_factory=asyncio.Event)
    headers: list[dict[str, str]] = field(default_factory=list)


class RealtimeEngine:
    """uvicorn + starlette serving a fake ``/v1/realtime`` (module docstring). ``MODEL`` is
    the one model ``session.update`` accepts."""

    MODEL = "fake-whisper"

    def __init__(self) -> None:
        self.record = RealtimeRecord()
        self.port = 0
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = Starlette(routes=[WebSocketRoute("/v1/realtime", self._endpoint)])
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", ws="websockets-sansio", lifespan="off",
                                ws_ping_interval=None)
        self._server = uvicorn.Server(config)
        self._task = asyncio.get_running_loop().create_task(
            self._server.serve(sockets=[sock]), name="fake realtime engine")
        while not self._server.started:  # uvicorn has no event for it
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise AssertionError("uvicorn stopped before it started")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await asyncio.wait_for(self._task, 10)

    async def _endpoint(self, websocket: WebSocket) -> None:
        record = self.record
        connection_id = f"ws-{uuid.uuid4()}"
        record.connections.append(connection_id)
        record.headers.append(dict(websocket.headers))
        await websocket.accept()
        await websocket.send_text(json.dumps({
            "type": "session.created", "id": f"sess-{uuid.uuid4().hex}",
            "created": int(time.time())}))
        audio: asyncio.Queue[bytes | None] = asyncio.Queue()
        validated = False
        request_id: str | None = None
        generation: asyncio.Task[None] | None = None
        try:
            while True:
                event = json.loads(await websocket.receive_text())
                kind = event.get("type")
                if kind == "session.update":
                    if event.get("model") != self.MODEL:
                        await self._error(websocket, "model not found", "model_not_found")
                        continue
                    validated = True
                elif kind == "input_audio_buffer.append":
                    pcm = base64.b64decode(event["audio"])
                    if not pcm:
                        await self._error(websocket, "Invalid audio data", "invalid_audio")
                        continue
                    audio.put_nowait(pcm)
                elif kind == "input_audio_buffer.commit":
                    if not validated:
                        await self._error(websocket, "Model not validated.",
                                          "model_not_validated")
                        continue
                    if event.get("final"):
                        audio.put_nowait(None)
                    elif generation is None or generation.done():
                        request_id = f"rt-{connection_id}-{uuid.uuid4()}"
                        record.request_ids.append(request_id)
                        generation = asyncio.create_task(self._generate(websocket, audio))
                else:
                    await self._error(websocket, f"Unknown event type: {kind}", "unknown_event")
        except WebSocketDisconnect:
            pass
        finally:
            # RealtimeConnection.cleanup: abort the engine request, then cancel the task.
            record.closed_at.append(time.monotonic())
            if request_id is not None:
                record.aborted.append((request_id, time.monotonic()))
            if generation is not None and not generation.done():
                generation.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await generation
            record.cleaned.set()

    async def _generate(self, websocket: WebSocket, audio: asyncio.Queue[bytes | None]) -> None:
        text = ""
        chunks = 0
        self.record.generating.set()
        while (pcm := await audio.get()) is not None:
            chunks += 1
            delta = f"w{chunks}({len(pcm)}) "
            text += delta
            await websocket.send_text(json.dumps({"type": "transcription.delta",
                                                  "delta": delta}))
        usage = {"prompt_tokens": chunks, "completion_tokens": chunks,
                 "total_tokens": 2 * chunks}
        await websocket.send_text(json.dumps({"type": "transcription.done", "text": text,
                                              "usage": usage}))

    @staticmethod
    async def _error(websocket: WebSocket, message: str, code: str) -> None:
        await websocket.send_text(json.dumps({"type": "error", "error": message, "code": code}))
