"""scripts/cpu_capped.py: a command, and all it starts, runs in a cgroup of its own with 1/FACTOR
of the machine's CPU time, from either cgroup version's cpu controller; the cgroup goes when the
command's processes have."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def cpu_capped_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("cpu_capped", REPO / "scripts" / "cpu_capped.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


SCRIPT = cpu_capped_script()
HYBRID_MOUNTS = """tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup /sys/fs/cgroup/cpuset cgroup rw,relatime,cpuset 0 0
cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,nosuid,nodev,noexec,relatime,cpu,cpuacct 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
"""


def test_the_quota_is_the_cores_time_per_period_divided_by_the_factor():
    assert SCRIPT.quota_us(2.5, cpus=2) == 8000
    assert SCRIPT.quota_us(1, cpus=4) == 40000
    assert SCRIPT.quota_us(100, cpus=1) == 1000        # never below the kernel's smallest quota
    with pytest.raises(ValueError, match="below 1"):
        SCRIPT.quota_us(0.5, cpus=2)


def test_cgroup_v2_is_used_where_its_root_offers_cpu_and_v1_where_it_does_not(tmp_path):
    unified = tmp_path / "unified"
    unified.mkdir()
    (unified / "cgroup.controllers").write_text("hugetlb\n")
    mounts = HYBRID_MOUNTS.replace("/sys/fs/cgroup/unified", str(unified))
    assert SCRIPT.cpu_controller(mounts) == SCRIPT.CpuController(Path("/sys/fs/cgroup/cpu,cpuacct"), 1)
    (unified / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    assert SCRIPT.cpu_controller(mounts) == SCRIPT.CpuController(unified, 2)
    assert SCRIPT.cpu_controller("tmpfs /sys/fs/cgroup tmpfs rw 0 0\n") is None


def test_throttling_is_read_from_either_versions_cpu_stat():
    v1 = "nr_periods 27552\nnr_throttled 26583\nthrottled_time 276621820289\n"
    v2 = ("usage_usec 10\nuser_usec 8\nsystem_usec 2\nnr_periods 40\nnr_throttled 7\n"
          "throttled_usec 123\n")
    assert SCRIPT.throttling(v1) == (26583, 27552)
    assert SCRIPT.throttling(v2) == (7, 40)


# A child that computes for 30 ms of CPU: with 1/16 of the cores it has at most 1.25 ms of every
# 10 ms period (at the kernel's 1 ms floor on a small machine), so it is throttled in some period,
# whatever the CPU's speed. It names its cgroups and leaves with its own exit status.
BUSY_CHILD = """
import sys, time
start = time.process_time()
while time.process_time() - start < 0.03:
    pass
print(open("/proc/self/cgroup").read())
sys.exit(3)
"""


@pytest.mark.skipif(os.geteuid() != 0 or SCRIPT.cpu_controller(Path("/proc/self/mounts").read_text()) is None,
                    reason="needs root and a cgroup hierarchy with the cpu controller")
def test_a_command_runs_capped_in_a_cgroup_of_its_own_which_goes_with_it():
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "cpu_capped.py"), "16",
                          sys.executable, "-c", BUSY_CHILD],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 3, run.stderr                      # the command's own status
    first, *_, last = run.stderr.splitlines()
    cgroup = Path(first.rsplit(" in ", 1)[1])
    cpus = len(os.sched_getaffinity(0))
    assert first.startswith(f"cpu_capped: {SCRIPT.quota_us(16, cpus) / SCRIPT.PERIOD_US:.2f} of {cpus} cores")
    assert f"/{cgroup.name}\n" in run.stdout                    # the child ran in it
    throttled, periods = (int(word) for word in last.split() if word.isdigit())
    assert 0 < throttled <= periods
    assert not cgroup.exists()
