"""The rolling-update rehearsal with real parts: two `server run` pods behind HAProxy, each
stopped and restarted in turn under open-loop load. Graceful (SIGTERM: readiness false, drain,
stop): no request fails. TorchServe's own stop, for comparison, in the same run: requests fail, so
the rehearsal can see a failure when there is one."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchserve_vision import paths
from torchserve_vision.lab.rolling_update import rehearse

pytestmark = pytest.mark.server
CLASSIFIER = "efficientnet_lite0-1.0.mar"


def test_a_rolling_update_under_load_fails_no_request_and_the_stock_stop_does(model_store: Path):
    """Both pods rolled with SIGTERM, then (same run, same load) the first pod stopped the way
    TorchServe's stock image stops: the rehearsal sees failures when there are some.
    The stock stop fails the requests sent in the second or so before the balancer notices:
    0 to 7 of them at 15 requests/s (a zero seen once in four), 9 to 14 at 30/s, the rate here."""
    report = rehearse(paths.DEVELOPMENT_CONFIG, model_store, pod_count=2, rate_rps=30,
                      drain_delay_s=1.0, settle_s=1.0, load_models=CLASSIFIER, stock_stop_after=True)
    assert [(step.graceful, step.exit_code) for step in report.steps] == [
        (True, 0), (True, 0), (False, 1)]   # the entrypoint saw TorchServe die
    assert report.sent > 30 * 20                     # load ran through all three restarts
    assert [step.failed for step in report.steps[:2]] == [0, 0], report.errors
    assert report.steps[2].failed > 0
    assert report.failed == sum(step.failed for step in report.steps)
