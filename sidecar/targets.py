"""Per-request abort targets: one more engine to abort, named by a request header.

A route's ``abort_from_header`` (:class:`~sidecar.config.AbortFromHeaderSettings`) names a
request header whose value is ``host:port`` of an engine chosen per request, and a configured
engine of the same kind used as a template. When a request of the route ends early, the
sidecar aborts that engine too, with the ids the template's kind derives, through the same
:class:`~sidecar.abort.Aborter` as every other engine (its batching, bounds and retries)::

    early end ──► RouteTarget.abort_engines(headers)
                    └► HeaderTargets.resolve: parse_value(header values)
                          refused (several_values, userinfo, scheme, path, malformed,
                                   not_allowed): counted, logged (never the value's secrets),
                                   never called
                          allowed: the adapter for that origin (an LRU of MAX_TARGETS, built
                                   from the template with EngineAdapter.at), aborted as well

Cold path: the header is read and checked only when a request ends early, before any call is
queued; the request itself is served whatever the header says, and the header goes upstream
unchanged (the routing sidecar behind needs it).

Written for llm-d (github.com/llm-d/llm-d-router, read at ebab68792):

- The scheduler names the prefill pod in ``x-prefiller-host-port``, ``<ip:port>``
  (``pkg/common/routing/common.go``, ``PrefillEndpointHeader``; set in
  ``pkg/epp/framework/plugins/scheduling/profilehandler/disagg/disagg_headers_handler.go``,
  one value). Before November 2025 the routing sidecar also read ``x-prefiller-url`` when that
  header was absent (``pkg/sidecar/proxy/chat_completions.go`` before commit 90dcc5952).
- The decode pod's routing sidecar (``pkg/sidecar/proxy/chat_completions.go``,
  ``disaggregatedPrefillHandler``) reads every value, deletes the header before forwarding,
  splits one value at commas and uses the first entry (a random one with
  ``--enable-prefiller-sampling``), checks its host against the InferencePool's pod IPs and
  names (``allowlist.go``, ``IsAllowed``; 403 otherwise, only with
  ``--enable-ssrf-protection``), and sends the prefill leg to ``http://`` (``https://`` with TLS
  to prefillers) plus the value, a leading ``http://`` trimmed (``proxy.go``,
  ``createProxyHandler``). So a list is refused here (``several_values``): which entry ran is
  not knowable with sampling on; a leading ``http://`` is accepted as llm-d accepts it.
- The prefill leg is the client's request (same path, headers and body but for the token
  limits and stream fields and ``kv_transfer_params``), so it runs at the prefill engine under
  the ids the sidecar's tag gave the whole request: NIXL v2 (``connector_nixlv2.go``,
  ``handleNIXLV2``) clones the request and ``Header.Add``s its own uuid as ``x-request-id``, so
  the prefill engine gets two values, the sidecar's first, and vLLM takes the first
  (``vllm/entrypoints/serve/engine/serving.py``, ``_base_request_id``: starlette's
  ``Headers.get``); SGLang (``connector_sglang.go``), Mooncake (``connector_mooncake.go``) and
  P2P (``connector_p2p.go``) clone the headers unchanged and keep the body's ``rid``; those three
  send the prefill leg with ``context.WithoutCancel``, so it runs on after the client left.
  Not knowable: NIXL v2 with ``--moriio-parallel-dispatch`` (``runNIXLProtocolV2WriteParallel``)
  ``Header.Set``s its own uuid, replacing the sidecar's id; such prefill legs are not aborted by
  id (the call names ids the engine does not have: a no-op).
"""

from __future__ import annotations

import enum
import ipaddress
import logging
import re
from collections import OrderedDict
from dataclasses import dataclass

from multidict import MultiMapping

from engine import EngineAdapter
from sidecar.config import AbortFromHeaderSettings, dns_name
from sidecar.metrics import Metrics

log = logging.getLogger(__name__)

MAX_TARGETS = 256  # per route: adapters kept for the most recently named host:port
ALLOWED = "allowed"  # the verdict label of a value whose engine is aborted too
_PORT = re.compile(r"[0-9]{1,5}")
# A name that resolvers read as an IPv4 address (inet_aton: "010.1.1.1" is octal, "0x7f000001"
# is 127.0.0.1): it would dodge the networks of the allowlist.
_NUMERIC_LABEL = re.compile(r"0x[0-9a-f]*|[0-9]+")
_LLM_D_PREFIX = "http://"  # trimmed by llm-d's createProxyHandler

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class Refusal(enum.StrEnum):
    """Why a header value is never called; the ``verdict`` label of
    ``cancel_sidecar_header_abort_targets_total`` (a fixed set: low cardinality)."""

    SEVERAL_VALUES = "several_values"  # the header repeated, or a comma-separated list
    USERINFO = "userinfo"  # user:password@ (the value is never logged)
    SCHEME = "scheme"  # a scheme other than llm-d's tolerated leading http://
    PATH = "path"  # a path, query or fragment after host:port
    MALFORMED = "malformed"  # not host:port with a port 1..65535
    NOT_ALLOWED = "not_allowed"  # host or port not in abort_from_header.allow / ports


@dataclass(frozen=True, slots=True)
class HostPort:
    """A checked ``host:port``: ``host`` lower case (an IPv6 literal without brackets), ``ip``
    its address if it is one, ``port`` 1..65535."""

    host: str
    port: int
    ip: IPAddress | None

    def origin(self, scheme: str) -> str:
        """``scheme://host:port``, an IPv6 literal in brackets."""
        host = f"[{self.host}]" if isinstance(self.ip, ipaddress.IPv6Address) else self.host
        return f"{scheme}://{host}:{self.port}"

    def __str__(self) -> str:
        return self.origin("").removeprefix("://")


def parse_value(values: list[str]) -> HostPort | Refusal | None:
    """The target named by a header's ``values`` (every occurrence), or why it is refused, or
    ``None`` when the header is absent or empty (llm-d then runs no prefill leg).

    Accepted: exactly one value ``host:port`` (surrounding whitespace dropped, as llm-d's
    ``strings.TrimSpace``), optionally after a literal ``http://``; ``host`` an IPv4 address, a
    DNS name (RFC 1123 labels, not all numeric), or ``[IPv6]``; ``port`` decimal 1..65535.
    """
    if not values or not any(v.strip() for v in values):
        return None
    if len(values) > 1:
        return Refusal.SEVERAL_VALUES
    value = values[0].strip()
    if "," in value:
        return Refusal.SEVERAL_VALUES
    if "@" in value:
        return Refusal.USERINFO
    value = value.removeprefix(_LLM_D_PREFIX)
    if "://" in value:
        return Refusal.SCHEME
    if any(c in value for c in "/?#"):
        return Refusal.PATH
    return _host_port(value)


def _host_port(value: str) -> HostPort | Refusal:
    if value.startswith("["):
        host, bracket, port = value[1:].partition("]")
        if not bracket or not port.startswith(":"):
            return Refusal.MALFORMED
        port = port[1:]
        ip = _ip(host)
        if not isinstance(ip, ipaddress.IPv6Address):
            return Refusal.MALFORMED
    else:
        host, colon, port = value.rpartition(":")
        if not colon or ":" in host:  # no port, or a bare IPv6 literal (Go: too many colons)
            return Refusal.MALFORMED
        ip = _ip(host)
        if ip is None:
            host = host.lower()
            if not dns_name(host) or all(_NUMERIC_LABEL.fullmatch(p) for p in host.split(".")):
                return Refusal.MALFORMED
        elif not isinstance(ip, ipaddress.IPv4Address):
            return Refusal.MALFORMED
    if not _PORT.fullmatch(port) or not 1 <= int(port) <= 65535:
        return Refusal.MALFORMED
    return HostPort(host if ip is None else str(ip), int(port), ip)


def _ip(text: str) -> IPAddress | None:
    if "%" in text:  # an IPv6 zone: never a pod address
        return None
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


class Allowlist:
    """``abort_from_header.allow`` and ``ports``: addresses in a network, exact host names, and
    names below a ``*.domain``; a name never matches a network (nothing is resolved here)."""

    def __init__(self, entries: list[str], ports: list[int] | None) -> None:
        self.networks = [ipaddress.ip_network(e) for e in entries if _network(e)]
        self.names = frozenset(e for e in entries if not _network(e) and not e.startswith("*."))
        self.suffixes = tuple(e[1:] for e in entries if e.startswith("*."))  # ".domain"
        self.ports = None if ports is None else frozenset(ports)

    def allows(self, target: HostPort) -> bool:
        if self.ports is not None and target.port not in self.ports:
            return False
        if target.ip is not None:
            ip = target.ip
            mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
            return any(a in n for n in self.networks for a in (ip, mapped)
                       if a is not None and a.version == n.version)
        return target.host in self.names or target.host.endswith(self.suffixes)


def _network(entry: str) -> bool:
    try:
        ipaddress.ip_network(entry)
    except ValueError:
        return False
    return True


class HeaderTargets:
    """One route's ``abort_from_header``: checks a request's header and hands out the adapter
    of the engine it names (``template`` at that origin), from an LRU of ``MAX_TARGETS``."""

    def __init__(self, settings: AbortFromHeaderSettings, template: EngineAdapter,
                 route: str) -> None:
        self.header = settings.header
        self.template = template
        self.route = route
        self.allowlist = Allowlist(settings.allow, settings.ports)
        self._scheme = template.base_url.partition("://")[0]
        self._adapters: OrderedDict[str, EngineAdapter] = OrderedDict()

    def resolve(self, headers: MultiMapping[str], sidecar_id: str,
                metrics: Metrics) -> EngineAdapter | None:
        """The adapter to abort for a request with ``headers`` that ended early, or ``None``
        (no header, or a value refused: counted in
        ``cancel_sidecar_header_abort_targets_total{route, verdict}`` and logged without the
        value unless it is a well-formed ``host:port``). Never raises on any header value."""
        target = parse_value(headers.getall(self.header, []))
        if target is None:
            return None
        counter = metrics.header_targets
        if isinstance(target, Refusal):
            counter.labels(self.route, target).inc()
            log.warning("request %s: header %s is refused as an abort target (%s; value not "
                        "shown); nothing is called for it", sidecar_id, self.header, target)
            return None
        if not self.allowlist.allows(target):
            counter.labels(self.route, Refusal.NOT_ALLOWED).inc()
            log.warning("request %s: header %s names %s, not in the route's "
                        "abort_from_header.allow/ports; it is not aborted", sidecar_id,
                        self.header, target)
            return None
        counter.labels(self.route, ALLOWED).inc()
        adapter = self.adapter(target)
        log.info("request %s: %s names %s: aborted as engine %s (its template) too", sidecar_id,
                 self.header, target, self.template.name)
        return adapter

    def adapter(self, target: HostPort) -> EngineAdapter:
        """The template's adapter at ``target`` (the same object while it stays among the
        ``MAX_TARGETS`` most recently used, so its aborts share one batching queue)."""
        origin = target.origin(self._scheme)
        adapter = self._adapters.get(origin)
        if adapter is None:
            adapter = self._adapters[origin] = self.template.at(origin)
            if len(self._adapters) > MAX_TARGETS:
                self._adapters.popitem(last=False)
        else:
            self._adapters.move_to_end(origin)
        return adapter

    def __len__(self) -> int:
        return len(self._adapters)
