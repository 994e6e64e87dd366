"""`--cpu-by-unit FILE`: the CPU each unit of the schedule used, with everything it started.

`--durations` gives each test's wall time. On a 2-core machine that both test processes keep
busy, what a unit computes is the figure to cut, and most of it is spent in processes the tests
start (TorchServe's frontend, its fork server and workers, the command line, builds), which leave
the test process's own accounting: a frontend outlives the `torchserve` command that started it.
So each pytest process moves itself into a cgroup (v2) named for the unit of the test it is about
to run (tests/conftest.py's `schedule_unit`, else the test's module), and all it starts from then
on is counted there, whatever it is reparented to. What a session-scoped fixture starts (the
model store's build, the shared server) is counted in the unit that first needed it; a process's
own start, collection and end in a line of their own. At the end the controlling process writes
one line per unit, the most first (core-seconds in all and in the kernel), then the run's total.
Needs root and a cgroup v2 hierarchy, the unified one or the hybrid /sys/fs/cgroup/unified
(docs/testing.md, "Where a run computes, unit by unit").
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from torchserve_vision.worker_forkserver.cgroups import mounted_cgroup2, own_cgroup

ROOT_VARIABLE = "TSV_CPU_BY_UNIT_CGROUP"    # the run's cgroup, for pytest-xdist's worker processes
OUTSIDE_UNITS = "(the processes' start, collection and end)"
UNIT_OF = pytest.StashKey[Callable[[str], str]]()   # test id -> unit; set by a conftest


@dataclass(frozen=True)
class _Run:
    """The run's cgroup, where it was started from, and the table's file."""
    root: Path
    home: Path          # the cgroup the run started in, where the controlling process goes back
    target: Path


_RUN = pytest.StashKey[_Run]()            # in the controlling process only
_CURRENT = pytest.StashKey[list[str]]()    # the unit this process is counted in now


@dataclass(frozen=True)
class UnitCpu:
    unit: str
    core_s: float
    system_s: float


def writable_cgroup2() -> Path | None:
    """The cgroup v2 mount where this process may make cgroups and move processes into them
    (root, a writable mount); None elsewhere."""
    mount = mounted_cgroup2()
    return mount if os.geteuid() == 0 and mount is not None and os.access(mount, os.W_OK) else None


def cgroup_name(unit: str) -> str:
    """A unit as the name of a cgroup directory: no slashes (and back with `unit_name`)."""
    return unit.replace("/", "|")


def unit_name(directory: str) -> str:
    return directory.replace("|", "/")


def cpu_seconds(stat: str) -> tuple[float, float]:
    """(all, kernel) seconds of CPU from a cgroup's cpu.stat text."""
    values = dict(line.split() for line in stat.splitlines() if line.strip())
    return int(values["usage_usec"]) / 1e6, int(values["system_usec"]) / 1e6


def table(units: list[UnitCpu], total: UnitCpu) -> str:
    """Tab-separated lines, the most CPU first, then the run's total."""
    rows = [*sorted(units, key=lambda row: (-row.core_s, row.unit)), total]
    return "unit\tcore_s\tsystem_s\n" + "".join(
        f"{row.unit}\t{row.core_s:.1f}\t{row.system_s:.1f}\n" for row in rows)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-by-unit", metavar="FILE", default=None,
                     help="write the CPU each unit of the schedule used, everything it started "
                          "included, to FILE (root and cgroup v2 needed; tests/cpu_by_unit.py)")


def command_of(pid: str) -> str:
    """`pid` and its command line's first words, or the pid alone once it has ended."""
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:3]
    except OSError:
        return pid
    return f"{pid} ({' '.join(word.decode(errors='replace') for word in words if word)})"


def move_into(root: Path, name: str) -> None:
    """This process (all its threads) into `root`/`name`, made if missing."""
    directory = root / cgroup_name(name)
    directory.mkdir(exist_ok=True)
    (directory / "cgroup.procs").write_text(str(os.getpid()))


def pytest_configure(config: pytest.Config) -> None:
    target = config.getoption("--cpu-by-unit", None)
    if not target:
        return
    root_text = os.environ.get(ROOT_VARIABLE)
    if root_text is None:        # the controlling process (or the only one): the run's cgroup
        mount = mounted_cgroup2()
        if mount is None:
            raise pytest.UsageError("--cpu-by-unit needs a cgroup v2 hierarchy; none is mounted")
        home = mount / own_cgroup(Path("/proc/self/cgroup").read_text()).lstrip("/")
        root = mount / f"torchserve-vision-tests-{os.getpid()}"
        try:
            root.mkdir()
            move_into(root, OUTSIDE_UNITS)
        except OSError as error:
            raise pytest.UsageError(f"--cpu-by-unit cannot make and enter a cgroup in {mount} "
                                    f"({error}): run as root") from error
        os.environ[ROOT_VARIABLE] = str(root)      # pytest-xdist's workers start with it
        config.stash[_RUN] = _Run(root, home, Path(target))
    else:
        move_into(Path(root_text), OUTSIDE_UNITS)
    config.stash[_CURRENT] = [OUTSIDE_UNITS]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before the test's fixtures start anything: into its unit's cgroup."""
    current = item.config.stash.get(_CURRENT, None)
    if current is None:
        return
    unit_of = item.config.stash.get(UNIT_OF, lambda nodeid: nodeid.split("::")[0])
    unit = unit_of(item.nodeid)
    if unit != current[0]:
        move_into(Path(os.environ[ROOT_VARIABLE]), unit)
        current[0] = unit


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """After the last test (session fixtures already torn down): out of its unit again, so that
    a process's end (reports, plugins' summaries) is not charged to the last unit it ran."""
    current = session.config.stash.get(_CURRENT, None)
    if current is not None and current[0] != OUTSIDE_UNITS:
        move_into(Path(os.environ[ROOT_VARIABLE]), OUTSIDE_UNITS)
        current[0] = OUTSIDE_UNITS


def pytest_unconfigure(config: pytest.Config) -> None:
    """In the controlling process, once every test process has ended: the table; the unit
    cgroups are removed where nothing runs in them any more, and what still runs in the others
    is named on standard error (a process the tests left behind)."""
    run = config.stash.get(_RUN, None)
    if run is None:
        return
    (run.home / "cgroup.procs").write_text(str(os.getpid()))
    units = []
    for directory in sorted(path for path in run.root.iterdir() if path.is_dir()):
        core_s, system_s = cpu_seconds((directory / "cpu.stat").read_text())
        units.append(UnitCpu(unit_name(directory.name), core_s, system_s))
    total = UnitCpu("(the run)", *cpu_seconds((run.root / "cpu.stat").read_text()))
    run.target.write_text(table(units, total))
    for directory in [*run.root.iterdir(), run.root]:
        if not directory.is_dir():
            continue
        try:
            directory.rmdir()
        except OSError:
            left = (directory / "cgroup.procs").read_text().split()
            if left:
                sys.stderr.write(f"--cpu-by-unit: still running at the end, started in "
                                 f"{unit_name(directory.name)}: {', '.join(map(command_of, left))}\n")
