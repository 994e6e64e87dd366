"""torchserve_vision.frontend.agent: the frontend agent's jar, built with the real javac against
the installed TorchServe (the agent at work in a real frontend: tests/server/test_queued_batching.py)."""

from __future__ import annotations

import re
import shutil
import subprocess
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
    # At its own name the class would lose to TorchServe's (the agent jar comes last on the path).
    assert not any(name.startswith("org/") for name in names)
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
