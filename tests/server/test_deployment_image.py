"""The container image's command, rehearsed on the host (no container engine here): the image's
layout (config/, model_store/ in the working directory), the Dockerfile's ENTRYPOINT + CMD and
ENV, only the ports moved to free ones; as the image's user and as an arbitrary UID in group 0
(OpenShift's way). It must become ready, serve with the production posture
(token authorization on unless the deployment turns it off), expose the Prometheus series the
autoscaler's adapter rules read, and exit 0 on SIGTERM."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import requests
import yaml

from tests.deployment_files import REPO, Dockerfile
from tests.images import CAT_LABELS, photo_bytes
from torchserve_vision import paths
from torchserve_vision.client import KeyFile
from torchserve_vision.deployment_settings import local_url
from torchserve_vision.model_descriptions import load_descriptions
from torchserve_vision.prometheus_text import series_names
from torchserve_vision.torchserve_config import free_ports, read_properties, server_config
from torchserve_vision.waiting import wait_until

pytestmark = pytest.mark.server


def adapter_series() -> set[str]:
    values = yaml.safe_load((REPO / "deploy" / "prometheus-adapter" / "values.yaml").read_text())
    rules = values["rules"]["custom"]
    return {rule["seriesQuery"].split("{")[0] for rule in rules}


# OpenShift runs a container as an arbitrary UID in group 0: the image's writable paths belong to
# group 0 with group write (the Dockerfile's `.run`), so any UID can run it. Here the interpreter
# lives under the host's /root (the image's is world-readable), so the UID keeps the capability to
# read and search any file (CAP_DAC_READ_SEARCH), not to write one: every write still needs the
# group-0 permission under test.
ANY_UID = ["setpriv", "--reuid=12345", "--regid=0", "--clear-groups",
           "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]


@pytest.mark.parametrize("user", ["image user", "any uid in group 0"])
def test_the_image_command_serves_exposes_the_autoscaling_series_and_stops_cleanly(model_store: Path,
                                                                                    tmp_path: Path, user):
    dockerfile = Dockerfile.read()
    command = dockerfile.exec_form("ENTRYPOINT") + dockerfile.exec_form("CMD")
    config_argument = Path(command[command.index("--config") + 1])
    # A directory every UID can enter (pytest's own are the owner's only), as the image's is.
    base = Path(tempfile.mkdtemp(prefix="image-"))
    base.chmod(0o755)
    workdir = base / "srv"
    shutil.copytree(REPO / "config", workdir / "config")
    # What the image's `torchserve-vision build` puts there: the archives of config/models.yaml
    # (not the versions other tests add to the session's store, which may be mid-write).
    (workdir / "model_store").mkdir()
    for description in load_descriptions(paths.MODEL_DESCRIPTIONS):
        shutil.copy2(model_store / description.archive_name, workdir / "model_store")
    for directory in (workdir, workdir / "config", workdir / "model_store"):
        directory.chmod(0o755)
    moved = server_config(tmp_path / "ports", Path("model_store"), REPO / config_argument)
    moved.replace(workdir / config_argument)
    (workdir / config_argument).chmod(0o644)
    (workdir / ".run").mkdir()
    os.chown(workdir / ".run", -1, 0)                  # as the Dockerfile leaves it: group 0, g+rwX
    (workdir / ".run").chmod(0o770)
    if user != "image user":
        command = ANY_UID + command
    probe_port = free_ports(1)[0]
    environment = {**os.environ, **dockerfile.environment(), "TSV_PROBE_PORT": str(probe_port),
                   "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    properties = read_properties(workdir / config_argument)
    inference = local_url(properties["inference_address"].replace("127.0.0.1", "0.0.0.0"))
    metrics = local_url(properties["metrics_address"].replace("127.0.0.1", "0.0.0.0"))
    with open(tmp_path / "output.txt", "wb") as output:
        process = subprocess.Popen(command, cwd=workdir, env=environment, stdout=output,
                                   stderr=subprocess.STDOUT)
    try:
        def ready() -> bool:
            assert process.poll() is None, (tmp_path / "output.txt").read_text()
            try:
                return requests.get(f"http://127.0.0.1:{probe_port}/ready", timeout=2).status_code == 200
            except requests.RequestException:
                return False

        wait_until(ready, 240, "the container's readiness", interval_s=0.2)
        assert "addresses bound to 0.0.0.0" in (tmp_path / "output.txt").read_text()
        url = f"{inference}/predictions/efficientnet_lite0"
        refused = requests.post(url, data=photo_bytes("chelsea.png"), timeout=30)
        assert refused.status_code in (400, 401)         # the image keeps token authorization on
        key = KeyFile(workdir / ".run" / "key_file.json").key("inference")
        answer = requests.post(url, data=photo_bytes("chelsea.png"), timeout=60,
                               headers={"Authorization": f"Bearer {key}", "Content-Type": "image/png"})
        assert answer.status_code == 200 and answer.json()[0]["label"] in CAT_LABELS
        exposed = series_names(requests.get(f"{metrics}/metrics", timeout=10).text)
        assert adapter_series() <= exposed, sorted(exposed)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=120) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        pid_file = workdir / ".run" / "tmp" / ".model_server.pid"
        if pid_file.exists():
            subprocess.run(["kill", pid_file.read_text().strip()], check=False)
        shutil.rmtree(base, ignore_errors=True)
