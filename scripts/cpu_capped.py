"""Run a command as if on a machine FACTOR times slower: its processes, and all they start, get
1/FACTOR of this machine's CPU time (a CFS bandwidth limit on a cgroup of their own, a quota per
10 ms period), while waits, timers and the network keep their speed.

    python3 scripts/cpu_capped.py 2.5 bash scripts/test.sh --durations=60

On a 2-core machine a factor of 2.5 gives the command 0.8 of a core, on both cores at once, in
every 10 ms. That rehearses a slower CPU's run: computing takes FACTOR times as long, and a test
that assumes a speed (a batch that must outlast a deadline, a start that must finish within a
bound) meets a slower machine. It is not that machine's instruction set (ATEN_CPU_CAPABILITY and
ONEDNN_MAX_CPU_ISA rehearse that) nor its caches. At the end it prints how many periods the cap
throttled. Needs root and the cpu controller: cgroup v2's cpu.max, or v1's cpu.cfs_quota_us
(docs/testing.md, "A slower machine, rehearsed").
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the repository (scripts/ is not a package)
from torchserve_vision.worker_forkserver.cgroups import cgroup2_mount  # standard library only

PERIOD_US = 10_000    # short: a process waits at most a period's rest when its quota is spent


@dataclass(frozen=True)
class CpuController:
    """Where cgroups with a CPU bandwidth limit are made, and in which version's files."""
    parent: Path
    version: int        # 2: cpu.max; 1: cpu.cfs_quota_us and cpu.cfs_period_us


def quota_us(factor: float, cpus: int, period_us: int = PERIOD_US) -> int:
    """The CPU time per period that gives `cpus` cores' worth divided by `factor`."""
    if factor < 1:
        raise ValueError(f"a factor below 1 would not slow anything: {factor}")
    return max(1000, round(cpus * period_us / factor))   # the kernel's smallest quota is 1 ms


def cpu_controller(mounts: str) -> CpuController | None:
    """The cpu controller's hierarchy from /proc/self/mounts' text: cgroup v2 where its root
    offers `cpu`, else a v1 hierarchy mounted with the `cpu` option; None without either."""
    unified = cgroup2_mount(mounts)
    if unified is not None:
        with contextlib.suppress(OSError):
            if "cpu" in (unified / "cgroup.controllers").read_text().split():
                return CpuController(unified, 2)
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) > 3 and fields[2] == "cgroup" and "cpu" in fields[3].split(","):
            return CpuController(Path(fields[1]), 1)
    return None


def make_capped_cgroup(controller: CpuController, quota: int, period_us: int = PERIOD_US) -> Path:
    """A new cgroup under the controller's root with `quota` us of CPU per `period_us`."""
    cgroup = controller.parent / f"cpu-capped-{os.getpid()}"
    if controller.version == 2:
        (controller.parent / "cgroup.subtree_control").write_text("+cpu")
        cgroup.mkdir()
        (cgroup / "cpu.max").write_text(f"{quota} {period_us}")
    else:
        cgroup.mkdir()
        (cgroup / "cpu.cfs_period_us").write_text(str(period_us))
        (cgroup / "cpu.cfs_quota_us").write_text(str(quota))
    return cgroup


def throttling(cpu_stat: str) -> tuple[int, int]:
    """(periods throttled, periods run) from a cgroup's cpu.stat text (either version)."""
    values = dict(line.split() for line in cpu_stat.splitlines() if len(line.split()) == 2)
    return int(values["nr_throttled"]), int(values["nr_periods"])


def remove_when_empty(cgroup: Path, timeout_s: float = 30.0) -> bool:
    """Remove the cgroup once the last process in it has ended; False when one is still running
    after `timeout_s` (a daemon the command left: the cgroup, and its cap, stay)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            cgroup.rmdir()
            return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("factor", type=float, help="how many times slower (2.5: 0.8 of 2 cores)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command and its arguments")
    args = parser.parse_args(argv)
    if not args.command:
        parser.error("no command to run")
    controller = cpu_controller(Path("/proc/self/mounts").read_text())
    if controller is None or os.geteuid() != 0:
        print("cpu_capped: needs root and a cgroup hierarchy with the cpu controller", file=sys.stderr)
        return 2
    cpus = len(os.sched_getaffinity(0))
    quota = quota_us(args.factor, cpus)
    cgroup = make_capped_cgroup(controller, quota)
    procs = str(cgroup / "cgroup.procs")

    def join() -> None:
        with open(procs, "w") as handle:
            handle.write(str(os.getpid()))

    print(f"cpu_capped: {quota / PERIOD_US:.2f} of {cpus} cores ({args.factor:g} times slower) "
          f"in {cgroup}", file=sys.stderr, flush=True)
    child = subprocess.Popen(args.command, preexec_fn=join)

    def forward(signum: int, _frame: object) -> None:
        child.send_signal(signum)

    # Ctrl-C reaches the command from the terminal itself; a signal sent to this process is passed on
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGHUP, forward)
    code = child.wait()
    if code < 0:                # ended by a signal: the status a shell gives it
        code = 128 - code
    throttled, periods = throttling((cgroup / "cpu.stat").read_text())
    print(f"cpu_capped: throttled in {throttled} of {periods} periods", file=sys.stderr)
    if not remove_when_empty(cgroup):
        print(f"cpu_capped: a process is still running in {cgroup}; it stays capped", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
