"""Config: YAML -> ``${VAR}`` expansion -> validated models -> cross-references -> frozen settings.

Every problem is collected, located by a dotted path (``engines.local.abort.timeout_s``) and
raised together as one :class:`~sidecar.errors.ConfigError`; ``cancel-sidecar --check-config``
prints them and exits 1. Unknown keys are rejected, so a typo never silently falls back to a
default, and a key given twice in one mapping is an error, a ``<<`` merge key too (YAML would
keep the last silently). Secrets (``api_key``, ``cancel_token``) are ``SecretStr``: never
printed, not even in error messages; neither is the value of an unknown key (a typo's value may
be a token), nor anything before the ``@`` of a URL-like value (``user:password@``, whatever
its scheme, slashes or whitespace).

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

A running sidecar re-reads the file on SIGHUP (see :mod:`sidecar.runtime`): engines, routes,
upstream, downstream (but ``downstream.idle_timeout_s``), tunnel and lifecycle apply to new
requests; listen, admin, log_level, log_format and ``downstream.idle_timeout_s`` need a restart.
"""

from __future__ import annotations

import difflib
import enum
import ipaddress
import logging
import os
import re
import typing
from collections.abc import Hashable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    AfterValidator,
    AnyHttpUrl,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
)

from sidecar.errors import ConfigError, ConfigProblem
from sidecar.logs import LogFormat

log = logging.getLogger(__name__)


class EngineKind(enum.StrEnum):
    """Engine kinds with an adapter in ``engine/``."""

    VLLM = "vllm"
    OPENAI = "openai"
    SGLANG = "sglang"


class WhenAbortUnavailable(enum.StrEnum):
    """What ``/readyz`` says while an engine answers its health check but its abort endpoint
    refuses the readiness probe (vLLM without ``--enable-scale-out``: 403; a wrong key or path):
    ``engines.NAME.abort.when_unavailable``, read by :mod:`sidecar.readiness`.

    ``not_ready`` (the default): ``/readyz`` answers 503, so the pod gets no traffic and a
    rolling update stops with the old pods serving, until the engine is fixed. ``close_only``:
    ``/readyz`` answers 200 and the engine serves; a disconnect still sends its abort call (a
    refused one closes the upstream connection at once, the way an engine without an abort
    endpoint is stopped) and ``cancel_sidecar_engine_abort_unavailable`` is 1, for an alert.
    """

    NOT_READY = "not_ready"
    CLOSE_ONLY = "close_only"


MAX_SECONDS = 365 * 24 * 3600.0  # a year: longer waits are typos, and overflow the loop's timers


def _positive_or_none(value: float | None) -> float | None:
    if value is not None and not 0 < value <= MAX_SECONDS:  # also refuses NaN
        raise ValueError(f"must be > 0 and <= {MAX_SECONDS:.0f} seconds; use null for no limit")
    return value


def _not_negative(value: float) -> float:
    if not 0 <= value <= MAX_SECONDS:  # also refuses NaN and infinity
        raise ValueError(f"must be >= 0 and <= {MAX_SECONDS:.0f} seconds; use 0 for none")
    return value


def _positive(value: float) -> float:
    if not 0 < value <= MAX_SECONDS:  # also refuses NaN and infinity
        raise ValueError(f"must be > 0 and <= {MAX_SECONDS:.0f} seconds")
    return value


def _not_bool(value: Any) -> Any:
    """YAML ``true``/``false`` where a number belongs is a mistake, not 1/0."""
    if isinstance(value, bool):
        raise ValueError("must be a number, not true/false")
    return value


def _api_key(value: SecretStr | None) -> SecretStr | None:
    """Surrounding whitespace is dropped (a key read from a file or a Kubernetes Secret often
    ends with a newline); a key still holding a control character cannot be sent in a header,
    nor can one outside ASCII be sent one way: HTTP has no single encoding for it (the abort wire
    wrote latin-1, the readiness probe UTF-8, and a client its own), so it matched nowhere."""
    if value is None:
        return None
    key = value.get_secret_value().strip()
    if any(ord(c) < 32 or ord(c) == 127 for c in key):
        raise ValueError("must not contain control characters (it is sent in an HTTP header)")
    if not key.isascii():
        raise ValueError("must be ASCII (it is sent in an HTTP header, where other characters "
                         "have no one encoding)")
    return SecretStr(key) if key else None


def _cancel_token(value: SecretStr | None) -> SecretStr | None:
    """As :func:`_api_key`, but an empty token is refused rather than read as none: a
    ``${VAR}`` set but empty (a missing Secret) must not open the cancel API."""
    token = _api_key(value)
    if value is not None and token is None:
        raise ValueError("must not be empty: omit admin.cancel_token for no token (an empty "
                         "${VAR} usually means its Secret or variable is missing)")
    return token


def _engine_url(value: AnyHttpUrl) -> AnyHttpUrl:
    """An engine's url: an origin (request paths are forwarded unchanged), with a port it can
    listen on, without ``user:password@`` (aiohttp sends it as Basic auth on every proxied
    request, refuses it next to the abort call's own ``Authorization`` header, and it would show
    in logs and ``/readyz``). Every problem in one message: a field check, so it runs next to
    the config's other problems (a model check is skipped once a field has one)."""
    problems = []
    if value.username or value.password:
        problems.append("must not contain a user name or password (user:password@): put the "
                        "engine's key in abort.api_key; clients send their own Authorization")
    if value.path not in (None, "", "/") or value.query or value.fragment:
        problems.append("must be an origin like http://127.0.0.1:8000 (no path, query or "
                        "fragment): request paths are forwarded unchanged")
    if value.port == 0:
        problems.append("port 0 names no engine: give the port it listens on")
    if problems:
        raise ValueError("; and ".join(problems))
    return value


def _route_prefix(value: str) -> str:
    if not value.startswith("/"):
        raise ValueError("must start with '/', e.g. /v1")
    return value


def _http_path(value: str | None) -> str | None:
    if value is not None and not value.startswith("/"):
        raise ValueError("must be an absolute path starting with '/'")
    if value is not None and any(ord(c) <= 32 or ord(c) == 127 for c in value):
        raise ValueError("must not contain spaces or control characters (percent-encode them)")
    return value


NotBool = BeforeValidator(_not_bool)
# 0 asks the OS for a free port (tests); the bound port is logged.
Port = Annotated[int, Field(ge=0, le=65535), NotBool]
# Case-insensitive in the file ("info" works); stored upper-case as logging expects.
LogLevel = Annotated[Literal["DEBUG", "INFO", "WARNING", "ERROR"],
                     BeforeValidator(lambda v: v.upper() if isinstance(v, str) else v)]
Seconds = Annotated[float, AfterValidator(_positive), NotBool]
SecondsOrZero = Annotated[float, AfterValidator(_not_negative), NotBool]
OptionalSeconds = Annotated[float | None, AfterValidator(_positive_or_none), NotBool]
RoutePrefix = Annotated[str, AfterValidator(_route_prefix)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _listen_host(value: str) -> str:
    """An empty host means every address to aiohttp (``0.0.0.0`` and ``::``): refused, so that
    an empty ``${VAR:-}`` never opens a listener to the network by accident."""
    if not value.strip():
        raise ValueError("must not be empty: write 0.0.0.0 (every IPv4 address), :: (every "
                         "address) or an address (an empty ${VAR} usually means it is unset)")
    return value


class Listener(_Model):
    """An address to listen on. Loopback by default: nothing listens beyond what is configured
    (an empty ``host``, every address to aiohttp, is refused: :func:`_listen_host`)."""

    host: Annotated[str, AfterValidator(_listen_host)] = "127.0.0.1"
    port: Port = 8080


class AdminSettings(Listener):
    """The admin listener (``/healthz``, ``/readyz``, ``/metrics``, the cancel API).

    ``cancel_token``: when set, ``POST /v1/requests/{id}/cancel`` needs ``Authorization: Bearer
    <token>`` (else 401); when null, the cancel API is open to whoever reaches the admin
    listener, which is loopback-only by default (see :func:`open_cancel_api`). Surrounding
    whitespace is dropped; an empty token is an error (omit the key for none). ``${VAR}``
    supported; never printed or logged. ``port`` defaults to 9090.
    """

    port: Port = 9090
    cancel_token: Annotated[SecretStr | None, AfterValidator(_cancel_token)] = None


class AbortSettings(_Model):
    """How to call an engine's abort endpoint.

    ``path`` defaults per engine kind (vLLM: ``/inference/v1/abort_requests``); ``api_key`` is sent
    as ``Authorization: Bearer <key>``; ``timeout_s`` bounds one abort call (one attempt), seconds;
    ``retries``: how many more attempts a call gets after a transient failure (see
    :mod:`sidecar.abort` for which failures are retried).

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

    ``when_unavailable``: ``not_ready`` or ``close_only``, what ``/readyz`` says while the
    engine is up but its abort endpoint refuses (:class:`WhenAbortUnavailable`).
    """

    path: Annotated[str | None, AfterValidator(_http_path)] = None
    api_key: Annotated[SecretStr | None, AfterValidator(_api_key)] = None
    timeout_s: Seconds = 2.0
    retries: Annotated[int, Field(ge=0, le=10), NotBool] = 2
    resend_window_s: SecondsOrZero = 2.0
    resend_max_interval_s: Seconds = 0.2
    confirm_timeout_s: SecondsOrZero = 2.0
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
    url: Annotated[AnyHttpUrl, AfterValidator(_engine_url)]
    health_path: Annotated[str | None, AfterValidator(_http_path)] = None
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
    sent until the response headers arrive (a non-streaming generation counts whole), seconds.
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


# An HTTP field name (RFC 9110 section 5.1: a token).
_FIELD_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# A DNS name as Kubernetes names pods and services (RFC 1123 labels), optionally ``*.``-prefixed.
_DNS_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")


def _field_name(value: str) -> str:
    if not _FIELD_NAME.fullmatch(value):
        raise ValueError("must be an HTTP header name (letters, digits and !#$%&'*+-.^_`|~), "
                         "e.g. x-prefiller-host-port")
    return value.lower()


def dns_name(value: str) -> bool:
    """True if ``value`` (lower case, no trailing dot) is a DNS name of RFC 1123 labels."""
    return 0 < len(value) <= 253 and all(_DNS_LABEL.fullmatch(p) for p in value.split("."))


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _allow_entry(value: str) -> str:
    """An ``abort_from_header.allow`` entry: an IP address, a network in CIDR notation (host
    bits clear), a DNS name, or ``*.`` and a DNS name (any name below it). Stored lower case."""
    entry = value.strip().lower().rstrip(".")
    try:
        ipaddress.ip_network(entry.strip("[]"))
        return entry.strip("[]")
    except ValueError as exc:
        if "/" in entry and _is_ip(entry.partition("/")[0]):
            raise ValueError(f"not a network: {exc} (e.g. 10.0.0.0/8; host bits must be zero)"
                             ) from exc
    if dns_name(entry.removeprefix("*.")) and "*" not in entry.removeprefix("*."):
        return entry
    raise ValueError("must be an IP address, a network (10.0.0.0/8, fd00::/8), a host name "
                     "(prefill-0.prefill.llm-d.svc.cluster.local) or *. and a domain "
                     "(*.prefill.llm-d.svc.cluster.local); no port, scheme or path (ports go "
                     "in abort_from_header.ports)")


AllowEntry = Annotated[str, AfterValidator(_allow_entry)]


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

    header: Annotated[str, AfterValidator(_field_name)]
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
    each named once (checked in :func:`_cross_reference`).

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
    refused; what is still running then is cancelled (upstream closed, engine aborted), and the
    abort calls get up to a further ``engines.*.abort.timeout_s``. The orchestrator's kill
    deadline (Kubernetes: ``terminationGracePeriodSeconds``) must exceed the sum.

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


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_SECRET_KEYS = frozenset({"api_key", "cancel_token"})


def _expand(node: Any, env: Mapping[str, str], loc: str, problems: list[ConfigProblem]) -> Any:
    """Replace ``${VAR}`` and ``${VAR:-default}`` in every string of the YAML tree."""
    if isinstance(node, dict):
        return {k: _expand(v, env, f"{loc}.{k}" if loc else str(k), problems)
                for k, v in node.items()}
    if isinstance(node, list):
        return [_expand(v, env, f"{loc}.{i}", problems) for i, v in enumerate(node)]
    if not isinstance(node, str):
        return node

    def substitute(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        if name in env:
            return env[name]
        if default is not None:
            return default
        fix = ("set it in the sidecar's environment (e.g. from a Secret), never the value "
               "in this file" if loc.rpartition(".")[2] in _SECRET_KEYS
               else f"set it or write ${{{name}:-default}}")
        problems.append(ConfigProblem(loc, f"environment variable {name} is not set; {fix}"))
        return ""

    return _VAR.sub(substitute, node)


_PUBLIC_ABORT_KEYS = frozenset({"path", "timeout_s", "retries", "when_unavailable"})
# A key whose name says it holds a secret (``cancel-token``, ``Password``, ``x-api-key``): every
# such key the schema knows is a SecretStr, so these are misspellings, and their values are masked.
_SECRET_NAME = re.compile(r"token|key|secret|pass|auth|credential", re.IGNORECASE)


def _names(loc: tuple[Hashable, ...]) -> list[Hashable]:
    """The key names in ``loc`` but an engine's name (the user's label, never masked)."""
    return [part for i, part in enumerate(loc) if not (i == 1 and loc[0] == "engines")]


def _is_secret(loc: tuple[Hashable, ...]) -> bool:
    """Whether the value at ``loc`` is never rendered: a known secret key, an unknown key whose
    name looks secret (not an engine's name: those are the user's labels), or anything under an
    engine's ``abort`` mapping but its path, timeout and retries (so ``apikey: sk-...`` is
    masked; a route's ``abort`` list names engines and stays readable)."""
    if any(part in _SECRET_KEYS or (isinstance(part, str) and _SECRET_NAME.search(part))
           for part in _names(loc)):
        return True
    # An engine's abort mapping (engines.NAME.abort...), not a route's list of engine names.
    return (len(loc) >= 4 and loc[0] == "engines" and loc[2] == "abort"
            and loc[-1] not in _PUBLIC_ABORT_KEYS)


def _userinfo_end(text: str, loc: tuple[Hashable, ...]) -> int:
    """Where the ``user:password@`` of a URL-like ``text`` ends (the index of its last ``@``), or
    -1. Not a URL parse: ``http:/u:p@h``, ``u:p@h`` and a password holding ``@`` or whitespace
    count too. Any ``@`` under a ``url`` key counts; elsewhere one with a ``:`` before it (so
    ``ops@example.com`` stays readable)."""
    head, at, _ = text.rpartition("@")
    return len(head) if at and (":" in head or "url" in _names(loc)) else -1


def _query_start(text: str, loc: tuple[Hashable, ...]) -> int:
    """Where the query (``?``) or fragment (``#``) of a ``url`` value starts, or -1: a token
    passed as ``?key=...`` is a secret like a password (the url is refused for it anyway)."""
    if "url" not in _names(loc):
        return -1
    return min((i for i in (text.find("?"), text.find("#")) if i >= 0), default=-1)


def _mask_userinfo(text: str, loc: tuple[Hashable, ...]) -> str:
    """``text`` with everything before its userinfo's ``@`` replaced by ``***``, and for a
    ``url`` value everything after its ``?`` or ``#`` (:func:`_query_start`)."""
    end = _userinfo_end(text, loc)
    if end >= 0:
        text = "***" + text[end:]
    query = _query_start(text, loc)
    return text if query < 0 else text[:query + 1] + "***"


# Every key some section of the schema knows: the value of any other key is never rendered.
_KNOWN_KEYS = frozenset(name for model in (
    Listener, AdminSettings, AbortSettings, EngineSettings, DownstreamSettings, UpstreamSettings,
    AbortFromHeaderSettings, RouteSettings, LifecycleSettings, TunnelSettings, Settings)
    for name in model.model_fields)


def _masked(value: Any, loc: tuple[Hashable, ...] = ()) -> Any:
    """``value`` as it may be rendered: secrets (:func:`_is_secret`) and the values of unknown
    keys as ``***``, URL userinfo masked (:func:`_mask_userinfo`)."""
    if _is_secret(loc):
        return "***"
    if isinstance(value, dict):
        labels = loc == ("engines",)  # engine names: the user's labels, not keys of the schema
        return {k: _masked(v, (*loc, k)) if labels or k in _KNOWN_KEYS else "***"
                for k, v in value.items()}
    if isinstance(value, list):
        return [_masked(v, (*loc, i)) for i, v in enumerate(value)]
    return _mask_userinfo(value, loc) if isinstance(value, str) else value


def _secrets(tree: Any, loc: tuple[Hashable, ...] = ()) -> set[str]:
    """Every secret string in a config tree (see :func:`_is_secret`), and the userinfo of every
    URL-like string with its likely password parts (see :func:`_userinfo_end`); each also as
    ``repr`` escapes it (``\\t``), since rendered values are ``repr``-ed."""
    if isinstance(tree, dict):
        return set().union(*(_secrets(v, (*loc, k)) for k, v in tree.items()))
    if isinstance(tree, list):
        return set().union(*(_secrets(v, (*loc, i)) for i, v in enumerate(tree)))
    if not isinstance(tree, str):
        return set()
    found = {tree} if _is_secret(loc) else set()
    if (query := _query_start(tree, loc)) >= 0:
        found.add(tree[query + 1:])
    end = _userinfo_end(tree, loc)
    if end >= 0:
        head = tree[:end]
        userinfo = head.rpartition("/")[2]
        found |= {head, userinfo, userinfo.partition(":")[2], userinfo.rpartition(":")[2],
                  userinfo.rpartition("@")[2]}
    found |= {repr(secret)[1:-1] for secret in found}
    return {secret for secret in found if len(secret) >= 3}


def _render_value(loc: tuple[Hashable, ...], value: Any) -> str:
    text = repr(_masked(value, loc))
    return text if len(text) <= 80 else text[:77] + "..."


SHORT_SECRET = 8  # a secret shorter than this is masked only as a whole word (see _scrub)


def _scrub(problems: list[ConfigProblem], secrets: set[str]) -> list[ConfigProblem]:
    """Last line of defence: no secret value survives in any message. A short secret (under
    ``SHORT_SECRET`` characters: ``local``, ``def``) only where it stands as a word of its own,
    so that an engine named like it or a word holding it (``default``) stays readable."""
    def clean(text: str | None) -> str | None:
        for secret in sorted(secrets, key=len, reverse=True):  # a password inside its userinfo
            if not text:
                break
            if len(secret) >= SHORT_SECRET:
                text = text.replace(secret, "***")
            else:
                text = re.sub(rf"(?<![\w-]){re.escape(secret)}(?![\w-])", "***", text)
        return text

    return [ConfigProblem(p.location, clean(p.message) or "", clean(p.value)) for p in problems]


# Kinds whose engines have no abort endpoint: a disconnect only closes the upstream connection.
KINDS_WITHOUT_ABORT = frozenset({EngineKind.OPENAI})


def _abort_without_endpoint(engines: Any) -> list[ConfigProblem]:
    """An ``abort`` section on an engine of a kind that cannot abort is a mistake (the user
    expects aborts that will never happen): located at ``engines.NAME.abort``."""
    problems = []
    for name, engine in engines.items() if isinstance(engines, dict) else ():
        if isinstance(engine, dict) and "abort" in engine and engine.get("kind") in {
                k.value for k in KINDS_WITHOUT_ABORT}:
            problems.append(ConfigProblem(
                f"engines.{name}.abort",
                f"engine kind {engine['kind']} has no abort endpoint (a disconnect only closes "
                "the upstream connection); remove this section, or use a kind that aborts "
                "(vllm) if the engine is one", _render_value(("engines", name, "abort"),
                                                              engine["abort"])))
    return problems


_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1", "0.0.0.0", "::"})


def _loops(engines: Any, listen: Any) -> list[ConfigProblem]:
    """An engine url that is the sidecar's own proxy listener (a loop: every request would come
    back in), located at ``engines.NAME.url``. Loopback names and the wildcard count as one
    host: a sidecar listening on ``0.0.0.0:8080`` also answers ``127.0.0.1:8080``."""
    listen = listen if isinstance(listen, dict) else {}
    host, port = listen.get("host", Listener().host), listen.get("port", Listener().port)
    if not isinstance(port, int) or isinstance(port, bool) or port == 0:
        return []
    problems = []
    for name, engine in engines.items() if isinstance(engines, dict) else ():
        url = engine.get("url") if isinstance(engine, dict) else None
        try:
            parts = urlsplit(url) if isinstance(url, str) else None
            url_port = parts.port if parts is not None else None
        except ValueError:
            continue
        if parts is None or (url_port is None and parts.scheme != "http"):
            continue
        url_host = (parts.hostname or "").lower()
        same = url_host == str(host).lower() or (url_host in _LOOPBACK and (
            str(host) in _LOOPBACK))
        if same and (url_port or 80) == port:
            problems.append(ConfigProblem(
                f"engines.{name}.url", f"is the sidecar's own listener (listen: {host}:{port}): "
                "every request would come back into the sidecar; write the engine's address "
                "(vLLM listens on 8000 unless --port says otherwise)", repr(url)))
    return problems


def _no_engine(name: str, engines: Any) -> str:
    """What to say of ``name``, which names none of ``engines`` (their names): the closest
    defined name, if one is close (a typo), and every defined name."""
    defined = sorted(map(str, engines))
    close = difflib.get_close_matches(name, defined, n=1, cutoff=0.6)
    mean = f"; did you mean '{close[0]}'?" if close else ""
    return f"names no defined engine{mean} (defined: {', '.join(defined) or 'none'})"


def _route_aborts(i: int, names: Any, engines: Any) -> list[ConfigProblem]:
    """``routes.N.abort``: each name a defined engine of a kind that aborts, named once."""
    if not isinstance(names, list) or not isinstance(engines, dict):
        return []
    problems = []
    first: dict[str, int] = {}
    for j, name in enumerate(names):
        loc = f"routes.{i}.abort.{j}"
        if not isinstance(name, str):
            continue
        engine = engines.get(name)
        if name in first:
            problems.append(ConfigProblem(loc, f"duplicates routes.{i}.abort.{first[name]}",
                                          repr(name)))
        elif engine is None:
            problems.append(ConfigProblem(loc, _no_engine(name, engines), repr(name)))
        elif isinstance(engine, dict) and engine.get("kind") in {
                k.value for k in KINDS_WITHOUT_ABORT}:
            problems.append(ConfigProblem(
                loc, f"engine {name} is of kind {engine['kind']}, which has no abort endpoint; "
                "list only engines that abort (e.g. the vllm prefill and decode engines behind "
                "a router)", repr(name)))
        first.setdefault(name, j)
    return problems


def _header_template(i: int, section: Any, engines: Any) -> list[ConfigProblem]:
    """``routes.N.abort_from_header.engine``: a defined engine of a kind that aborts."""
    name = section.get("engine") if isinstance(section, dict) else None
    if not isinstance(name, str) or not isinstance(engines, dict):
        return []
    loc = f"routes.{i}.abort_from_header.engine"
    engine = engines.get(name)
    if engine is None:
        return [ConfigProblem(loc, _no_engine(name, engines), repr(name))]
    if isinstance(engine, dict) and engine.get("kind") in {k.value for k in KINDS_WITHOUT_ABORT}:
        return [ConfigProblem(
            loc, f"engine {name} is of kind {engine['kind']}, which has no abort endpoint; name "
            "an engine of the prefill pods' kind (vllm or sglang) as the template", repr(name))]
    return []


def _cross_reference(raw: dict[str, Any]) -> list[ConfigProblem]:
    """Checks across sections, on the raw tree so they run even when the schema check failed."""
    engines = raw.get("engines")
    problems = _abort_without_endpoint(engines) + _loops(engines, raw.get("listen"))
    routes = raw.get("routes")
    names = set(engines) if isinstance(engines, dict) else None
    seen: dict[str, int] = {}
    for i, route in enumerate(routes if isinstance(routes, list) else []):
        if not isinstance(route, dict):
            continue
        engine, prefix = route.get("engine"), route.get("prefix")
        if names is not None and isinstance(engine, str) and engine not in names:
            problems.append(ConfigProblem(f"routes.{i}.engine", _no_engine(engine, names),
                                          repr(engine)))
        problems.extend(_route_aborts(i, route.get("abort"), engines))
        problems.extend(_header_template(i, route.get("abort_from_header"), engines))
        if isinstance(prefix, str):
            if prefix in seen:
                problems.append(ConfigProblem(
                    f"routes.{i}.prefix", f"duplicates routes.{seen[prefix]}.prefix",
                    repr(prefix)))
            seen.setdefault(prefix, i)
    return problems


_UNKNOWN_KEY = "unknown key (value not shown); check its spelling and section"
_MERGE = "tag:yaml.org,2002:merge"
_VALUE = "tag:yaml.org,2002:value"


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, recording every key given twice in one mapping (PyYAML itself keeps
    the last silently), a ``<<`` merge key too, as a problem located by its dotted path, with
    both line numbers; and the line of every key and list item, by dotted path (``lines``, for
    :func:`_at_lines`)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.duplicates: list[ConfigProblem] = []
        self.lines: dict[str, int] = {}  # dotted path -> 1-based line of its key or list item
        self._seen: set[int] = set()

    def construct_document(self, node: yaml.Node) -> Any:
        self._check(node, "")
        return super().construct_document(node)

    def _check(self, node: yaml.Node, path: str) -> None:
        """Check every mapping node once (an alias repeats none), first path wins, before any is
        constructed: constructing a ``<<`` merges it away, rewriting the mapping node in place."""
        if id(node) in self._seen:
            return
        self._seen.add(id(node))
        children: list[tuple[str, yaml.Node]] = []
        if isinstance(node, yaml.MappingNode):
            first: dict[Hashable, int] = {}
            for key_node, value_node in node.value:
                name = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else "?"
                children.append((name, value_node))
                if key_node.tag == _MERGE:
                    key: Any = _MERGE  # not the string "<<", which a quoted '<<' would be
                elif key_node.tag == _VALUE:
                    key = "="  # as PyYAML reads it
                elif isinstance(key_node, yaml.ScalarNode):
                    key = self.construct_object(key_node)  # 1 and 0x1 are one key
                else:
                    continue  # a collection key: PyYAML reports it unhashable
                line = key_node.start_mark.line + 1
                self.lines.setdefault(f"{path}.{name}" if path else name, line)
                if not isinstance(key, Hashable):
                    continue
                if key in first:
                    advice = ("merge several mappings with one `<<: [*a, *b]` (the first listed "
                              "wins on shared keys)" if key == _MERGE else
                              "YAML would keep only the last; remove or rename one")
                    self.duplicates.append(ConfigProblem(
                        f"{path}.{name}" if path else name,
                        f"duplicate key (line {first[key]} and line {line}): {advice}"))
                first.setdefault(key, line)
        elif isinstance(node, yaml.SequenceNode):
            children = [(str(i), v) for i, v in enumerate(node.value)]
            for name, child in children:
                self.lines.setdefault(f"{path}.{name}" if path else name,
                                      child.start_mark.line + 1)
        for name, child in children:
            self._check(child, f"{path}.{name}" if path else name)


def _load_yaml(text: str) -> tuple[Any, list[ConfigProblem], dict[str, int]]:
    """The YAML tree of ``text``, its duplicate-key problems and the line of every dotted path
    (:attr:`_Loader.lines`). Raises ``yaml.YAMLError``."""
    loader = _Loader(text)
    try:
        return loader.get_single_data(), loader.duplicates, loader.lines
    finally:
        loader.dispose()


def _at_lines(problems: list[ConfigProblem], lines: Mapping[str, int]) -> list[ConfigProblem]:
    """Each problem with the file line of its location, or of the nearest enclosing key or list
    item the file has (a missing key: the mapping that lacks it; a key a ``<<`` merge brought:
    the mapping that merged it), as ``line N: `` before its message; a problem of no line (a
    top-level key that is missing) as it is."""
    located = []
    for problem in problems:
        path = problem.location
        while path and path not in lines:
            path = path.rpartition(".")[0]
        line = lines.get(path) if path else None
        located.append(problem if line is None else ConfigProblem(
            problem.location, f"line {line}: {problem.message}", problem.value))
    return located


def parse_config(text: str, source: str = "<string>",
                 env: Mapping[str, str] | None = None) -> Settings:
    """Validate config text (YAML).

    Returns the frozen :class:`Settings`. Raises :class:`ConfigError` listing every problem, each
    with its dotted location, what was wrong and the offending value (secrets masked).
    """
    try:
        raw, problems, lines = _load_yaml(text)
    except yaml.YAMLError as exc:
        # Only the position and the problem: PyYAML's full message quotes the offending line,
        # which may hold a key.
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ConfigError(source, [ConfigProblem(where, f"not valid YAML: {problem}")]) from exc
    if not isinstance(raw, dict):
        raise ConfigError(source, [ConfigProblem("", "must be a YAML mapping at the top level",
                                                 type(raw).__name__)])
    loaded = len(problems)  # the duplicates: their message names their lines already
    expanded = _expand(raw, os.environ if env is None else env, "", problems)
    # A value that is nothing but an unset ${VAR} was already named (it expands to ""): its
    # validation error would only say the same thing twice. Any other error there is kept.
    unset = {problem.location for problem in problems[loaded:]}

    def cross_reference() -> list[ConfigProblem]:  # but "names no defined engine (got '')"
        return [p for p in _cross_reference(expanded)
                if not (p.location in unset and p.value == repr(""))]

    settings, invalid = None, None
    try:
        settings = Settings.model_validate(expanded)
    except ValidationError as exc:
        problems.extend(_schema_problems(exc, unset))
        invalid = exc
    problems.extend(cross_reference())
    problems.extend(_listener_clash(expanded))  # every problem, not only the model's
    if settings is None or problems:
        located = problems[:loaded] + _at_lines(problems[loaded:], lines)
        raise ConfigError(source, _scrub(located, _secrets(raw) | _secrets(expanded))
                          ) from invalid
    return settings


def _schema_problems(exc: ValidationError, unset: set[str]) -> list[ConfigProblem]:
    """The problems of a failed :class:`Settings` validation, each named once with its fix:
    an unknown key with the closest key its section has (a required key that it names is not
    also "Field required": ``rotues`` is one problem), a URL without a scheme as such, and no
    problem for a value that is only an unset ``${VAR}`` in ``unset`` (already named)."""
    errors = exc.errors()
    close = {i: _close_key(err["loc"]) for i, err in enumerate(errors)
             if err["type"] == "extra_forbidden"}
    meant = {(*errors[i]["loc"][:-1], key) for i, key in close.items() if key is not None}
    problems = []
    for i, err in enumerate(errors):
        loc = ".".join(str(part) for part in err["loc"])
        if (loc in unset and err["input"] == "" and err["type"] != "extra_forbidden"):
            continue
        if err["type"] == "extra_forbidden":  # a typo's value may be anything, a key too
            key = close[i]
            problems.append(ConfigProblem(
                loc, _UNKNOWN_KEY + (f"; did you mean '{key}'?" if key else "")))
            continue
        if err["type"] == "missing" and tuple(err["loc"]) in meant:
            continue  # the unknown key that names it says so
        value = None if err["type"] == "missing" else _render_value(err["loc"], err["input"])
        message = err["msg"].removeprefix("Value error, ")
        if (err["type"] in ("url_parsing", "url_scheme") and isinstance(err["input"], str)
                and err["input"] and "://" not in err["input"]):
            # pydantic says "relative URL without a base" (127.0.0.1:8000), or takes the host
            # for a scheme (vllm:8000)
            message = "has no scheme: write it as http://HOST:PORT (or https://HOST:PORT)"
        if err["type"] == "enum" and err["loc"][-1] == "kind" and isinstance(err["input"], str):
            message += _kind_hint(err["input"])
        problems.append(ConfigProblem(loc, message, value))
    return problems


# Servers people name as a kind that have no adapter of their own: OpenAI-compatible, no abort
# endpoint the sidecar knows (engine/openai.py: close-only).
_OPENAI_SERVERS = frozenset({"tgi", "text-generation-inference", "llamacpp", "llama.cpp",
                             "llama-cpp", "llama_cpp", "llama-server", "ollama", "lmdeploy",
                             "trtllm", "tensorrt-llm", "litellm", "openai-compatible"})


def _kind_hint(given: str) -> str:
    """What to add to an unknown ``engines.NAME.kind``: the kind it spells in other case or
    nearly (``vLLM``, ``sglnag``), or ``openai`` for an OpenAI-compatible server that has no
    kind of its own (``tgi``, ``ollama``, ``llama.cpp``)."""
    kinds = [k.value for k in EngineKind]
    lower = given.strip().lower()
    if lower in kinds:
        return f"; did you mean '{lower}'? (kinds are lower case)"
    if lower in _OPENAI_SERVERS:
        return ("; an OpenAI-compatible server with no kind of its own is kind 'openai' (a "
                "disconnect closes its upstream connection; nothing is aborted by id)")
    close = difflib.get_close_matches(lower, kinds, n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def _close_key(loc: tuple[int | str, ...]) -> str | None:
    """The key of its section closest to the unknown key at ``loc``
    (:func:`difflib.get_close_matches`: ``rotues`` -> ``routes``), or ``None``. The section is
    found by walking :class:`Settings`' fields along ``loc`` (list indexes and mapping keys
    skipped)."""
    model: type[BaseModel] | None = Settings
    for part in loc[:-1]:
        if model is None:
            return None
        field = model.model_fields.get(str(part))
        if field is None:
            continue  # a list index or a mapping key (an engine's name): same model inside
        model = _model_in(field.annotation)
    if model is None:
        return None
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1, cutoff=0.75)
    return close[0] if close else None


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The config model an annotation holds: itself, or inside Optional, list, dict or
    Annotated; ``None`` for a plain value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        if (found := _model_in(arg)) is not None:
            return found
    return None


def _listener_clash(expanded: dict[str, Any]) -> list[ConfigProblem]:
    """``admin.port`` on ``listen``'s address, read from the two sections alone, so that it is
    reported next to problems elsewhere in the file; none if either section is itself invalid
    (that is reported as such)."""
    try:
        listen = Listener.model_validate(expanded.get("listen", {}))
        admin_raw = expanded.get("admin", {})
        admin = None if admin_raw is None else AdminSettings.model_validate(admin_raw)
    except ValidationError:
        return []
    if admin is None or not admin.port or (admin.host, admin.port) != (listen.host, listen.port):
        return []
    return [ConfigProblem("admin.port", "must differ from listen.port on the same host (the "
                          "default admin port is 9090)", str(admin.port))]


def load_config(path: Path, env: Mapping[str, str] | None = None) -> Settings:
    """Read and validate the config file at ``path``. Raises :class:`ConfigError`."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(str(path), [ConfigProblem("", f"cannot read file: {exc}")]) from exc
    return parse_config(text, str(path), env)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name, or "" (every address)


def open_cancel_api(settings: Settings, port: int | None = None) -> str | None:
    """``HOST:PORT`` of an admin listener whose cancel API takes unauthenticated calls from
    beyond loopback (``admin.host`` not a loopback address, no ``admin.cancel_token``), else
    None. ``port``: the bound admin port, when known (``admin.port`` may be 0)."""
    admin = settings.admin
    if admin is None or admin.cancel_token is not None or _is_loopback(admin.host):
        return None
    return f"{admin.host}:{admin.port if port is None else port}"


def warn_open_cancel_api(new: Settings, running: Settings | None = None,
                         port: int | None = None) -> None:
    """Log a WARNING when ``new`` leaves the cancel API open beyond loopback (see
    :func:`open_cancel_api`): at start (``running`` None; ``port`` the bound admin port), and on
    a reload only when the file changed that compared with ``running`` (admin needs a restart)."""
    where = open_cancel_api(new, port)
    if where is None:
        return
    if running is None:
        log.warning("the cancel API on %s is open to anyone who can reach it; set "
                    "admin.cancel_token", where)
    elif where != open_cancel_api(running):
        log.warning("reload: after a restart (admin changes need one) the cancel API on %s will "
                    "be open to anyone who can reach it; set admin.cancel_token", where)
