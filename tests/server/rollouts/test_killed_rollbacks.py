"""A rollback SIGKILLed under load after each of its steps (versions.KILL_POINTS), then run
again or aborted."""

from __future__ import annotations

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
def test_a_rollback_killed_at_any_step_finishes_when_run_again_or_is_aborted(
        client, archives, rollout_server, model_store, tmp_path, point, then):
    """v2 rolled out (v1 retired); its rollback re-registers v1 from its archive and is killed.
    Run again: v1 serves, v2 is retired. Aborted: v2 serves, v1 is gone."""
    history = tmp_path / "history.json"
    assert cli(rollout_server, model_store, history, "rollout", MODEL, archives["v2"]) == 0
    with load_on_server(client) as load:
        load.wait_for(10)
        kill_change_at(point, models_command(rollout_server, model_store, history, "rollback", MODEL),
                       client, "2.0", "1.0")
        assert states(history) == ["done", "started"]
        if then == "run again":
            assert cli(rollout_server, model_store, history, "rollback", MODEL) == 0
        else:
            assert cli(rollout_server, model_store, history, "rollout", MODEL, "--abort") == 0
        settled_at = time.monotonic()
        load.wait_for(10)
    assert_only_serving(client, load, settled_at, "1.0" if then == "run again" else "2.0")
    assert states(history) == ["done", "done" if then == "run again" else "aborted"]
