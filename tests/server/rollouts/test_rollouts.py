"""Versioned rollouts, rollbacks and scaling on a real TorchServe under continuous load (the
versions: versions.py; a change killed at each of its steps: test_killed_rollouts.py and
test_killed_rollbacks.py, each module with a server of its own)."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import pytest
import requests

from tests.images import CAT_LABELS
from tests.server.commands import started_command
from tests.server.rollouts.versions import (
    MODEL,
    SETTINGS,
    SLOW_START_S,
    V1_LENGTH,
    V2_LENGTH,
    built_rollout_archives,
    cli,
    killed_once,
    load_on_server,
    models_command,
    plan,
    states,
)
from torchserve_vision.model_descriptions import (
    ServingSettings,
)
from torchserve_vision.rollout import (
    RolloutError,
    rollout,
    wait_for_workers,
)
from torchserve_vision.rollout_history import HistoryEntry, Journal, now_text
from torchserve_vision.server_process import TorchServeInstance
from torchserve_vision.server_state import served_default_version, versions_of
from torchserve_vision.waiting import wait_until

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def archives(model_store: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return built_rollout_archives(model_store, tmp_path_factory)


def test_rollout_under_load_fails_no_request_and_switches_to_v2(client, archives, model_store):
    events: dict[str, float] = {}

    def log(message: str) -> None:
        if message.endswith("is the default"):
            events["default"] = time.monotonic()

    with load_on_server(client) as load:
        load.wait_for(20)
        entry = rollout(client, plan(archives["v2"]), model_store, log)
        load.wait_for(40)
    assert load.failures() == []
    lengths_before = {len(o.body) for o in load.outcomes if o.received_at < events["default"]}
    lengths_after = {len(o.body) for o in load.outcomes if o.sent_at > events["default"]}
    assert V1_LENGTH in lengths_before
    assert lengths_after == {V2_LENGTH}
    assert all(o.body[0]["label"] in CAT_LABELS for o in load.outcomes)
    assert [v["modelVersion"] for v in versions_of(client, MODEL)] == ["2.0"]
    assert (entry.from_version, entry.to_version) == ("1.0", "2.0")



def test_a_failed_smoke_test_leaves_v1_serving_and_removes_the_new_version(
        client, archives, model_store, rollout_server, tmp_path, capsys):
    with load_on_server(client) as load:
        load.wait_for(10)
        code = cli(rollout_server, model_store, tmp_path / "history.json", "rollout", MODEL,
                   archives["bad"], *[arg for label in sorted(CAT_LABELS)
                                      for arg in ("--expect-label", label)])
        load.wait_for(20)
    assert code == 1
    error = capsys.readouterr().err
    assert "smoke test" in error and "failed and was undone" in error
    assert load.failures() == []
    assert {len(o.body) for o in load.outcomes} == {V1_LENGTH}
    assert [v["modelVersion"] for v in versions_of(client, MODEL)] == ["1.0"]
    assert states(tmp_path / "history.json") == ["undone"]


def test_a_rollout_to_a_registered_version_is_refused_without_changes(client, archives,
                                                                        model_store):
    with pytest.raises(RolloutError, match="already registered and is the default"):
        rollout(client, plan("efficientnet_lite0-1.0.mar"), model_store, print)
    client.register(archives["v2"], 4, 20, 1, 60)         # not as the rollout would register it
    wait_for_workers(client, MODEL, "2.0", 1, 120)
    with pytest.raises(RolloutError, match=r"already registered, with batch size 4 \(this rollout: 8\)"):
        rollout(client, plan(archives["v2"]), model_store, print)
    assert sorted(v["modelVersion"] for v in versions_of(client, MODEL)) == ["1.0", "2.0"]
    assert served_default_version(client, MODEL)["modelVersion"] == "1.0"


def test_a_half_done_rollout_whose_archive_changed_since_is_not_taken_up(client, archives,
                                                                        rollout_server,
                                                                        model_store, tmp_path):
    """A rollout that died after registering v2, recorded with v2's archive digest; the archive
    in the store has changed since (rebuilt): running it again refuses to take the registered
    version as its own, and --abort undoes it."""
    history = tmp_path / "history.json"
    client.register(archives["v2"], SETTINGS.batch_size, SETTINGS.max_batch_delay_ms, 1, 60)
    wait_for_workers(client, MODEL, "2.0", 1, 120)
    died = HistoryEntry(kind="rollout", model=MODEL, to_version="2.0", to_archive=archives["v2"],
                        to_settings=SETTINGS, from_version="1.0", from_archive="efficientnet_lite0-1.0.mar",
                        from_settings=SETTINGS, time=now_text(), to_archive_sha256="0" * 64)
    Journal(history).begin(died)
    with pytest.raises(RolloutError, match="changed since the rollout that registered"):
        rollout(client, plan(archives["v2"]), model_store, print, Journal(history))
    assert cli(rollout_server, model_store, history, "rollout", MODEL, "--abort") == 0
    assert [v["modelVersion"] for v in versions_of(client, MODEL)] == ["1.0"]
    assert states(history) == ["aborted"]


def test_a_half_done_rollout_refuses_other_changes_of_the_model(client, archives, rollout_server,
                                                                model_store, tmp_path, capsys):
    history = tmp_path / "history.json"
    killed_once(models_command(rollout_server, model_store, history, "rollout", MODEL, archives["v2"]),
                lambda: len(versions_of(client, MODEL)) == 2, "v2's registration")
    for change in (("rollout", MODEL, "--same-archive", "--batch-size", "4"), ("rollback", MODEL),
                   ("scale", MODEL, "--workers", "2")):
        capsys.readouterr()
        assert cli(rollout_server, model_store, history, *change) == 1, change
        assert "is half-done" in capsys.readouterr().err, change
    assert cli(rollout_server, model_store, history, "rollout", MODEL, "--abort") == 0
    assert [v["modelVersion"] for v in versions_of(client, MODEL)] == ["1.0"]


def test_rollback_refuses_a_change_recorded_on_another_server(client, rollout_server, model_store,
                                                              tmp_path, capsys):
    """A history written before the server was restarted: its latest change to 1.0 is not this
    server's to undo."""
    history = tmp_path / "history.json"
    assert cli(rollout_server, model_store, history, "scale", MODEL, "--workers", "2") == 0
    (scaled,) = json.loads(history.read_text())
    assert scaled["state"] == "done" and scaled["server"]
    scaled["server"] = "1@2000-01-01T00:00:00Z"              # as if made on an earlier server
    history.write_text(json.dumps([scaled]))
    capsys.readouterr()
    assert cli(rollout_server, model_store, history, "rollback", MODEL) == 1
    assert "was made on another server" in capsys.readouterr().err
    assert len(client.describe(MODEL, "1.0")[0]["workers"]) == 2       # nothing undone
    client.scale(MODEL, "1.0", 1, 1)


def test_scaling_up_and_down_under_load_fails_no_request(client, rollout_server, model_store,
                                                         tmp_path):
    history = tmp_path / "history.json"
    with load_on_server(client) as load:
        load.wait_for(10)
        assert cli(rollout_server, model_store, history, "scale", MODEL,
                   "--min", "2", "--max", "2") == 0
        workers_up = len(client.describe(MODEL, "1.0")[0]["workers"])
        load.wait_for(20)
        assert cli(rollout_server, model_store, history, "scale", MODEL, "--workers", "1") == 0
        load.wait_for(20)
    assert workers_up == 2
    assert load.failures() == []
    (scaled_down,) = client.describe(MODEL, None)  # scaled down by swapping in a 1-worker copy
    assert len(scaled_down["workers"]) == 1 and scaled_down["minWorkers"] == 1


def test_rollback_under_load_fails_no_request(client, archives, rollout_server, model_store,
                                              tmp_path):
    history = tmp_path / "history.json"
    assert cli(rollout_server, model_store, history, "rollout", MODEL, archives["v2"]) == 0
    with load_on_server(client) as load:
        load.wait_for(10)
        assert cli(rollout_server, model_store, history, "rollback", MODEL) == 0
        rolled_back_at = time.monotonic()
        load.wait_for(20)
    assert load.failures() == []
    assert {len(o.body) for o in load.outcomes if o.sent_at > rolled_back_at} == {V1_LENGTH}
    assert [v["modelVersion"] for v in versions_of(client, MODEL)] == ["1.0"]


def test_new_batch_settings_roll_out_as_a_new_version_under_load(client, rollout_server,
                                                                 model_store, tmp_path):
    with load_on_server(client) as load:
        load.wait_for(10)
        assert cli(rollout_server, model_store, tmp_path / "h.json", "rollout", MODEL,
                   "--same-archive", "--batch-size", "4", "--batching", "delayed",
                   "--max-batch-delay", "5") == 0
        load.wait_for(20)
    assert load.failures() == []
    (current,) = client.describe(MODEL, "all")
    assert current["modelVersion"] == "1.0-bs4-d5"
    assert (current["batchSize"], current["maxBatchDelay"], current["continuousBatching"]) == (4, 5, False)


def test_dry_run_prints_the_calls_and_changes_nothing(client, archives, rollout_server,
                                                      model_store, tmp_path, capsys):
    assert cli(rollout_server, model_store, tmp_path / "h.json", "rollout", MODEL, archives["v2"],
               "--dry-run") == 0
    printed = capsys.readouterr().out
    assert f"[dry-run] POST {rollout_server.management_url}/models?url={archives['v2']}" in printed
    assert f"[dry-run] DELETE {rollout_server.management_url}/models/{MODEL}/1.0" in printed
    assert [v["modelVersion"] for v in versions_of(client, MODEL)] == ["1.0"]


def test_list_and_describe_as_json_and_text(rollout_server, client, model_store, tmp_path, capsys):
    assert cli(rollout_server, model_store, tmp_path / "h.json", "describe", MODEL, "--json") == 0
    described = json.loads(capsys.readouterr().out)
    assert described[0]["modelVersion"] == "1.0" and "jobQueueStatus" in described[0]
    assert cli(rollout_server, model_store, tmp_path / "h.json", "list") == 0
    text = capsys.readouterr().out
    assert f"{MODEL} 1.0" in text and "worker" in text and "queue:" in text


# --- whatever a version costs to start, and whatever goes wrong ------------------------------------
class FrontendWatch:
    """Polls /ping and GET /models every 0.5 s; records how long each answer took (None: none
    within 8 s, less than the slow version's start). A call that waits for workers inside the
    frontend shows here."""

    def __init__(self, server: TorchServeInstance) -> None:
        self.server = server
        self.seconds: list[float | None] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for url in (f"{self.server.inference_url}/ping", f"{self.server.management_url}/models"):
                started = time.monotonic()
                try:
                    requests.get(url, timeout=8).raise_for_status()
                    self.seconds.append(time.monotonic() - started)
                except requests.RequestException:
                    self.seconds.append(None)
            self._stop.wait(0.5)

    def __enter__(self) -> FrontendWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=20)


def test_a_slow_starting_version_rolls_out_and_back_under_load_without_holding_the_frontend(
        client, archives, rollout_server, model_store, tmp_path):
    history = tmp_path / "history.json"
    with load_on_server(client) as load, FrontendWatch(rollout_server) as watch:
        load.wait_for(10)
        started = time.monotonic()
        assert cli(rollout_server, model_store, history, "rollout", MODEL, archives["slow"]) == 0
        assert time.monotonic() - started > SLOW_START_S
        load.wait_for(10)
        assert cli(rollout_server, model_store, history, "rollback", MODEL) == 0
        load.wait_for(10)
    assert load.failures() == []
    # Every poll was answered within its 8 s timeout while the version took 12 s to start: the
    # frontend never waited for it.
    assert watch.seconds and None not in watch.seconds, watch.seconds
    assert [v["modelVersion"] for v in versions_of(client, MODEL)] == ["1.0"]
    kinds = [entry.get("kind", "rollout") for entry in json.loads(history.read_text())]
    assert kinds == ["rollout", "rollback"]


def test_a_version_not_ready_by_its_deadline_is_undone(client, archives, rollout_server,
                                                      model_store, tmp_path, capsys):
    history = tmp_path / "history.json"
    with load_on_server(client) as load:
        load.wait_for(10)
        code = cli(rollout_server, model_store, history, "rollout", MODEL, archives["slow"],
                   "--timeout", "3")
        load.wait_for(10)
    assert code == 1
    error = capsys.readouterr().err
    assert "timed out after 3 s waiting for" in error and "READY workers of efficientnet_lite0" in error
    assert "undone (efficientnet_lite0 1.0 is the default)" in error
    assert load.failures() == []
    assert [v["modelVersion"] for v in versions_of(client, MODEL)] == ["1.0"]
    assert states(history) == ["undone"]


def test_a_refused_registration_is_undone_and_reported(client, archives, rollout_server,
                                                      model_store, tmp_path, capsys):
    code = cli(rollout_server, model_store, tmp_path / "history.json", "rollout", MODEL,
               archives["refused"])
    assert code == 1
    error = capsys.readouterr().err
    assert "failed and was undone" in error and "POST /models" in error and "Runtime" in error
    assert [v["modelVersion"] for v in versions_of(client, MODEL)] == ["1.0"]
    assert states(tmp_path / "history.json") == ["undone"]


def test_a_version_whose_workers_die_while_loading_is_undone_without_waiting_out_the_deadline(
        client, archives, rollout_server, model_store, tmp_path, capsys):
    with load_on_server(client) as load:
        load.wait_for(10)
        code = cli(rollout_server, model_store, tmp_path / "history.json", "rollout", MODEL,
                   archives["crashing"])
        load.wait_for(10)
    assert code == 1
    # Said only when the workers' restarts are counted, not when the deadline (startupTimeout +
    # 30 s = 150 s) runs out.
    assert "died while loading" in capsys.readouterr().err
    assert load.failures() == []
    assert [v["modelVersion"] for v in versions_of(client, MODEL)] == ["1.0"]


def test_an_interrupted_rollout_is_undone_and_exits_non_zero(client, archives, rollout_server,
                                                             model_store, tmp_path):
    history = tmp_path / "history.json"
    arguments = ["models", "rollout", MODEL, archives["slow"],
                 "--management-url", rollout_server.management_url,
                 "--inference-url", rollout_server.inference_url,
                 "--model-store", str(model_store), "--history", str(history)]
    with load_on_server(client) as load:
        load.wait_for(10)
        process = started_command(arguments)
        wait_until(lambda: len(versions_of(client, MODEL)) == 2, 30, "the new version's registration",
                   interval_s=0.2)
        process.send_signal(signal.SIGINT)   # what Ctrl-C does, while it waits for the workers
        out, err = process.communicate(timeout=60)
        load.wait_for(10)
    assert process.returncode == 130, (out, err)
    assert "interrupted and undone" in err
    assert "unregistered efficientnet_lite0 4.0" in out
    assert load.failures() == []
    assert [v["modelVersion"] for v in versions_of(client, MODEL)] == ["1.0"]
    assert states(history) == ["undone"]


def test_rollback_after_a_scale_down_explains_itself_then_restores_the_workers(
        client, rollout_server, model_store, tmp_path, capsys):
    history = tmp_path / "history.json"
    assert cli(rollout_server, model_store, history, "scale", MODEL, "--workers", "2") == 0
    assert cli(rollout_server, model_store, history, "scale", MODEL, "--workers", "1") == 0
    assert client.describe(MODEL, None)[0]["modelVersion"] == "1.0-w1"
    capsys.readouterr()
    assert cli(rollout_server, model_store, history, "rollback", MODEL, "--dry-run") == 0
    said = capsys.readouterr().out
    assert "undoing the scale of" in said and "1.0 is gone; re-registering it" in said
    assert "workers 2/2" in said and "[dry-run] POST" in said
    assert client.describe(MODEL, None)[0]["modelVersion"] == "1.0-w1"   # nothing changed
    with load_on_server(client) as load:
        load.wait_for(10)
        assert cli(rollout_server, model_store, history, "rollback", MODEL) == 0
        load.wait_for(10)
    assert load.failures() == []
    (restored,) = client.describe(MODEL, "all")
    assert restored["modelVersion"] == "1.0" and restored["minWorkers"] == 2
    client.scale(MODEL, "1.0", 1, 1)


def test_a_rollout_carries_the_current_settings_and_timeouts_forward(client, archives, rollout_server,
                                                                   model_store, tmp_path):
    (before,) = client.describe(MODEL, None)
    assert cli(rollout_server, model_store, tmp_path / "h.json", "rollout", MODEL, archives["v2"]) == 0
    (after,) = client.describe(MODEL, None)
    assert after["modelVersion"] == "2.0"
    # Compared as settings: with queued batching TorchServe reports 100 ms for the unused delay
    # of 0 that config.properties gave, and 0 for the one a register call gave.
    assert ServingSettings.of_version(after) == ServingSettings.of_version(before)
    for key in ("batchSize", "minWorkers", "maxWorkers", "responseTimeout", "startupTimeout"):
        assert after[key] == before[key], key
