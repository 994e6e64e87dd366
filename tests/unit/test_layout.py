"""docs/layout.md names every module of the two packages, and names none that does not exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

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


# --- one-way layers inside handlers/ ---------------------------------------------------------------
# Lowest first: a module of one of these folders imports from its own folder or a lower level
# only. The stages' folders share the highest level, and none imports another.
LEVELS = (("ground",), ("request",), ("task",), ("model",), ("batch",), ("cache", "drift", "shadow"))
LAYERS = tuple(folder for level in LEVELS for folder in level)


def level_of(folder: str) -> int:
    return next(index for index, level in enumerate(LEVELS) if folder in level)


def layer_of(module: str) -> str | None:
    """The folder a `handlers.<folder>...` module belongs to; None for the top level of
    handlers/, which every folder lies below."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[1] in LAYERS else None


def upward_imports(module: str, source: str) -> list[str]:
    """The imports of handlers/ in `source` (the text of `module`) that leave its folder for a
    higher level, another folder of its level, or the top level of handlers/."""
    own = layer_of(module) or ""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module
                 else [alias.name for alias in node.names] if isinstance(node, ast.Import) else [])
        for name in names:
            if name.split(".")[0] != "handlers":
                continue
            target = layer_of(name)
            if target is None and isinstance(node, ast.ImportFrom) and name in (
                    f"handlers.{layer}" for layer in LAYERS):   # `from handlers.model import x`
                target = name.split(".")[1]
            if target is None or (target != own and level_of(target) >= level_of(own)):
                found.append(f"{module} imports {name}")
    return found


def test_the_handlers_layers_import_downward_only():
    found = []
    for layer in LAYERS:
        for path in sorted((ROOT / "handlers" / layer).glob("*.py")):
            module = f"handlers.{layer}.{path.stem}"
            found += upward_imports(module, path.read_text())
    assert found == []


@pytest.mark.parametrize(("module", "source"), [
    ("handlers.request.decode", "from handlers.model.settings import ClassifierSettings\n"),
    ("handlers.task.cascade", "from handlers.model.pipeline_settings import CascadeSettings\n"),
    ("handlers.ground.limits", "import handlers.task.detection\n"),
    ("handlers.model.settings", "from handlers.batch.request_slot import RequestSlot\n"),
    ("handlers.request.decode", "from handlers.cache.cache_stage import CacheStage\n"),
    ("handlers.batch.request_slot", "from handlers.drift.drift_stage import DriftStage\n"),
    ("handlers.drift.drift_stage", "from handlers.shadow.shadow_metrics import emit_shadow_dropped\n"),
    ("handlers.cache.cache_stage", "from handlers.serving import BatchedImageHandler\n"),
])
def test_an_upward_import_is_found(module, source):
    assert upward_imports(module, source) != []


def test_a_downward_import_is_not_an_upward_one():
    assert upward_imports("handlers.model.settings",
                          "from handlers.ground.limits import ImageLimits\n"
                          "from handlers.task.detection import DetectorInput\n"
                          "from handlers.model import model_loading\nimport torch\n") == []
    assert upward_imports("handlers.drift.drift_stage",
                          "from handlers.batch.request_slot import RequestSlot\n"
                          "from handlers.drift.drift_metrics import emit_drift_reference\n"
                          "from handlers.request.image_header import read_header\n") == []
