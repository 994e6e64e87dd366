"""Every file, module and function the README and docs/ name exists (the commands they show are
checked by tests/unit/test_command_line.py, Kubernetes' by test_kubernetes_docs.py): a renamed
or moved module fails here, not in a newcomer's hands.

What is read as a name: a repository path (`handlers/...`, `torchserve_vision/...`, `tests/...`,
`scripts/...`, `config/...`, `deploy/...`, `docs/...`), also with `.attribute` after a module
(`handlers/model/compiled_model.load_aoti_package`), or as the prefix of files an `--out`
writes; a dotted module path (`handlers.request.decode`, `handlers.model.answer_agreement.
cross_device_bound`); and, in backticks outside code blocks, `module.attribute` where the
module is one of the project's (by file name) and not a section of config/models.yaml
(`serving.deadline_ms` is a setting).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PACKAGES = ("handlers", "torchserve_vision")
PATH = re.compile(r"(?<![\w/.-])((?:handlers|torchserve_vision|tests|scripts|config|deploy|docs|\.ci)"
                  r"/[\w./-]*\w)")
DOTTED = re.compile(r"(?<![\w./-])((?:handlers|torchserve_vision)(?:\.\w+)+)")
QUALIFIED = re.compile(r"`([a-z_][a-z0-9_]*)\.([A-Za-z_]\w*)(?:\(\))?`")
CODE_BLOCK = re.compile(r"```.*?```", re.S)
FILE_SUFFIXES = {"py", "md", "yaml", "yml", "json", "properties", "xml", "sh", "txt", "png", "csv",
                 "jar", "mar", "pt", "lock", "java", "log", "toml", "onnx", "bin", "whl"}


def module_names() -> dict[str, list[str]]:
    """Each module file's name (without .py) -> the dotted modules of that name."""
    found: dict[str, list[str]] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if path.name != "__init__.py":
                found.setdefault(path.stem, []).append(".".join(path.relative_to(ROOT).with_suffix("").parts))
    return found


def settings_sections() -> set[str]:
    """Every key of config/models.yaml, at any depth."""
    keys: set[str] = set()

    def walk(value: object) -> None:
        if isinstance(value, dict):
            keys.update(str(key) for key in value)
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(yaml.safe_load((ROOT / "config" / "models.yaml").read_text()))
    return keys


def resolves(dotted: str) -> bool:
    """`dotted` names a module of the project, or an attribute of one."""
    parts = dotted.split(".")
    for length in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:length]))
        except ImportError:
            continue
        for attribute in parts[length:]:
            if not hasattr(found, attribute):
                return False
            found = getattr(found, attribute)
        return True
    return False


def path_exists(name: str) -> bool:
    path = ROOT / name
    if path.exists() or any(path.parent.glob(path.name + ".*")):   # a file, or an --out prefix
        return True
    module, _, attribute = name.rpartition(".")
    return bool(module) and (ROOT / f"{module}.py").is_file() and resolves(
        f"{module.replace('/', '.')}.{attribute}")


def problems_of(text: str) -> Iterator[str]:
    for name in PATH.findall(text):
        if not any(mark in name for mark in "*{<") and not path_exists(name):
            yield f"no file {name}"
    for name in DOTTED.findall(text):
        if not resolves(name):
            yield f"no module or attribute {name}"
    modules, sections = module_names(), settings_sections()
    for module, attribute in QUALIFIED.findall(CODE_BLOCK.sub("", text)):
        checked = module in modules and module not in sections and attribute not in FILE_SUFFIXES
        if checked and not any(resolves(f"{dotted}.{attribute}") for dotted in modules[module]):
            yield f"no {attribute} in {module}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_name_on_the_page_exists(page):
    assert list(problems_of(page.read_text())) == []


@pytest.mark.parametrize("stale", [
    "see handlers/compiled_model.load_aoti_package",              # moved into handlers/model/
    "handlers/model/compiled_model.load_aot_package",             # a function renamed
    "(handlers.request.decode.decode_one_image)",                 # a function that is not there
    "the test tests/unit/test_decoder.py",
    "`answer_agreement.device_bound`",
])
def test_a_stale_name_is_found(stale):
    assert list(problems_of(stale))


def test_real_names_and_settings_pass():
    text = ("handlers/model/compiled_model.py, handlers/model/compiled_model.load_aoti_package, "
            "handlers.request.decode, `answer_agreement.cross_device_bound`, `serving.deadline_ms`, "
            "--out docs/sweep-cpu")
    assert list(problems_of(text)) == []
