"""Every relative link in the README and the docs resolves: the file exists and its ``#anchor``
is a heading there, by GitHub's rules (lowercase; punctuation other than ``-`` and ``_`` dropped;
spaces to hyphens; a repeated heading gets ``-1``, ``-2``...). Links inside code are not links.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         ROOT / "config" / "k8s" / "README.md"]

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """``text`` without fenced blocks and inline code (links there are examples, not links)."""
    return _CODE.sub("", _FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found: set[str] = set()
    for heading in _HEADING.findall(_FENCE.sub("", path.read_text())):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(page: Path) -> list[str]:
    """Each relative link of ``page`` that does not resolve, with the reason."""
    broken = []
    for target in _LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto: ...
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves(page: Path) -> None:
    broken = broken_links(page)
    assert not broken, f"expected every link in {page.relative_to(ROOT)} to resolve, got:\n" + (
        "\n".join(broken))


def test_the_checker_finds_a_missing_file_and_a_missing_heading(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## Set-up: `make test` (2 cores)\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n## Page\n\n"
        "[ok](other.md#set-up-make-test-2-cores) [ok](#page-1) [ok](https://example.org/x)\n"
        "`[code](nowhere.md)` [gone](nowhere.md) [no heading](other.md#setup)\n"
        "```\n[fenced](nowhere.md)\n```\n")
    broken = broken_links(page)
    assert len(broken) == 2 and "nowhere.md" in broken[0] and "#setup" in broken[1], (
        f"expected the missing file and the missing heading, got {broken}")


def test_the_docs_index_lists_every_page() -> None:
    """The README's docs index names every page of docs/ (the generated benchmarks included)."""
    readme = (ROOT / "README.md").read_text()
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md"))
               if f"(docs/{p.name})" not in readme]
    assert not missing, f"expected the README to link every docs page, missing {missing}"
