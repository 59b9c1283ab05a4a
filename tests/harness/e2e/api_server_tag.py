"""Pure-ASGI middleware that names the vLLM API-server process in every response.

With ``vllm serve --api-server-count N`` each new TCP connection is served by one of N
processes for its whole life. A client cannot tell which one from anything vLLM sends by
default, so tests and probes load this middleware (``--middleware
tests.harness.e2e.api_server_tag.ApiServerTagMiddleware``) and read the response header
``x-api-server``: the multiprocessing process name and the pid, e.g. ``ApiServer_1 pid=4242``
(vLLM names its processes ``ApiServer_{i}``, ``vllm/v1/utils.py``: APIServerProcessManager; a
single-process server is ``MainProcess``).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

HEADER = "x-api-server"


def process_tag() -> str:
    """``"{process name} pid={pid}"`` of the calling process."""
    return f"{multiprocessing.current_process().name} pid={os.getpid()}"


class ApiServerTagMiddleware:
    """Add ``x-api-server: <process name> pid=<pid>`` to every HTTP response head."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.header = (HEADER.encode(), process_tag().encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def tagged_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self.header]
            await send(message)

        await self.app(scope, receive, tagged_send)
