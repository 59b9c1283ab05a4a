"""The config's named value types and the checks behind them.

Each check raises ``ValueError`` with a message that says how to fix the input (pydantic puts it
in the problem for the value's dotted location): ``Port``, ``Seconds`` (> 0, at most
:data:`MAX_SECONDS`), ``SecondsOrZero``, ``OptionalSeconds`` (null for no limit), an engine's
url (an origin, no ``user:password@``), an HTTP path or header name, an ``allow`` entry, secrets
(``ApiKey``, ``CancelToken``: ASCII, no control characters); and the enums :class:`EngineKind`
and :class:`WhenAbortUnavailable`. YAML ``true``/``false`` is never a number here (``NotBool``).
"""

from __future__ import annotations

import enum
import ipaddress
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, AnyHttpUrl, BeforeValidator, Field, SecretStr


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


# Kinds whose engines have no abort endpoint: a disconnect only closes the upstream connection.
KINDS_WITHOUT_ABORT = frozenset({EngineKind.OPENAI})
# The keys whose values are secrets (``SecretStr``: never printed, :mod:`sidecar.config.secrets`).
SECRET_KEYS = frozenset({"api_key", "cancel_token"})

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


def _listen_host(value: str) -> str:
    """An empty host means every address to aiohttp (``0.0.0.0`` and ``::``): refused, so that
    an empty ``${VAR:-}`` never opens a listener to the network by accident."""
    if not value.strip():
        raise ValueError("must not be empty: write 0.0.0.0 (every IPv4 address), :: (every "
                         "address) or an address (an empty ${VAR} usually means it is unset)")
    return value


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


# The named types, each a Python type and the checks above.
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
AllowEntry = Annotated[str, AfterValidator(_allow_entry)]
ListenHost = Annotated[str, AfterValidator(_listen_host)]
HttpPath = Annotated[str | None, AfterValidator(_http_path)]
FieldName = Annotated[str, AfterValidator(_field_name)]
EngineUrl = Annotated[AnyHttpUrl, AfterValidator(_engine_url)]
ApiKey = Annotated[SecretStr | None, AfterValidator(_api_key)]
CancelToken = Annotated[SecretStr | None, AfterValidator(_cancel_token)]
