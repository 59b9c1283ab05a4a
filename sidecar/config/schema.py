"""The config's models: frozen, unknown keys rejected, each field a named type of
:mod:`sidecar.config.values`; :class:`Settings` is the whole file.

Shape (see ``config/sidecar.yaml`` for the commented reference)::

    listen:   {host, port}                       client-facing proxy listener
    admin:    {host, port, cancel_token}         /healthz, /readyz, /metrics, cancel API
    downstream: {idle_timeout_s, body_timeout_s, max_body_bytes, write_buffer_bytes}
    upstream: {connect_timeout_s, first_byte_timeout_s, read_timeout_s, keepalive_timeout_s, ...}
    engines:  {NAME: {kind, url, abort: {path, api_key, timeout_s, retries}}}
    routes:   [{prefix, engine, abort, abort_from_header, max_duration_s}]  abort: the engines
                                                 to abort (default [engine]); abort_from_header:
                                                 {header, engine, allow, ports}, one more engine
                                                 per request, named by a request header (llm-d's
                                                 prefill pod); max_duration_s: a request's deadline
    lifecycle: {grace_period_s, record_dir}      how a stop waits; where in-flight work is recorded
    tunnel:   {idle_timeout_s, max_bytes}        Connection: Upgrade sessions (sidecar.tunnel)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from sidecar.config.values import (
    AllowEntry,
    ApiKey,
    CancelToken,
    EngineKind,
    EngineUrl,
    FieldName,
    HttpPath,
    ListenHost,
    LogLevel,
    NotBool,
    OptionalSeconds,
    Port,
    RoutePrefix,
    Seconds,
    SecondsOrZero,
    WhenAbortUnavailable,
)
from sidecar.logs import LogFormat


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)



class Listener(_Model):
    """An address to listen on. Loopback by default: nothing listens beyond what is configured
    (an empty ``host``, every address to aiohttp, is refused:
    :data:`~sidecar.config.values.ListenHost`)."""

    host: ListenHost = "127.0.0.1"
    port: Port = 8080


class AdminSettings(Listener):
    """The admin listener (``/healthz``, ``/readyz``, ``/metrics``, the cancel API).

    ``cancel_token``: when set, ``POST /v1/requests/{id}/cancel`` needs ``Authorization: Bearer
    <token>`` (else 401); when null, the cancel API is open to whoever reaches the admin
    listener, which is loopback-only by default (see
    :func:`~sidecar.config.exposure.open_cancel_api`). Surrounding whitespace is dropped; an empty
    token is an error (omit the key for none). ``${VAR}`` supported; never printed or logged.
    ``port`` defaults to 9090.
    """

    port: Port = 9090
    cancel_token: CancelToken = None


class AbortSettings(_Model):
    """How to call an engine's abort endpoint.

    ``path`` defaults per engine kind (vLLM: ``/inference/v1/abort_requests``); ``api_key`` is sent
    as ``Authorization: Bearer <key>``; ``timeout_s`` bounds one abort call (one attempt), seconds;
    ``retries``: how many more attempts a call gets after a transient failure (see
    :mod:`sidecar.abort_call` for which failures are retried).

    Re-sends (the registration window). An engine ignores an abort naming an id it does not know
    yet, and it learns a request's ids only after preprocessing it (vLLM: chat template,
    tokenization, media fetches; SGLang: tokenization): an abort sent at once after a client
    left right after its body would be a no-op, and the request would then run to its end for
    nobody. So a request that ended early within ``resend_window_s`` seconds of the engine
    getting its whole body has its ids sent again, 5 ms after the first call and then at
    intervals doubling up to ``resend_max_interval_s``, the last one when the window closes;
    after the window one call. The defaults cover text prompts (preprocessing of milliseconds
    to a few hundred); raise the window for media URLs (seconds of downloads). 0: one call,
    no re-sends.

    Confirmation (engine kinds that say on the request's own connection that it stopped: vllm,
    sglang; :mod:`sidecar.confirm`). After a disconnect the upstream connection stays open and is
    read, not relayed, until the engine ends the response: ``confirmed`` if it ended aborted,
    ``finished`` if it had ended on its own. Until then the ids are re-sent (whatever the
    registration window), each re-send on other abort connections than the last, the width
    doubling from 1 to ``fanout`` calls (``fanout`` from the first call once the engine was seen
    with several processes), at most ``max_calls`` calls per request, because an
    engine with several API-server processes (``vllm serve --api-server-count N``) ignores an
    abort that reaches another process than the owner's. ``connections``: warm abort connections
    kept per engine (each reaches one process: keep it at least twice the process count).
    ``confirm_timeout_s``: seconds after the disconnect (or the registration window's end, if
    later) after which the request is ``unconfirmed`` (counted, a WARNING) and its upstream
    closed; 0: no confirmation (the upstream closed at once, outcome ``accepted``, re-sends only
    inside the registration window).

    A late start (vllm's chat and completions: a stream's first byte comes only once the engine
    registered it). A stream whose engine had sent nothing by that bound may still be
    registering (a long prompt behind others, an API process busy for seconds): it is watched on
    for ``late_start_s`` seconds after the disconnect, sending nothing; if its response begins
    meanwhile, the abort goes again at once, and confirmation starts over for
    ``confirm_timeout_s``, within ``max_calls`` calls of its own. A JSON request on those routes
    (nothing of it comes before its end, so nothing says when it registered) is watched on the
    same way while its ids are re-sent at gaps doubling from ``resend_max_interval_s``, widening
    to ``fanout``, within ``max_calls`` calls of its own. 0: ``unconfirmed`` at the bound, as for
    any other request.

    ``when_unavailable``: ``not_ready`` or ``close_only``, what ``/readyz`` says while the
    engine is up but its abort endpoint refuses (:class:`WhenAbortUnavailable`).
    """

    path: HttpPath = None
    api_key: ApiKey = None
    timeout_s: Seconds = 2.0
    retries: Annotated[int, Field(ge=0, le=10), NotBool] = 2
    resend_window_s: SecondsOrZero = 2.0
    resend_max_interval_s: Seconds = 0.2
    confirm_timeout_s: SecondsOrZero = 2.0
    late_start_s: SecondsOrZero = 30.0
    connections: Annotated[int, Field(ge=1, le=64), NotBool] = 16
    fanout: Annotated[int, Field(ge=1, le=64), NotBool] = 8
    max_calls: Annotated[int, Field(ge=1, le=1000), NotBool] = 64
    when_unavailable: WhenAbortUnavailable = WhenAbortUnavailable.NOT_READY


class EngineSettings(_Model):
    """One engine (upstream) the sidecar proxies to and aborts on.

    ``health_path``: what ``/readyz`` GETs on the engine (a 2xx answer means it is up); the
    default depends on the kind (vllm, sglang: ``/health``; openai: ``/v1/models``). ``url``: an
    origin without ``user:password@`` (the key goes in ``abort.api_key``).
    """

    kind: EngineKind
    url: EngineUrl
    health_path: HttpPath = None
    abort: AbortSettings = AbortSettings()


class DownstreamSettings(_Model):
    """Limits on the downstream (client) side. No total timeout here (a request's deadline is
    ``routes[].max_duration_s``).

    ``idle_timeout_s``: a client connection with no request in progress (idle keep-alive, or a
    request head not yet complete: a silent client) is closed after this many seconds, counted
    from its accept or from the end of its last response; bytes trickling in do not extend it,
    and a request being handled (a stream of any length) is never cut by it. It is aiohttp's
    ``keepalive_timeout`` (default 3630 s) on the proxy and admin listeners
    (:mod:`sidecar.server`), so a change needs a restart; the other keys apply on reload.
    ``body_timeout_s``: longest wait for the next chunk of a request body, seconds; then the
    client gets 408 and the upstream request is closed (no abort: the engine never had all of
    it); null for no limit. ``max_body_bytes``: larger request bodies get 413; 0 for no limit.
    ``write_buffer_bytes``: how much of a response is buffered for a client that reads slowly
    before the sidecar stops reading from the engine (backpressure); a slow reader is not a
    disconnect.
    """

    idle_timeout_s: Seconds = 75.0
    body_timeout_s: OptionalSeconds = 60.0
    max_body_bytes: Annotated[int, Field(ge=0, le=2**40), NotBool] = 64 * 1024 * 1024
    write_buffer_bytes: Annotated[int, Field(ge=4096, le=2**30), NotBool] = 256 * 1024


class UpstreamSettings(_Model):
    """Limits on the upstream (engine) side. No total timeout here (a request's deadline is
    ``routes[].max_duration_s``).

    ``connect_timeout_s``: TCP connect, seconds. ``first_byte_timeout_s``: from the request being
    sent until the response headers arrive (a non-streaming generation counts whole), seconds;
    a wait for a pool slot or a new connection before the request is sent has the same limit.
    ``read_timeout_s``: once the response headers arrived, the longest wait for the next body
    byte (a stream's first event after queueing and prefill counts; time spent writing to a slow
    client does not), seconds; then the client's response ends abnormally, the upstream
    connection is closed and the engine aborted.
    ``keepalive_timeout_s``: how long an idle pooled connection is kept; keep it below the
    engine's own idle timeout (uvicorn: 5 s) so the engine is not the one closing it.
    ``max_connections``: pool size, 0 for unlimited. ``replay_buffer_bytes``: a POST that fails on
    a stale pooled connection before any response byte is re-sent once on a new connection if its
    body fit in this many bytes.
    """

    connect_timeout_s: OptionalSeconds = 5.0
    first_byte_timeout_s: OptionalSeconds = 600.0
    read_timeout_s: OptionalSeconds = 600.0
    keepalive_timeout_s: Seconds = 4.0
    max_connections: Annotated[int, Field(ge=0, le=1_000_000), NotBool] = 0
    replay_buffer_bytes: Annotated[int, Field(ge=0, le=2**32), NotBool] = 8 * 1024 * 1024




class AbortFromHeaderSettings(_Model):
    """One more engine to abort per request, named by a request header: llm-d's prefill pod.

    llm-d's scheduler picks a prefill pod per request and names it (``host:port``) in the
    request header ``x-prefiller-host-port`` (``pkg/common/routing/common.go``,
    ``PrefillEndpointHeader``) that the decode pod's routing sidecar reads
    (``pkg/sidecar/proxy/chat_completions.go``). A request of this route that ends early is then
    also aborted at ``<scheme of engine's url>://<host:port from header>``, with the kind, abort
    path, key, timeout and retries of ``engine`` (a configured engine used as a template; its own
    url is not called and, if no route proxies to or aborts at it, not probed by ``/readyz``),
    and the ids that kind derives (the prefill leg runs under the sidecar's id there: see
    :mod:`sidecar.targets`). The header goes upstream unchanged.

    ``header``: the request header (case-insensitive). ``allow``: the hosts the value may name
    (IP addresses, networks, host names, ``*.domain``); anything else is never called, and
    counted. ``ports``: the ports it may name; omitted, any. The template's ``abort.api_key`` is
    sent to every allowed host, so allow only the prefill pods.
    """

    header: FieldName
    engine: str
    allow: Annotated[list[AllowEntry], Field(min_length=1)]
    ports: Annotated[list[Annotated[int, Field(ge=1, le=65535), NotBool]] | None,
                     Field(min_length=1)] = None


class RouteSettings(_Model):
    """Requests whose path is ``prefix`` or lies below it go to ``engine``.

    ``abort``: the engines whose abort endpoint a cancelled request of this route is sent to,
    each with the ids its own kind derives; omitted, just ``engine``. When given it is the
    complete list (fan-out: prefill and decode engines behind a router of kind ``openai``, or
    every data-parallel replica); every name must be a defined engine of a kind that aborts,
    each named once (checked in :func:`~sidecar.config.references.cross_reference`).

    ``abort_from_header``: one more engine per request, named by a request header (llm-d's
    prefill pod): :class:`AbortFromHeaderSettings`.

    ``max_duration_s``: a request's deadline, seconds from the sidecar receiving its head; on
    expiry the engine is aborted and the client gets 504 (before the head) or a final SSE error
    event (see :mod:`sidecar.proxy`). A client's ``X-Sidecar-Deadline-S`` header may only lower
    it. Null (the default): no deadline unless the client asks for one.
    """

    prefix: RoutePrefix
    engine: str
    abort: Annotated[list[str] | None, Field(min_length=1)] = None
    abort_from_header: AbortFromHeaderSettings | None = None
    max_duration_s: OptionalSeconds = None

    def abort_engines(self) -> tuple[str, ...]:
        """The names of the engines a cancelled request of this route is aborted at."""
        return (self.engine,) if self.abort is None else tuple(self.abort)


class LifecycleSettings(_Model):
    """How the sidecar stops (SIGTERM/SIGINT).

    ``grace_period_s``: seconds in-flight requests may take to finish after new connections are
    refused; what is still running then is cancelled (upstream closed, engine aborted): the
    cancelled handlers get up to 5 s more to unwind (``sidecar.runtime.CANCEL_WAIT_S``) and the
    abort calls up to 5 s more to finish (``sidecar.app.ABORT_DRAIN_S``). The orchestrator's kill
    deadline (Kubernetes: ``terminationGracePeriodSeconds``) must exceed the sum plus
    ``engines.*.abort.timeout_s`` (docs/operations.md, "Signals").

    ``record_dir``: the directory of the record of in-flight engine work that a killed sidecar
    process leaves to abort (:mod:`sidecar.inflight`; default :func:`default_record_dir`);
    ``null`` keeps no record (a killed sidecar then leaves its requests running). Made if
    missing; read at the start (what a dead sidecar left is aborted before the proxy listens)
    and when a ``--workers`` worker dies. Needs a restart to change.
    """

    grace_period_s: Seconds = 30.0
    record_dir: Path | None = Field(default_factory=lambda: default_record_dir())


def default_record_dir() -> Path:
    """Where the record of in-flight engine work goes (:mod:`sidecar.inflight`) unless
    ``lifecycle.record_dir`` says: ``$XDG_STATE_HOME/cancel-sidecar`` (XDG's place for state
    that outlives a restart), else ``~/.local/state/cancel-sidecar``. The image sets
    ``XDG_STATE_HOME=/var/lib`` (a directory its user owns; mount a volume there to survive a
    container restart)."""
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                            "state")
    return Path(state) / "cancel-sidecar"


class TunnelSettings(_Model):
    """Limits on an upgraded connection (``Connection: Upgrade``, a WebSocket: see
    :mod:`sidecar.tunnel`), once the engine answered ``101``.

    ``idle_timeout_s``: a tunnel with no byte in either direction for this many seconds is
    closed (both sides, FIN); null for no limit. 300 s by default: WebSocket servers ping far
    more often (uvicorn and the ``websockets`` library every 20 s), so only a tunnel whose ends
    are both gone or stuck meets it. ``max_bytes``: the most bytes relayed in each direction
    (counted separately, frames and all); the tunnel is closed when one direction would pass it;
    0 for no limit (the default: a realtime audio session streams for as long as it lasts).
    The rest comes from the other sections: ``upstream.connect_timeout_s`` and
    ``first_byte_timeout_s`` (until the ``101``), ``downstream.write_buffer_bytes`` (how much
    waits for a slow reader, each way, before the other side is no longer read), and the
    route's ``max_duration_s`` (and the client's ``X-Sidecar-Deadline-S``): the session's
    deadline.
    """

    idle_timeout_s: OptionalSeconds = 300.0
    max_bytes: Annotated[int, Field(ge=0, le=2**62), NotBool] = 0


class Settings(_Model):
    """The whole validated config file, before cross-references are checked."""

    listen: Listener = Listener()
    admin: AdminSettings | None = AdminSettings()
    downstream: DownstreamSettings = DownstreamSettings()
    upstream: UpstreamSettings = UpstreamSettings()
    engines: Annotated[dict[str, EngineSettings], Field(min_length=1)]
    routes: Annotated[list[RouteSettings], Field(min_length=1)]
    # A factory: lifecycle.record_dir's default reads the environment when the config is read.
    lifecycle: LifecycleSettings = Field(default_factory=LifecycleSettings)
    tunnel: TunnelSettings = TunnelSettings()
    log_level: LogLevel = "INFO"
    log_format: LogFormat = "json"

