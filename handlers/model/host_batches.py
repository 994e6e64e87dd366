"""Which of the host's workers are inside a batch, so that a batch that runs while every other
worker is idle may take their cores too.

Workers are separate processes, each with a fixed number of threads (`torch_threads`): with two
workers of one thread on two cores, a lone request computes on one core while the other idles.
An engine that computes on threads of its own (OpenVINO, ONNX Runtime) can be loaded twice, at
the worker's threads and at `solo_threads`, and a batch picks the wide one when it is alone on
the host and did not fill up (so nothing is queued for another worker to begin at once):
measured on 2 cores, OpenVINO bf16 Lite0 at batch 1 takes 3.1 ms on two threads, 6.0 on one
(docs/benchmarks.md, "Solo threads").

Every worker holds a shared `flock` on one file of the host's temporary directory for the length
of each batch; a batch is alone when an exclusive lock, asked for without waiting, is granted
(then turned into the shared one). The kernel drops a dead worker's lock, so nothing is left
behind. What a wrong guess costs is speed only: a batch that went wide just before another
worker's batch began shares the cores for a while (two workers of two threads each on two cores
served as many requests at 16 clients as two of one thread, measured beside it).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # a worker's batch registration, and the tests' stand-in workers, need no torch
    import torch

    from handlers.model.compiled_model import Runner

logger = logging.getLogger(__name__)

LOCK_FILE_NAME = "torchserve-vision-batches.lock"
LOCK_DIR_VARIABLE = "TSV_BATCH_LOCK_DIR"   # the host's shared directory, if not the temp dir


class HostBatches:
    """The batches of one process, registered on the host's lock file at `path`. Threads of one
    process that run batches side by side (a threaded lab server) share one registration: a
    batch is alone only when no other batch, of this process or another, is running."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.handle: int | None = None
        self.mutex = threading.Lock()    # guards `running` and the lock file's state
        self.running = 0                 # this process's batches now
        self.state = threading.local()   # per thread: whether its batch began alone

    def descriptor(self) -> int | None:
        """The lock file, opened once. flock needs no write access, so read-only: the file may
        belong to another user's workers (and opening an existing file of another user with
        O_CREAT in a sticky /tmp is refused where fs.protected_regular is set)."""
        if self.handle is None:
            try:
                try:
                    self.handle = os.open(self.path, os.O_RDONLY)
                except FileNotFoundError:
                    self.handle = os.open(self.path, os.O_RDONLY | os.O_CREAT, 0o666)
            except OSError as error:
                logger.warning("no batch lock at %s (%s): batches never take solo threads",
                               self.path, error)
                self.handle = -1
        return None if self.handle < 0 else self.handle

    def enter(self, may_be_alone: bool) -> bool:
        """Register a batch; whether it is alone on the host (never when not `may_be_alone`)."""
        with self.mutex:
            self.running += 1
            fd = self.descriptor()
            if fd is None or self.running > 1:
                return False
            if may_be_alone:
                return self.exclusive_granted(fd)
            fcntl.flock(fd, fcntl.LOCK_SH)
            return False

    def still_alone(self) -> bool:
        """Whether this thread's batch began alone and no other worker has begun one since (asked
        again just before the forward pass: decoding a batch gives another worker time to begin)."""
        if not self.alone:
            return False
        with self.mutex:
            fd = self.descriptor()
            return fd is not None and self.running == 1 and self.exclusive_granted(fd)

    @staticmethod
    def exclusive_granted(fd: int) -> bool:
        """Ask for the exclusive lock without waiting (granted: no other worker is in a batch),
        then hold the shared one either way: from exclusive, other workers may enter again; after
        a refusal, because a failed conversion from shared drops the lock held."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            granted = True
        except BlockingIOError:
            granted = False
        fcntl.flock(fd, fcntl.LOCK_SH)
        return granted

    def leave(self) -> None:
        with self.mutex:
            self.running -= 1
            fd = self.descriptor()
            if self.running == 0 and fd is not None:
                fcntl.flock(fd, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def batch(self, may_be_alone: bool = True) -> Iterator[bool]:
        """Hold this worker's place on the host for a batch; yields whether no other batch was
        running when it began (False when not `may_be_alone`: see `solo_eligible`)."""
        alone = self.enter(may_be_alone)
        self.state.alone = alone
        try:
            yield alone
        finally:
            self.state.alone = False
            self.leave()

    @property
    def alone(self) -> bool:
        """Whether the batch this thread is in began alone on the host (False outside one)."""
        return bool(getattr(self.state, "alone", False))


def solo_eligible(batch_size: int, max_batch_size: int) -> bool:
    """Whether a batch may take solo threads: one that did not fill up took everything queued, so
    no other worker is about to begin one. A full batch leaves requests queued behind it, which
    another worker takes at once: with solo threads the two would share the cores (measured past
    capacity on 2 cores: 5 to 12 % fewer answers when full batches went solo too)."""
    return max_batch_size == 1 or batch_size < max_batch_size


@functools.cache
def host_batches() -> HostBatches:
    """The process's registration on the host's batch lock file."""
    directory = Path(os.environ.get(LOCK_DIR_VARIABLE) or tempfile.gettempdir())
    return HostBatches(directory / LOCK_FILE_NAME)


class SoloThreadsRunner:
    """One engine loaded at the worker's thread count (`shared`) and at more (`solo`); a call
    inside a batch that began alone on the host, and is still alone, runs on `solo`, any other
    on `shared`."""

    def __init__(self, shared: Runner, solo: Runner, batches: HostBatches) -> None:
        self.shared, self.solo, self.batches = shared, solo, batches

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        return self.chosen()(batch)

    def outputs(self, batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every output of a model that has more than one (an SSD's backbone and head)."""
        outputs: tuple[torch.Tensor, ...] = self.chosen().outputs(batch)  # type: ignore[attr-defined]
        return outputs

    def chosen(self) -> Runner:
        return self.solo if self.batches.still_alone() else self.shared


def loads_of(runner: Runner) -> tuple[Runner, ...]:
    """Every load that may serve a call of `runner` (both of a SoloThreadsRunner's), for checks
    and warm-up that must cover each."""
    if isinstance(runner, SoloThreadsRunner):
        return (runner.shared, runner.solo)
    return (runner,)
