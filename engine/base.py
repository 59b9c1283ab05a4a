"""The small interface every engine kind implements.

An adapter answers three questions for the proxy, all pure functions of the request:

1. how to tag an upstream request so the engine uses an id the sidecar chose
   (:meth:`EngineAdapter.tag`, e.g. the ``X-Request-Id`` header for vLLM);
2. which engine request ids a request produced (:meth:`EngineAdapter.engine_request_ids`,
   from the path, the sidecar request id and, where the count depends on it, the body);
3. which HTTP call aborts a batch of ids (:meth:`EngineAdapter.abort_call`, at most
   :attr:`EngineAdapter.max_ids_per_call` of them; the sidecar batches the ids of many requests
   into one call). A kind without an abort endpoint (:attr:`EngineAdapter.aborts` false: the
   ``openai`` kind) names no engine ids, so nothing is ever aborted and a disconnect only closes
   the upstream connection; ``/readyz`` then probes no abort endpoint.

A request on a generating route that names no ids although its kind aborts is asked one more
question, only when it ends early (cold path): :meth:`EngineAdapter.unabortable`, the
:class:`Unabortable` reason the engine runs it under ids the sidecar cannot know. The proxy
counts it in ``cancel_sidecar_unabortable_requests_total{engine, reason}``.

Before either, an early end asks :meth:`EngineAdapter.kept_after_disconnect`: the
:class:`Kept` reason the engine keeps the request running on purpose after its client leaves
(a background response, :mod:`engine.responses`). Such a request is never aborted, only its
upstream connection closed; the proxy counts it in
``cancel_sidecar_kept_requests_total{engine, reason}``.

An adapter whose kind ends an aborted request's response with an abort mark says so
(:attr:`EngineAdapter.confirms`): the proxy then learns from the engine whether the work stopped
(:mod:`sidecar.confirm`) instead of trusting the abort call's 200.

The proxy owns all network I/O; adapters never touch a socket, so each can be tested exhaustively
(and property-tested) on its own.
"""

from __future__ import annotations

import abc
import copy
import enum
import json
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import TypeAdapter, ValidationError

from sidecar.config import EngineKind, EngineSettings

_LAX_INT: TypeAdapter[int] = TypeAdapter(int)
_LAX_BOOL: TypeAdapter[bool] = TypeAdapter(bool)


def lax_int(value: Any, default: int) -> int:
    """``value`` read as an ``int`` field the way vLLM's and SGLang's pydantic request models
    read it (pydantic v2 lax mode: ``"2"``, ``2.0`` and ``" 2 "`` are 2), else ``default``.
    A body the engine would coerce must be judged by the coerced value: ``"n": "2"`` runs two
    samples there."""
    if type(value) is int:
        return value
    try:
        return _LAX_INT.validate_python(value)
    except ValidationError:
        return default


def lax_bool(value: Any) -> bool:
    """``value`` read as a ``bool`` field as pydantic v2 lax mode does (``true``, ``1``,
    ``"true"``, ``"1"``, ``"yes"``, ``"on"``, ``"t"``, ``"y"``, any case, are true); ``False``
    for anything else."""
    if value is True or value is False:
        return value
    try:
        return _LAX_BOOL.validate_python(value)
    except ValidationError:
        return False


def parse_json(body: bytes | None) -> Any:
    """``body`` parsed as JSON, or ``None`` if absent or malformed (too deep included): an
    adapter's best-effort view of a body the engine will judge itself. Never raises."""
    if body is None:
        return None
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


def with_field(body: bytes, name: str, value: Any) -> bytes | None:
    """``body`` (a JSON object) with ``name`` set to ``value``, re-serialised compactly as UTF-8
    (text stays text: escaping every non-ASCII character as ``\\uXXXX`` would double a CJK
    prompt and make every later look at the body parse it); ``None`` if ``body`` is not a JSON
    object (sent unchanged; the engine rejects it itself). A string holding a lone surrogate
    (only a ``\\ud800``-style escape can carry one) keeps the ASCII escapes: it has no UTF-8."""
    parsed = parse_json(body)
    if not isinstance(parsed, dict):
        return None
    parsed[name] = value
    try:
        return json.dumps(parsed, separators=(",", ":"), ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return json.dumps(parsed, separators=(",", ":")).encode()


class Unabortable(enum.StrEnum):
    """Why a request that ended early got no abort call although its engine aborts by id: the
    engine runs it under ids the sidecar cannot know, so only its upstream connection was
    closed. The value is the ``reason`` label of ``cancel_sidecar_unabortable_requests_total``;
    the set is fixed (low cardinality), each value in the metrics table of docs/operations.md."""

    # SGLang gives each of n > 1 samples (and the prefix warm-up run) a fresh uuid4 rid.
    SGLANG_N_SAMPLES = "sglang_n_samples"
    # vLLM beam search submits ``{base}-{random}-beam-{k}`` per step (use_beam_search: true).
    VLLM_BEAM_SEARCH = "vllm_beam_search"
    # A body-rewriting route (SGLang ``rid`` and ``/v1/responses``, vLLM ``/v1/responses``) got
    # a body over ``upstream.replay_buffer_bytes``: relayed unrewritten, so the engine picked
    # the id. Also a route whose ids are counted from the body (vLLM's completions prompts,
    # chat batch conversations, scoring items, /invocations): only the ids derivable without the
    # body are aborted (the proxy's _derive_ids), the others may run on.
    BODY_OVER_REPLAY_BUFFER = "body_over_replay_buffer"

    @property
    def why(self) -> str:
        """One clause for a log line."""
        return _WHY[self]


_WHY = {
    Unabortable.SGLANG_N_SAMPLES: "SGLang runs n > 1 samples under fresh random rids",
    Unabortable.VLLM_BEAM_SEARCH: "vLLM beam search runs under random ids",
    Unabortable.BODY_OVER_REPLAY_BUFFER: "its body was over upstream.replay_buffer_bytes, "
                                         "not rewritten, so the engine picked its own id",
}


class Kept(enum.StrEnum):
    """Why a request that ended early got no abort call on purpose: its engine keeps the work
    after the client leaves, by design, so aborting it would destroy what the client will come
    back for. The value is the ``reason`` label of ``cancel_sidecar_kept_requests_total`` and the
    access line's ``kept_by_engine``; the set is fixed (low cardinality)."""

    # POST /v1/responses with "background": true: generated to its end and stored.
    BACKGROUND_RESPONSE = "background_response"
    # GET /v1/responses/{id} (JSON, or stream=true resuming with starting_after): a reader of a
    # stored response, which goes on whether or not this reader stays.
    RESPONSE_RETRIEVAL = "response_retrieval"

    @property
    def why(self) -> str:
        """One clause for a log line."""
        return _KEPT_WHY[self]


_KEPT_WHY = {
    Kept.BACKGROUND_RESPONSE: "a background response runs to its end and is stored for the "
                              "client to fetch",
    Kept.RESPONSE_RETRIEVAL: "it reads a stored response, which goes on without this reader",
}


@dataclass(frozen=True, slots=True)
class AbortCall:
    """One HTTP call to an engine's abort endpoint: ``POST <engine url><path>`` with ``json``."""

    path: str
    json: Any


class EngineAdapter(abc.ABC):
    """How one engine kind is tagged and aborted. One instance per configured engine."""

    kind: ClassVar[EngineKind]
    # False for a kind with no abort endpoint: engine_request_ids is always empty and
    # abort_call raises; /readyz only checks the health path.
    aborts: ClassVar[bool] = True
    default_abort_path: ClassVar[str | None]
    # What /readyz GETs (2xx: the engine is up) unless engines.NAME.health_path says otherwise.
    default_health_path: ClassVar[str] = "/health"
    # How many ids one abort call may name: 1 for an engine that aborts one id per call.
    max_ids_per_call: ClassVar[int]
    # True if an aborted request's own response ends at once with an abort mark (vLLM's and
    # SGLang's finish_reason "abort"): the proxy then reads that confirmation on the upstream
    # connection (sidecar.confirm) and re-sends the abort until it comes.
    confirms: ClassVar[bool] = False
    # A cheap GET the engine answers in the API-server process that accepted the connection,
    # touching no generation: keeps a confirmed kind's idle abort connections open past the
    # engine's idle timeout (sidecar.abort_wire). None: they are replaced instead.
    keepalive_path: ClassVar[str | None] = None

    def __init__(self, name: str, settings: EngineSettings) -> None:
        self.name = name
        self.settings = settings
        self.base_url = str(settings.url).rstrip("/")
        self.abort_path = settings.abort.path or self.default_abort_path
        self.health_path = settings.health_path or self.default_health_path
        configured = {self.abort_path.rstrip("/")} if self.abort_path else set()
        self._forbidden_paths = self.extra_forbidden_paths | configured

    def at(self, origin: str) -> EngineAdapter:
        """This adapter for another engine of the same kind and settings at ``origin``
        (``scheme://host:port``): only :attr:`base_url` differs, the name too stays (metrics
        label engines by name: low cardinality). For per-request abort targets
        (:mod:`sidecar.targets`); a copy, so no ``__init__`` side effect (a log line) repeats."""
        clone = copy.copy(self)
        clone.base_url = origin.rstrip("/")
        return clone

    # Engine paths that abort work by id, besides ``abort_path``: never proxied for clients.
    extra_forbidden_paths: ClassVar[frozenset[str]] = frozenset()

    def forbidden_paths(self) -> frozenset[str]:
        """Paths (percent-decoded, no trailing slash) the proxy refuses with 403: the engine's
        abort endpoints, so that only the sidecar can abort and no client can abort another's
        request."""
        return self._forbidden_paths

    def abort_headers(self) -> dict[str, str]:
        """Headers for an abort call: the bearer key, if configured. Never logged."""
        key = self.settings.abort.api_key
        return {"Authorization": f"Bearer {key.get_secret_value()}"} if key is not None else {}

    @abc.abstractmethod
    def tag(self, path: str, sidecar_id: str, headers: MutableMapping[str, str]) -> None:
        """Make the engine use ids derived from ``sidecar_id``: edit the upstream ``headers``."""

    def rewrites_body(self, method: str, path: str) -> bool:
        """True if the engine takes its request id from the body on this route, so the body must
        be read whole and passed through :meth:`rewrite_body` before it goes upstream."""
        return False

    def rewrite_body(self, method: str, path: str, sidecar_id: str, body: bytes) -> bytes | None:
        """The body to send upstream instead of ``body``, or ``None`` to send it unchanged (e.g.
        not a JSON object: the engine will reject it itself). Never raises on bad input."""
        return None

    @abc.abstractmethod
    def wants_body(self, method: str, path: str) -> bool:
        """True if :meth:`engine_request_ids` or :meth:`kept_after_disconnect` needs a copy of
        the request body for this route (kept until the request ends)."""

    @abc.abstractmethod
    def engine_request_ids(
        self, method: str, path: str, sidecar_id: str, body: bytes | None
    ) -> tuple[str, ...]:
        """Every engine request id this request produced, in order; empty if the route
        generates nothing (then nothing is aborted). ``body`` is the request body copy when
        :meth:`wants_body` said so (``None`` if it was too large to keep). Never raises on a
        malformed body: the engine rejects such a body itself, so a best-effort answer is fine.
        """

    def unabortable(self, method: str, path: str, body: bytes | None) -> Unabortable | None:
        """For a request that ended early and got no ids from :meth:`engine_request_ids`: the
        reason its engine may still run it under ids the sidecar cannot know, or ``None`` (the
        route generates nothing, or the kind never aborts: ``openai`` is close-only by its
        configuration, already visible as its kind). ``body`` as for :meth:`engine_request_ids`.
        Cold path: called only on an early end. Never raises on a malformed body."""
        return None

    def registered_once_streaming(self, method: str, path: str) -> bool:
        """True if, on this route, the engine sends a response body byte only once it has
        registered the request's (single) engine id: an abort after that byte needs no re-send
        (:mod:`sidecar.abort`'s registration window). Default ``False``: re-send, as for a
        route whose first events go out before the engine knows the id (vLLM's
        ``/v1/responses`` sends ``response.created`` first)."""
        return False

    def registers_later(self, method: str, path: str, ids: tuple[str, ...],
                        body: bytes | None) -> bool:
        """True if some of the request's engine ids (``ids``, as :meth:`engine_request_ids`
        derived them from ``body``, the request body copy) may be registered long after the
        engine had the whole body: ``/v1/responses`` with built-in tools runs a generation turn
        per tool call, the next one registered after the tool ran (vLLM: one id per turn;
        SGLang: the same id again). Its re-sends then run for the registration window from the
        disconnect, not from the body's arrival (:mod:`sidecar.abort`). Default ``False``."""
        return False

    def kept_after_disconnect(self, method: str, path: str, body: bytes | None) -> Kept | None:
        """For a request that ended early: the reason its engine keeps running it on purpose
        after the client leaves (then it is never aborted, only its upstream closed), or
        ``None`` (abort it as usual). Judged from ``method``, ``path`` and ``body`` (the copy, as
        for :meth:`engine_request_ids`; ``None`` if not kept: then ``None``, unless the path
        alone decides). Cold path: called only on an early end. Never raises on a malformed
        body."""
        return None

    @abc.abstractmethod
    def abort_call(self, ids: tuple[str, ...]) -> AbortCall:
        """The one call that aborts ``ids`` (1 to :attr:`max_ids_per_call` of them, possibly of
        several requests). Raises ``ValueError`` on an empty tuple or too many ids, or if the kind
        has no abort endpoint (:attr:`aborts` false)."""

    def abort_calls(self, ids: tuple[str, ...]) -> list[AbortCall]:
        """The calls that abort ``ids`` (non-empty): chunks of at most :attr:`max_ids_per_call`,
        in order, each id named once. Raises ``ValueError`` on an empty tuple."""
        if not ids:
            raise ValueError("refusing an empty id list: an engine may read it as 'abort all'")
        step = self.max_ids_per_call
        return [self.abort_call(ids[i:i + step]) for i in range(0, len(ids), step)]
