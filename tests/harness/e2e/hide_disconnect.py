"""Pure-ASGI middleware that hides client disconnects from the wrapped app.

It reproduces the real-world bug where a layer in front of vLLM's handlers buffers the
request body and then never forwards later ``receive()`` messages: vLLM never sees
``http.disconnect`` and keeps generating after the client left.

Load it into a real vLLM server with (from the repo root, so ``tests`` is importable)::

    PYTHONPATH=/work/main python -m vllm.entrypoints.openai.api_server ... \
        --middleware tests.harness.e2e.hide_disconnect.HideDisconnectMiddleware

vLLM's ``--middleware`` does ``importlib.import_module(path.rsplit('.', 1)[0])`` and, for a
class, ``app.add_middleware(cls)``; the class is then constructed as ``cls(app)``. Being
added last, it is the outermost user middleware (outside CORS/auth/X-Request-Id).
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


class HideDisconnectMiddleware:
    """Buffer the whole HTTP request body, replay it once, then block forever.

    Non-HTTP scopes (lifespan, websocket) are passed through untouched.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    break
            elif message["type"] == "http.disconnect":
                # Client left before the body was complete: nothing to run.
                return
        body = b"".join(chunks)
        replayed = False

        async def hidden_receive() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            # Never deliver http.disconnect: block until cancelled.
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

        await self.app(scope, hidden_receive, send)
