"""The cancel API on the admin listener: ``POST /v1/requests/{request_id}/cancel``.

``request_id`` is the sidecar request id the proxy returned in ``X-Request-Id``. Answers::

    200 {"id": ..., "cancelled": true, "phase": ...}   found: engine aborted, client's response
                                                        ended (see sidecar.cancellation)
    404 {"error": {..., "type": "not_found"}}           no such request in flight (never was,
                                                        finished, or already ending: cancelled,
                                                        its deadline passed, its client gone)
    401 {"error": {..., "type": "unauthorized"}}        admin.cancel_token set, and no
                                                        ``Authorization: Bearer <token>`` matching
    502 {"error": {..., "type": "worker_unreachable"}}  --workers N only: not found, and some
                                                        worker could not be asked (it may hold it)
    200 {"id": ..., "cancelled": true, "phase": null,   --workers N only: a request of a worker
         "worker_died": true}                           that died in the last 60 s, aborted at
                                                        its engines by the supervisor from the
                                                        worker's record (sidecar.inflight)

The answer comes once the request's handler has unwound (bounded by ``UNWIND_S``): its engine
abort has started and the client's response has ended, so a second cancel of the same id is 404.
``phase`` is where the request was: ``request_body``, ``before_first_byte``,
``awaiting_response`` or ``streaming`` (as ``client_disconnects_total``).

Where the request is looked up (a :data:`Canceller` under ``CANCELLER``)::

    one process:  admin listener -> local_canceller: this process's proxy.EXCHANGES
    --workers N:  supervisor's admin listener (checks the token)
                    -> WorkerCanceller: POST the same path to every live worker at once, over
                       its control listener (a Unix socket in the supervisor's 0700 run
                       directory, no token, sidecar.workers) -> local_canceller in the worker
                    first 200 wins and is passed on as is; all 404 -> 404; else 502; a dead
                    worker whose record the supervisor read is not asked: its requests are
                    known (200 worker_died), so an id found nowhere is 404

Sidecar ids are 128 random bits (:func:`sidecar.ticket.new_request_id`), so at most one worker
holds an id: the first 200 is the answer and the other asks are cancelled. A worker that does not
answer within ``WORKER_ANSWER_S`` (or refuses the connection) while another found the id changes
nothing; if none found it, the answer is 502 rather than 404, because the request may be in flight
in the worker that could not be asked, and a 404 would tell the caller it is not."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
from aiohttp import web
from pydantic import SecretStr
from yarl import URL

from sidecar.proxy import Exchange
from sidecar.replies import error_response

log = logging.getLogger(__name__)

CANCEL_PATH = "/v1/requests/{request_id}/cancel"
UNWIND_S = 10.0  # how long the answer waits for the cancelled handler to unwind
# How long the supervisor waits for one worker's answer: the worker's own UNWIND_S bound, plus
# room for the hop, so a found request whose handler unwinds slowly is not taken for a failure.
WORKER_ANSWER_S = UNWIND_S + 2.0
# Idle keep-alive of the supervisor's connections to the control listeners: the client lets them
# go well before the server would close them, so a cancel never meets a connection being closed.
CONTROL_KEEPALIVE_S = 30.0
CONTROL_IDLE_S = 2 * CONTROL_KEEPALIVE_S

# Looks a sidecar request id up, cancels it if found, and gives the admin answer (200/404/502).
Canceller = Callable[[str], Awaitable[web.Response]]
CANCELLER: web.AppKey[Canceller] = web.AppKey("canceller")
CANCEL_TOKEN: web.AppKey[SecretStr | None] = web.AppKey("cancel_token")


def _authorized(request: web.Request) -> bool:
    token = request.app[CANCEL_TOKEN]
    if token is None:
        return True  # open: the admin listener is loopback-only unless configured otherwise
    # aiohttp decodes header bytes as UTF-8 with surrogateescape: encode them back the same
    # way (a plain encode() raised on a non-UTF-8 header: a 500 for anyone reaching the port).
    given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
    # The scheme is case-insensitive (RFC 9110 section 11.1): "bearer <token>" counts.
    scheme, _, credentials = given.partition(b" ")
    expected = token.get_secret_value().encode()
    return scheme.lower() == b"bearer" and hmac.compare_digest(credentials, expected)


def _not_found() -> web.Response:
    return error_response(404, "no request in flight with this id", "not_found")


async def _cancel(request: web.Request) -> web.Response:
    if not _authorized(request):
        response = error_response(401, "a valid 'Authorization: Bearer <admin.cancel_token>' "
                                  "is required", "unauthorized")
        response.headers["WWW-Authenticate"] = "Bearer"
        return response
    return await request.app[CANCELLER](request.match_info["request_id"])


def add_cancel_route(app: web.Application, token: SecretStr | None,
                     canceller: Canceller) -> None:
    """Serve the cancel API on ``app`` (the admin listener, or a worker's control listener),
    looking ids up with ``canceller``, behind ``token`` if set."""
    app[CANCEL_TOKEN] = token
    app[CANCELLER] = canceller
    app.router.add_post(CANCEL_PATH, _cancel)


def local_canceller(exchanges: dict[str, Exchange]) -> Canceller:
    """Cancel among ``exchanges`` (this process's ``proxy.EXCHANGES``): 200 once the handler
    unwound (bounded by ``UNWIND_S``), or 404."""

    async def cancel(request_id: str) -> web.Response:
        exchange = exchanges.get(request_id)
        if exchange is None or not exchange.request_cancel():
            return _not_found()
        log.info("request %s: cancel requested via API", request_id)
        if exchange.task is not None:
            await asyncio.wait({exchange.task}, timeout=UNWIND_S)
        return web.json_response({"id": request_id, "cancelled": True,
                                  "phase": exchange.phase})

    return cancel


class WorkerCanceller:
    """The supervisor's :data:`Canceller`: asks every live worker's control listener at once.

    ``workers()`` gives ``(pid, control socket path)`` of the workers still running;
    ``starting(pid)`` is True for one that has not said it listens yet. One keep-alive client
    session per socket, made on first use; :meth:`close` closes them.
    """

    def __init__(self, workers: Callable[[], Sequence[tuple[int, Path]]],
                 orphaned: Callable[[str], bool] = lambda _: False,
                 starting: Callable[[int], bool] = lambda _: False) -> None:
        self._workers = workers
        self._orphaned = orphaned
        self._starting = starting
        self._sessions: dict[Path, aiohttp.ClientSession] = {}

    def _session(self, path: Path) -> aiohttp.ClientSession:
        session = self._sessions.get(path)
        if session is None or session.closed:
            session = self._sessions[path] = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=str(path),
                                                keepalive_timeout=CONTROL_KEEPALIVE_S),
                timeout=aiohttp.ClientTimeout(total=WORKER_ANSWER_S),
                cookie_jar=aiohttp.DummyCookieJar(), trust_env=False)
        return session

    async def _ask(self, pid: int, path: Path, url: URL) -> dict[str, Any] | str | None:
        """One worker's answer: its 200 body (found), ``None`` (its 404, or a worker still
        starting whose control socket does not listen yet: it has taken no request), or why it
        could not be asked (refused, reset, no answer within ``WORKER_ANSWER_S``, another
        status)."""
        starting = self._starting(pid)
        try:
            async with self._session(path).post(url) as response:
                if response.status == 404:
                    return None
                if response.status != 200:
                    return f"worker {pid} answered {response.status}"
                found = await response.json()
        except TimeoutError:
            return f"worker {pid}: no answer within {WORKER_ANSWER_S:.1f} s"
        except (aiohttp.ClientError, ValueError) as exc:  # ValueError: a 200 that is not JSON
            if (starting and isinstance(exc, aiohttp.ClientConnectorError)
                    and isinstance(exc.os_error, (FileNotFoundError, ConnectionRefusedError))):
                # Not listening yet (no socket file, or bound and not yet listening): a worker
                # listens on its control socket before its proxy listener opens
                # (sidecar.server.start), so one still starting has taken no request.
                return None
            return f"worker {pid}: {str(exc) or type(exc).__name__}"
        if not isinstance(found, dict):
            return f"worker {pid} answered 200 without a JSON object"
        return found

    async def __call__(self, request_id: str) -> web.Response:
        if self._orphaned(request_id):
            # A dead worker's request, aborted at its engines on the worker's behalf
            # (sidecar.inflight); its client's connection died with the worker.
            return web.json_response({"id": request_id, "cancelled": True, "phase": None,
                                      "worker_died": True})
        workers = self._workers()
        if not workers:
            return error_response(502, "no worker is running", "worker_unreachable")
        url = URL(f"http://worker/v1/requests/{quote(request_id, safe='')}/cancel",
                  encoded=True)
        loop = asyncio.get_running_loop()
        asks = {loop.create_task(self._ask(pid, path, url), name=f"cancel ask worker {pid}")
                for pid, path in workers}
        unasked: list[str] = []
        try:
            pending = set(asks)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    answer = task.result()
                    if isinstance(answer, dict):
                        return web.json_response(answer)
                    if answer is not None:
                        unasked.append(answer)
        finally:  # found (ids are unique: the others can only say 404), or all answered
            for task in asks:
                task.cancel("another worker found the request")
            await asyncio.wait(asks)
        if not unasked:
            return _not_found()
        log.warning("cancel %s: not found in %d of %d worker(s); could not ask the others: %s",
                    request_id, len(workers) - len(unasked), len(workers), "; ".join(unasked))
        return error_response(
            502, f"not found in {len(workers) - len(unasked)} of {len(workers)} worker(s); "
            f"the request may be in flight in one that could not be asked ({'; '.join(unasked)})",
            "worker_unreachable")

    async def close(self) -> None:
        await asyncio.gather(*(s.close() for s in self._sessions.values()))
        self._sessions.clear()
