"""The docs in docs/ are the repository's own, linked from the README, and stay true to the code."""

from __future__ import annotations

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


def test_the_security_doc_lists_every_rpc_of_the_role_table() -> None:
    """docs/security.md's role table names every kvd RPC the interceptor's table has."""
    from kvd.server.authz import RPC_ROLES

    doc = (REPO / "docs" / "security.md").read_text()
    for method in RPC_ROLES:
        if method.startswith("/kvd."):
            assert method.rsplit("/", 1)[-1] in doc, method
