"""Pure-ASGI middleware that holds a response's head for as long as the request asks.

A request with the header ``X-E2E-Hold-Head-S: <seconds>`` gets its ``http.response.start``
message (and so every byte of its response) that much later; the app runs as usual meanwhile.
It stands for an engine whose answer is slow to leave (a loaded API process, a network in
between): it opens a window in which a client leaves a request the engine is already working
on, before any response byte. vLLM answers a non-streaming background ``POST /v1/responses``
with its ``queued`` JSON within milliseconds, before it even adds the request to the engine
(``_create_responses`` only starts the task), so without such a window a client's leaving there
cannot be timed against a running generation. Other requests pass untouched.

Load it beside ``HideDisconnectMiddleware`` (``tests/harness/e2e/vllm_server.py``)::

    --middleware tests.harness.e2e.hide_disconnect.HideDisconnectMiddleware \
    --middleware tests.harness.e2e.hold_head.HoldHeadMiddleware
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

HOLD_HEADER = b"x-e2e-hold-head-s"


class HoldHeadMiddleware:
    """Delay ``http.response.start`` by the request's ``X-E2E-Hold-Head-S`` seconds."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        hold = next((float(v) for k, v in scope.get("headers", ()) if k == HOLD_HEADER), 0.0)
        if scope["type"] != "http" or hold <= 0:
            await self.app(scope, receive, send)
            return

        async def held_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                await asyncio.sleep(hold)
            await send(message)

        await self.app(scope, receive, held_send)
