"""The header names the sidecar reads and writes itself, and header rewriting for one proxy hop
(RFC 9110 section 7.6).

The sidecar's own fields: :data:`REQUEST_ID` (the sidecar request id, returned to the client; a
client's own value goes upstream as :data:`CLIENT_REQUEST_ID` and is returned under that name),
:data:`DEADLINE_HEADER` (a client's deadline, addressed to the sidecar: never forwarded; parsed
by :meth:`sidecar.route.RouteTarget.deadline_s`) and :data:`SHOULD_RETRY`.

Downstream -> upstream: drop hop-by-hop fields (section 7.6.1: ``Connection`` and every field it
names, ``Proxy-Connection``, ``Keep-Alive``, ``TE``, ``Transfer-Encoding``, ``Upgrade``, plus
``Proxy-Authenticate``/``Proxy-Authorization`` from RFC 7230's list); drop ``Host`` (the upstream
client sets the upstream's) and ``Expect`` (the sidecar answers ``100-continue`` itself); append
``X-Forwarded-For``/``X-Forwarded-Proto``. ``Authorization`` passes unchanged.

Upstream -> downstream: the same hop-by-hop filter; everything else byte-for-byte, repeated fields
included.

An upgrade request (``Connection: upgrade`` with an ``Upgrade`` field, :func:`is_upgrade`) keeps
its ``Upgrade`` field and goes upstream with ``Connection: Upgrade`` (RFC 9110 section 7.8: a
proxy that relays the upgrade must forward both); the other hop-by-hop fields are dropped as
above. The engine's ``101`` is relayed byte for byte by :mod:`sidecar.tunnel`, never filtered.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from multidict import CIMultiDict, CIMultiDictProxy, istr

REQUEST_ID = "X-Request-Id"
SHOULD_RETRY = "X-Should-Retry"  # the openai SDKs' retry override (not a standard header)
CLIENT_REQUEST_ID = "X-Client-Request-Id"
# A client's deadline for its request, seconds (a positive decimal number); it can only lower the
# route's max_duration_s. Addressed to the sidecar: never forwarded upstream.
DEADLINE_HEADER = "X-Sidecar-Deadline-S"

HOP_BY_HOP = frozenset(
    istr(name)
    for name in (
        "Connection",
        "Proxy-Connection",
        "Keep-Alive",
        "TE",
        "Transfer-Encoding",
        "Upgrade",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "Trailer",
    )
)
_DROP_UPSTREAM = HOP_BY_HOP | {istr("Host"), istr("Expect")}


def _connection_tokens(headers: CIMultiDictProxy[str] | CIMultiDict[str]) -> set[str]:
    return {
        token.strip().lower()
        for value in headers.getall("Connection", ())
        for token in value.split(",")
        if token.strip()
    }


def _filtered(
    pairs: Iterable[tuple[str, str]], drop: frozenset[istr], named: set[str]
) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in pairs:
        if name in drop or name.lower() in named:
            continue
        out.add(name, value)
    return out


def upstream_request_headers(
    headers: CIMultiDictProxy[str], client_ip: str | None, proto: str
) -> CIMultiDict[str]:
    """Headers to send upstream for a downstream request with ``headers``.

    ``client_ip`` is the peer address (``None`` for a Unix socket); ``proto`` is ``http``/``https``.
    """
    out = _filtered(headers.items(), _DROP_UPSTREAM, _connection_tokens(headers))
    if client_ip is not None:
        _append(out, "X-Forwarded-For", client_ip)
    _append(out, "X-Forwarded-Proto", proto)
    return out


def is_upgrade(headers: CIMultiDictProxy[str]) -> bool:
    """True if a request asks to switch protocols: ``Connection`` names ``upgrade`` and an
    ``Upgrade`` field is present (RFC 9110 section 7.8)."""
    return "upgrade" in _connection_tokens(headers) and bool(headers.get("Upgrade"))


def upgrade_request_headers(
    headers: CIMultiDictProxy[str], client_ip: str | None, proto: str
) -> CIMultiDict[str]:
    """As :func:`upstream_request_headers`, for an upgrade request: its ``Upgrade`` field(s)
    kept and ``Connection: Upgrade`` set (the other fields ``Connection`` names still
    dropped). ``Host`` is left to the caller."""
    out = upstream_request_headers(headers, client_ip, proto)
    for value in headers.getall("Upgrade"):
        out.add("Upgrade", value)
    out["Connection"] = "Upgrade"
    return out


def downstream_response_headers(headers: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    """Headers to send downstream for an upstream response with ``headers``."""
    return _filtered(headers.items(), HOP_BY_HOP, _connection_tokens(headers))


# What aiohttp refuses to write in a header (``http_writer._FORBIDDEN_HEADER_CHARS_RE``; RFC 9110
# section 5.5): control characters but HTAB. aiohttp's client accepts them in what it reads.
_FORBIDDEN_HEADER_CHARS = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def is_event_stream(headers: Mapping[str, str]) -> bool:
    """True if ``headers`` (a response head's) say ``Content-Type: text/event-stream``, any
    parameters and case. Not aiohttp's ``content_type``: it parses with the email package, ~30
    us."""
    ctype = headers.get("Content-Type", "")
    return ctype.partition(";")[0].strip().lower() == "text/event-stream"


def has_forbidden_characters(headers: CIMultiDictProxy[str], reason: str = "") -> bool:
    """True if a header name or value, or the ``reason`` phrase, holds a character aiohttp
    cannot send downstream: such an upstream response is malformed (relaying it raised in
    ``prepare``, or for a line feed in the reason in ``StreamResponse``, and the client got a
    500 as for a sidecar bug). RFC 9112 section 4: reason-phrase = 1*( HTAB / SP / VCHAR /
    obs-text )."""
    return bool(_FORBIDDEN_HEADER_CHARS.search(reason)) or any(
        _FORBIDDEN_HEADER_CHARS.search(name) or _FORBIDDEN_HEADER_CHARS.search(value)
        for name, value in headers.items())


def _append(headers: CIMultiDict[str], name: str, value: str) -> None:
    """Append ``value`` to a comma-separated list field, folding repeated fields into one."""
    existing = headers.getall(name, ())
    if existing:
        headers.popall(name)
        headers[name] = ", ".join([*existing, value])
    else:
        headers[name] = value


def unsupported_transfer_coding(headers: CIMultiDictProxy[str]) -> bool:
    """True if a request's ``Transfer-Encoding`` names a coding other than ``chunked``.

    aiohttp 3.14's parser refuses (400) one that does not end in ``chunked`` but accepts, for
    instance, ``gzip, chunked``: it removes the chunked framing and never decodes the gzip, so
    the engine would get gzip bytes labelled as nothing (the field is hop-by-hop). RFC 9112
    section 6.1: a server SHOULD answer 501 to a transfer coding it does not understand.
    """
    return any(coding.strip().lower() != "chunked"
               for value in headers.getall("Transfer-Encoding", ())
               for coding in value.split(","))
