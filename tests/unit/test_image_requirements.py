"""The image's locks (deploy/requirements-{cpu,gpu}.lock, written by
scripts/lock_image_requirements.py): every package pinned with its hashes, in step with
pyproject.toml's runtime dependencies and constraints.txt, the CPU lock the GPU lock without
torch, torchvision and CUDA's packages. Checked offline; writing them needs PyPI. And the
Dockerfile's install step (deploy/install-image-packages.sh), with a pip that only records."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[2]
LOCKS = {"cpu": REPO / "deploy" / "requirements-cpu.lock", "gpu": REPO / "deploy" / "requirements-gpu.lock"}


def lock_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("lock_image_requirements",
                                                  REPO / "scripts" / "lock_image_requirements.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SCRIPT = lock_script()


def normalised(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(lines: str) -> dict[str, str]:
    """name -> version of `name==version` lines (requirement files and constraints alike)."""
    found = re.findall(r"^([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([^\s;\\]+)", lines, re.M)
    return {normalised(name): version for name, version in found}


def runtime_dependencies() -> dict[str, str]:
    with open(REPO / "pyproject.toml", "rb") as project:
        return pins("\n".join(tomllib.load(project)["project"]["dependencies"]))


@pytest.mark.parametrize("target", sorted(LOCKS))
def test_every_locked_package_is_pinned_with_hashes(target):
    blocks = SCRIPT.requirement_blocks(LOCKS[target].read_text())
    assert len(blocks) > 30
    for name, text in blocks:
        assert re.match(r"^[A-Za-z0-9_.-]+==\S+ \\$", text.splitlines()[0]), text.splitlines()[0]
        assert re.search(r"--hash=sha256:[0-9a-f]{64}", text), name
    sources = r"^(--find-links|--index-url|--extra-index-url|-e )"
    assert not re.search(sources, LOCKS[target].read_text(), re.M)   # PyPI's, not a local folder


def test_the_gpu_lock_holds_every_runtime_dependency_at_its_pinned_version():
    locked = pins(LOCKS["gpu"].read_text())
    for name, version in runtime_dependencies().items():
        assert locked.get(name) == version, name


@pytest.mark.parametrize("target", sorted(LOCKS))
def test_the_locks_agree_with_the_constraints(target):
    constraints = pins((REPO / "constraints.txt").read_text())
    for name, version in pins(LOCKS[target].read_text()).items():
        if name in constraints:
            assert constraints[name] == version, name


def test_the_cpu_lock_is_the_gpu_lock_without_torch_torchvision_and_cuda():
    gpu = SCRIPT.requirement_blocks(LOCKS["gpu"].read_text())
    cpu = SCRIPT.requirement_blocks(LOCKS["cpu"].read_text())
    assert cpu == [(name, text) for name, text in gpu if not SCRIPT.NOT_IN_CPU_LOCK.match(name)]
    left_out = {name for name, _ in gpu} - {name for name, _ in cpu}
    assert {"torch", "torchvision"} <= left_out
    assert all(name in ("torch", "torchvision", "triton") or name.startswith(("nvidia-", "cuda-"))
               for name in left_out)
    dependencies = runtime_dependencies()
    assert {name for name, _ in cpu} >= set(dependencies) - {"torch", "torchvision"}


# --- deploy/install-image-packages.sh: which lock, and where torch comes from --------------------
FAKE_PIP = """#!/bin/sh
# Records each call; an install from the index named in $REFUSED_INDEX fails as an unreachable
# index does.
echo "$*" >> "$CALLS"
case " $* " in *" --index-url $REFUSED_INDEX "*) exit 1 ;; esac
"""


def installed(tmp_path: Path, target: str, index: str,
              refused_index: str = "none") -> tuple[int, list[str], str]:
    """Run the Dockerfile's install step with a pip that only records; (status, pip calls, output)."""
    for name in ("pyproject.toml", "deploy/requirements-cpu.lock", "deploy/requirements-gpu.lock",
                 "deploy/install-image-packages.sh"):
        shutil.copy(REPO / name, tmp_path / Path(name).name)
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "pip").write_text(FAKE_PIP)
    (venv / "pip").chmod(0o755)
    (venv / "python").symlink_to(sys.executable)
    calls = tmp_path / "calls"
    calls.touch()
    result = subprocess.run(["sh", "install-image-packages.sh", str(tmp_path / "venv"), target, index],
                            cwd=tmp_path, capture_output=True, text=True, check=False,
                            env={"PATH": os.environ["PATH"], "CALLS": str(calls),
                                 "REFUSED_INDEX": refused_index})
    return result.returncode, calls.read_text().splitlines(), result.stdout + result.stderr


def locked_install(lock: str) -> str:
    return f"install --no-cache-dir --require-hashes --no-deps -r {lock}"


CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def test_the_gpu_image_installs_the_gpu_lock_alone(tmp_path: Path):
    status, calls, _ = installed(tmp_path, "gpu", CPU_INDEX)
    assert status == 0 and calls == [locked_install("requirements-gpu.lock")]


def test_the_cpu_image_takes_cpu_builds_of_pyprojects_torch_from_the_cpu_index(tmp_path: Path):
    status, calls, output = installed(tmp_path, "cpu", CPU_INDEX)
    assert status == 0 and calls[0] == locked_install("requirements-cpu.lock")
    words = calls[1].split()
    assert words[words.index("--index-url") + 1] == CPU_INDEX
    # a local version only the CPU index has: no other index can hand over a CUDA build
    dependencies = runtime_dependencies()
    assert [word for word in words if "==" in word] == [
        f"torch=={dependencies['torch']}+cpu", f"torchvision=={dependencies['torchvision']}+cpu"]
    assert len(calls) == 2 and "CPU builds" in output


@pytest.mark.parametrize("index", [CPU_INDEX, ""], ids=["unreachable", "none given"])
def test_without_the_cpu_index_the_cpu_image_takes_torch_hash_checked_from_the_gpu_lock(tmp_path: Path,
                                                                                         index: str):
    status, calls, output = installed(tmp_path, "cpu", index, refused_index=CPU_INDEX)
    assert status == 0
    assert calls[0] == locked_install("requirements-cpu.lock")
    assert calls[-1] == locked_install("requirements-gpu.lock")
    assert len(calls) == (3 if index else 2)
    assert "about 7 GB" in output


def test_an_unknown_target_is_refused(tmp_path: Path):
    status, calls, output = installed(tmp_path, "tpu", CPU_INDEX)
    assert status == 2 and calls == [] and "cpu or gpu" in output


def test_ultralytics_is_a_test_dependency_only():
    """AGPL-3.0: pinned for the tests in requirements-ultralytics.txt and nowhere a user's
    install, the image or the project's code when it serves or builds can take it from; `lab
    ultralytics`, which measures Ultralytics' own predict, imports it inside the function that
    runs it, where installed by hand."""
    def mentions(path: Path) -> bool:
        return any(normalised(line.split("==")[0].strip()) == "ultralytics"
                   for line in path.read_text().splitlines() if line.strip() and not line.startswith("#"))

    assert mentions(REPO / "requirements-ultralytics.txt")
    for path in (REPO / "requirements.txt", REPO / "constraints.txt", *LOCKS.values()):
        assert not mentions(path), path
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = [*project["dependencies"], *(dep for group in project["optional-dependencies"].values()
                                            for dep in group)]
    assert not [dep for dep in declared if normalised(re.split(r"[=<>\[ ;]", dep)[0]) == "ultralytics"]
    lab = REPO / "torchserve_vision" / "lab"
    for package in ("handlers", "torchserve_vision"):
        for source in (REPO / package).rglob("*.py"):
            indent = "" if source.parent == lab else r"\s*"
            imports = re.search(rf"^{indent}(import|from) ultralytics", source.read_text(), re.MULTILINE)
            assert not imports, source
