"""SGLang adapter: write ``rid`` into the body, abort through ``POST /abort_request {"rid": id}``.

Facts (SGLang 0.5.23, the PyPI wheel's source; ``tests/sglang_facts.md`` has each with its file
and function, and where issue 4's claims hold):

- SGLang ignores ``X-Request-Id``: the id is the body field ``rid`` of ``GenerateReqInput``
  (``/generate``), ``CompletionRequest`` and ``ChatCompletionRequest`` (``srt/entrypoints/openai/
  protocol.py``), passed on as ``rid=request.rid``; absent, SGLang picks ``uuid4().hex``. So on
  those three routes the sidecar sets ``rid`` to its own id (a client's value is overwritten).
  With ``SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES`` the header ``X-Override-Rid`` wins over the
  body (``srt/entrypoints/request_headers.py``): the sidecar overwrites that header too. It also
  sets ``X-Request-Id`` to its id, as for every kind: SGLang ignores it, but routers and access
  logs in between see the id the client got back.
- Ids per request, with ``{id}`` the sidecar id (``srt/managers/io_struct.py``,
  ``GenerateReqInput._determine_batch_size`` / ``_normalize_rid``): a single prompt runs as
  ``{id}``; a batch of B prompts (``text`` a list, ``input_ids`` a list of lists, an OpenAI
  ``prompt`` list of strings or of token lists) runs as ``{id}_0`` .. ``{id}_{B-1}``.
- ``n > 1`` (``sampling_params.n``, OpenAI ``n``): every sample, and the prefix warm-up run
  before them, gets a fresh ``uuid4().hex`` (``srt/managers/tokenizer_manager.py``,
  ``_handle_batch_request`` -> ``regenerate_rid``), and the ``{id}_{i}`` states are dropped
  before the samples start. No id the sidecar knows reaches them: such a request is not
  aborted by id (:meth:`SGLangAdapter.unabortable`: ``sglang_n_samples``); when it ends early
  the sidecar closes its upstream (SGLang's own disconnect check may then abort it), logs a
  warning with the request id and counts it in ``cancel_sidecar_unabortable_requests_total``.
- ``POST /abort_request`` takes ``{"rid": str, "abort_all": bool}`` (``AbortReq``) and answers
  200 whatever the id. ``TokenizerManager.abort_request`` drops an empty rid, and with one
  tokenizer worker drops a rid that is not exactly a live request's; otherwise the scheduler
  (``Scheduler.abort_request``) aborts every request whose rid ``startswith`` it. So an abort
  names each exact id; ``{id}_1`` also matching ``{id}_10`` stays within the same request.
  Sidecar ids are 32 hex characters each (``sidecar.ticket.new_request_id``), and a string is
  a prefix of another of the same length only if they are equal, so no request's ids reach
  another's.
- ``POST /v1/responses`` takes its id from the body field ``request_id`` (``ResponsesRequest``,
  default ``resp_{uuid4().hex}``; ``serving_responses.py`` passes ``rid=request.request_id``),
  so the sidecar sets ``request_id`` to ``resp_{id}`` and the abort names ``resp_{id}``. With
  built-in tools (``tools[].type`` ``web_search``, ``web_search_preview`` or
  ``code_interpreter``: :data:`BUILTIN_TOOL_TYPES`), ``_generate_with_builtin_tools`` runs a
  generation turn per tool call, every one under that same rid, the next registered only after
  the tool answered (``while True``, no bound; only for a harmony model with a tool server,
  otherwise the re-sends below are merely spare): such a request is re-sent for the
  registration window from the disconnect (:meth:`SGLangAdapter.registers_later`). The client's
  own ``request_id`` is replaced, and SGLang makes it the response's id: the client learns
  ``resp_{id}`` from the response. A background one that does not stream (``"background":
  true``) is kept by SGLang on purpose after the client leaves (one that streams is an ordinary
  stream there, aborted), and a ``GET /v1/responses/{id}`` reads a stored one:
  :meth:`SGLangAdapter.kept_after_disconnect` says so, for the count and the access line (facts
  in :mod:`engine.responses`).
- One rid per call (``rid`` is ``Optional[str]``): ``max_ids_per_call = 1``. Never
  ``abort_all``; clients may not reach the endpoints that abort others' work.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

from engine.base import (
    AbortCall,
    EngineAdapter,
    Kept,
    Unabortable,
    lax_int,
    parse_json,
    with_field,
)
from engine.responses import RESPONSES_PATH, kept, may_name_tools, tool_type
from sidecar.config import EngineKind, EngineSettings

log = logging.getLogger(__name__)

OVERRIDE_RID_HEADER = "X-Override-Rid"
REQUEST_ID_HEADER = "X-Request-Id"
# POST routes where SGLang reads ``rid`` from the body.
GENERATE = "/generate"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
BODY_RID_ROUTES = frozenset({GENERATE, COMPLETIONS, CHAT})
# Responses tool types that make SGLang run more generation turns under the same rid
# (``serving_responses.py``: ``_construct_input_messages_with_harmony`` offers the model the
# browser for ``web_search``/``web_search_preview`` and python for ``code_interpreter``;
# ``_generate_with_builtin_tools`` loops while the last message is addressed to one of them,
# ``entrypoints/context.py`` ``HarmonyContext.need_builtin_tool_call``).
BUILTIN_TOOL_TYPES = frozenset({"web_search", "web_search_preview", "code_interpreter"})


def builtin_tools(body: bytes | None) -> bool:
    """True if the raw ``/v1/responses`` ``body`` asks for a tool of
    :data:`BUILTIN_TOOL_TYPES` (parsed only if a substring test says it may)."""
    if not may_name_tools(body, BUILTIN_TOOL_TYPES):
        return False
    parsed = parse_json(body)
    tools = parsed.get("tools") if isinstance(parsed, dict) else None
    return isinstance(tools, list) and any(
        isinstance(tool, dict) and tool_type(tool.get("type")) in BUILTIN_TOOL_TYPES
        for tool in tools)



def _list_size(value: Any, single_item: type | tuple[type, ...]) -> int | None:
    """``len(value)`` if ``value`` is a batch (a non-empty list whose first item is not a
    ``single_item``), else ``None`` (one input)."""
    if isinstance(value, list) and value and not isinstance(value[0], single_item):
        return len(value)
    return None


def batch_size(path: str, body: Any) -> int | None:
    """Number of prompts SGLang runs for a batch request, or ``None`` for a single one.

    ``/generate``: ``text`` (str | list[str]), else ``input_ids`` (list[int] |
    list[list[int]]), else ``input_embeds`` (one list of float rows | a list of those).
    ``/v1/completions``: ``prompt`` a list of strings is ``text``, any other list is
    ``input_ids`` (``serving_completions.py``). Chat is always single. Malformed: single.
    """
    if not isinstance(body, dict):
        return None
    if path == GENERATE:
        if body.get("text") is not None:
            text = body["text"]
            return len(text) if isinstance(text, list) else None
        if body.get("input_ids") is not None:
            return _list_size(body["input_ids"], int)
        embeds = body.get("input_embeds")
        if isinstance(embeds, list) and embeds and isinstance(embeds[0], list) and embeds[0]:
            return None if isinstance(embeds[0][0], float | int) else len(embeds)
        return None
    if path == COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            return len(prompt)
        return _list_size(prompt, int)
    return None


def samples(path: str, body: Any) -> int:
    """``n``, the samples per prompt (``sampling_params.n`` for ``/generate``, the first entry
    of a list; OpenAI ``n`` otherwise); 1 when absent or malformed."""
    if not isinstance(body, dict):
        return 1
    if path == GENERATE:
        params = body.get("sampling_params")
        if isinstance(params, list):
            params = params[0] if params else None
        n = params.get("n", 1) if isinstance(params, dict) else 1
    else:
        n = body.get("n", 1)
    n = lax_int(n, 1)  # as SGLang's pydantic request models read it: "2" and 2.0 are 2
    return n if n > 1 else 1


class SGLangAdapter(EngineAdapter):
    """Adapter for SGLang's HTTP server (``sglang.srt.entrypoints.http_server``)."""

    kind = EngineKind.SGLANG
    default_abort_path = "/abort_request"
    max_ids_per_call = 1
    # An aborted request ends at once with finish_reason {"type": "abort", ...} (native) or
    # "abort" (OpenAI routes) (sidecar.confirm).
    confirms = True
    # The model's info from the tokenizer manager, no generation (entrypoints/http_server.py;
    # SGLang's native API docs).
    keepalive_path = "/get_model_info"
    # Endpoints that abort work clients do not own: ``/abort_request`` (any rid, or
    # ``abort_all``), ``/pause_generation`` (``mode: abort`` aborts every request) and
    # ``/update_weight_version`` (``abort_all_requests``).
    extra_forbidden_paths = frozenset({"/abort_request", "/pause_generation",
                                       "/update_weight_version"})

    def __init__(self, name: str, settings: EngineSettings) -> None:
        super().__init__(name, settings)
        log.warning("engine %s (sglang): requests with n > 1 cannot be aborted by id (SGLang "
                    "gives each sample a fresh random rid); on a disconnect only their upstream "
                    "is closed, counted in cancel_sidecar_unabortable_requests_total"
                    "{reason=\"sglang_n_samples\"}. Routes other than %s are not tagged and "
                    "are not aborted by id", name,
                    ", ".join(sorted(BODY_RID_ROUTES | {RESPONSES_PATH})))

    def tag(self, path: str, sidecar_id: str, headers: MutableMapping[str, str]) -> None:
        # Only read when SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES is set; then it beats the body.
        headers[OVERRIDE_RID_HEADER] = sidecar_id
        headers[REQUEST_ID_HEADER] = sidecar_id  # read by nothing in SGLang; for correlation

    def rewrites_body(self, method: str, path: str) -> bool:
        return method == "POST" and (path in BODY_RID_ROUTES or path == RESPONSES_PATH)

    def rewrite_body(self, method: str, path: str, sidecar_id: str, body: bytes) -> bytes | None:
        """Set ``rid`` to ``sidecar_id`` (``/v1/responses``: ``request_id`` to
        ``resp_{sidecar_id}``), replacing any value (string or list) the client sent: a client
        never chooses the id an abort names. ``None`` for a body that is not a JSON object
        (SGLang rejects it itself)."""
        if path == RESPONSES_PATH:
            return with_field(body, "request_id", f"resp_{sidecar_id}")
        return with_field(body, "rid", sidecar_id)

    def wants_body(self, method: str, path: str) -> bool:
        """The ``rid`` routes, and ``/v1/responses`` (is it background? built-in tools?)."""
        return self.rewrites_body(method, path)

    def registers_later(self, method: str, path: str, ids: tuple[str, ...],
                        body: bytes | None) -> bool:
        """``/v1/responses`` with built-in tools (:func:`builtin_tools`): every generation turn
        after a tool call registers the same rid again, seconds after the body."""
        return method == "POST" and path == RESPONSES_PATH and builtin_tools(body)

    def kept_after_disconnect(self, method: str, path: str, body: bytes | None) -> Kept | None:
        """``background_response`` for a background ``POST /v1/responses`` that SGLang runs in the
        background (not one that streams: SGLang streams it on its connection; not one it refuses
        for ``store``), ``response_retrieval`` for ``GET /v1/responses/{id}``
        (:mod:`engine.responses`)."""
        return kept(method, path, body, store_read_raw=False, stream_detaches=False)

    def engine_request_ids(
        self, method: str, path: str, sidecar_id: str, body: bytes | None
    ) -> tuple[str, ...]:
        if not self.rewrites_body(method, path):
            return ()
        if path == RESPONSES_PATH:  # one prompt, one rid: never a batch, no n
            return (f"resp_{sidecar_id}",)
        parsed = parse_json(body)
        if samples(path, parsed) > 1:
            return ()  # fresh random rids: see unabortable
        size = batch_size(path, parsed)
        if size is None:
            return (sidecar_id,)
        return tuple(f"{sidecar_id}_{i}" for i in range(size))

    def unabortable(self, method: str, path: str, body: bytes | None) -> Unabortable | None:
        """``sglang_n_samples`` for ``n > 1`` on a route that takes ``rid`` from the body."""
        if (method == "POST" and path in BODY_RID_ROUTES
                and samples(path, parse_json(body)) > 1):
            return Unabortable.SGLANG_N_SAMPLES
        return None

    def abort_call(self, ids: tuple[str, ...]) -> AbortCall:
        """``POST <abort path>`` with ``{"rid": id}``: exactly one non-empty id (an empty rid
        would prefix-match every request in a multi-worker SGLang)."""
        if len(ids) != 1 or not ids[0]:
            raise ValueError(f"an SGLang abort call names exactly one non-empty rid, got {ids!r}")
        assert self.abort_path is not None
        return AbortCall(self.abort_path, {"rid": ids[0]})
