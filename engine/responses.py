"""The OpenAI Responses API's background mode: work an engine keeps after its client leaves.

``POST /v1/responses`` with ``"background": true`` asks the engine to generate the response to
its end whatever happens to the connection, store it, and serve it later: ``GET
/v1/responses/{id}`` (the stored response as JSON, or with ``stream=true`` its events again,
from ``starting_after`` + 1), and ``POST /v1/responses/{id}/cancel`` to stop it. Aborting such a
request by id destroys what the client will come back for: vLLM 0.32 then stores it as
``"status": "completed"`` with the tokens made so far and no ``incomplete_details`` (its
``responses_full_generator`` maps an ``abort`` finish to the catch-all ``completed``). So the
sidecar never aborts it, and never aborts a reader of a stored response either.

Facts, vLLM 0.32 (``vllm/entrypoints/openai/responses/``):

- ``protocol.py``, ``ResponsesRequest``: ``background: bool | None = False``, read by pydantic
  in lax mode (``"true"``, ``1``, ``"yes"`` are true: :func:`engine.base.lax_bool`);
  ``store: bool | None = True``. Its ``validate_background`` (a ``mode="before"`` validator on
  the raw JSON) refuses ``background`` with a falsy raw ``store`` (``false``, ``0``, ``null``,
  ``""``) with 400: such a request never runs, so it is not "kept".
- ``serving.py``, ``_create_responses``: a background request is stored as ``queued`` and run
  in an ``asyncio.create_task`` (``_run_background_request``, or with ``stream: true``
  ``_run_background_request_stream``, which appends every event to ``event_store``); the
  connection only reads: a JSON request gets the ``queued`` response at once, a streaming one
  ``responses_background_stream_generator`` over the stored events. Nothing in that task
  watches the connection. Without ``VLLM_ENABLE_RESPONSES_API_STORE=1`` a background request
  with ``store`` true is refused (400, ``_validate_create_responses_input``), one with
  ``store`` "false" as a string (truthy raw, false parsed) runs in the background all the same.
- ``api_router.py``: ``GET /v1/responses/{response_id}`` (``stream``, ``starting_after``) and
  ``POST /v1/responses/{response_id}/cancel`` (``cancel_responses``: marks it ``cancelled`` and
  cancels the task, which aborts the engine request). No other vLLM route runs work in the
  background (``grep -r create_task vllm/entrypoints``).

SGLang 0.5.23 (``sglang/srt/entrypoints/openai/serving_responses.py``, ``_create_responses``,
adapted from vLLM's): ``ResponsesRequest.background: Optional[bool] = False``; a background
request is refused (400) without ``--enable-response-store`` or with ``store`` false as pydantic
reads it (``"false"`` included: ``not request.store``). Only a background request that does not
stream is stored and run in a task, answered with its ``queued`` JSON at once, and its
``GenerateReqInput(background=True)`` skips the tokenizer manager's own disconnect abort
(``managers/tokenizer_manager.py``, ``_wait_one_response``: ``not obj.background and await
request.is_disconnected()``). One that streams is an ordinary stream on its connection
(``background=request.background and not request.stream``: "background+stream streams on this
connection, so don't detach"), so it is aborted like any other. The same ``GET`` and
``/cancel`` routes.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.base import Kept, lax_bool, parse_json

RESPONSES_PATH = "/v1/responses"
_STORED = RESPONSES_PATH + "/"


def retrieves_response(method: str, path: str) -> bool:
    """True for ``GET /v1/responses/{id}`` (one path segment after the prefix; any query)."""
    if method != "GET" or not path.startswith(_STORED):
        return False
    response_id = path[len(_STORED):]
    return bool(response_id) and "/" not in response_id


def kept(method: str, path: str, body: bytes | None, *, store_read_raw: bool,
         stream_detaches: bool) -> Kept | None:
    """The :class:`Kept` reason for a request the engine keeps after its client leaves:
    ``background_response`` for ``POST /v1/responses`` whose ``body`` (the request body copy;
    ``None``: not known, not kept) asks for ``background`` and that the engine runs in the
    background: not one it refuses for its ``store`` (falsy as raw JSON with ``store_read_raw``,
    vLLM's ``validate_background``; else false as a pydantic bool, SGLang's), and, unless
    ``stream_detaches``, not one that streams (SGLang streams it on its connection);
    ``response_retrieval`` for ``GET /v1/responses/{id}``; else ``None``. A substring test first:
    most bodies are never parsed (one with a ``\\u`` escape anywhere is: a key may be spelt with
    escapes)."""
    if retrieves_response(method, path):
        return Kept.RESPONSE_RETRIEVAL
    if (method != "POST" or path != RESPONSES_PATH or body is None
            or (b"background" not in body and b"\\u" not in body)):
        return None
    parsed = parse_json(body)
    if not isinstance(parsed, dict) or not lax_bool(parsed.get("background")):
        return None
    store = parsed.get("store", True)
    if not (store if store_read_raw else lax_bool(store)):
        return None  # refused with 400: it never runs
    if not stream_detaches and lax_bool(parsed.get("stream")):
        return None
    return Kept.BACKGROUND_RESPONSE


def may_name_tools(body: bytes | None, types: Iterable[str]) -> bool:
    """A substring test before any parse: False if the raw ``/v1/responses`` ``body`` cannot ask
    for a tool of one of ``types`` (most bodies: then never parsed for it, on the path of every
    response's first byte). A body with a ``\\u`` escape anywhere may: a key or a type may be
    spelt with escapes."""
    return body is not None and (b"\\u" in body or (b'"tools"' in body and any(
        kind.encode() in body for kind in types)))


def tool_type(value: object) -> str | None:
    """A ``tools[]`` entry's ``type`` (or label) if it is a string, else ``None``: a malformed
    body (``"type": ["web_search"]``) must not make a set lookup raise."""
    return value if isinstance(value, str) else None
