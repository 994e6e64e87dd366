"""The worker fork server with a stand-in worker script at TorchServe's path (ts/model_service_worker.py)
and a shell as the frontend: the same answers as a plain start, one server per frontend, and
the worker, its stand-in and the server living and dying together."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from handlers import torchserve_context
from handlers.shadow.shadow_policy import TRAFFIC_DIR_ENVIRONMENT
from tests.cpu_by_unit import writable_cgroup2
from torchserve_vision import paths
from torchserve_vision.server_process import instance_for, process_alive
from torchserve_vision.waiting import wait_until
from torchserve_vision.worker_forkserver import (
    DIRECTORY_VARIABLE,
    FRONTEND_PID_VARIABLE,
    OWNER_VARIABLE,
    SWITCH_VARIABLE,
    shared_owner,
)
from torchserve_vision.worker_forkserver.cgroups import own_cgroup
from torchserve_vision.worker_forkserver.channel import ForkServerFiles, server_key
from torchserve_vision.worker_forkserver.client import server_environment
from torchserve_vision.worker_forkserver.frontend_setup import (
    SITE_DIR,
    fork_server_pids,
    with_fork_server,
    without_fork_server,
)

WORKER_SCRIPT = """
import gc, json, os, sys, tempfile, time
import model_module
print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv[1:], "cwd": os.getcwd(),
                  "tmp": tempfile.gettempdir(), "logs": os.environ.get("LOG_LOCATION"),
                  "cgroup": open("/proc/self/cgroup").read(),
                  "setting": os.environ.get("WORKER_SETTING"), "module": model_module.VALUE,
                  "path0": sys.path[0], "name": __name__, "collector_on": gc.isenabled(),
                  "frozen": gc.get_freeze_count(),
                  "frontend": os.environ.get("TSV_FRONTEND_PID")}), flush=True)
print("to standard error", file=sys.stderr, flush=True)
if "--sleep" in sys.argv:
    time.sleep(600)
sys.exit(int(os.environ.get("WORKER_EXIT_CODE", "0")))
"""


@pytest.fixture
def worker_tree(tmp_path: Path) -> tuple[Path, Path]:
    """(the worker script at TorchServe's path, a model directory holding `model_module`)."""
    script = tmp_path / "home" / "ts" / "model_service_worker.py"
    script.parent.mkdir(parents=True)
    script.write_text(WORKER_SCRIPT)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "model_module.py").write_text("VALUE = 'from the model directory'\n")
    return script, model_dir


def frontend_environment(tmp_path: Path, model_dir: Path, fork_server: bool,
                         shared_by: tuple[int, Path] | None = None) -> dict[str, str]:
    """A frontend's environment: its fork server in `tmp_path / "run"`, or the one
    `shared_by` (owner pid, directory) names."""
    environment = {**os.environ, "WORKER_SETTING": "set", "WORKER_EXIT_CODE": "7"}
    for name in (DIRECTORY_VARIABLE, OWNER_VARIABLE):
        environment.pop(name, None)
    environment["PYTHONPATH"] = str(model_dir)     # TorchServe appends the model's directory
    if not fork_server:
        return {**environment, SWITCH_VARIABLE: "0"}
    if shared_by is not None:
        environment.update({OWNER_VARIABLE: str(shared_by[0]), DIRECTORY_VARIABLE: str(shared_by[1])})
    environment = with_fork_server({**environment, SWITCH_VARIABLE: "1"}, tmp_path / "run")
    (tmp_path / "run").mkdir(parents=True, exist_ok=True)
    return environment


def run_frontend(script: Path, model_dir: Path, environment: dict[str, str],
                 workers: int, cgroup: Path | None = None) -> tuple[int, list[str]]:
    """A shell as the frontend (in `cgroup` when given): start `workers` workers one after the
    other (as TorchServe does, in the model's directory), print each one's exit code. (The
    shell's pid, its output.)"""
    command = 'echo $$; ' + "; ".join(f'"{sys.executable}" "{script}" --port {9000 + n}; echo "exit $?"'
                                      for n in range(workers))
    if cgroup is not None:
        command = f'echo $$ > "{cgroup}/cgroup.procs"; {command}'
    done = subprocess.run(["sh", "-c", command], cwd=model_dir, env=environment,
                          capture_output=True, text=True, timeout=240, check=True)
    assert done.stderr.count("to standard error") == workers, done.stderr
    shell, *lines = done.stdout.splitlines()
    return int(shell), lines


def test_the_fork_servers_key_ignores_only_what_the_frontend_adds_and_the_instances_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    base = {"PATH": "/bin", "PYTHONPATH": "/models/a"}
    assert server_key("python", base, 1) == server_key("python", {**base, "PYTHONPATH": "/models/b"}, 1)
    assert server_key("python", base, 1) == server_key("python", {**base, "TS_IPEX_ENABLE": "false"}, 1)
    assert server_key("python", base, 1) != server_key("python", {**base, "OMP_NUM_THREADS": "1"}, 1)
    assert server_key("python", base, 1) != server_key("python", base, 2)       # another frontend
    # where each instance keeps its files (server_process.TorchServeInstance.environment)
    monkeypatch.delenv(OWNER_VARIABLE, raising=False)
    instances = [instance_for(paths.DEVELOPMENT_CONFIG, tmp_path / run).environment() for run in ("a", "b")]
    assert {name for name in instances[0] if instances[0][name] != instances[1].get(name)} == {
        "TMPDIR", "TEMP", "LOG_LOCATION", "METRICS_LOCATION", TRAFFIC_DIR_ENVIRONMENT, DIRECTORY_VARIABLE}
    assert server_key("python", instances[0], 1) == server_key("python", instances[1], 1)
    assert server_key("python", base, 1) == server_key("python", {**base, "PYTEST_CURRENT_TEST": "t"}, 1)
    assert server_key("python", base, 1) != server_key("python3", base, 1)
    socket_name = ForkServerFiles(Path("/t"), server_key("python", base, 1)).socket.name
    assert len(socket_name) <= len(".ts.sock.65535")     # fits where TorchServe's sockets fit


def test_the_worker_is_told_its_frontend_under_the_name_the_handlers_read():
    assert FRONTEND_PID_VARIABLE == torchserve_context.FRONTEND_PID_VARIABLE


def test_the_handlers_frontend_is_the_named_process_or_else_the_parent(monkeypatch: pytest.MonkeyPatch):
    def frontend_pid() -> int | None:
        frontend = torchserve_context.frontend_process()
        return None if frontend is None else frontend.pid
    monkeypatch.delenv(FRONTEND_PID_VARIABLE, raising=False)
    assert frontend_pid() == os.getppid()
    monkeypatch.setenv(FRONTEND_PID_VARIABLE, str(os.getpid()))
    assert frontend_pid() == os.getpid()


def test_the_frontend_environment_puts_the_site_first_unless_switched_off(tmp_path: Path):
    environment = with_fork_server({"PYTHONPATH": "/user/lib"}, tmp_path)
    assert environment["PYTHONPATH"].split(os.pathsep) == [str(SITE_DIR), "/user/lib"]
    assert environment[DIRECTORY_VARIABLE] == str(tmp_path)
    assert (SITE_DIR / "sitecustomize.py").is_file()
    off = {SWITCH_VARIABLE: "0", "PYTHONPATH": "/user/lib"}
    assert with_fork_server(off, tmp_path) == off
    assert without_fork_server(environment) == {"PYTHONPATH": "/user/lib"}
    assert without_fork_server(with_fork_server({}, tmp_path)) == {}


def test_the_server_imports_nothing_from_the_models_directory():
    entries = ["/site", "/tmp/models/abc", "/tmp/models/abc/sub", "/tmp/models/abcd", "/lib"]
    environment = server_environment({"PYTHONPATH": os.pathsep.join(entries)}, "/tmp/models/abc")
    assert environment["PYTHONPATH"] == os.pathsep.join(["/site", "/tmp/models/abcd", "/lib"])


def parents(lines: list[str]) -> set[int]:
    """The workers' parent pids, from their lines."""
    return {json.loads(line)["ppid"] for line in lines if not line.startswith("exit")}


@pytest.mark.slow
def test_workers_forked_from_one_server_answer_as_plainly_started_ones(tmp_path: Path, worker_tree):
    script, model_dir = worker_tree
    plain_shell, plain = run_frontend(script, model_dir, frontend_environment(tmp_path, model_dir, False), 2)
    forked_shell, forked = run_frontend(script, model_dir, frontend_environment(tmp_path, model_dir, True), 2)

    def comparable(lines: list[str]) -> list[Any]:
        return [line if line.startswith("exit") else
                {k: v for k, v in json.loads(line).items() if k not in ("pid", "ppid", "frontend", "frozen")}
                for line in lines]
    assert comparable(forked) == comparable(plain)
    assert comparable(forked)[0]["collector_on"] is True
    # the fork server's imports (torch, torchvision, timm, ...) are frozen out of a forked
    # worker's cycle collections; a plainly started worker has frozen nothing
    assert {json.loads(line)["frozen"] for line in plain[::2]} == {0}
    assert min(json.loads(line)["frozen"] for line in forked[::2]) > 100_000
    assert comparable(plain)[1] == "exit 7" and comparable(plain)[0]["module"] == "from the model directory"
    assert comparable(plain)[0]["name"] == "__main__" and comparable(plain)[2]["argv"] == ["--port", "9001"]
    assert parents(plain) == {plain_shell}
    # a forked worker is told its frontend (handlers.torchserve_context.frontend_process)
    assert [json.loads(line)["frontend"] for line in forked[::2]] == [str(forked_shell)] * 2
    assert len(parents(forked)) == 1 and parents(forked) != {forked_shell}    # one server forked both
    server = parents(forked).pop()
    wait_until(lambda: not psutil.pid_exists(server) and not fork_server_pids(tmp_path / "run"), 30,
               "the fork server to exit after its frontend", interval_s=0.05)
    assert not list((tmp_path / "run").glob(".fork.*.failed"))


def start_sleeping_worker(tmp_path: Path, script: Path,
                          model_dir: Path) -> tuple[subprocess.Popen[str], int, int]:
    """(the shell, the stand-in's pid, the worker's pid) for a worker that sleeps."""
    environment = frontend_environment(tmp_path, model_dir, True)
    shell = subprocess.Popen(["sh", "-c", f'"{sys.executable}" "{script}" --sleep; echo "exit $?"'],
                             cwd=model_dir, env=environment, stdout=subprocess.PIPE, text=True)
    assert shell.stdout is not None
    worker = json.loads(shell.stdout.readline())
    stand_in = [child for child in psutil.Process(shell.pid).children() if child.pid != worker["pid"]]
    assert len(stand_in) == 1 and worker["ppid"] != shell.pid
    return shell, stand_in[0].pid, worker["pid"]


@pytest.mark.slow
def test_a_killed_stand_in_takes_its_worker_and_a_killed_worker_its_stand_in(tmp_path: Path, worker_tree):
    script, model_dir = worker_tree
    shell, stand_in, worker = start_sleeping_worker(tmp_path, script, model_dir)
    os.kill(stand_in, signal.SIGKILL)            # what TorchServe's destroyForcibly does
    wait_until(lambda: not process_alive(worker), 30, "the worker to die with its stand-in", interval_s=0.05)
    assert shell.communicate(timeout=30)[0].strip() == f"exit {128 + signal.SIGKILL}"

    shell, stand_in, worker = start_sleeping_worker(tmp_path, script, model_dir)
    os.kill(worker, signal.SIGTERM)
    # the stand-in ends as the worker did
    assert shell.communicate(timeout=30)[0].strip() == f"exit {128 + signal.SIGTERM}"
    assert not psutil.pid_exists(stand_in)


@pytest.mark.slow
def test_a_fork_server_that_cannot_start_leaves_workers_to_start_plainly(tmp_path: Path, worker_tree):
    script, model_dir = worker_tree
    environment = frontend_environment(tmp_path, model_dir, True)
    deep = tmp_path / ("d" * 100)     # no Unix socket can be bound there
    deep.mkdir()
    environment[DIRECTORY_VARIABLE] = str(deep)
    shell, lines = run_frontend(script, model_dir, environment, 2)
    assert lines[1] == lines[3] == "exit 7"
    assert parents(lines) == {shell}       # each started by the shell itself
    failed = list(deep.glob(".fork.*.failed"))
    assert len(failed) == 1 and "did not start" in failed[0].read_text()


def test_an_owner_needs_a_directory_and_a_pid():
    assert shared_owner({OWNER_VARIABLE: "42", DIRECTORY_VARIABLE: "/run/fork"}) == 42
    assert shared_owner({OWNER_VARIABLE: "42"}) is None
    assert shared_owner({OWNER_VARIABLE: "0", DIRECTORY_VARIABLE: "/run/fork"}) is None
    assert shared_owner({OWNER_VARIABLE: "me", DIRECTORY_VARIABLE: "/run/fork"}) is None
    assert shared_owner({DIRECTORY_VARIABLE: "/run/fork"}) is None
    shared = {OWNER_VARIABLE: "42", DIRECTORY_VARIABLE: "/run/fork"}
    assert with_fork_server(shared, Path("/instance/tmp"))[DIRECTORY_VARIABLE] == "/run/fork"
    assert with_fork_server({DIRECTORY_VARIABLE: "/run/fork"}, Path("/instance/tmp"))[DIRECTORY_VARIABLE] \
        == "/instance/tmp"
    assert OWNER_VARIABLE not in without_fork_server(with_fork_server(shared, Path("/instance/tmp")))


@pytest.fixture
def frontend_cgroup() -> Iterator[Path | None]:
    """A cgroup v2 of its own for a frontend (None where this process may not make one)."""
    mount = writable_cgroup2()
    if mount is None:
        yield None
        return
    cgroup = mount / f"torchserve-vision-fork-test-{os.getpid()}"
    cgroup.mkdir()
    try:
        yield cgroup
    finally:
        wait_until(lambda: not (cgroup / "cgroup.procs").read_text().strip(), 30, "the cgroup emptied",
                   interval_s=0.05)
        cgroup.rmdir()


@pytest.mark.slow
def test_the_frontends_of_one_owner_share_its_fork_server_which_ends_with_the_owner(
        tmp_path: Path, worker_tree, frontend_cgroup: Path | None):
    script, model_dir = worker_tree
    owner = subprocess.Popen(["sleep", "600"])
    shared = tmp_path / "shared"
    shared.mkdir()
    try:
        shells, lines = [], []
        for name, cgroup in (("a", None), ("b", frontend_cgroup)):   # two instances, each with
            # its files in directories of its own; the second frontend in a cgroup of its own
            environment = frontend_environment(tmp_path / name, model_dir, True, (owner.pid, shared))
            environment.update({"TMPDIR": str(tmp_path / name),
                                "LOG_LOCATION": str(tmp_path / name / "logs")})
            shell, output = run_frontend(script, model_dir, environment, 1, cgroup)
            shells.append(shell)
            lines.append(json.loads(output[0]))
        if frontend_cgroup is not None:     # each worker counted with its own frontend
            own = Path("/proc/self/cgroup").read_text()
            assert [own_cgroup(line["cgroup"]) for line in lines] == [
                own_cgroup(own), "/" + frontend_cgroup.name]
        assert lines[0]["ppid"] == lines[1]["ppid"] not in shells    # one server forked both
        assert [line["frontend"] for line in lines] == [str(shell) for shell in shells]
        # each worker with its own instance's directories, not those of the first
        assert [(line["tmp"], line["logs"]) for line in lines] == [
            (str(tmp_path / name), str(tmp_path / name / "logs")) for name in ("a", "b")]
        assert len(fork_server_pids(shared)) == 1
        assert not fork_server_pids(tmp_path / "a" / "run") and not fork_server_pids(tmp_path / "b" / "run")
        server = lines[0]["ppid"]
        assert psutil.pid_exists(server)     # its frontends have exited; its owner has not
    finally:
        owner.kill()
        owner.wait()
    wait_until(lambda: not psutil.pid_exists(server) and not fork_server_pids(shared), 30,
               "the shared fork server to exit after its owner", interval_s=0.05)
