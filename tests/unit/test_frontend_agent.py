"""torchserve_vision.frontend.agent: the frontend agent's jar, built with the real javac against
the installed TorchServe (the agent at work in a real frontend: tests/server/test_queued_batching.py)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from torchserve_vision.frontend import agent


@pytest.mark.slow
def test_the_jar_holds_the_agent_and_hides_the_classes_it_substitutes(tmp_path: Path):
    jar = agent.build_agent_jar(tmp_path / "agent.jar")
    with zipfile.ZipFile(jar) as archive:
        names = set(archive.namelist())
        manifest = archive.read("META-INF/MANIFEST.MF").decode()
    assert "Premain-Class: torchserve_vision.frontend.Agent" in manifest
    assert "torchserve_vision/frontend/Agent.class" in names
    assert "replacement/ContinuousBatching.class.bin" in names
    assert "replacement/ServerGroups.class.bin" in names
    # At its own name a substitute would lose to TorchServe's (the agent jar comes last on the
    # path); the one class of TorchServe's package it adds, which TorchServe lacks, is found there.
    added = {name for name in names if name.startswith("org/")}
    assert added == {"org/pytorch/serve/wlm/RefusingQueue.class"}
    assert not list(tmp_path.glob("*.tmp"))


def javap(target: str, classpath: str) -> str:
    return subprocess.run([shutil.which("javap") or "javap", "-protected", "-cp", classpath, target],
                          capture_output=True, text=True, check=True).stdout


def members(class_file: Path, frontend: Path) -> set[str]:
    """The public and protected methods and fields `javap` lists for a class file, with those it
    inherits from TorchServe's classes (a substitute may inherit what TorchServe's class
    overrides), `throws` clauses left out (they are not part of what the JVM links)."""
    listed = javap(str(class_file), str(class_file.parent))
    found: set[str] = set()
    while True:
        found |= {line.strip().split(" throws ")[0].rstrip(";") for line in listed.splitlines()
                  if line.startswith("  ")}
        parent = re.search(r" extends (org\.pytorch\.\S+)", listed)
        if parent is None:
            return found
        listed = javap(parent[1], str(frontend))


@pytest.mark.slow
@pytest.mark.parametrize(("compiled_name", "stored_name"), agent.REPLACEMENTS)
def test_each_substitute_has_every_member_of_torchserves_class(tmp_path: Path, compiled_name: str,
                                                               stored_name: str):
    """The frontend calls TorchServe's class by its members: one missing from the substitute
    would fail at run time (NoSuchMethodError), not when the agent is compiled."""
    jar = agent.build_agent_jar(tmp_path / "agent.jar")
    ours, theirs = tmp_path / "ours" / compiled_name, tmp_path / "theirs" / compiled_name
    for target, source, name in ((ours, jar, stored_name), (theirs, agent.frontend_jar(), compiled_name)):
        target.parent.mkdir(parents=True)
        with zipfile.ZipFile(source) as archive:
            target.write_bytes(archive.read(name))
    expected = members(theirs, agent.frontend_jar())
    assert any("(" in member for member in expected), expected
    assert expected - members(ours, agent.frontend_jar()) == set()


@pytest.mark.slow
def test_the_jar_is_built_once_and_again_when_a_source_changes(tmp_path: Path, monkeypatch):
    sources = tmp_path / "frontend"
    shutil.copytree(agent.SOURCES, sources, ignore=shutil.ignore_patterns("build", "*.py", "__pycache__"))
    monkeypatch.setattr(agent, "SOURCES", sources)
    monkeypatch.setattr(agent, "jar_directories", lambda: [tmp_path / "jars"])
    first = agent.agent_jar()
    assert first.is_file() and agent.agent_jar() == first
    changed = sources / "Agent.java"
    changed.write_text(changed.read_text() + "\n// changed\n")
    assert agent.agent_jar_path() != first


def test_without_javac_the_error_says_what_to_install(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(agent.shutil, "which", lambda _name: None)
    with pytest.raises(agent.AgentError, match="openjdk-17-jdk-headless"):
        agent.build_agent_jar(tmp_path / "agent.jar")


def test_a_path_with_whitespace_is_refused_for_vmargs(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(agent, "agent_jar", lambda: tmp_path / "with space" / "agent.jar")
    with pytest.raises(agent.AgentError, match="whitespace"):
        agent.java_agent_option()
    monkeypatch.setattr(agent, "agent_jar", lambda: tmp_path / "agent.jar")
    assert agent.java_agent_option() == f"-javaagent:{tmp_path / 'agent.jar'}"


REPO = Path(__file__).resolve().parents[2]


def printed(command: list[str], cwd: Path) -> str:
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return subprocess.run(command, cwd=cwd, env=environment, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_the_jar_is_where_the_installed_package_looks_whatever_the_directory_that_builds_it(
        tmp_path: Path):
    """A container image builds the jar with `python -m` in a copy of the sources (`WORKDIR /src`),
    which imports the package from the working directory, and runs the server from the installed
    package: both must name the same jar, outside either copy of the sources."""
    source_tree = tmp_path / "src"
    shutil.copytree(REPO / "torchserve_vision", source_tree / "torchserve_vision",
                    ignore=shutil.ignore_patterns("build", "__pycache__"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where_imported = [sys.executable, "-c", "import torchserve_vision; print(torchserve_vision.__file__)"]
    assert printed(where_imported, source_tree).startswith(str(source_tree))   # the copy, as in /src
    assert not printed(where_imported, elsewhere).startswith(str(source_tree))
    built_from_the_copy = printed([sys.executable, "-m", "torchserve_vision.frontend.agent", "--path"],
                                  source_tree)
    found_by_the_package = printed([sys.executable, "-c", "from torchserve_vision.frontend import agent; "
                                    "print(agent.agent_jar_path())"], elsewhere)
    assert built_from_the_copy == found_by_the_package
    for sources in (source_tree, REPO / "torchserve_vision"):
        assert not Path(built_from_the_copy).is_relative_to(sources)


def test_the_jar_goes_to_the_users_cache_where_the_environment_is_not_writable(tmp_path: Path,
                                                                               monkeypatch):
    """A user install into a system Python: its data directory (/usr/local) belongs to root."""
    system = tmp_path / "usr-local"
    system.mkdir()
    monkeypatch.setattr(agent.sysconfig, "get_path", lambda _name: str(system))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    # the suite may run as root, who may write anywhere: os.access answers as for another user
    monkeypatch.setattr(agent.os, "access", lambda path, _mode: not Path(path).is_relative_to(system))
    assert not agent.writable(system / "share" / "torchserve-vision")   # judged by /usr/local itself
    assert agent.agent_jar_path() == tmp_path / "cache" / "torchserve-vision" / agent.agent_jar_name()
    installed = system / "share" / "torchserve-vision" / agent.agent_jar_name()
    installed.parent.mkdir(parents=True)
    installed.write_bytes(b"jar")
    assert agent.agent_jar_path() == installed      # one that exists is found before a writable one


def test_a_jar_placed_beside_the_sources_is_taken_where_none_was_built(tmp_path: Path, monkeypatch):
    """A host without javac gets the jar in a bundle, put beside the sources."""
    monkeypatch.setattr(agent, "jar_directories", lambda: [tmp_path / "prefix", tmp_path / "cache"])
    monkeypatch.setattr(agent, "SOURCES", tmp_path / "sources")
    placed = tmp_path / "sources" / "build" / agent.agent_jar_name()
    assert agent.agent_jar_path() == tmp_path / "prefix" / agent.agent_jar_name()     # built there
    placed.parent.mkdir(parents=True)
    placed.write_bytes(b"jar")
    assert agent.agent_jar_path() == placed
    built = tmp_path / "prefix" / agent.agent_jar_name()
    built.parent.mkdir(parents=True)
    built.write_bytes(b"jar")
    assert agent.agent_jar_path() == built                     # the environment's first
