"""Which workers of the host are inside a batch, and the runner that takes more threads for a
batch alone on the host (handlers/model/host_batches)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from handlers.model.host_batches import HostBatches, SoloThreadsRunner, loads_of, solo_eligible

IN_A_BATCH = """
import sys
from pathlib import Path
from handlers.model.host_batches import HostBatches
with HostBatches(Path(sys.argv[1])).batch() as alone:
    print("alone" if alone else "shared", flush=True)
    sys.stdin.read()
"""


@dataclass
class OtherWorker:
    process: subprocess.Popen[str]
    said: str          # "alone" or "shared": what it found when its batch began

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(30)


@contextmanager
def other_worker_in_a_batch(lock: Path) -> Iterator[OtherWorker]:
    """Another process (a worker) inside a batch until the block ends."""
    process = subprocess.Popen([sys.executable, "-c", IN_A_BATCH, str(lock)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        yield OtherWorker(process, process.stdout.readline().strip())
    finally:
        if process.poll() is None:
            assert process.stdin is not None
            process.stdin.close()
        process.wait(30)


def recorded(name: str, ran: list[str]) -> Callable[[torch.Tensor], torch.Tensor]:
    """A load that notes its name in `ran` and answers its input."""
    def run(batch: torch.Tensor) -> torch.Tensor:
        ran.append(name)
        return batch
    return run


def test_a_batch_is_alone_only_while_no_other_worker_is_in_one(tmp_path):
    lock = tmp_path / "batches.lock"
    batches = HostBatches(lock)
    with batches.batch() as alone:
        assert alone and batches.alone
    assert not batches.alone                      # outside a batch
    with other_worker_in_a_batch(lock) as other:
        assert other.said == "alone"
        with batches.batch() as alone:
            assert not alone and not batches.alone
    with batches.batch() as alone:                # the other worker has left its batch
        assert alone


def test_the_other_worker_is_not_alone_while_this_one_is_in_a_batch(tmp_path):
    lock = tmp_path / "batches.lock"
    batches = HostBatches(lock)
    with batches.batch() as alone:
        assert alone
        with other_worker_in_a_batch(lock) as other:
            assert other.said == "shared"
    with other_worker_in_a_batch(lock) as other:
        assert other.said == "alone"


def test_a_killed_worker_leaves_no_batch_behind(tmp_path):
    lock = tmp_path / "batches.lock"
    with other_worker_in_a_batch(lock) as other:
        other.kill()
        with HostBatches(lock).batch() as alone:
            assert alone


def test_batches_of_threads_of_one_process_count_as_others(tmp_path):
    batches = HostBatches(tmp_path / "batches.lock")
    entered, release = threading.Event(), threading.Event()
    seen: list[bool] = []

    def first_batch() -> None:
        with batches.batch() as alone:
            seen.append(alone)
            entered.set()
            release.wait(30)

    thread = threading.Thread(target=first_batch)
    thread.start()
    assert entered.wait(30)
    with batches.batch() as alone:
        seen.append(alone)
        assert not batches.alone
    release.set()
    thread.join(30)
    with batches.batch() as alone:
        seen.append(alone)
    assert seen == [True, False, True]


def test_without_a_lock_file_batches_run_and_are_never_alone(tmp_path, caplog):
    batches = HostBatches(tmp_path / "missing" / "batches.lock")
    with caplog.at_level("WARNING", logger="handlers.model.host_batches"):
        with batches.batch() as alone:
            assert not alone
        with batches.batch() as alone:
            assert not alone
    assert sum("no batch lock" in record.getMessage() for record in caplog.records) == 1


def test_the_solo_load_runs_a_batch_alone_on_the_host_and_the_shared_load_any_other(tmp_path):
    lock = tmp_path / "batches.lock"
    batches = HostBatches(lock)
    ran: list[str] = []

    shared, solo = recorded("shared", ran), recorded("solo", ran)
    runner = SoloThreadsRunner(shared, solo, batches)
    batch = torch.ones(2, 3)
    runner(batch)                                 # outside a batch (warm-up, checks)
    with batches.batch():
        torch.testing.assert_close(runner(batch), batch)
    with other_worker_in_a_batch(lock), batches.batch():
        runner(batch)
    assert ran == ["shared", "solo", "shared"]
    assert loads_of(runner) == (shared, solo) and loads_of(shared) == (shared,)


def test_a_batch_that_may_not_be_alone_still_counts_for_the_others(tmp_path):
    lock = tmp_path / "batches.lock"
    batches = HostBatches(lock)
    with batches.batch(may_be_alone=False) as alone:
        assert not alone
        with other_worker_in_a_batch(lock) as other:
            assert other.said == "shared"


def test_only_a_batch_that_did_not_fill_up_may_take_solo_threads():
    assert [solo_eligible(size, 8) for size in (1, 7, 8)] == [True, True, False]
    assert solo_eligible(1, 1)           # batch size 1: a full batch says nothing of the queue


def test_a_batch_that_began_alone_runs_shared_once_another_worker_has_begun_one(tmp_path):
    lock = tmp_path / "batches.lock"
    batches = HostBatches(lock)
    ran: list[str] = []
    runner = SoloThreadsRunner(recorded("shared", ran), recorded("solo", ran), batches)
    with batches.batch() as alone:
        assert alone and batches.still_alone()
        with other_worker_in_a_batch(lock) as other:   # began while this one decoded
            assert other.said == "shared"
            runner(torch.ones(1))
            assert not batches.still_alone()
        runner(torch.ones(1))                          # the other has finished
    assert ran == ["shared", "solo"]


def test_the_lock_file_is_opened_read_only_so_another_users_file_serves(tmp_path):
    # flock needs no write access, and the file may belong to another user's workers (root, who
    # runs these tests, could write it anyway: so the opening mode is what is checked).
    lock = tmp_path / "batches.lock"
    lock.touch()
    lock.chmod(0o444)
    batches = HostBatches(lock)
    with batches.batch() as alone:
        assert alone
        with other_worker_in_a_batch(lock) as other:
            assert other.said == "shared"
    descriptor = batches.descriptor()
    assert descriptor is not None
    assert fcntl.fcntl(descriptor, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
