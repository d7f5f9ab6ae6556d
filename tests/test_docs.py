"""The reference pages are generated from the code and committed; they must be current."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dxr.docs import PAGES, ROOT


@pytest.mark.parametrize("page", sorted(PAGES))
def test_generated_reference_is_current(page):
    committed = (ROOT / page).read_text()
    assert committed == PAGES[page](), f"{page} is stale: run `.venv/bin/python -m dxr.docs` and commit"


def test_readme_shows_the_commands_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_readme_links_resolve():
    readme = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(((?!https?:)[^)#]+)", readme):
        assert (ROOT / target).exists(), f"README links to missing {target}"
