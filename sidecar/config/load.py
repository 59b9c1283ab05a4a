"""Loading: a config file or text -> frozen :class:`~sidecar.config.schema.Settings`, or one
:class:`~sidecar.errors.ConfigError` listing every problem.

:func:`parse_config` runs the steps of :mod:`sidecar.config` in order (YAML, ``${VAR}``, the
models, the cross-references), turns pydantic's errors into problems named once each with their
fix and a did-you-mean hint (an unknown key, an engine kind), puts the file line in front of
each, and masks every secret before raising.
"""

from __future__ import annotations

import difflib
import os
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from sidecar.config.references import cross_reference, listener_clash
from sidecar.config.schema import Settings
from sidecar.config.secrets import render_value, scrub, secrets_in
from sidecar.config.source import at_lines, expand, load_yaml
from sidecar.config.values import EngineKind
from sidecar.errors import ConfigError, ConfigProblem

_UNKNOWN_KEY = "unknown key (value not shown); check its spelling and section"


def parse_config(text: str, source: str = "<string>",
                 env: Mapping[str, str] | None = None) -> Settings:
    """Validate config text (YAML).

    Returns the frozen :class:`Settings`. Raises :class:`ConfigError` listing every problem, each
    with its dotted location, what was wrong and the offending value (secrets masked).
    """
    try:
        raw, problems, lines = load_yaml(text)
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
    expanded = expand(raw, os.environ if env is None else env, "", problems)
    # A value that is nothing but an unset ${VAR} was already named (it expands to ""): its
    # validation error would only say the same thing twice. Any other error there is kept.
    unset = {problem.location for problem in problems[loaded:]}

    settings, invalid = None, None
    try:
        settings = Settings.model_validate(expanded)
    except ValidationError as exc:
        problems.extend(_schema_problems(exc, unset))
        invalid = exc
    problems.extend(p for p in cross_reference(expanded)  # but "names no defined engine (got '')"
                    if not (p.location in unset and p.value == repr("")))
    problems.extend(listener_clash(expanded))  # every problem, not only the model's
    if settings is None or problems:
        located = problems[:loaded] + at_lines(problems[loaded:], lines)
        raise ConfigError(source, scrub(located, secrets_in(raw) | secrets_in(expanded))
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
        value = None if err["type"] == "missing" else render_value(err["loc"], err["input"])
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


def load_config(path: Path, env: Mapping[str, str] | None = None) -> Settings:
    """Read and validate the config file at ``path``. Raises :class:`ConfigError`."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(str(path), [ConfigProblem("", f"cannot read file: {exc}")]) from exc
    return parse_config(text, str(path), env)

