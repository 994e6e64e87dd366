"""The `torchserve-vision` command: every command the README, docs/ and the demo show parses, every
subcommand has --help, and the layers import as documented (no command imports another)."""

from __future__ import annotations

import argparse
import ast
import re
import shlex
from pathlib import Path

import pytest

from torchserve_vision.cli import command_parser, main

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "torchserve_vision"


SHELL_OPERATORS = {"|", ">", ">>", "&", "&&", ";", "||"}


def documented_commands(text: str) -> list[list[str]]:
    """Arguments of every `torchserve-vision ...` / `$TSV ...` line (continuations joined), up to
    a shell operator (a pipe, a redirection, `&`, `&&`, `;`)."""
    joined = re.sub(r"\\\n\s*", " ", text)
    commands = []
    for line in joined.splitlines():
        match = re.match(r"\s*(?:\.venv/bin/)?(?:torchserve-vision|\$TSV)\s+(.*)", line)
        if match:
            words = shlex.split(match.group(1), comments=True)
            ends = [index for index, word in enumerate(words) if word in SHELL_OPERATORS]
            commands.append(words[:ends[0]] if ends else words)
    return commands


README_COMMANDS = documented_commands((ROOT / "README.md").read_text())
DEMO_COMMANDS = documented_commands((ROOT / "scripts" / "demo.sh").read_text())
DOCS_COMMANDS = [arguments for page in sorted((ROOT / "docs").glob("*.md"))
                 for arguments in documented_commands(page.read_text())]


def test_the_readme_the_docs_and_the_demo_show_the_command():
    assert len(README_COMMANDS) >= 10 and len(DOCS_COMMANDS) >= 40
    every_group = {"build", "server", "predict", "models", "lab"}
    assert {arguments[0] for arguments in README_COMMANDS} == every_group
    assert {arguments[0] for arguments in DOCS_COMMANDS} == every_group
    assert [arguments[0] for arguments in DEMO_COMMANDS] == ["build", "server", *["predict"] * 5,
                                                              "server"]


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    """The whole command's parser, built once (parsing leaves it as it was)."""
    return command_parser()


@pytest.mark.parametrize("arguments", README_COMMANDS + DEMO_COMMANDS + DOCS_COMMANDS, ids=" ".join)
def test_every_documented_command_parses(arguments, parser):
    arguments = [a.replace("$PHOTOS", "/photos").replace("[--model", "--model").rstrip("]")
                 for a in arguments]
    parsed = parser.parse_args(arguments)
    assert callable(parsed.run)


def subcommand_paths(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*prefix, name)
                yield from subcommand_paths(sub, (*prefix, name))


def test_every_subcommand_has_help(capsys):
    paths = list(subcommand_paths(command_parser()))
    assert ("models", "rollout") in paths and ("lab", "rollout-drill") in paths and len(paths) >= 25
    for path in [(), *paths]:
        with pytest.raises(SystemExit) as exit_info:
            main([*path, "--help"])
        assert exit_info.value.code == 0
        text = capsys.readouterr().out
        assert f"usage: torchserve-vision {' '.join(path)}".strip() in text
        assert "option_strings" not in text and "%(" not in text, path   # help strings render


@pytest.mark.parametrize("arguments", [["--help"], ["models", "--help"], ["models", "list", "--help"],
                                       ["models", "rollout", "--help"], ["server", "start", "--help"],
                                       ["build", "--help"], ["predict", "--help"]], ids=" ".join)
def test_help_and_the_model_and_server_commands_import_no_torch(arguments):
    """The command answers at once: `python -X importtime` lists every module a command
    imports; torch (seconds to import) must not be among them outside `lab` and building."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "torchserve_vision", *arguments],
                            capture_output=True, text=True, cwd=ROOT, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:")}
    assert "torchserve_vision.cli" in imported   # the measurement saw the command's imports
    heavy = sorted(name for name in imported if name.split(".")[0] in {"torch", "torchvision", "timm"})
    assert heavy == [], heavy[:5]


def test_the_same_flags_name_the_same_things():
    """--inference-url, --management-url and --key-file on every subcommand that talks to a server."""
    parser = command_parser()
    talking = [("predict", "x.jpg"), ("models", "list"), ("lab", "load"), ("lab", "sweep"),
               ("lab", "compare"), ("lab", "tune", "x.mar", "--p99-ms", "1", "--rate", "1")]
    for arguments in talking:
        parsed = parser.parse_args([*arguments, "--inference-url", "http://h:1", "--management-url",
                                    "http://h:2", "--key-file", "k.json"])
        assert (parsed.inference_url, parsed.management_url, parsed.key_file) == \
            ("http://h:1", "http://h:2", "k.json"), arguments


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def is_command_module(name: str) -> bool:
    return name == "torchserve_vision.cli" or name.startswith("torchserve_vision.cli.")


# The worker fork server gives a forked worker the search path a fresh interpreter would have had,
# and its sitecustomize finds the one it hides: the only modules that touch sys.path.
SEARCH_PATH_OWNERS = {Path("worker_forkserver/server.py"), Path("worker_forkserver/site/sitecustomize.py")}


def test_no_layer_imports_the_command_and_no_command_imports_another():
    for path in PACKAGE.rglob("*.py"):
        imports = imported_modules(path)
        if path.relative_to(PACKAGE) not in SEARCH_PATH_OWNERS:
            assert "sys.path" not in path.read_text(), path
        if path.name == "__main__.py":
            continue   # `python -m torchserve_vision` is the command
        if path.parent.name != "cli":
            assert not any(is_command_module(name) for name in imports), path
        elif path.name not in ("__init__.py", "common.py"):
            commands = {name.rsplit(".", 1)[0] if name.count(".") > 2 else name
                        for name in imports if is_command_module(name)}
            # a command's own parts (cli/lab.py's table names cli/lab_served.py's runners;
            # cli/models_*.py share cli/models_common.py) and the shared flags; never another
            family = f"torchserve_vision.cli.{path.stem.split('_')[0]}"
            own_parts = {name for name in commands if name == family or name.startswith(f"{family}_")}
            assert commands - own_parts <= {"torchserve_vision.cli.common"}, (path, commands)


def test_the_pure_handlers_package_never_imports_the_command_package():
    for path in (ROOT / "handlers").rglob("*.py"):
        assert not any(name.startswith("torchserve_vision") for name in imported_modules(path)), path
