"""docs/layout.md names every module of the two packages, and names none that does not exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = (ROOT / "docs" / "layout.md").read_text()


def modules() -> set[str]:
    return {path.name for package in ("handlers", "torchserve_vision")
            for path in (ROOT / package).rglob("*.py")
            if path.name not in ("__init__.py", "__main__.py") and "__pycache__" not in path.parts}


def test_every_module_is_on_the_layout_page():
    named = set(re.findall(r"(?<![\w*])(\w+\.py)\b", LAYOUT))
    assert modules() - named == set()


def test_every_module_on_the_layout_page_exists():
    named = set(re.findall(r"(?<![\w*])(\w+\.py)\b", LAYOUT))
    scripts_and_tests = {path.name for pattern in ("tests/**/*.py", "scripts/*.py")
                         for path in ROOT.glob(pattern)}
    assert named - modules() - scripts_and_tests == set()


def test_each_handlers_subpackage_lists_its_own_modules():
    sections: dict[str, set[str]] = {}
    current = None
    for line in LAYOUT.splitlines():
        header = re.match(r"^(\w+)/: ", line)
        if header:
            current = header[1]
            sections[current] = set()
        elif line and not line.startswith(" "):
            current = None
        elif current is not None:
            sections[current] |= set(re.findall(r"(?<![\w*])(\w+\.py)\b", line))
    subpackages = {path.parent.name for path in (ROOT / "handlers").glob("*/__init__.py")}
    assert set(sections) == subpackages
    for name, listed in sections.items():
        on_disk = {path.name for path in (ROOT / "handlers" / name).glob("*.py")} - {"__init__.py"}
        assert listed == on_disk, name
