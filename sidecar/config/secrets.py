"""What no config message ever shows.

Secrets (``api_key``, ``cancel_token``) are ``SecretStr``: never printed, not even in error
messages; neither is the value of an unknown key (a typo's value may be a token), nor anything
before the ``@`` of a URL-like value (``user:password@``, whatever its scheme, slashes or
whitespace), nor a ``url``'s query. :func:`render_value` masks a value before it is shown;
:func:`scrub` is the last pass over every message, with the secrets :func:`secrets_in` finds.
"""

from __future__ import annotations

import re
from collections.abc import Hashable
from typing import Any

from sidecar.config.schema import (
    AbortFromHeaderSettings,
    AbortSettings,
    AdminSettings,
    DownstreamSettings,
    EngineSettings,
    LifecycleSettings,
    Listener,
    RouteSettings,
    Settings,
    TunnelSettings,
    UpstreamSettings,
)
from sidecar.config.values import SECRET_KEYS
from sidecar.errors import ConfigProblem

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
    if any(part in SECRET_KEYS or (isinstance(part, str) and _SECRET_NAME.search(part))
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


def secrets_in(tree: Any, loc: tuple[Hashable, ...] = ()) -> set[str]:
    """Every secret string in a config tree (see :func:`_is_secret`), and the userinfo of every
    URL-like string with its likely password parts (see :func:`_userinfo_end`); each also as
    ``repr`` escapes it (``\\t``), since rendered values are ``repr``-ed."""
    if isinstance(tree, dict):
        return set().union(*(secrets_in(v, (*loc, k)) for k, v in tree.items()))
    if isinstance(tree, list):
        return set().union(*(secrets_in(v, (*loc, i)) for i, v in enumerate(tree)))
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


def render_value(loc: tuple[Hashable, ...], value: Any) -> str:
    text = repr(_masked(value, loc))
    return text if len(text) <= 80 else text[:77] + "..."


SHORT_SECRET = 8  # a secret shorter than this is masked only as a whole word (see scrub)


def scrub(problems: list[ConfigProblem], secrets: set[str]) -> list[ConfigProblem]:
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

