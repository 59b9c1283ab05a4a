"""vLLM adapter: tag with ``X-Request-Id``, abort through ``POST /inference/v1/abort_requests``.

Facts (vLLM 0.32, read in the installed source and proven on a real engine by ``tests/e2e``):

- The external request id comes from the ``X-Request-Id`` header, which wins over the body field
  ``request_id`` (``vllm/entrypoints/serve/engine/serving.py``, ``_base_request_id``). The
  sidecar always overwrites that header with its own id, so a client can never choose the id
  an abort names.
- Engine request ids per route, with ``{id}`` the sidecar request id (``tests/e2e/
  VLLM_FACTS_CHECKED.md`` has the source function of each and how it was proven on a real engine):

  ================================  ==============================  ===============================
  route (POST)                      engine request ids              source (``vllm/entrypoints/``)
  ================================  ==============================  ===============================
  ``/v1/chat/completions``          ``chatcmpl-{id}``               ``openai/chat_completion/
                                                                    serving.py``
  ``/v1/chat/completions/batch``    ``chatcmpl-{id}_{i}``, i < C    ``openai/chat_completion/
                                                                    batch_serving.py``
  ``/v1/completions``               ``cmpl-{id}-{i}``, i < P        ``openai/completion/serving.py``
  ``/v1/messages``                  ``chatcmpl-{id}``               ``anthropic/serving.py``
  ``/v1/responses``                 ``resp_{id}_{k}`` (body         ``openai/responses/serving.py``
                                    rewrite), k < 1, or < 16 with
                                    built-in tools
  ``/inference/v1/generate``        ``generate-tokens-{id}``        ``scale_out/token_in_token_out/
                                                                    serving.py``
  ``/invocations``                  as chat if the body has         ``serve/sagemaker/
                                    ``messages``, else completions  api_router.py``
  ``/cohere/v2/chat``               ``chatcmpl-{id}``               ``cohere/serving.py``
  ``/generative_scoring``           ``generative-scoring-{id}-{i}``,  ``generate/generative_scoring/
                                    i < the body's ``items``        serving.py``
  ``/v1/audio/transcriptions``      ``transcribe-{id}``, ``-{id}-   ``speech_to_text/base/
                                    lang_detect``, ``-{id}-{i}``,   serving.py``
                                    i < 64 (:data:`AUDIO_CHUNKS`)
  ``/v1/audio/translations``        the same with ``translate-``    ``speech_to_text/base/
                                                                    serving.py``
  ================================  ==============================  ===============================

  C is the number of conversations in ``messages``. P is the number of prompts: one for a string
  or a list of token ids, ``len(prompt)`` for a list of strings or of token-id lists, plus one per
  ``prompt_embeds`` entry. ``n > 1`` children share their parent's id, so one id aborts them all.
  ``/v1/responses`` ignores the header and takes the body field ``request_id`` (suffixed with the
  turn number), so the sidecar overwrites that field with ``resp_{id}``. A request with built-in
  tools (``tools[].type`` ``web_search_preview``, ``code_interpreter``, ``container``, or an
  ``mcp`` tool whose ``server_label`` is one of them)
  runs one generation turn per tool call, ``{request_id}_{k}`` each, the next one registered
  after the tool answered (``_generate_with_builtin_tools``: ``while True``, no bound): the
  sidecar names ``_0`` .. ``_15`` (:data:`BUILTIN_TOOL_TURNS`) and re-sends them for the
  engine's registration window from the disconnect (:meth:`VLLMAdapter.registers_later`). An
  aborted turn ends the loop (its output holds no complete tool call: ``need_builtin_tool_call``
  is false); a client that leaves while a tool runs longer than ``resend_window_s`` leaves the
  next turn to run unaborted. Not abortable by id: beam search (vLLM adds random
  suffixes), ``/v1/realtime``; the upstream close is all the sidecar can do for them.
- Beam search (``"use_beam_search": true`` on ``/v1/completions`` and ``/v1/chat/completions``,
  also through ``/invocations``) submits ``{base}-{random}-beam-{k}`` per step
  (``generate/beam_search/online.py``, ``beam_search``; ``tests/e2e/VLLM_FACTS_CHECKED.md``):
  such a request names no ids, so no abort call is made for it (it would be a no-op), and
  :meth:`VLLMAdapter.unabortable` says ``vllm_beam_search``. It is detected from the body copy:
  on ``/v1/chat/completions`` the copy is dropped once the response head arrives (the route
  needs no body for its id), so a streamed chat beam search that ends after its head is
  aborted as ``chatcmpl-{id}`` (a no-op) and not counted; a non-streaming one gets its head
  only with the whole response, so it is always detected.
- A background response (``POST /v1/responses`` with ``"background": true``, stream or not) runs
  in a task of its own, is stored and served again by ``GET /v1/responses/{id}``: vLLM keeps
  it after the client leaves on purpose, so it is never aborted
  (:meth:`VLLMAdapter.kept_after_disconnect`, ``background_response``; the facts in
  :mod:`engine.responses`); nor is a reader of a stored response (``response_retrieval``).
  ``POST /v1/responses/{id}/cancel`` is vLLM's way to stop one: proxied like any route. The
  ``/v1/responses`` body copy is kept for that decision (:meth:`VLLMAdapter.wants_body`).
- The abort endpoint exists only when vLLM runs with ``--enable-scale-out``; otherwise it answers
  403. It answers 200 at once and ignores unknown ids. It is guarded by ``--api-key``.
- Never send an empty id list: the dev-mode route ``/abort_requests`` reads that as "abort all".
- The endpoint takes a list, so one call aborts many requests; the sidecar caps a call at
  ``MAX_IDS_PER_CALL`` ids (its choice, not vLLM's: about 25 KB of JSON per call).
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

from engine.base import (
    AbortCall,
    EngineAdapter,
    Kept,
    Unabortable,
    lax_bool,
    parse_json,
    with_field,
)
from engine.responses import RESPONSES_PATH, kept, may_name_tools, tool_type
from sidecar.config import EngineKind

REQUEST_ID_HEADER = "X-Request-Id"
MAX_IDS_PER_CALL = 512


def count_prompts(body: Any) -> int:
    """Number of engine inputs a ``/v1/completions`` body makes; at least 1.

    Mirrors how vLLM splits ``prompt`` (str | list[str] | list[int] | list[list[int]]) and
    ``prompt_embeds`` (str | list[str]) into engine inputs. Any malformed shape counts as 1.
    """
    if not isinstance(body, dict):
        return 1
    count = 0
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        count += 1
    elif isinstance(prompt, list) and prompt:
        count += 1 if all(isinstance(t, int) for t in prompt) else len(prompt)
    embeds = body.get("prompt_embeds")
    if isinstance(embeds, str | bytes):
        count += 1
    elif isinstance(embeds, list):
        count += len(embeds)
    return max(count, 1)



def _chat(sid: str, body: Any) -> tuple[str, ...]:
    return (f"chatcmpl-{sid}",)


def _chat_batch(sid: str, body: Any) -> tuple[str, ...]:
    messages = body.get("messages") if isinstance(body, dict) else None
    count = len(messages) if isinstance(messages, list) and messages else 1
    return tuple(f"chatcmpl-{sid}_{i}" for i in range(count))


def _completions(sid: str, body: Any) -> tuple[str, ...]:
    return tuple(f"cmpl-{sid}-{i}" for i in range(count_prompts(body)))


# Built-in tool types of a Responses request that may run more generation turns, as vLLM's
# ``extract_tool_types`` (``openai/responses/utils.py``) reads ``tools[].type``, or an "mcp"
# tool's ``server_label`` (counted by vLLM only if on ``VLLM_GPT_OSS_SYSTEM_TOOL_MCP_LABELS``, an
# engine env var the sidecar cannot see, whose values can only be these three: ``envs.py``); a
# turn runs only for a tool the engine's tool server has (``serving.py``, builtin_tool_list).
BUILTIN_TOOL_TYPES = frozenset({"web_search_preview", "code_interpreter", "container"})
# Generation turns named for a Responses request with built-in tools: ``_0`` .. ``_{N-1}``. vLLM
# bounds them by nothing (``_generate_with_builtin_tools``: ``while True``); ids it does not
# know are ignored, so naming more costs only bytes (~45 per id).
BUILTIN_TOOL_TURNS = 16


def builtin_tools(body: Any) -> bool:
    """True if a parsed ``/v1/responses`` body asks for a built-in tool
    (:data:`BUILTIN_TOOL_TYPES`, directly or as an ``mcp`` tool's ``server_label``): vLLM may
    then run a generation turn per tool call, each under an id of its own."""
    tools = body.get("tools") if isinstance(body, dict) else None
    return isinstance(tools, list) and any(
        isinstance(tool, dict) and tool_type(tool.get("server_label") if tool.get("type") == "mcp"
                                             else tool.get("type")) in BUILTIN_TOOL_TYPES
        for tool in tools)


def may_ask_builtin_tools(body: bytes | None) -> bool:
    """False if the raw ``/v1/responses`` body cannot ask for a built-in tool
    (:func:`engine.responses.may_name_tools`): then it is never parsed for it."""
    return may_name_tools(body, BUILTIN_TOOL_TYPES)


def _responses(sid: str, body: Any) -> tuple[str, ...]:
    turns = BUILTIN_TOOL_TURNS if builtin_tools(body) else 1
    return tuple(f"resp_{sid}_{turn}" for turn in range(turns))


# The parsed JSON body (None if absent, too large or not JSON) -> engine request ids.
IdRule = Callable[[str, Any], tuple[str, ...]]


# Speech to text: audio longer than the model's ``max_audio_clip_s`` (30 s for Whisper) is split
# into chunks, one engine request each, all generating at once, plus a language detection run
# before them when no ``language`` is given (``speech_to_text/base/serving.py``: ``request_id =
# f"{task_type}-{_base_request_id(raw_request)}"``, ``engine_request_ids``, ``_detect_language``;
# ``merge_async_iterators``). The chunk count depends on the audio, which the sidecar does not
# decode: it names the first ``AUDIO_CHUNKS`` (32 min of 30 s chunks; vLLM ignores unknown ids).
AUDIO_CHUNKS = 64


def _speech_to_text(task_type: str) -> IdRule:
    def rule(sid: str, body: Any) -> tuple[str, ...]:
        base = f"{task_type}-{sid}"
        return (base, f"{base}-lang_detect", *(f"{base}-{i}" for i in range(AUDIO_CHUNKS)))
    return rule


def _generative_scoring(sid: str, body: Any) -> tuple[str, ...]:
    # One 1-token read (a prefill) per item, all at once (``generate/generative_scoring/
    # serving.py``, ``_build_prompts``; ``generate/label_reads.py``, ``next_token_label_reads``).
    items = body.get("items") if isinstance(body, dict) else None
    count = len(items) if isinstance(items, list) and items else 1
    return tuple(f"generative-scoring-{sid}-{i}" for i in range(count))


def _generate(sid: str, body: Any) -> tuple[str, ...]:
    return (f"generate-tokens-{sid}",)


def _invocations(sid: str, body: Any) -> tuple[str, ...]:
    # SageMaker: vLLM tries ChatCompletionRequest first, then CompletionRequest
    # (generate/factories.py: get_generate_invocation_types).
    if isinstance(body, dict) and "messages" in body:
        return _chat(sid, body)
    if isinstance(body, dict) and ("prompt" in body or "prompt_embeds" in body):
        return _completions(sid, body)
    if body is None:  # not kept (over upstream.replay_buffer_bytes) or not JSON: either shape
        return (*_chat(sid, None), *_completions(sid, None))
    return ()


# POST path -> (needs the body?, rule). Only POSTs generate.
ROUTES: dict[str, tuple[bool, IdRule]] = {
    "/v1/chat/completions": (False, _chat),
    "/v1/chat/completions/batch": (True, _chat_batch),
    "/v1/completions": (True, _completions),
    "/v1/messages": (False, _chat),
    "/v1/responses": (True, _responses),
    "/inference/v1/generate": (False, _generate),
    "/invocations": (True, _invocations),
    "/cohere/v2/chat": (False, _chat),  # VLLM_ENABLE_COHERE_API=1: a chat request inside
    "/generative_scoring": (True, _generative_scoring),
    "/v1/audio/transcriptions": (False, _speech_to_text("transcribe")),
    "/v1/audio/translations": (False, _speech_to_text("translate")),
}

# Routes whose first streamed body byte comes after the engine registered the request (vLLM 0.32:
# openai/chat_completion/serving.py chat_completion_stream_generator and
# openai/completion/serving.py completion_stream_generator build their first chunk inside
# ``async for ... in result_generator``, which AsyncLLM.add_request starts). Not /v1/responses
# (responses_stream_generator sends response.created and response.in_progress first), nor the
# routes not checked.
REGISTERED_ONCE_STREAMING = frozenset({"/v1/chat/completions", "/v1/completions"})

# Routes whose body may ask for beam search (ChatCompletionRequest, CompletionRequest).
BEAM_SEARCH_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/invocations"})


def beam_search(path: str, body: bytes | None) -> bool:
    """True if ``body`` (the request body copy, ``None`` if not kept) asks vLLM for beam search
    on ``path``. A substring test first: most bodies are never parsed here."""
    if path not in BEAM_SEARCH_ROUTES or body is None or b"use_beam_search" not in body:
        return False
    parsed = parse_json(body)
    # As vLLM's pydantic request models read the field: "true", 1 and "yes" are true too.
    return isinstance(parsed, dict) and lax_bool(parsed.get("use_beam_search"))


class VLLMAdapter(EngineAdapter):
    """Adapter for vLLM's OpenAI-compatible server (``vllm.entrypoints.openai.api_server``)."""

    kind = EngineKind.VLLM
    default_abort_path = "/inference/v1/abort_requests"
    max_ids_per_call = MAX_IDS_PER_CALL
    # An aborted request ends at once: a last chunk with "finish_reason":"abort" and data: [DONE]
    # (stream), or the partial output with that finish_reason (JSON) (v1/engine FinishReason.ABORT;
    # ../shared/notes/cancellation-facts.md, measured on vLLM 0.32 CPU).
    confirms = True
    # A dict built in the API-server process (entrypoints/serve/instrumentator/basic.py).
    keepalive_path = "/version"
    # Dev-mode (VLLM_SERVER_DEV_MODE=1) abort route: an empty list there aborts EVERY request.
    extra_forbidden_paths = frozenset({"/inference/v1/abort_requests", "/abort_requests"})

    def tag(self, path: str, sidecar_id: str, headers: MutableMapping[str, str]) -> None:
        headers[REQUEST_ID_HEADER] = sidecar_id

    def wants_body(self, method: str, path: str) -> bool:
        """The routes whose ids depend on the body (``/v1/responses``: is it background, does it
        ask for built-in tools?)."""
        rule = ROUTES.get(path) if method == "POST" else None
        return rule is not None and rule[0]

    def engine_request_ids(
        self, method: str, path: str, sidecar_id: str, body: bytes | None
    ) -> tuple[str, ...]:
        rule = ROUTES.get(path) if method == "POST" else None
        if rule is None or beam_search(path, body):
            return ()
        parse = rule[0] and (path != RESPONSES_PATH or may_ask_builtin_tools(body))
        return rule[1](sidecar_id, parse_json(body) if parse else None)

    def unabortable(self, method: str, path: str, body: bytes | None) -> Unabortable | None:
        """``vllm_beam_search`` for a body that asks for beam search (see the module notes)."""
        if method == "POST" and beam_search(path, body):
            return Unabortable.VLLM_BEAM_SEARCH
        return None

    def registered_once_streaming(self, method: str, path: str) -> bool:
        """Chat and completions (:data:`REGISTERED_ONCE_STREAMING`)."""
        return method == "POST" and path in REGISTERED_ONCE_STREAMING

    def registers_later(self, method: str, path: str, ids: tuple[str, ...],
                        body: bytes | None) -> bool:
        """``/v1/responses`` with built-in tools: named with more than one turn's id
        (:func:`_responses`); turn ``k + 1`` is registered once turn ``k`` asked for a tool and
        the tool answered, seconds later. Read from the ids: the body is not parsed again."""
        return method == "POST" and path == RESPONSES_PATH and len(ids) > 1

    def kept_after_disconnect(self, method: str, path: str, body: bytes | None) -> Kept | None:
        """``background_response`` for a background ``POST /v1/responses`` that vLLM runs (not
        one it refuses: ``store`` falsy), ``response_retrieval`` for ``GET /v1/responses/{id}``
        (:mod:`engine.responses`)."""
        return kept(method, path, body, store_read_raw=True, stream_detaches=True)

    def rewrites_body(self, method: str, path: str) -> bool:
        return method == "POST" and path == RESPONSES_PATH

    def rewrite_body(self, method: str, path: str, sidecar_id: str, body: bytes) -> bytes | None:
        """``/v1/responses``: set ``request_id`` to ``resp_{sidecar_id}``, replacing any value
        the client sent (it must never choose the id an abort names)."""
        return with_field(body, "request_id", f"resp_{sidecar_id}")

    def abort_call(self, ids: tuple[str, ...]) -> AbortCall:
        """``POST <abort path>`` with ``{"request_ids": [...ids]}``."""
        if not ids:
            raise ValueError("refusing an empty id list: a dev-mode vLLM aborts everything on it")
        if len(ids) > self.max_ids_per_call:
            raise ValueError(f"{len(ids)} ids in one abort call; at most {self.max_ids_per_call}")
        assert self.abort_path is not None
        return AbortCall(self.abort_path, {"request_ids": list(ids)})
