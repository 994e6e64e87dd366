"""Install packages into this interpreter's environment with uv, from the package sources pip is
configured with (scripts/setup.sh installs the pinned requirements this way, then with pip if this
fails). uv unpacks and byte-compiles in parallel; it reads no pip configuration, so the sources
pip would use (pip.conf files and PIP_* variables: index, extra indexes, find-links, a
machine-wide constraint file, a CA bundle) are passed to it here. Resolution as pip's: the best
version over all indexes (`--index-strategy unsafe-best-match`), bytecode compiled.

    .venv/bin/python scripts/uv_install.py -r requirements.txt -c constraints.txt
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

# pip reads the install command's options from these sections, a later one overriding an earlier.
SECTION_ORDER = {"global": 0, "install": 1, ":env:": 2}
TRUE_VALUES = {"1", "true", "yes", "on"}


def pip_settings(config_lines: Iterable[str]) -> dict[str, str]:
    """The settings `pip config list` prints (`section.option='value'`) as pip's install command
    sees them: per option, the value of the last section in SECTION_ORDER that sets it."""
    found: dict[str, tuple[int, str]] = {}
    for line in config_lines:
        key, separator, text = line.strip().partition("=")
        section, _, option = key.rpartition(".")
        if not separator or section not in SECTION_ORDER:
            continue
        rank = SECTION_ORDER[section]
        if option not in found or found[option][0] <= rank:
            found[option] = (rank, str(ast.literal_eval(text)))
    return {option: value for option, (_, value) in found.items()}


def uv_sources(settings: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """uv's arguments and environment for pip's package sources."""
    arguments: list[str] = []
    if "index-url" in settings:
        arguments += ["--index-url", settings["index-url"]]
    for url in settings.get("extra-index-url", "").split():
        arguments += ["--extra-index-url", url]
    for location in settings.get("find-links", "").split():
        arguments += ["--find-links", location]
    for constraints in settings.get("constraint", "").split():
        arguments += ["--constraint", constraints]
    if settings.get("no-index", "").lower() in TRUE_VALUES:
        arguments.append("--no-index")
    environment = {"SSL_CERT_FILE": settings["cert"]} if "cert" in settings else {}
    return arguments, environment


def main(arguments: list[str]) -> int:
    uv = shutil.which("uv", path=str(Path(sys.executable).parent))
    if uv is None:
        print(f"uv_install: no uv beside {sys.executable}", file=sys.stderr)
        return 1
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                            text=True, check=True).stdout
    sources, environment = uv_sources(pip_settings(listed.splitlines()))
    command = [uv, "pip", "install", "--python", sys.executable, "--index-strategy",
               "unsafe-best-match", "--compile-bytecode", *sources, *arguments]
    return subprocess.run(command, env={**environment, **os.environ}).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
