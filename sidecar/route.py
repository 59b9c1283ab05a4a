"""Routes: which engine serves a request path.

Prefixes match on path-segment boundaries (``/v1`` matches ``/v1`` and ``/v1/models``, never
``/v10``); the longest matching prefix wins, so ``/`` is a catch-all.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine import EngineAdapter
from sidecar.config import Settings


@dataclass(frozen=True, slots=True)
class RouteTarget:
    """A matched route: its configured prefix and the adapter of the engine behind it."""

    prefix: str
    engine: EngineAdapter


class Router:
    """Longest-prefix match over the configured routes."""

    def __init__(self, settings: Settings, adapters: dict[str, EngineAdapter]) -> None:
        routes = sorted(settings.routes, key=lambda r: len(r.prefix.rstrip("/")), reverse=True)
        self._targets = [
            (r.prefix.rstrip("/"), RouteTarget(r.prefix, adapters[r.engine])) for r in routes
        ]

    def match(self, path: str) -> RouteTarget | None:
        """The target for ``path`` (already percent-decoded), or ``None`` if no route covers it."""
        for stem, target in self._targets:
            if path == stem or path.startswith(stem + "/") or not stem:
                return target
        return None
