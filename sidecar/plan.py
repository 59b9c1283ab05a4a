"""The abort plan: where a request stood when it ended early (its :class:`Phase`), and what to
abort for it (one :class:`AbortStep` per engine) and why the rest is not aborted
(:class:`Withheld`).

Pure functions of what is known about a request: its method and path, its sidecar id, the kept
copy of its body (``None``: not kept, or not read whole), whether that copy was dropped for
being over ``upstream.replay_buffer_bytes`` (``over_limit``) and whether a body-rewriting route
relayed it unrewritten for that reason (``unrewritten``), its route (:class:`RouteTarget`) and
the engines to abort (:meth:`RouteTarget.abort_engines`, which resolves ``abort_from_header``
and counts that itself). Nothing here counts, logs or calls anything: the caller
(:class:`sidecar.cancellation.Cancellation`) counts and logs the :class:`Withheld` reasons, and
queues the steps at :class:`sidecar.abort.Aborter`; :class:`sidecar.proxy.Exchange` prepares the
steps ahead of the end where nothing is withheld (:func:`prepared_steps`).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from engine import EngineAdapter, Kept, Unabortable
from sidecar.headers import is_event_stream
from sidecar.route import RouteTarget


class Phase(enum.StrEnum):
    """Where a request was when it stopped: the label of
    ``cancel_sidecar_client_disconnects_total{phase}`` and the access line's ``phase``."""

    REQUEST_BODY = "request_body"  # the engine never had all of the body: never aborted
    BEFORE_FIRST_BYTE = "before_first_byte"  # a stream was asked for; the engine queues/prefills
    AWAITING_RESPONSE = "awaiting_response"  # a non-streaming response computed or sent
    STREAMING = "streaming"  # a text/event-stream response being relayed


class AbortStep(NamedTuple):
    """One abort engine's part of a request's abort: its engine request ids (never empty) and
    how they get registered (:meth:`~engine.base.EngineAdapter.registered_once_streaming`,
    :meth:`~engine.base.EngineAdapter.registers_later`)."""

    engine: EngineAdapter
    ids: tuple[str, ...]
    once_streaming: bool
    registers_later: bool


class Withheld(NamedTuple):
    """An engine not told to stop all of a request, and why: it keeps the request after its
    client leaves on purpose (``Kept``: a background response), or it may still run it (or
    part of it) under ids the sidecar cannot know (``Unabortable``). ``named``: the ids aborted
    all the same (those derivable without a body that was too large to keep), else 0."""

    engine: EngineAdapter
    reason: Kept | Unabortable
    named: int


def stopped_phase(body_complete: bool, response_headers: Mapping[str, str] | None,
          body: bytes | None) -> Phase:
    """Where a request stopped: :attr:`Phase.REQUEST_BODY` unless its body went whole upstream
    (``body_complete``); then :func:`response_phase` once its response head is in
    (``response_headers``); before that, :attr:`Phase.BEFORE_FIRST_BYTE` if its body (the kept
    copy) asks ``"stream": true``, else :attr:`Phase.AWAITING_RESPONSE`. Cold path: the body is
    parsed only here."""
    if not body_complete:
        return Phase.REQUEST_BODY
    if response_headers is not None:
        return response_phase(response_headers)
    copy = body or b""
    try:
        asked = b'"stream"' in copy and json.loads(copy).get("stream") is True
    except (ValueError, AttributeError, RecursionError):
        asked = False
    return Phase.BEFORE_FIRST_BYTE if asked else Phase.AWAITING_RESPONSE


def response_phase(headers: Mapping[str, str]) -> Phase:
    """The phase of a request whose body went whole and whose response head (``headers``) is
    in: :attr:`Phase.STREAMING` for an SSE response, else :attr:`Phase.AWAITING_RESPONSE`."""
    return Phase.STREAMING if is_event_stream(headers) else Phase.AWAITING_RESPONSE


def engine_ids(engine: EngineAdapter, method: str, path: str, sidecar_id: str,
               body: bytes | None, *, unrewritten: bool, over_limit: bool
               ) -> tuple[tuple[str, ...], Kept | Unabortable | None]:
    """The ids to abort at ``engine``, or none and why: the engine keeps the request after its
    client leaves (``Kept``), or may still run it under ids the sidecar cannot know
    (``Unabortable``; ``None`` if nothing needs saying). ``body``: the kept copy. An engine that
    never aborts (kind ``openai``) is close-only by its configuration: no reason."""
    if (kept := engine.kept_after_disconnect(method, path, body)) is not None:
        return (), kept
    if unrewritten and engine.rewrites_body(method, path):
        return (), Unabortable.BODY_OVER_REPLAY_BUFFER
    ids = engine.engine_request_ids(method, path, sidecar_id, body)
    if body is None and over_limit and engine.wants_body(method, path):
        # The ids are counted from the body (prompts, conversations, items), which was too
        # large to keep: those derivable without it are aborted, the others may run on.
        return ids, Unabortable.BODY_OVER_REPLAY_BUFFER
    if ids or not engine.aborts:
        return ids, None
    return (), engine.unabortable(method, path, body)


def abort_step(engine: EngineAdapter, method: str, path: str, ids: tuple[str, ...],
         body: bytes | None) -> AbortStep | None:
    """``engine``'s :class:`AbortStep` for ``ids`` (derived from ``body``, the kept copy);
    ``None`` if there are none."""
    if not ids:
        return None
    return AbortStep(engine, ids, engine.registered_once_streaming(method, path),
                     engine.registers_later(method, path, ids, body))


def abort_steps(engines: Iterable[EngineAdapter], method: str, path: str, sidecar_id: str,
               body: bytes | None, *, unrewritten: bool, over_limit: bool
               ) -> tuple[list[AbortStep], tuple[Withheld, ...]]:
    """Every :class:`AbortStep` of a request that ended early, at ``engines`` (the route's abort
    engines and the one its ``abort_from_header`` names, if allowed:
    :meth:`RouteTarget.abort_engines`), in their order, and every engine :class:`Withheld` from
    all or part of it, in the same order. ``body``: the kept copy."""
    steps: list[AbortStep] = []
    withheld: tuple[Withheld, ...] = ()
    for engine in engines:
        ids, reason = engine_ids(engine, method, path, sidecar_id, body,
                                 unrewritten=unrewritten, over_limit=over_limit)
        if reason is not None:  # a Kept engine names no ids
            withheld += (Withheld(engine, reason, len(ids)),)
        if found := abort_step(engine, method, path, ids, body):
            steps.append(found)
    return steps, withheld


def prepared_steps(target: RouteTarget, method: str, path: str, sidecar_id: str,
                  body: bytes | None, *, unrewritten: bool, over_limit: bool
                  ) -> list[AbortStep] | None:
    """:func:`abort_steps` ahead of the end, for a request whose plan withholds nothing: the
    route's abort engines (``target.aborts``), each with its ids. ``None`` if the plan must be
    derived at the end instead (an ``abort_from_header`` route: its header is resolved then;
    something kept or unabortable: counted and logged then)."""
    if target.from_header is not None:
        return None
    plan = []
    for engine in target.aborts:
        ids, reason = engine_ids(engine, method, path, sidecar_id, body,
                                 unrewritten=unrewritten, over_limit=over_limit)
        if reason is not None:
            return None
        if found := abort_step(engine, method, path, ids, body):
            plan.append(found)
    return plan
