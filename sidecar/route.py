"""Routes: which engine serves a request path, and which engines abort its cancelled requests.

Prefixes match on path-segment boundaries (``/v1`` matches ``/v1`` and ``/v1/models``, never
``/v10``); the longest matching prefix wins, so ``/`` is a catch-all.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass, field

from engine import EngineAdapter
from sidecar.config import Settings


@dataclass(frozen=True, slots=True)
class RouteTarget:
    """A matched route: its configured prefix, the adapter of the engine behind it, and the
    adapters of the engines its cancelled requests are aborted at (``routes[].abort``; by
    default just ``engine``; several for prefill/decode or data-parallel fan-out), and its
    ``max_duration_s`` (seconds, ``None``: no deadline of its own).

    The request-shaping methods ask every adapter involved (``engine`` first, then the abort
    engines), so each engine sees the same sidecar id and each can derive its own ids.
    """

    prefix: str
    engine: EngineAdapter
    aborts: tuple[EngineAdapter, ...] = ()
    max_duration_s: float | None = None
    _shapers: tuple[EngineAdapter, ...] = field(init=False, repr=False)
    forbidden_paths: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        if not self.aborts:
            object.__setattr__(self, "aborts", (self.engine,))
        shapers = (self.engine, *(a for a in self.aborts if a is not self.engine))
        object.__setattr__(self, "_shapers", shapers)
        # A router may forward a client's call to an abort engine's endpoint: refuse them all.
        object.__setattr__(self, "forbidden_paths",
                           frozenset().union(*(a.forbidden_paths() for a in shapers)))

    def tag(self, path: str, sidecar_id: str, headers: MutableMapping[str, str]) -> None:
        """Tag the upstream request for every engine involved (see :meth:`EngineAdapter.tag`)."""
        for adapter in self._shapers:
            adapter.tag(path, sidecar_id, headers)

    def wants_body(self, method: str, path: str) -> bool:
        """True if some abort engine needs the body copy to derive its ids."""
        return any(a.wants_body(method, path) for a in self.aborts)

    def rewrites_body(self, method: str, path: str) -> bool:
        return any(a.rewrites_body(method, path) for a in self._shapers)

    def rewrite_body(self, method: str, path: str, sidecar_id: str, body: bytes) -> bytes | None:
        """Each engine's rewrite applied in turn; ``None`` if none changed the body."""
        new = None
        for adapter in self._shapers:
            if adapter.rewrites_body(method, path):
                new = adapter.rewrite_body(method, path, sidecar_id,
                                           body if new is None else new) or new
        return new


class Router:
    """Longest-prefix match over the configured routes."""

    def __init__(self, settings: Settings, adapters: dict[str, EngineAdapter]) -> None:
        routes = sorted(settings.routes, key=lambda r: len(r.prefix.rstrip("/")), reverse=True)
        self._targets = [
            (r.prefix.rstrip("/"), RouteTarget(
                r.prefix, adapters[r.engine], tuple(adapters[n] for n in r.abort_engines()),
                r.max_duration_s))
            for r in routes
        ]

    def match(self, path: str) -> RouteTarget | None:
        """The target for ``path`` (already percent-decoded), or ``None`` if no route covers it."""
        for stem, target in self._targets:
            if path == stem or path.startswith(stem + "/") or not stem:
                return target
        return None
