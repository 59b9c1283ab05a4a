"""The cancel API on the admin listener: ``POST /v1/requests/{request_id}/cancel``.

``request_id`` is the sidecar request id the proxy returned in ``X-Request-Id``. Answers::

    200 {"id": ..., "cancelled": true, "phase": ...}   found: engine aborted, client's response
                                                        ended (see proxy.Exchange.end_cancelled)
    404 {"error": {..., "type": "not_found"}}           no such request in flight (never was,
                                                        finished, or already ending: cancelled,
                                                        its deadline passed, its client gone)
    401 {"error": {..., "type": "unauthorized"}}        admin.cancel_token set, and no
                                                        ``Authorization: Bearer <token>`` matching
    501 {"error": {..., "type": "not_implemented"}}     --workers N: requests live in the worker
                                                        processes, this listener in the supervisor

The answer comes once the request's handler has unwound (bounded by ``UNWIND_S``): its engine
abort has started and the client's response has ended, so a second cancel of the same id is 404.
``phase`` is where the request was: ``request_body``, ``before_first_byte``,
``awaiting_response`` or ``streaming`` (as ``client_disconnects_total``).
"""

from __future__ import annotations

import asyncio
import hmac
import logging

from aiohttp import web
from pydantic import SecretStr

from sidecar.keys import EXCHANGES
from sidecar.proxy import error_response

log = logging.getLogger(__name__)

CANCEL_PATH = "/v1/requests/{request_id}/cancel"
UNWIND_S = 10.0  # how long the answer waits for the cancelled handler to unwind
CANCEL_TOKEN: web.AppKey[SecretStr | None] = web.AppKey("cancel_token")
NEEDS_ONE_WORKER = ("the cancel API needs --workers 1 for now: with --workers N the requests "
                    "live in the worker processes and this admin listener in the supervisor")


def _authorized(request: web.Request) -> bool:
    token = request.app[CANCEL_TOKEN]
    if token is None:
        return True  # open: the admin listener is loopback-only unless configured otherwise
    given = request.headers.get("Authorization", "").encode()
    expected = b"Bearer " + token.get_secret_value().encode()
    return hmac.compare_digest(given, expected)


async def _cancel(request: web.Request) -> web.Response:
    if not _authorized(request):
        response = error_response(401, "a valid 'Authorization: Bearer <admin.cancel_token>' "
                                  "is required", "unauthorized")
        response.headers["WWW-Authenticate"] = "Bearer"
        return response
    exchanges = request.app.get(EXCHANGES)
    if exchanges is None:
        return error_response(501, NEEDS_ONE_WORKER, "not_implemented")
    request_id = request.match_info["request_id"]
    exchange = exchanges.get(request_id)
    if exchange is None or not exchange.request_cancel():
        return error_response(404, "no request in flight with this id", "not_found")
    log.info("request %s: cancel requested via API", request_id)
    if exchange.task is not None:
        await asyncio.wait({exchange.task}, timeout=UNWIND_S)
    return web.json_response({"id": request_id, "cancelled": True, "phase": exchange.phase})


def add_cancel_route(app: web.Application, token: SecretStr | None) -> None:
    """Serve the cancel API on the admin ``app``: for the exchanges under ``keys.EXCHANGES``
    (absent: 501), behind ``token`` if set."""
    app[CANCEL_TOKEN] = token
    app.router.add_post(CANCEL_PATH, _cancel)
