"""Logs: one formatter for every record, and one access line per request.

:func:`configure_logging` sends every record (startup, warnings, the access lines) to stderr
through one formatter: ``json`` (the default, one JSON object per line) or ``text`` (one readable
line). aiohttp's own access log stays off; :class:`RequestLog` replaces it.

The access line is written once per request, when the request is completely done: its handler
has returned or been cancelled *and* its abort has an outcome (abort calls are batched across
requests, run in their own tasks and outlive the handler). JSON fields, in order::

    ts                   ISO 8601 UTC, milliseconds ("2025-01-31T12:00:00.123Z")
    level, logger        "INFO", "sidecar.access"
    msg                  "request"
    request_id           the sidecar request id (32 hex characters)
    client_request_id    the client's X-Request-Id, or null
    route, engine        the matched route prefix and engine name (null: no route matched)
    method, path         the request's method and path, never its query string (secrets)
    status               the status sent downstream, or null if none was sent
    duration_s           seconds from the request's arrival to the handler's end
    bytes_sent           downstream body bytes relayed (framing not counted)
    client_disconnected  true if the client left before its response was complete
    phase                where the sidecar stopped the exchange (request_body,
                         before_first_byte, awaiting_response, streaming), or null
    cancel_reason        null, or why the sidecar itself ended the request
                         ("cancelled via API": POST /v1/requests/{id}/cancel)
    abort                null, or the final outcome of the request's abort. Engine kinds that
                         confirm (vllm, sglang; sidecar.confirm): confirmed (the engine ended
                         the request's response aborted), finished (it ended on its own
                         first), unconfirmed (nothing ended within abort.confirm_timeout_s;
                         a WARNING names the ids). Others: accepted (the first call was
                         answered 2xx: not proof the engine knew the ids or stopped anything;
                         the re-sends inside the registration window come later and are not
                         waited for). Any kind: http_<status>, timeout, error (the first call
                         failed, after its retries), cancelled (the sidecar shut down first),
                         dropped (the engine's abort queue was full). With several abort
                         engines (routes[].abort) the weakest: a failure, else accepted, else
                         the engines' own word
    abort_latency_s      seconds from noticing the disconnect to that outcome (the slowest
                         engine's; for confirmed, to the end of the engine's response), or null
    kept_by_engine       null, or why a request that ended early was not aborted on purpose:
                         its engine keeps it after the client leaves (background_response,
                         response_retrieval); its abort is then null

An upgraded connection (a ``101`` relayed: :mod:`sidecar.tunnel`) has ``status`` 101,
``phase`` "tunnel", ``duration_s`` its whole life, ``bytes_sent`` the bytes relayed engine ->
client after the 101, ``client_disconnected`` true if the client ended it, ``abort`` null, and
four more fields::

    upgrade              the protocol switched to (the request's Upgrade value, e.g. "websocket")
    bytes_received       bytes relayed client -> engine after the 101
    closed_by            client, engine or sidecar
    close_reason         fin, reset (the side that ended it), or the sidecar's reason:
                         idle_timeout, max_bytes, deadline, shutdown

Nothing secret is ever logged: no header values, no query strings, no abort key.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Literal

LogFormat = Literal["json", "text"]
ACCESS_LOGGER = "sidecar.access"

access_log = logging.getLogger(ACCESS_LOGGER)

# A request with several abort engines reports the weakest outcome: the first failure, else
# accepted (taken, unconfirmed) over the engine's own word (confirmed, finished).
_RANK = {"confirmed": 0, "finished": 0, "accepted": 1}


def configure_logging(level: str, fmt: LogFormat) -> None:
    """Send every log record to stderr through one formatter, at ``level`` (``DEBUG``,
    ``INFO``, ``WARNING`` or ``ERROR``, any case). Replaces any handler on the root logger."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())


def _timestamp(record: logging.LogRecord) -> str:
    stamp = datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")
    return stamp.removesuffix("+00:00") + "Z"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``ts``, ``level``, ``logger``, ``msg``, then the access
    fields of an access line, or ``exc`` (the traceback) for a record with exception info."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {"ts": _timestamp(record), "level": record.levelname,
                                "logger": record.name, "msg": record.getMessage()}
        fields = getattr(record, "access", None)
        if fields is not None:
            line.update(fields)
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc"] = record.exc_text
        return json.dumps(line, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    """``TIME LEVEL LOGGER MESSAGE``; an access line adds its fields as ``key=value``."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        text = super().formatMessage(record)
        fields = getattr(record, "access", None)
        if fields is None:
            return text
        pairs = " ".join(f"{k}={_text_value(v)}" for k, v in fields.items())
        return f"{text} {pairs}"


def _text_value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.6f}".rstrip("0").rstrip(".") or "0"
    return str(value)


class RequestLog:
    """One request's access line, filled in as the request goes.

    It is written when both the handler (:meth:`handler_done`) and every abort call it started
    (:meth:`abort_started` / :meth:`abort_done`) are done: exactly once. Cheap: plain
    attributes, no per-chunk work; nothing is formatted unless INFO is enabled.
    """

    __slots__ = ("_abort", "_abort_latency", "_cancel_reason", "_fields", "_kept", "_pending",
                 "_started", "over")

    # The extra fields of an upgraded connection's line (module docstring), in order.
    TUNNEL_FIELDS = ("upgrade", "bytes_received", "closed_by", "close_reason")

    def __init__(self, request_id: str, method: str, path: str, route: str | None,
                 engine: str | None, client_request_id: str | None) -> None:
        self._started = time.monotonic()
        self._pending = 1  # the handler
        self._abort: str | None = None
        self._abort_latency: float | None = None
        self._fields: dict[str, Any] = {
            "request_id": request_id, "client_request_id": client_request_id,
            "route": route, "engine": engine, "method": method, "path": path,
        }
        self._cancel_reason: str | None = None
        self._kept: str | None = None
        # Called once when the request is over (the line's moment), whether or not it is
        # logged: the record of in-flight work writes its end (sidecar.inflight).
        self.over: Callable[[], None] | None = None

    def abort_started(self) -> None:
        """An abort call for this request started; the line waits for its outcome."""
        self._pending += 1

    def abort_done(self, outcome: str, latency_s: float) -> None:
        """An engine's abort of this request ended with ``outcome`` (``confirmed``,
        ``finished``, ``unconfirmed``, ``accepted``, ``http_<status>``, ``timeout``, ``error``,
        ``cancelled``, ``dropped``), ``latency_s`` seconds after the disconnect was noticed."""
        if self._abort is None or _RANK.get(outcome, 2) > _RANK.get(self._abort, 2):
            self._abort = outcome
        self._abort_latency = max(latency_s, self._abort_latency or 0.0)
        self._release()

    def kept_by_engine(self, reason: str) -> bool:
        """The request was not aborted because its engine keeps it (``reason``); ``False`` if
        that was already recorded (several abort engines)."""
        first = self._kept is None
        self._kept = self._kept or reason
        return first

    def cancelled(self, reason: str) -> None:
        """The sidecar ended the request itself, for ``reason`` (e.g. the cancel API)."""
        self._cancel_reason = reason

    def tunnel_done(self, upgrade: str, bytes_received: int, closed_by: str,
                    close_reason: str) -> None:
        """An upgraded connection ended (call before :meth:`handler_done`): ``upgrade`` the
        protocol, ``bytes_received`` client -> engine bytes, who closed it and why."""
        self._fields.update(zip(self.TUNNEL_FIELDS,
                                (upgrade, bytes_received, closed_by, close_reason), strict=True))

    def handler_done(self, status: int | None, bytes_sent: int, client_disconnected: bool,
                     phase: str | None) -> None:
        """The handler ended: ``status`` sent (``None``: none was), ``bytes_sent`` body bytes."""
        self._fields.update(status=status, duration_s=round(time.monotonic() - self._started, 6),
                            bytes_sent=bytes_sent, client_disconnected=client_disconnected,
                            phase=phase, cancel_reason=self._cancel_reason)
        self._release()

    def _release(self) -> None:
        self._pending -= 1
        if self._pending == 0 and self.over is not None:
            self.over()
        if self._pending == 0 and access_log.isEnabledFor(logging.INFO):
            fields = self._fields
            fields["abort"] = self._abort
            fields["abort_latency_s"] = (None if self._abort_latency is None
                                         else round(self._abort_latency, 6))
            fields["kept_by_engine"] = self._kept
            access_log.info("request", extra={"access": fields})
