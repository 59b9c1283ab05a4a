"""A fake of llm-d's routing sidecar, the decode pod's P/D proxy, written from its source
(github.com/llm-d/llm-d-router at ebab68792, ``pkg/sidecar/proxy``), never from the code under
test. A real aiohttp server on 127.0.0.1 with handler cancellation on, as Go's ``net/http``
cancels a request's context when its client leaves.

As llm-d does (file, function):

- ``POST /v1/completions`` and ``/v1/chat/completions`` (``proxy.go``, ``createRoutes``) go
  through the P/D handler (``chat_completions.go``, ``disaggregatedPrefillHandler``): it reads
  every value of ``x-prefiller-host-port`` and deletes the header from what it forwards; one
  value is split at commas and the first entry, trimmed, is the prefill target (sampling off);
  none: the decoder alone. No allowlist (``--enable-ssrf-protection`` off: ``IsAllowed`` is
  true). The prefill leg goes to ``http://`` + the value, a leading ``http://`` trimmed
  (``proxy.go``, ``createProxyHandler``), with the request's path and query.
- ``connector="nixlv2"`` (``connector_nixlv2.go``, ``handleNIXLV2``), serial: the prefill leg
  is the request with its own uuid added as a second ``x-request-id`` (``Header.Add``), the token
  limits (``max_tokens``, ``max_completion_tokens``, ``min_tokens``) set to 1, ``stream`` false,
  ``stream_options`` dropped and ``kv_transfer_params`` asking for a remote decode; it is
  cancelled with the client's request (``r.Context()``). Then the decode leg: the request with
  the uuid added likewise, the original body with the prefill answer's ``kv_transfer_params``,
  relayed to the client.
- ``connector="sglang"`` (``connector_sglang.go``, ``handleSGLang``): the body gets
  ``bootstrap_host`` (the target's host), ``bootstrap_port`` (8998) and ``bootstrap_room``; the
  prefill leg (headers unchanged) is sent with ``context.WithoutCancel``, concurrently with the
  decode leg, and its answer dropped: it runs on whatever the client does.
- ``GET /health`` answers 200; every other request goes to the decoder unchanged.

One deviation: a value llm-d cannot turn into a working prefill leg (no port, another scheme,
a path) fails its prefill there (the client gets 502); here such a request goes to the decoder
alone, as without the header, so a test sees the sidecar serve it and forward the header
unchanged.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from tests.fakes.engine import Watch

PREFILL_HEADER = "x-prefiller-host-port"  # pkg/common/routing/common.go, PrefillEndpointHeader
SGLANG_BOOTSTRAP_PORT = 8998  # connector_sglang.go, the default of SGLANG_BOOTSTRAP_PORT
TOKEN_LIMITS = ("max_tokens", "max_completion_tokens", "min_tokens")  # chat/completions API
_NOT_FORWARDED = {"host", "content-length", "transfer-encoding", "connection", PREFILL_HEADER}
PD_PATHS = ("/v1/completions", "/v1/chat/completions")
REQUEST_ID = "x-request-id"  # pkg/common/request/constants.go, RequestIDHeaderKey


@dataclass
class Leg:
    """One request the routing sidecar sent: to the prefill target or the decoder."""

    role: str  # "prefill" or "decode"
    url: str
    request_ids: list[str]  # every X-Request-Id value it carried, in order
    body: dict[str, Any]


@dataclass
class Forwarded:
    """One P/D request as the routing sidecar got it: the prefill header's values as received,
    the target it used (``None``: decoder alone), and the legs it sent."""

    header_values: list[str]
    target: str | None = None
    legs: list[Leg] = field(default_factory=list)
    at: float = field(default_factory=time.monotonic)


class RoutingSidecar:
    """The fake routing sidecar in front of the decoder at ``decoder_url``."""

    def __init__(self, decoder_url: str, connector: str) -> None:
        if connector not in ("nixlv2", "sglang"):
            raise ValueError(connector)
        self.decoder_url = decoder_url
        self.connector = connector
        self.requests: list[Forwarded] = []
        self.watch = Watch()
        self.app = web.Application()
        for path in PD_PATHS:
            self.app.router.add_post(path, self.pd)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_route("*", "/{path:.*}", self.passthrough)
        self.runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        self._background: set[asyncio.Task[None]] = set()
        self._session: aiohttp.ClientSession | None = None
        self.url = ""

    async def start(self) -> None:
        self._session = aiohttp.ClientSession()
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        await self.runner.cleanup()
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "start() the routing sidecar first"
        return self._session

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        headers = _forwarded_headers(request)
        return await self._relay(request, request.method, self.decoder_url + request.path_qs,
                                 headers, await request.read())

    async def pd(self, request: web.Request) -> web.StreamResponse:
        values = request.headers.getall(PREFILL_HEADER, [])
        record = Forwarded(list(values))
        self.requests.append(record)
        self.watch.changed()
        headers = _forwarded_headers(request)  # Header.Del(PrefillEndpointHeader) included
        body = json.loads(await request.read())
        entries = values[0].split(",") if len(values) == 1 else values
        target = entries[0].strip() if entries else ""
        prefill_url = _prefill_url(target)
        decode_url = self.decoder_url + request.path_qs
        if prefill_url is None:
            return await self._decode(request, record, decode_url, headers, body)
        record.target = target
        prefill_url += request.path_qs
        if self.connector == "sglang":
            host = URL(prefill_url).host or ""
            body = {**body, "bootstrap_host": host, "bootstrap_port": SGLANG_BOOTSTRAP_PORT,
                    "bootstrap_room": time.time_ns()}
            task = asyncio.get_running_loop().create_task(
                self._prefill(record, prefill_url, headers, body), name="sglang prefill leg")
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            return await self._decode(request, record, decode_url, headers, body)
        own_id = str(uuid.uuid4())
        prefill_headers = headers.copy()
        prefill_headers.add(REQUEST_ID, own_id)
        prefill_body = {**body, **dict.fromkeys(TOKEN_LIMITS, 1), "stream": False,
                        "kv_transfer_params": {"do_remote_decode": True,
                                               "do_remote_prefill": False}}
        prefill_body.pop("stream_options", None)
        answer = await self._prefill(record, prefill_url, prefill_headers, prefill_body)
        decode_headers = headers.copy()
        decode_headers.add(REQUEST_ID, own_id)
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        decode_body = {**body, "kv_transfer_params": params or {"do_remote_prefill": True}}
        return await self._decode(request, record, decode_url, decode_headers, decode_body)

    async def _prefill(self, record: Forwarded, url: str, headers: CIMultiDict[str],
                       body: dict[str, Any]) -> Any:
        record.legs.append(Leg("prefill", url, headers.getall(REQUEST_ID, []), body))
        self.watch.changed()
        async with self.session.post(url, data=json.dumps(body).encode(),
                                     headers=headers) as response:
            raw = await response.read()
        try:
            return json.loads(raw)
        except ValueError:
            return None

    async def _decode(self, request: web.Request, record: Forwarded, url: str,
                      headers: CIMultiDict[str], body: dict[str, Any]) -> web.StreamResponse:
        record.legs.append(Leg("decode", url, headers.getall(REQUEST_ID, []), body))
        self.watch.changed()
        return await self._relay(request, "POST", url, headers, json.dumps(body).encode())

    async def _relay(self, request: web.Request, method: str, url: str,
                     headers: CIMultiDict[str], data: bytes) -> web.StreamResponse:
        async with self.session.request(method, url, data=data or None,
                                        headers=headers) as upstream:
            response = web.StreamResponse(status=upstream.status)
            if "Content-Type" in upstream.headers:
                response.content_type = upstream.content_type
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response


def _forwarded_headers(request: web.Request) -> CIMultiDict[str]:
    """The request's headers to forward, names lower case: aiohttp's client keeps a repeated
    name only if it is spelled the same (``ClientSession._prepare_headers``), and the server
    spells ``X-Request-ID`` as its constant does."""
    return CIMultiDict((k.lower(), v) for k, v in request.headers.items()
                       if k.lower() not in _NOT_FORWARDED)


def _prefill_url(target: str) -> str | None:
    """``http://`` + ``target`` (a leading ``http://`` trimmed), or ``None`` if that is no
    origin with a port (see the module docstring's deviation)."""
    if not target:
        return None
    try:
        url = URL("http://" + target.removeprefix("http://"))
    except ValueError:
        return None
    if not url.host or url.explicit_port is None or url.path not in ("", "/") or url.query_string:
        return None
    return str(url.origin()) if url.user is None else str(url).rstrip("/")
