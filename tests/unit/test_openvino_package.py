"""OpenVINO is imported without its usage telemetry, by a build and by a worker, in a process
where it would otherwise send: no consent file in the (new) home directory, no CI variable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deployment_files import REPO

pytestmark = pytest.mark.slow          # a fresh process imports torch, OpenVINO and NNCF

# A build's conversion, a worker's runner and NNCF's import, each through the project's code, in a
# process that counts its forks (each telemetry event forks the process to post it).
CONVERT_AND_SERVE = """
import json, os, sys
forks = []
os.register_at_fork(before=lambda: forks.append(1))
from pathlib import Path
import torch
from torch import nn
from handlers.model.engine_runners import OpenVinoRunner
from torchserve_vision.archives.engine_exports import convert_openvino
from handlers.model.openvino_package import block_openvino_telemetry

torch.manual_seed(0)
network = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(8, 10)).eval()
path = Path(sys.argv[1]) / "model.xml"
convert_openvino(network, (3, 16, 16), path)
logits = OpenVinoRunner(path, "fp32", 1, None)(torch.rand(2, 3, 16, 16))     # as a worker runs it
block_openvino_telemetry()
import nncf
from nncf.telemetry import wrapper
import openvino.tools.ovc.convert_impl as convert_impl
print(json.dumps({"forks": len(forks), "shape": list(logits.shape),
                  "telemetry_module": repr(sys.modules["openvino_telemetry"]),
                  "conversion_telemetry": convert_impl.tm.__name__,
                  "nncf_telemetry_is_its_stub": isinstance(wrapper.telemetry, wrapper.NNCFTelemetryStub)}))
"""


def test_a_conversion_a_worker_runner_and_nncf_send_no_telemetry(tmp_path: Path):
    home = tmp_path / "home"
    home.mkdir()
    environment = {name: value for name, value in os.environ.items()
                   if name not in {"CI", "TF_BUILD", "JENKINS_URL"}}
    environment.update(HOME=str(home), PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", CONVERT_AND_SERVE, str(tmp_path)], cwd=REPO,
                          env=environment, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["shape"] == [2, 10]
    assert report["telemetry_module"] == "None"
    assert report["conversion_telemetry"] == "openvino.tools.ovc.telemetry_stub"
    assert report["nncf_telemetry_is_its_stub"] is True
    assert report["forks"] == 0
    assert not (home / "intel").exists()       # nor a consent file or client id written
