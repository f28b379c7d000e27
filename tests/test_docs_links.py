"""Every relative link in README.md and docs/ resolves: the file (or folder) exists, and so does its #anchor.

Anchors are GitHub's: a heading's text in lower case, punctuation dropped, spaces as hyphens, a repeated
heading numbered -1, -2, …
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.support import ROOT

_LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+).+?\1")


def pages(root: Path = ROOT) -> list[Path]:
    """README.md and every Markdown page under docs/."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def _prose(text: str, keep_code: bool = False) -> list[tuple[int, str]]:
    """(line number, line) outside code fences, inline code removed unless kept: links there are not links."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line if keep_code else _CODE_SPAN.sub("", line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"[`*_]|<[^>]+>", "", heading).strip().lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a Markdown page has, one per heading (repeats numbered as GitHub numbers them)."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in _prose(path.read_text(encoding="utf-8"), keep_code=True):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(files: list[Path], root: Path = ROOT) -> list[str]:
    """Each relative link of the files that does not resolve, as 'file:line: target (why)'."""
    out = []
    for page in files:
        for number, line in _prose(page.read_text(encoding="utf-8")):
            for target in _LINK.findall(line):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
                    continue  # http:, https:, mailto: … are not ours to check
                path_part, _, anchor = target.partition("#")
                where = f"{page.relative_to(root)}:{number}: {target}"
                resolved = (page.parent / path_part).resolve() if path_part else page
                if not resolved.exists():
                    out.append(f"{where} (no such file)")
                elif anchor and resolved.is_file() and resolved.suffix == ".md" and anchor not in anchors(resolved):
                    out.append(f"{where} (no heading with that anchor)")
    return out


def test_every_relative_link_in_the_readme_and_docs_resolves():
    broken = broken_links(pages())
    assert broken == [], "links that do not resolve:\n  " + "\n  ".join(broken)


def test_the_readme_stays_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines < 200, f"README.md has {lines} lines: move detail into a page under docs/ and link it"


def test_the_docs_hold_the_pages_the_readme_promises():
    for page in ("design.md", "testing.md", "reference/settings.md", "flows/callbacks.md", "providers/stripe.md"):
        assert (ROOT / "docs" / page).is_file(), page


def test_a_missing_file_and_a_missing_anchor_are_reported(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Two words, and `code`\n\n## Two words, and `code`\n")
    (tmp_path / "README.md").write_text(
        "See [a](docs/a.md), [b](docs/b.md), [anchor](docs/a.md#two-words-and-code),\n"
        "[repeat](docs/a.md#two-words-and-code-1), [wrong](docs/a.md#three-words), [folder](docs/),\n"
        "[web](https://example.com/x.md), [here](#nowhere), `[code](docs/c.md)`.\n"
        "```\n[fenced](docs/d.md)\n```\n"
    )
    assert broken_links(pages(tmp_path), tmp_path) == [
        "README.md:1: docs/b.md (no such file)",
        "README.md:2: docs/a.md#three-words (no heading with that anchor)",
        "README.md:3: #nowhere (no heading with that anchor)",
    ]


def test_slugs_are_githubs():
    assert (
        slug("4. Invariants (tests must be able to fail on each)") == "4-invariants-tests-must-be-able-to-fail-on-each"
    )
    assert slug("Chaos run (`make chaos`)") == "chaos-run-make-chaos"
    assert slug("Ops console (`/ops`)") == "ops-console-ops"
