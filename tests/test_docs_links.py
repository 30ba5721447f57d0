"""Every relative link in README.md, docs/*.md, bench/README.md and bench/results/*/HISTORY.md resolves: the file
exists and, for ``file.md#anchor``, so does a heading with that anchor (GitHub's rule for heading ids). Links inside
code are not links.

Run ``python tests/test_docs_links.py`` to print every broken link.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.MULTILINE)
_INLINE_LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def documentation_files() -> list[Path]:
    """README.md, every Markdown file under docs/, bench/README.md and the run histories beside the results."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "bench" / "README.md",
            *sorted((REPO / "bench" / "results").glob("*/HISTORY.md"))]


def _without_code(text: str) -> str:
    """The text with fenced blocks blanked (line count kept) and inline code spans removed."""
    text = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return _CODE_SPAN.sub("", text)


def heading_anchor(heading: str) -> str:
    """The id GitHub gives a heading: its text lower-cased, punctuation dropped, spaces as hyphens."""
    text = _INLINE_LINK.sub(r"\1", heading).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, repeated headings numbered as GitHub numbers them."""
    text = _FENCE.sub("", path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    found: set[str] = set()
    for match in _HEADING.finditer(text):
        anchor = heading_anchor(match.group(2))
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        found.add(anchor if count == 0 else f"{anchor}-{count}")
    return found


def broken_links(path: Path, root: Path = REPO) -> list[str]:
    """``file:line: target (why)`` for each relative link of ``path`` that does not resolve.

    Args:
        path: the Markdown file to check.
        root: the folder that file names in the messages are relative to.
    """
    text = _without_code(path.read_text(encoding="utf-8"))
    problems = []
    for match in _LINK.finditer(text):
        target = match.group(1)
        if _SCHEME.match(target):
            continue
        line = text.count("\n", 0, match.start()) + 1
        where = f"{path.relative_to(root)}:{line}: {target}"
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            problems.append(f"{where} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{where} (no heading with anchor #{anchor} in {resolved.name})")
    return problems


@pytest.mark.parametrize("path", documentation_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(path):
    assert broken_links(path) == []


def test_checker_finds_a_broken_file_and_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# Title: one (`x_y`)\n## Two\n## Two\n", encoding="utf-8")
    page = tmp_path / "b.md"
    page.write_text(
        "[ok](a.md#title-one-x_y) [ok](a.md#two-1) [ok](#local) `[not a link](nowhere.md)`\n"
        "## Local\n[bad](missing.md) [bad](a.md#three)\n```\n[in code](nowhere.md)\n```\n",
        encoding="utf-8",
    )
    assert broken_links(page, root=tmp_path) == [
        "b.md:3: missing.md (no such file)",
        "b.md:3: a.md#three (no heading with anchor #three in a.md)",
    ]


if __name__ == "__main__":
    problems = [problem for path in documentation_files() for problem in broken_links(path)]
    print("\n".join(problems) or f"all relative links resolve in {len(documentation_files())} files")
    raise SystemExit(1 if problems else 0)
