"""Routes: which engine serves a request path, which engines abort its cancelled requests (the
configured ones, ``routes[].abort``, and per request the one its ``abort_from_header`` header
names: :mod:`sidecar.targets`), and its deadline (``routes[].max_duration_s``, lowered by the
client's ``X-Sidecar-Deadline-S``).

Prefixes match on path-segment boundaries (``/v1`` matches ``/v1`` and ``/v1/models``, never
``/v10``); the longest matching prefix wins, so ``/`` is a catch-all.
"""

from __future__ import annotations

import json
import math
from collections.abc import MutableMapping
from dataclasses import dataclass, field

from multidict import MultiMapping

from engine import EngineAdapter
from sidecar.config import MAX_SECONDS, Settings
from sidecar.headers import DEADLINE_HEADER
from sidecar.metrics import Metrics
from sidecar.targets import HeaderTargets


@dataclass(frozen=True, slots=True)
class RouteTarget:
    """A matched route: its configured prefix, the adapter of the engine behind it, and the
    adapters of the engines its cancelled requests are aborted at (``routes[].abort``; by
    default just ``engine``; several for prefill/decode or data-parallel fan-out), its
    ``max_duration_s`` (seconds, ``None``: no deadline of its own), and ``from_header``: the
    engine a request header names per request (``routes[].abort_from_header``), if any.

    The request-shaping methods ask every adapter involved (``engine`` first, then the abort
    engines, then ``from_header``'s template), so each engine sees the same sidecar id and each
    can derive its own ids.
    """

    prefix: str
    engine: EngineAdapter
    aborts: tuple[EngineAdapter, ...] = ()
    max_duration_s: float | None = None
    from_header: HeaderTargets | None = None
    _shapers: tuple[EngineAdapter, ...] = field(init=False, repr=False)
    forbidden_paths: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        if not self.aborts:
            object.__setattr__(self, "aborts", (self.engine,))
        template = () if self.from_header is None else (self.from_header.template,)
        shapers = tuple(dict.fromkeys((self.engine, *self.aborts, *template)))
        object.__setattr__(self, "_shapers", shapers)
        # A router may forward a client's call to an abort engine's endpoint: refuse them all.
        object.__setattr__(self, "forbidden_paths",
                           frozenset().union(*(a.forbidden_paths() for a in shapers)))

    def tag(self, path: str, sidecar_id: str, headers: MutableMapping[str, str]) -> None:
        """Tag the upstream request for every engine involved (see :meth:`EngineAdapter.tag`)."""
        for adapter in self._shapers:
            adapter.tag(path, sidecar_id, headers)

    def deadline_s(self, headers: MultiMapping[str]) -> float | None:
        """The deadline of a request with ``headers``, seconds: the client's
        :data:`~sidecar.headers.DEADLINE_HEADER` value capped by ``max_duration_s`` (either may
        be absent: no limit of its own; ``None``: no deadline). Raises ``ValueError`` with the
        message for the client if the header is given more than once or is not a finite number
        > 0 and <= ``sidecar.config.MAX_SECONDS``."""
        given = headers.getall(DEADLINE_HEADER, [])
        if not given:
            return self.max_duration_s
        if len(given) > 1:
            raise ValueError(f"{DEADLINE_HEADER} must be given at most once")
        header = given[0]
        try:
            asked = math.nan if "_" in header else float(header)  # Python's float takes "1_0"
        except ValueError:
            asked = math.nan
        if not 0 < asked <= MAX_SECONDS:  # also refuses NaN and infinity
            raise ValueError(f"{DEADLINE_HEADER} must be a number of seconds > 0 and <= "
                             f"{MAX_SECONDS:.0f}, got {json.dumps(header[:40])}")
        return asked if self.max_duration_s is None else min(asked, self.max_duration_s)

    def abort_engines(self, headers: MultiMapping[str], sidecar_id: str,
                      metrics: Metrics) -> tuple[EngineAdapter, ...]:
        """The engines to abort for a request with ``headers`` that ended early: ``aborts``, and
        the one its ``abort_from_header`` header names if that is allowed (else it is counted and
        logged by :meth:`HeaderTargets.resolve`) and not already among them. Cold path."""
        if self.from_header is None:
            return self.aborts
        extra = self.from_header.resolve(headers, sidecar_id, metrics)
        if extra is None or any(a.base_url == extra.base_url for a in self.aborts):
            return self.aborts
        return (*self.aborts, extra)

    def wants_body(self, method: str, path: str) -> bool:
        """True if some abort engine (``from_header``'s template included) needs the body copy
        to derive its ids."""
        template = () if self.from_header is None else (self.from_header.template,)
        return any(a.wants_body(method, path) for a in (*self.aborts, *template))

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
    """Longest-prefix match over the configured routes. ``templates_only``: the names of the
    engines used only as ``abort_from_header`` templates (their url is never called: not
    probed by ``/readyz``)."""

    def __init__(self, settings: Settings, adapters: dict[str, EngineAdapter]) -> None:
        routes = sorted(settings.routes, key=lambda r: len(r.prefix.rstrip("/")), reverse=True)
        self._targets = [
            (r.prefix.rstrip("/"), RouteTarget(
                r.prefix, adapters[r.engine], tuple(adapters[n] for n in r.abort_engines()),
                r.max_duration_s,
                None if r.abort_from_header is None else HeaderTargets(
                    r.abort_from_header, adapters[r.abort_from_header.engine], r.prefix)))
            for r in routes
        ]
        used = {n for r in routes for n in (r.engine, *r.abort_engines())}
        self.templates_only = frozenset(
            r.abort_from_header.engine for r in routes
            if r.abort_from_header is not None) - used

    def match(self, path: str) -> RouteTarget | None:
        """The target for ``path`` (already percent-decoded), or ``None`` if no route covers it."""
        for stem, target in self._targets:
            if path == stem or path.startswith(stem + "/") or not stem:
                return target
        return None
