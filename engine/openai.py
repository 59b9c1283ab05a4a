"""OpenAI-compatible adapter: any server without an abort endpoint; a disconnect only closes.

For TGI, the llama.cpp server, Ollama, a hosted API or anything else that speaks the OpenAI HTTP
API but offers no way to abort a request by id. The sidecar still proxies transparently and,
when a client disconnects, closes the upstream connection at once
(``sidecar.cancellation.Cancellation._stop``); it calls nothing else, because there is nothing
to call. Whether the server then stops generating is up to the server: most notice a closed
connection only when they next write a token, some only at the end of the request, some never
(a hosted API bills the whole completion). That is why close-only is weaker than the ``vllm``
kind's abort.

- ``tag`` sets ``X-Request-Id`` to the sidecar request id: harmless, many servers log it, and
  it matches the id on the client's response and the access line. It names no engine id.
- ``engine_request_ids`` is empty for every route, so :class:`sidecar.abort.Aborter` is never
  asked; ``abort_call`` raises if called anyway.
- ``/readyz`` only GETs ``health_path`` (default ``/v1/models``, which every OpenAI-compatible
  server and hosted API serves; llama.cpp and TGI also answer ``/health``, Ollama ``/`` and
  ``/api/version``). The config rejects an ``abort`` section on such an engine
  (``sidecar.config.KINDS_WITHOUT_ABORT``), and so does naming such an engine in a route's
  ``abort`` list. Such an engine can still be a route's proxied ``engine`` while the route aborts
  others (``routes[].abort``: a P/D router in front of vLLM prefill and decode engines).
"""

from __future__ import annotations

from collections.abc import MutableMapping

from engine.base import AbortCall, EngineAdapter
from sidecar.config import EngineKind

REQUEST_ID_HEADER = "X-Request-Id"


class OpenAIAdapter(EngineAdapter):
    """Adapter for an OpenAI-compatible server with no abort endpoint: close-only."""

    kind = EngineKind.OPENAI
    aborts = False
    default_abort_path = None
    default_health_path = "/v1/models"
    max_ids_per_call = 1  # never used: no call is ever made

    def tag(self, path: str, sidecar_id: str, headers: MutableMapping[str, str]) -> None:
        headers[REQUEST_ID_HEADER] = sidecar_id

    def wants_body(self, method: str, path: str) -> bool:
        return False

    def engine_request_ids(
        self, method: str, path: str, sidecar_id: str, body: bytes | None
    ) -> tuple[str, ...]:
        return ()

    def abort_call(self, ids: tuple[str, ...]) -> AbortCall:
        raise ValueError(f"engine {self.name} (kind openai) has no abort endpoint")
