"""The docs as pages: README.md and benchmarks/README.md stay short, every
relative link and every results file they name exists, and
docs/configuration.md documents every setting there is (and no other)."""

from __future__ import annotations

import dataclasses
import itertools
import pathlib
import re

import pytest

import hoplite_gpu as hg
from hoplite_gpu.config import Config

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGES = sorted([ROOT / "README.md", ROOT / "benchmarks" / "README.md",
                *(ROOT / "docs").glob("*.md")])


def _rel(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize(("page", "limit"), [("README.md", 15_000),
                                             ("benchmarks/README.md", 25_000)])
def test_the_front_pages_stay_short(page, limit):
    """README.md is what a newcomer reads and benchmarks/README.md the current
    figures; reference goes to docs/ and history to git."""
    size = len((ROOT / page).read_bytes())
    assert size < limit, f"{page} is {size} bytes; keep it under {limit}"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_relative_link_resolves(page):
    links = re.findall(r"\]\(([^)\s]+)\)", page.read_text())
    local = [link.split("#")[0] for link in links if "://" not in link and
             not link.startswith(("#", "mailto:"))]
    missing = [link for link in local if link and not (page.parent / link).exists()]
    assert not missing, f"{_rel(page)} links to what does not exist: {missing}"


def _expand(name: str) -> list[str]:
    """`a-{x,y}-b.json` -> both names (the docs' shorthand for sibling files)."""
    parts = re.split(r"\{([^}]*)\}", name)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def _named_results(text: str) -> set[str]:
    pattern = r"(?:archive/)?[\w.{},*-]+-20\d\d-\d\d-\d\d[\w.{},*-]*?(?:\.json|\.png|/)"
    return {n for m in re.findall(pattern, text) for n in _expand(m.rstrip("/"))}


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_results_file_a_page_names_exists(page):
    """A figure names the file it comes from; superseded files move to
    results/archive/, and a page that still cites one says so in its path."""
    names = _named_results(page.read_text())
    missing = sorted(n for n in names if not any(RESULTS.glob(n)))
    assert not missing, f"{_rel(page)} names results that are not in benchmarks/results: {missing}"


def _documented_settings() -> set[str]:
    text = (ROOT / "docs" / "configuration.md").read_text()
    first_cells = [row.split("|")[1] for row in text.splitlines() if row.startswith("| `HOPLITE_")]
    return {name for cell in first_cells for name in re.findall(r"`(HOPLITE_[A-Z0-9_]+)`", cell)}


def test_every_setting_has_a_row_in_the_configuration_page():
    fields = {f"HOPLITE_{f.name.upper()}" for f in dataclasses.fields(Config)}
    documented = _documented_settings()
    assert not fields - documented, \
        f"docs/configuration.md has no row for {sorted(fields - documented)}"
    assert not documented - fields, \
        f"docs/configuration.md documents settings Config does not have: {sorted(documented - fields)}"


def test_the_readme_shows_the_group_api_once_it_exists():
    """README's API at a glance holds a marker where the `Group`
    communicator goes; once `hoplite_gpu.Group` exists the README must show
    it, not the marker."""
    readme = (ROOT / "README.md").read_text()
    marker = "<!-- Group: add when hoplite_gpu.Group lands -->"
    if hasattr(hg, "Group"):
        assert "Group(" in readme and marker not in readme, \
            "hoplite_gpu.Group exists: show it in README.md's API at a glance"
    else:
        assert marker in readme and "hg.Group(" not in readme, \
            "README.md shows a Group API that hoplite_gpu does not have"
