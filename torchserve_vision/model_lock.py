"""One change at a time per model: `models rollout`, `rollback` and `scale` hold an exclusive
lock on a file beside the rollout history while they act. The lock is the kernel's (`flock`),
so a process that dies, even by SIGKILL, holds it no more; the file names the holder for the
message a second command gets. It excludes commands that share the history file (one machine);
commands run from two machines against one server are not excluded by it."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from torchserve_vision.errors import CommandError
from torchserve_vision.rollout_history import now_text


class ModelLocked(CommandError):
    """Another command is changing this model."""


def lock_path(history_file: Path, model: str) -> Path:
    return history_file.with_name(f".{history_file.name}.{model}.lock")


@contextmanager
def model_lock(history_file: Path, model: str) -> Iterator[None]:
    """Hold `model`'s lock for the block; ModelLocked at once when another process holds it."""
    path = lock_path(history_file, model)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+", encoding="utf-8") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise ModelLocked(f"{model} is being changed by {holder}; wait for it to finish (the "
                              "lock goes with its process)") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} since {now_text()}\n")
        handle.flush()
        try:
            yield
        finally:
            handle.truncate(0)
