"""The rolling-update rehearsal with real parts: two `server run` pods behind HAProxy, each
stopped and restarted in turn under open-loop load. Graceful (SIGTERM: readiness false, drain,
stop): no request fails. TorchServe's own stop, for comparison: requests fail, so the rehearsal
can see a failure when there is one."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchserve_vision import paths
from torchserve_vision.lab.rolling_update import rehearse

pytestmark = pytest.mark.server
CLASSIFIER = "efficientnet_lite0-1.0.mar"


def test_a_rolling_update_under_load_fails_no_request(model_store: Path):
    report = rehearse(paths.DEVELOPMENT_CONFIG, model_store, pod_count=2, rate_rps=15,
                      drain_delay_s=1.0, settle_s=1.0, load_models=CLASSIFIER)
    assert [step.exit_code for step in report.steps] == [0, 0]
    assert report.sent > 15 * 20                     # load ran through both restarts
    assert report.failed == 0, report.errors


def test_the_stock_stop_drops_requests_in_the_same_rehearsal(model_store: Path):
    report = rehearse(paths.DEVELOPMENT_CONFIG, model_store, pod_count=2, rate_rps=15,
                      settle_s=1.0, load_models=CLASSIFIER, graceful=False, roll_count=1)
    assert report.failed > 0
    assert [step.exit_code for step in report.steps] == [1]   # the entrypoint saw TorchServe die
