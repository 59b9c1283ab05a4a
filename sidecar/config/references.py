"""Checks across sections, on the expanded YAML tree rather than the models, so that they run
(and are reported next to the schema's problems) even when the schema check failed: every engine
a route names is defined and, where it is to be aborted, of a kind that aborts; no engine url is
the sidecar's own listener; no two routes share a prefix; the admin listener is not the proxy's.
"""

from __future__ import annotations

import difflib
from typing import Any
from urllib.parse import urlsplit

from pydantic import ValidationError

from sidecar.config.schema import AdminSettings, Listener
from sidecar.config.secrets import render_value
from sidecar.config.values import KINDS_WITHOUT_ABORT
from sidecar.errors import ConfigProblem


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
                "(vllm) if the engine is one", render_value(("engines", name, "abort"),
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


def cross_reference(raw: dict[str, Any]) -> list[ConfigProblem]:
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



def listener_clash(expanded: dict[str, Any]) -> list[ConfigProblem]:
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

