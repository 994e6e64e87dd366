"""The rolling-update rehearsal with real parts: two `server run` pods behind HAProxy, each
stopped and restarted in turn under open-loop load, coming back with a new version of the model
(what a new image per version does on Kubernetes, docs/kubernetes.md). Graceful (SIGTERM:
readiness false, drain, stop): no request fails, the old version answers until the first pod
stops and only the new one once the last pod is back. TorchServe's own stop, for comparison, in
the same run: requests fail, so the rehearsal can see a failure when there is one."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.images import load_photo
from torchserve_vision import paths
from torchserve_vision.archives.versions import archive_with_version
from torchserve_vision.lab.rolling_update import REMOVAL_BOUND_S, rehearse

pytestmark = pytest.mark.server
CLASSIFIER = "efficientnet_lite0-1.0.mar"
NEW_VERSION = "2.0-rolled"      # this module's own version name: no other module writes it
WIDE_QUEUE = 100


def wide_queue_store(model_store: Path, directory: Path) -> Path:
    """A model store with the classifier's 1.0 queueing up to WIDE_QUEUE requests, over its
    archive's own 32: while one pod restarts, the other takes the whole load, about its capacity on
    a 2-core machine shared by both, and the burst waits in its queue; with the production
    profile's queue it would be shed with 503s (docs/robustness.md), which is not what this test
    is about."""
    directory.mkdir()
    shutil.copy(model_store / CLASSIFIER, directory / "source.mar")
    archive_with_version(directory, "source.mar", "1.0", frontend_changes={"jobQueueSize": WIDE_QUEUE})
    (directory / "source.mar").unlink()
    return directory


def test_a_new_version_rolled_out_under_load_fails_no_request_and_the_stock_stop_does(
        model_store: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Both pods rolled with SIGTERM onto the new version, then (same run, same load) the first
    pod stopped the way TorchServe's stock image stops: the rehearsal sees failures when there
    are some. The stock stop fails the requests sent to its pod before the balancer notices,
    which takes two failed checks 250 ms apart, so at least a quarter second at 15 requests/s per
    pod: 5 to 16 failed per stock-stopped pod at 30/s, the rate here. (Out after one failed
    check, the window could be nearly nothing: 0 to 7 failed at 15/s, and once 0 at 30/s.)
    A graceful pod keeps serving twice the longest the balancer may take to notice, and the
    balancer's own record shows each pod taken out (a graceful one for its readiness) and back. A failure
    counts against the step during which it happened (on a loaded 2-core machine answers take
    over a second, and requests sent just before the stock stop fail in it)."""
    monkeypatch.setenv("TSV_WORKERS", "1")   # one worker per pod, as a pod per core would run
    store = wide_queue_store(model_store, tmp_path / "store")
    rolled = archive_with_version(store, CLASSIFIER, NEW_VERSION)
    report = rehearse(paths.DEVELOPMENT_CONFIG, store, pod_count=2, rate_rps=30,
                      drain_delay_s=2 * REMOVAL_BOUND_S, settle_s=1.0, load_models=CLASSIFIER,
                      stock_stop_after=True, rolled_load_models=rolled, payload=load_photo())
    assert [(step.graceful, step.exit_code) for step in report.steps] == [
        (True, 0), (True, 0), (False, 1)]   # the entrypoint saw TorchServe die
    assert all(step.sent_while_out > 0 for step in report.steps)   # load ran through each restart
    assert [step.failed for step in report.steps[:2]] == [0, 0], (
        [step.errors for step in report.steps], report.balancer_changes)
    # the balancer took each stopped pod out of its rotation and back, in turn (a graceful one
    # because its readiness answered 503)
    changes = iter(change.split(": ", 1)[1] for change in report.balancer_changes)
    for step in report.steps:
        out = next((change for change in changes if change.startswith(f"{step.pod} DOWN")), "")
        assert out and (not step.graceful or "code: 503" in out), (step, report.balancer_changes)
        assert any(change.startswith(f"{step.pod} UP") for change in changes), report.balancer_changes
    assert report.steps[2].failed > 0
    assert report.failed == sum(step.failed for step in report.steps)
    assert set(report.versions_before) == {"1.0"} and report.versions_before["1.0"] > 10
    assert set(report.versions_after) == {NEW_VERSION} and report.versions_after[NEW_VERSION] > 10
    assert set(report.versions_during) <= {"1.0", NEW_VERSION}
