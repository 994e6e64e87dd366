"""Ctrl-C and a rollout's record (torchserve_vision/rollout.py): before the old version is
unregistered a Ctrl-C undoes the rollout (recorded undone); from its unregistering on, the old
version is gone and cannot be the default again, so the rollout finishes, is recorded done, and
the Ctrl-C takes effect after. The management API is a dictionary of versions; the archive, the
history file and the signals are real. The real-server test of an interrupted rollout is
tests/server/test_rollouts.py."""

from __future__ import annotations

import functools
import json
import zipfile
from pathlib import Path
from typing import Any

import pytest

from tests.ctrl_c import interrupt_now
from torchserve_vision import rollout as rollout_module
from torchserve_vision import server_state
from torchserve_vision.client import ManagementError
from torchserve_vision.model_descriptions import ServingSettings
from torchserve_vision.rollout import RolloutError, RolloutInterrupted, RolloutPlan, rollout, scale
from torchserve_vision.rollout_history import ChangeState, HistoryEntry, Journal, read_history

MODEL = "m"
SETTINGS = ServingSettings(4, 0, 1, 1, 60)


pytestmark = pytest.mark.usefixtures("ctrl_c_raises")


@pytest.fixture(autouse=True)
def quick_drain_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake server has nothing in flight: the drain's five quiet polls need not be 0.1 s apart
    (their spacing is tests/unit/test_drain_waiting.py's)."""
    monkeypatch.setattr(rollout_module, "wait_until_answered",
                        functools.partial(server_state.wait_until_answered, poll_s=0.001))


class FakeManagement:
    """One model's versions as TorchServe's management API describes them; a Ctrl-C lands just
    after the call named `interrupt_after` (e.g. "unregister 1.0") is done, or a call named in
    `refuse` is answered 500."""

    dry_run = False
    inference_url = "http://127.0.0.1:1"

    def __init__(self, interrupt_after: str | None = None, refuse: str | None = None) -> None:
        self.versions = {"1.0": self.description("1.0", "m-1.0.mar")}
        self.default = "1.0"
        self.interrupt_after, self.refuse = interrupt_after, refuse

    @staticmethod
    def description(version: str, archive: str) -> dict[str, Any]:
        return {"modelName": MODEL, "modelVersion": version, "modelUrl": archive, "batchSize": 4,
                "maxBatchDelay": 0, "minWorkers": 1, "maxWorkers": 1, "responseTimeout": 60,
                "workers": [{"id": "9000", "pid": 100 + len(version), "status": "READY"}],
                "jobQueueStatus": {"pendingRequests": 0}}

    def called(self, call: str) -> None:
        if call == self.refuse:
            raise ManagementError(500, "refused", call)

    def done(self, call: str) -> None:
        if call == self.interrupt_after:
            interrupt_now()

    def describe(self, model: str, version: str | None = "all",
                 customized: bool = False) -> list[dict[str, Any]]:
        if version == "all":
            return list(self.versions.values())
        wanted = self.default if version is None else version
        if wanted not in self.versions:
            raise ManagementError(404, "no such version", f"describe {wanted}")
        return [self.versions[wanted]]

    def register(self, archive: str, *settings: Any) -> None:
        self.called("register")
        self.versions["2.0"] = self.description("2.0", archive)
        self.done("register")

    def scale(self, model: str, version: str, low: int, high: int) -> None:
        self.versions[version]["minWorkers"], self.versions[version]["maxWorkers"] = low, high

    def set_default(self, model: str, version: str) -> None:
        if version not in self.versions:
            raise ManagementError(404, "no such version", f"set-default {version}")
        self.default = version
        self.done(f"set-default {version}")

    def unregister(self, model: str, version: str) -> None:
        self.called(f"unregister {version}")
        del self.versions[version]
        self.done(f"unregister {version}")

    def predict(self, model: str, version: str | None, image: bytes) -> Any:
        return [{"label": "tiger cat", "probability": 0.9}]

    def requests_in_batch(self) -> dict[tuple[str, str], int]:
        return {(MODEL, version): 0 for version in self.versions}


class JournalInterruptedAtDone(Journal):
    """A Ctrl-C lands as the rollout's entry is being ended done: the rollout is complete."""

    def end(self, entry: HistoryEntry, state: ChangeState) -> HistoryEntry:
        if state == "done":
            interrupt_now()
        return super().end(entry, state)


@pytest.fixture
def store(tmp_path: Path) -> Path:
    with zipfile.ZipFile(tmp_path / "m-2.0.mar", "w") as mar:
        mar.writestr("MAR-INF/MANIFEST.json",
                     json.dumps({"model": {"modelName": MODEL, "modelVersion": "2.0"}}))
    return tmp_path


def plan() -> RolloutPlan:
    return RolloutPlan(MODEL, "m-2.0.mar", SETTINGS, b"image", drain_timeout_s=5, drain_grace_s=0)


def states(store: Path) -> list[str]:
    return [entry.state for entry in read_history(store / "history.json")]


@pytest.mark.parametrize("journal, interrupt_after", [
    (Journal, "unregister 1.0"),                      # the old version just went
    (JournalInterruptedAtDone, None),                 # as the entry is ended done
], ids=["as-the-old-version-goes", "as-the-rollout-is-recorded"])
def test_a_ctrl_c_once_the_old_version_is_unregistered_lets_the_rollout_finish_and_say_done(
        store, journal, interrupt_after):
    server = FakeManagement(interrupt_after=interrupt_after)
    with pytest.raises(KeyboardInterrupt) as raised:
        rollout(server, plan(), store, lambda line: None, journal(store / "history.json"))  # type: ignore[arg-type]
    assert not isinstance(raised.value, RolloutInterrupted)
    assert (server.default, sorted(server.versions)) == ("2.0", ["2.0"])
    assert states(store) == ["done"]
    assert Journal(store / "history.json").pending(MODEL) is None


@pytest.mark.parametrize("interrupt_after", ["register", "set-default 2.0"])
def test_a_ctrl_c_before_the_old_version_goes_undoes_the_rollout(store, interrupt_after):
    server = FakeManagement(interrupt_after=interrupt_after)
    with pytest.raises(RolloutInterrupted, match="interrupted and undone"):
        rollout(server, plan(), store, lambda line: None, Journal(store / "history.json"))  # type: ignore[arg-type]
    assert (server.default, sorted(server.versions)) == ("1.0", ["1.0"])
    assert states(store) == ["undone"]


def test_a_refused_unregistering_of_the_old_version_is_still_undone(store):
    server = FakeManagement(refuse="unregister 1.0")
    with pytest.raises(RolloutError, match=r"failed and was undone .*refused"):
        rollout(server, plan(), store, lambda line: None, Journal(store / "history.json"))  # type: ignore[arg-type]
    assert (server.default, sorted(server.versions)) == ("1.0", ["1.0"])
    assert states(store) == ["undone"]


def test_a_rollout_without_ctrl_c_is_recorded_done(store):
    server = FakeManagement()
    entry = rollout(server, plan(), store, lambda line: None, Journal(store / "history.json"))  # type: ignore[arg-type]
    assert (entry.state, entry.from_version, entry.to_version) == ("done", "1.0", "2.0")
    assert (server.default, sorted(server.versions)) == ("2.0", ["2.0"])
    assert states(store) == ["done"]


def test_a_ctrl_c_as_a_scaling_is_recorded_comes_after_it_says_done(store):
    server = FakeManagement()
    with pytest.raises(KeyboardInterrupt):
        scale(server, MODEL, "1.0", 1, 2, store, b"image", lambda line: None,  # type: ignore[arg-type]
              journal=JournalInterruptedAtDone(store / "history.json"))
    assert server.versions["1.0"]["maxWorkers"] == 2
    assert states(store) == ["done"]


def test_finishing_a_half_done_rollout_interrupted_as_the_old_version_goes_says_done(store):
    server = FakeManagement(interrupt_after="unregister 1.0")
    server.register("m-2.0.mar")
    server.set_default(MODEL, "2.0")          # an earlier run died here, its entry `started`
    journal = Journal(store / "history.json")
    journal.begin(HistoryEntry(kind="rollout", model=MODEL, to_version="2.0", to_archive="m-2.0.mar",
                               to_settings=SETTINGS, from_version="1.0", from_archive="m-1.0.mar",
                               from_settings=SETTINGS, time=""))
    with pytest.raises(KeyboardInterrupt):
        rollout(server, plan(), store, lambda line: None, journal)  # type: ignore[arg-type]
    assert (server.default, sorted(server.versions)) == ("2.0", ["2.0"])
    assert states(store) == ["done"]
