"""The image's locks (deploy/requirements-{cpu,gpu}.lock, written by
scripts/lock_image_requirements.py): every package pinned with its hashes, in step with
pyproject.toml's runtime dependencies and constraints.txt, the CPU lock the GPU lock without
torch, torchvision and CUDA's packages. Checked offline; writing them needs PyPI."""

from __future__ import annotations

import importlib.util
import re
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
