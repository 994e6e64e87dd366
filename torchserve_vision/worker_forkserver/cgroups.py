"""Which cgroup (v2) a process is in, read from /proc: so that a worker forked from a fork server
that another frontend's worker started counts, and is limited, where its own frontend is."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def cgroup2_mount(mounts: str) -> Path | None:
    """Where the cgroup v2 hierarchy is mounted, from /proc/self/mounts' text, if it is (the
    unified mount, or the hybrid one at /sys/fs/cgroup/unified)."""
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) > 2 and fields[2] == "cgroup2":
            return Path(fields[1])
    return None


def mounted_cgroup2() -> Path | None:
    """Where this process sees the cgroup v2 hierarchy mounted, if it does."""
    return cgroup2_mount(Path("/proc/self/mounts").read_text())


def own_cgroup(proc_cgroup: str) -> str:
    """A process's cgroup v2 path (below the mount) from its /proc/PID/cgroup text."""
    for line in proc_cgroup.splitlines():
        if line.startswith("0::"):
            return line[3:]
    return "/"


def join_cgroup_of(pid: int) -> None:
    """Move this process into `pid`'s cgroup v2 when it is in another one; nothing when there is
    no v2 hierarchy, `pid` is gone, or the move is not allowed (no permission, a read-only
    mount: the process then stays where it is)."""
    with contextlib.suppress(OSError):
        mount = mounted_cgroup2()
        theirs = own_cgroup(Path(f"/proc/{pid}/cgroup").read_text())
        if mount is None or theirs == own_cgroup(Path("/proc/self/cgroup").read_text()):
            return
        (mount / theirs.lstrip("/") / "cgroup.procs").write_text(str(os.getpid()))
