"""A rollout SIGKILLed under load after each of its steps (versions.KILL_POINTS), then run
again or aborted."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from tests.server.rollouts.versions import (
    KILL_POINTS,
    MODEL,
    assert_only_serving,
    built_rollout_archives,
    cli,
    kill_change_at,
    load_on_server,
    models_command,
    states,
)

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def archives(model_store: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return built_rollout_archives(model_store, tmp_path_factory, frozenset({"v2"}))


@pytest.mark.parametrize("then", ["run again", "abort"])
@pytest.mark.parametrize("point", KILL_POINTS)
def test_a_rollout_killed_at_any_step_finishes_when_run_again_or_is_aborted(
        client, archives, rollout_server, model_store, tmp_path, capsys, point, then):
    """SIGKILL of the real command under load (no undo can run). `models list` shows the
    half-done rollout; the same command again brings v2, `--abort` v1 back; zero failed
    requests, no version left over, one history entry."""
    history = tmp_path / "history.json"
    arguments = models_command(rollout_server, model_store, history, "rollout", MODEL, archives["v2"])
    with load_on_server(client) as load:
        load.wait_for(10)
        kill_change_at(point, arguments, client, "1.0", "2.0")
        assert states(history) == ["started"]
        capsys.readouterr()
        assert cli(rollout_server, model_store, history, "list") == 0
        listed = capsys.readouterr().out
        assert "half-done: a rollout of efficientnet_lite0 from 1.0 to 2.0" in listed
        assert "models rollout --abort efficientnet_lite0" in listed
        if then == "run again":
            done = subprocess.run(arguments, capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, (done.stdout, done.stderr)
        else:
            assert cli(rollout_server, model_store, history, "rollout", MODEL, "--abort") == 0
        settled_at = time.monotonic()
        load.wait_for(10)
    assert_only_serving(client, load, settled_at, "2.0" if then == "run again" else "1.0")
    assert states(history) == ["done" if then == "run again" else "aborted"]
    if then == "abort":
        assert cli(rollout_server, model_store, history, "rollout", MODEL, "--abort") == 1
