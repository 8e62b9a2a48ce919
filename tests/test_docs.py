"""The README is a front door (under 180 lines; the reference lives in docs/), and every relative link in the
README and docs/ points at a file of this repository."""

from __future__ import annotations

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_readme_stays_a_front_door():
    assert len((REPO / "README.md").read_text().splitlines()) < 180


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if not re.match(r"[a-z]+://", target) and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
    assert broken == []


def test_the_link_check_sees_a_broken_link(tmp_path):
    """Negative control: the same pattern finds a link to a missing page."""
    page = tmp_path / "x.md"
    page.write_text("see [the guide](docs/missing.md#part) and [a site](https://example.org)")
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
    assert targets == ["docs/missing.md", "https://example.org"]
    assert not (tmp_path / targets[0]).exists()
