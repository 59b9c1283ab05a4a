"""The config file's text -> a YAML tree, located, with ``${VAR}`` expanded.

:func:`load_yaml` reads the tree with PyYAML's safe loader, records the line of every key and
list item by dotted path (:func:`at_lines` puts it in front of a problem's message), and makes
a key given twice in one mapping a problem, a ``<<`` merge key too (YAML would keep the last
silently). :func:`expand` replaces ``${VAR}`` and ``${VAR:-default}`` from the environment;
an unset variable without a default is a problem at its location.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Mapping
from typing import Any

import yaml

from sidecar.config.values import SECRET_KEYS
from sidecar.errors import ConfigProblem

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def expand(node: Any, env: Mapping[str, str], loc: str, problems: list[ConfigProblem]) -> Any:
    """Replace ``${VAR}`` and ``${VAR:-default}`` in every string of the YAML tree."""
    if isinstance(node, dict):
        return {k: expand(v, env, f"{loc}.{k}" if loc else str(k), problems)
                for k, v in node.items()}
    if isinstance(node, list):
        return [expand(v, env, f"{loc}.{i}", problems) for i, v in enumerate(node)]
    if not isinstance(node, str):
        return node

    def substitute(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        if name in env:
            return env[name]
        if default is not None:
            return default
        fix = ("set it in the sidecar's environment (e.g. from a Secret), never the value "
               "in this file" if loc.rpartition(".")[2] in SECRET_KEYS
               else f"set it or write ${{{name}:-default}}")
        problems.append(ConfigProblem(loc, f"environment variable {name} is not set; {fix}"))
        return ""

    return _VAR.sub(substitute, node)

_MERGE = "tag:yaml.org,2002:merge"
_VALUE = "tag:yaml.org,2002:value"


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, recording every key given twice in one mapping (PyYAML itself keeps
    the last silently), a ``<<`` merge key too, as a problem located by its dotted path, with
    both line numbers; and the line of every key and list item, by dotted path (``lines``, for
    :func:`at_lines`)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.duplicates: list[ConfigProblem] = []
        self.lines: dict[str, int] = {}  # dotted path -> 1-based line of its key or list item
        self._seen: set[int] = set()

    def construct_document(self, node: yaml.Node) -> Any:
        self._check(node, "")
        return super().construct_document(node)

    def _check(self, node: yaml.Node, path: str) -> None:
        """Check every mapping node once (an alias repeats none), first path wins, before any is
        constructed: constructing a ``<<`` merges it away, rewriting the mapping node in place."""
        if id(node) in self._seen:
            return
        self._seen.add(id(node))
        children: list[tuple[str, yaml.Node]] = []
        if isinstance(node, yaml.MappingNode):
            first: dict[Hashable, int] = {}
            for key_node, value_node in node.value:
                name = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else "?"
                children.append((name, value_node))
                if key_node.tag == _MERGE:
                    key: Any = _MERGE  # not the string "<<", which a quoted '<<' would be
                elif key_node.tag == _VALUE:
                    key = "="  # as PyYAML reads it
                elif isinstance(key_node, yaml.ScalarNode):
                    key = self.construct_object(key_node)  # 1 and 0x1 are one key
                else:
                    continue  # a collection key: PyYAML reports it unhashable
                line = key_node.start_mark.line + 1
                self.lines.setdefault(f"{path}.{name}" if path else name, line)
                if not isinstance(key, Hashable):
                    continue
                if key in first:
                    advice = ("merge several mappings with one `<<: [*a, *b]` (the first listed "
                              "wins on shared keys)" if key == _MERGE else
                              "YAML would keep only the last; remove or rename one")
                    self.duplicates.append(ConfigProblem(
                        f"{path}.{name}" if path else name,
                        f"duplicate key (line {first[key]} and line {line}): {advice}"))
                first.setdefault(key, line)
        elif isinstance(node, yaml.SequenceNode):
            children = [(str(i), v) for i, v in enumerate(node.value)]
            for name, child in children:
                self.lines.setdefault(f"{path}.{name}" if path else name,
                                      child.start_mark.line + 1)
        for name, child in children:
            self._check(child, f"{path}.{name}" if path else name)


def load_yaml(text: str) -> tuple[Any, list[ConfigProblem], dict[str, int]]:
    """The YAML tree of ``text``, its duplicate-key problems and the line of every dotted path
    (:attr:`_Loader.lines`). Raises ``yaml.YAMLError``."""
    loader = _Loader(text)
    try:
        return loader.get_single_data(), loader.duplicates, loader.lines
    finally:
        loader.dispose()


def at_lines(problems: list[ConfigProblem], lines: Mapping[str, int]) -> list[ConfigProblem]:
    """Each problem with the file line of its location, or of the nearest enclosing key or list
    item the file has (a missing key: the mapping that lacks it; a key a ``<<`` merge brought:
    the mapping that merged it), as ``line N: `` before its message; a problem of no line (a
    top-level key that is missing) as it is."""
    located = []
    for problem in problems:
        path = problem.location
        while path and path not in lines:
            path = path.rpartition(".")[0]
        line = lines.get(path) if path else None
        located.append(problem if line is None else ConfigProblem(
            problem.location, f"line {line}: {problem.message}", problem.value))
    return located

