"""`--cpu-by-unit` (tests/cpu_by_unit.py): its parsing and table, and real runs of pytest in one
process and in two, in which one unit's test starts a process that is reparented and computes on,
and another's leaves a process running, which the run names."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cpu_by_unit import (
    OUTSIDE_UNITS,
    ROOT_VARIABLE,
    UnitCpu,
    cgroup_name,
    cpu_seconds,
    table,
    unit_name,
    writable_cgroup2,
)
from torchserve_vision.waiting import wait_until
from torchserve_vision.worker_forkserver.cgroups import cgroup2_mount, own_cgroup

REPO = Path(__file__).resolve().parents[2]
BUSY_S = 0.6       # of CPU, counted by the process itself: the same on any machine


def test_the_mount_the_own_cgroup_and_the_usage_are_read_from_the_kernels_text():
    mounts = ("cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0\n"
              "cgroup2 /sys/fs/cgroup/unified cgroup2 rw,nosuid 0 0\n")
    assert cgroup2_mount(mounts) == Path("/sys/fs/cgroup/unified")
    assert cgroup2_mount("cgroup /sys/fs/cgroup/cpu cgroup rw 0 0\n") is None
    assert own_cgroup("4:memory:/a\n0::/user.slice/run-1.scope\n") == "/user.slice/run-1.scope"
    assert cpu_seconds("usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\n") == (2.5, 0.5)


def test_units_become_directory_names_and_back_and_the_table_puts_the_most_first():
    unit = "tests/server (the session's shared server)"
    assert "/" not in cgroup_name(unit) and unit_name(cgroup_name(unit)) == unit
    text = table([UnitCpu("b", 1.0, 0.5), UnitCpu("a", 3.25, 0.25), UnitCpu("c", 1.0, 0.0)],
                 UnitCpu("(the run)", 6.0, 1.0))
    assert text.splitlines() == ["unit\tcore_s\tsystem_s", "a\t3.2\t0.2", "b\t1.0\t0.5",
                                 "c\t1.0\t0.0", "(the run)\t6.0\t1.0"]


QUIET_MODULE = "def test_quiet():\n    assert True\n"
# A test that leaves a process behind, as a server not stopped would
LEAVING_MODULE = """
import subprocess


def test_leaves_a_process_running():
    subprocess.Popen(["sleep", "600"], start_new_session=True)
"""
BUSY_MODULE = f"""
import subprocess, sys

from torchserve_vision.waiting import wait_until

# The child forks and exits at once: the grandchild computes reparented, as a TorchServe
# frontend does once `torchserve --start` has returned.
GRANDCHILD = '''
import os, sys, time
if os.fork():
    os._exit(0)
start = time.process_time()
while time.process_time() - start < {BUSY_S}:
    pass
open(sys.argv[1], "w").close()
'''


def test_busy(tmp_path):
    done = tmp_path / "done"
    subprocess.run([sys.executable, "-c", GRANDCHILD, str(done)], check=True)
    wait_until(done.exists, 120, "the grandchild to finish", interval_s=0.02)
"""


@pytest.mark.slow            # two runs of pytest of their own, about 5 s: not in the fast tier
@pytest.mark.skipif(writable_cgroup2() is None, reason="needs root and a cgroup v2 hierarchy")
@pytest.mark.parametrize("processes", ["0", "2"])
def test_a_unit_is_charged_with_what_its_tests_started_even_once_reparented(tmp_path, processes):
    (tmp_path / "test_a_quiet.py").write_text(QUIET_MODULE)
    (tmp_path / "test_b_busy.py").write_text(BUSY_MODULE)
    (tmp_path / "test_c_leaving.py").write_text(LEAVING_MODULE)
    out = tmp_path / "cpu.tsv"
    mount = writable_cgroup2()
    assert mount is not None
    before = set(mount.glob("torchserve-vision-tests-*"))
    environment = {name: value for name, value in os.environ.items() if name != ROOT_VARIABLE}
    environment["PYTHONPATH"] = str(REPO)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-p", "tests.cpu_by_unit", "--cpu-by-unit", str(out), "-n", processes,
                          "--dist", "loadfile", "test_a_quiet.py", "test_b_busy.py", "test_c_leaving.py"],
                         cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=300)
    left = set(mount.glob("torchserve-vision-tests-*")) - before
    try:
        assert run.returncode == 0, run.stdout + run.stderr
        assert len(left) == 1, left          # the run's cgroup stays: a process is left in it
        (message,) = [line for line in run.stderr.splitlines() if "still running" in line]
        assert message.startswith("--cpu-by-unit: still running at the end, started in "
                                  "test_c_leaving.py: ")
        assert "(sleep 600)" in message
    finally:
        for root in left:                    # the process left behind, then the cgroups
            for pid in (root / cgroup_name("test_c_leaving.py") / "cgroup.procs").read_text().split():
                os.kill(int(pid), signal.SIGKILL)
            for directory in [*(path for path in root.iterdir() if path.is_dir()), root]:
                wait_until(functools.partial(removed, directory), 30, f"{directory} emptied")
    rows = {line.split("\t")[0]: float(line.split("\t")[1])
            for line in out.read_text().splitlines()[1:]}
    assert set(rows) == {"test_a_quiet.py", "test_b_busy.py", "test_c_leaving.py", OUTSIDE_UNITS,
                         "(the run)"}
    assert rows["test_b_busy.py"] >= BUSY_S - 0.05
    assert rows["test_a_quiet.py"] < BUSY_S / 2
    # The total is read after the units and holds them all; each row is rounded to 0.1, so the
    # rounded units can exceed the rounded total by half a tenth per row, the total's included.
    units_s = sum(value for unit, value in rows.items() if unit != "(the run)")
    assert rows["(the run)"] >= units_s - 0.05 * len(rows) - 1e-9


def removed(directory: Path) -> bool:
    """Whether the cgroup `directory` is gone, trying to remove it (it can be once empty)."""
    try:
        directory.rmdir()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True
