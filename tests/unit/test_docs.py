"""The docs in docs/ are the repository's own, linked from the README, and stay true to the code."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = ("architecture.md", "flows.md", "failure-rules.md", "connector-config.md", "security.md")


def test_the_readme_points_at_the_docs_in_the_repository() -> None:
    readme = (REPO / "README.md").read_text()
    assert "../shared/" not in readme
    for doc in DOCS:
        assert f"docs/{doc}" in readme, doc
        assert (REPO / "docs" / doc).is_file(), doc


def test_relative_links_between_docs_resolve() -> None:
    for doc in DOCS:
        text = (REPO / "docs" / doc).read_text()
        for target in DOCS:
            if f"]({target}" in text:
                assert (REPO / "docs" / target).is_file()


def heading_anchors(markdown: str) -> set[str]:
    """GitHub's anchor of every heading of a markdown text."""
    titles = (line.lstrip("#").strip().lower() for line in markdown.splitlines() if line.startswith("#"))
    return {re.sub(r"[^a-z0-9 _-]", "", title).replace(" ", "-") for title in titles}


def test_every_link_to_a_section_of_the_docs_names_a_heading_there() -> None:
    """A link ``doc.md#section`` (or ``#section`` within one doc) between the docs, the README and
    the changelog lands on a heading: a section renamed or never written is caught here."""
    texts = {path.name: path.read_text() for path in (REPO / "docs").glob("*.md")}
    texts.update({name: (REPO / name).read_text() for name in ("README.md", "CHANGELOG.md")})
    anchors = {name: heading_anchors(text) for name, text in texts.items()}
    broken = [
        f"{name} -> {Path(target).name or name}#{anchor}"
        for name, text in texts.items()
        for target, anchor in re.findall(r"\]\(([\w./-]*?\.md)?#([^)\s]+)\)", text)
        if (Path(target).name or name) in anchors and anchor not in anchors[Path(target).name or name]
    ]
    assert not broken, broken


def test_the_security_doc_lists_every_rpc_of_the_role_table() -> None:
    """docs/security.md's role table names every kvd RPC the interceptor's table has."""
    from kvd.server.authz import RPC_ROLES

    doc = (REPO / "docs" / "security.md").read_text()
    for method in RPC_ROLES:
        if method.startswith("/kvd."):
            assert method.rsplit("/", 1)[-1] in doc, method
