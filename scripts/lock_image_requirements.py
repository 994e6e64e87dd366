"""Write the image's locked requirements, every package pinned with its hashes (deploy/Dockerfile
installs them with `pip install --require-hashes --no-deps`):

- deploy/requirements-gpu.lock: the runtime dependencies of pyproject.toml, resolved on PyPI
  within constraints.txt (PyPI's Linux torch wheels are CUDA builds, with their CUDA packages);
- deploy/requirements-cpu.lock: the same without torch, torchvision and the packages only CUDA
  needs. The CPU image installs torch and torchvision after it, at pyproject.toml's versions,
  from the PyTorch CPU wheel index (not on PyPI), without hashes.

Run from the repository after a change to pyproject.toml's dependencies or constraints.txt (the
tests fail until the locks agree with them); it needs PyPI and takes a few minutes:

    python3 scripts/lock_image_requirements.py

pip-compile (pip-tools, pinned below) runs in a virtual environment of its own, on Python 3.11 on
x86-64 Linux: the image's interpreter and platform, which the resolution depends on.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parent.parent
PIP_TOOLS = "pip-tools==7.6.2"
GPU_LOCK = REPO / "deploy" / "requirements-gpu.lock"
CPU_LOCK = REPO / "deploy" / "requirements-cpu.lock"
# From the PyTorch CPU index in the CPU image, or needed by PyTorch's CUDA builds only.
LOCAL_PACKAGE_SOURCES = {"PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX"}
NOT_IN_CPU_LOCK = re.compile(r"^(torch|torchvision|triton|nvidia-.*|cuda-.*)$")
HEADER = """\
# {what}
# Written by scripts/lock_image_requirements.py from pyproject.toml's dependencies and
# constraints.txt; do not edit. deploy/Dockerfile installs it with
# `pip install --require-hashes --no-deps`.
"""


def runtime_dependencies() -> list[str]:
    with open(REPO / "pyproject.toml", "rb") as project:
        return list(tomllib.load(project)["project"]["dependencies"])


def compiled(dependencies: list[str]) -> str:
    """pip-compile's pinned, hashed resolution of `dependencies` on PyPI within constraints.txt."""
    with tempfile.TemporaryDirectory() as tmp:
        venv = Path(tmp) / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", PIP_TOOLS], check=True)
        result = subprocess.run(
            [str(venv / "bin" / "pip-compile"), "--quiet", "--generate-hashes", "--allow-unsafe",
             "--no-header", "--no-annotate", "--no-emit-index-url", "--no-emit-find-links",
             "--strip-extras",
             "--index-url", "https://pypi.org/simple", "-c", "constraints.txt",
             "--output-file", "-", "-"],
            input="\n".join(dependencies) + "\n", capture_output=True, text=True, check=True,
            # PyPI alone: not the indexes or wheel folders a local pip config may add
            cwd=REPO, env={**{key: value for key, value in os.environ.items()
                              if key not in LOCAL_PACKAGE_SOURCES}, "PIP_CONFIG_FILE": os.devnull})
    return result.stdout


def requirement_blocks(lock: str) -> list[tuple[str, str]]:
    """(normalised name, its lines: `name==version \\` and its hash lines) of a compiled lock."""
    blocks: list[tuple[str, str]] = []
    for line in lock.splitlines(keepends=True):
        if line.strip().startswith("#") or not line.strip():
            continue
        if not line.startswith(" "):
            name = re.split(r"[=\[ ]", line, maxsplit=1)[0].lower().replace("_", "-")
            blocks.append((name, line))
        else:
            blocks[-1] = (blocks[-1][0], blocks[-1][1] + line)
    return blocks


def main() -> int:
    blocks = requirement_blocks(compiled(runtime_dependencies()))
    GPU_LOCK.write_text(HEADER.format(what="The GPU image's packages, from PyPI.")
                        + "".join(text for _, text in blocks))
    CPU_LOCK.write_text(HEADER.format(what="The CPU image's packages, from PyPI; torch and torchvision "
                                           "come from the PyTorch CPU index after them.")
                        + "".join(text for name, text in blocks if not NOT_IN_CPU_LOCK.match(name)))
    print(f"wrote {GPU_LOCK.relative_to(REPO)} and {CPU_LOCK.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
