"""What a config file turns into at run time, swapped whole on reload, and the in-flight count.

A :class:`Runtime` is one generation of config-derived state: the settings, the engine adapters,
the router and the upstream connection pool. :class:`Runtimes` holds the current one (the proxy
app keeps it under ``keys.RUNTIME``), counts the requests running on each, and:

- ``swap(settings)`` (SIGHUP): new requests get a new generation; requests already running keep
  the one they started on; a replaced generation's connections are closed once no request that
  started on it is still running.
- ``drain(grace_s)`` (SIGTERM): waits for running requests, then cancels what is left; each
  cancelled handler closes its upstream and aborts its engine ids
  (``cancellation.Cancellation.cancel``).

State shared by every generation (metrics, the abort session and its TaskSet) stays on the app.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import Any

from engine import EngineAdapter, build_adapters
from sidecar.config import Settings
from sidecar.pool import UpstreamPool
from sidecar.route import Router
from sidecar.tasks import TaskSet

log = logging.getLogger(__name__)

# Sections a running process applies on reload, and those only a restart applies.
RELOADABLE = ("engines", "routes", "upstream", "downstream", "lifecycle", "tunnel")
NEEDS_RESTART = ("listen", "admin", "log_level", "log_format")
# Keys of a reloadable section that only a restart applies: ``downstream.idle_timeout_s`` is
# each listener's aiohttp ``keepalive_timeout``, fixed when the listener starts
# (``sidecar.server.start``); the other ``downstream`` keys are read per request from the
# generation it runs on. ``lifecycle.record_dir``: each process opens its record of in-flight
# work once, at start (``sidecar.app.open_record``), and a supervisor reads its workers' records
# where it started (``sidecar.workers``).
RESTART_KEYS: dict[str, tuple[str, ...]] = {"downstream": ("idle_timeout_s",),
                                            "lifecycle": ("record_dir",)}
# What a supervised worker takes from the config its supervisor started with rather than from the
# file (sidecar.workers): a worker started after a SIGHUP (a replacement) reads the file as it is
# then, and would otherwise apply a restart-only change that its supervisor and the other workers
# do not; above all ``lifecycle.record_dir``, where the supervisor reads the records of dead
# workers. Not ``admin``: a worker serves no admin listener, and its token is a secret, which
# never goes on a command line.
WORKER_PINNED = ("listen", "log_level", "log_format")

CANCEL_WAIT_S = 5.0  # after the grace period: how long cancelled handlers may take to unwind


@dataclass(eq=False)
class Runtime:
    """One generation of config-derived state; ``pool`` holds its upstream connections
    (:class:`sidecar.pool.UpstreamPool`)."""

    generation: int
    settings: Settings
    adapters: dict[str, EngineAdapter]
    router: Router
    pool: UpstreamPool
    in_flight: int = 0

    @classmethod
    def open(cls, settings: Settings, generation: int = 0) -> Runtime:
        adapters = build_adapters(settings.engines)
        return cls(generation, settings, adapters, Router(settings, adapters),
                   UpstreamPool(settings.upstream))

    async def close(self) -> None:
        await self.pool.close()


@dataclass(eq=False)
class Runtimes:
    """The current :class:`Runtime` and the replaced ones still in use."""

    current: Runtime
    tasks: TaskSet
    _retired: list[Runtime] = field(default_factory=list)
    _handlers: set[asyncio.Task[Any]] = field(default_factory=set)
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    def enter(self) -> Runtime:
        """A request starts: it runs on the current generation. Pair with :meth:`leave`."""
        runtime = self.current
        runtime.in_flight += 1
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        return runtime

    def leave(self, runtime: Runtime) -> None:
        runtime.in_flight -= 1
        task = asyncio.current_task()
        if task is not None:
            self._handlers.discard(task)
        if not self._handlers:
            self._idle.set()
        if self._retired:
            self._close_unused()

    def swap(self, settings: Settings) -> Runtime:
        """Make a new generation from ``settings`` current; returns it."""
        old = self.current
        self.current = Runtime.open(settings, old.generation + 1)
        self._retired.append(old)
        self._close_unused()
        return self.current

    def _close_unused(self) -> None:
        # A request uses the generation it entered on (app.proxy_handler gets it from enter()).
        for runtime in [r for r in self._retired if not r.in_flight]:
            self._retired.remove(runtime)
            self.tasks.spawn(runtime.close(),
                             name=f"close the upstream connections of config {runtime.generation}")

    @property
    def in_flight(self) -> int:
        return len(self._handlers)

    async def drain(self, grace_s: float) -> tuple[int, int]:
        """Wait up to ``grace_s`` seconds for running requests, then cancel the rest and wait
        (up to ``CANCEL_WAIT_S``) for their handlers to unwind, which starts their aborts.

        Returns (requests that finished within the grace period, requests cancelled).
        """
        running = len(self._handlers)
        if running:
            self._idle.clear()
            try:
                async with asyncio.timeout(grace_s):
                    await self._idle.wait()
            except TimeoutError:
                pass
        stragglers = set(self._handlers)
        for task in stragglers:
            task.cancel("sidecar stopping: grace period over")
        if stragglers:
            _, stuck = await asyncio.wait(stragglers, timeout=CANCEL_WAIT_S)
            if stuck:
                log.error("%d request handler(s) did not unwind within %.0f s of being "
                          "cancelled", len(stuck), CANCEL_WAIT_S)
        return running - len(stragglers), len(stragglers)

    async def close(self) -> None:
        """Close every generation's upstream connections (at teardown, after :meth:`drain`)."""
        runtimes, self._retired = [*self._retired, self.current], []
        await asyncio.gather(*(r.close() for r in runtimes))


def pinned_for_workers(settings: Settings) -> str:
    """The restart-only values of ``settings`` a worker keeps (:data:`WORKER_PINNED` and
    :data:`RESTART_KEYS`), as the JSON text of :func:`with_pinned`; nothing secret."""
    values: dict[str, Any] = {name: settings.model_dump(mode="json", include={name})[name]
                              for name in WORKER_PINNED}
    for section, keys in RESTART_KEYS.items():
        values[section] = getattr(settings, section).model_dump(mode="json", include=set(keys))
    return json.dumps(values, separators=(",", ":"))


def with_pinned(settings: Settings, pinned: str) -> Settings:
    """``settings`` (the file as read now) with the restart-only values of ``pinned``
    (:func:`pinned_for_workers` of the config the supervisor started with). Raises
    ``ValueError`` (pydantic's ``ValidationError`` among them) if ``pinned`` is not such text."""
    values = json.loads(pinned)
    update: dict[str, Any] = {}
    for name in WORKER_PINNED:
        field = getattr(settings, name)
        update[name] = (type(field).model_validate(values[name]) if hasattr(field, "model_dump")
                        else values[name])
    for section in RESTART_KEYS:
        current = getattr(settings, section)
        update[section] = type(current).model_validate({**current.model_dump(),
                                                        **values[section]})
    return Settings.model_validate({**dict(settings), **update})


def describe_changes(old: Settings, new: Settings) -> tuple[list[str], list[str]]:
    """What differs between two configs: (changes applied on reload, changes that need a
    restart), each a list of human-readable lines naming the dotted key. Sections in
    ``RELOADABLE`` apply but for their ``RESTART_KEYS``; ``NEEDS_RESTART`` sections and those
    keys need a restart. Secrets are compared, never shown."""
    applied: list[str] = []
    ignored: list[str] = []
    for section in (*RELOADABLE, *NEEDS_RESTART):
        before, after = getattr(old, section), getattr(new, section)
        if before == after:
            continue
        target = applied if section in RELOADABLE else ignored
        if section == "engines":
            for name in sorted(before.keys() - after.keys()):
                target.append(f"engines.{name} removed")
            for name in sorted(after.keys() - before.keys()):
                target.append(f"engines.{name} added ({after[name].url})")
            for name in sorted(before.keys() & after.keys()):
                if before[name] != after[name]:
                    target.extend(_field_changes(f"engines.{name}", before[name].model_dump(),
                                                 after[name].model_dump()))
        elif section == "routes":
            target.append("routes: " + _routes(before) + " -> " + _routes(after))
        elif hasattr(before, "model_dump") and hasattr(after, "model_dump"):
            old_fields, new_fields = before.model_dump(), after.model_dump()
            for key in RESTART_KEYS.get(section, ()):
                a, b = old_fields.pop(key), new_fields.pop(key)
                if a != b:
                    ignored.append(f"{section}.{key}: {a!s} -> {b!s}")
            target.extend(_field_changes(section, old_fields, new_fields))
        else:
            target.append(f"{section}: {before!r} -> {after!r}")
    return applied, ignored


def _routes(routes: list[Any]) -> str:
    return "[" + ", ".join(f"{r.prefix} -> {r.engine}" + (
        f" (abort {', '.join(r.abort)})" if r.abort is not None else "") + (
        f" (abort from {r.abort_from_header.header} as {r.abort_from_header.engine})"
        if r.abort_from_header is not None else "") for r in routes) + "]"


def _field_changes(loc: str, before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for key in sorted(before.keys() | after.keys()):
        a, b = before.get(key), after.get(key)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            lines.extend(_field_changes(f"{loc}.{key}", a, b))
        elif key == "api_key" or "SecretStr" in type(a).__name__ + type(b).__name__:
            lines.append(f"{loc}.{key} changed")
        else:
            lines.append(f"{loc}.{key}: {a!s} -> {b!s}")
    return lines
