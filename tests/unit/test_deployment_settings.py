"""Settings a deployment takes from its environment, and the probes' answers, without a server."""

from __future__ import annotations

import json
import threading

import pytest
import requests

from torchserve_vision.deployment_settings import DeploymentSettings, SettingsError, local_url
from torchserve_vision.pod_health import PodHealth, ProbeEndpoint

PROPERTIES = {
    "inference_address": "http://127.0.0.1:8080",
    "management_address": "http://127.0.0.1:8081",
    "metrics_address": "http://127.0.0.1:8082",
    "disable_token_authorization": "false",
    "models": json.dumps({"m": {"1.0": {"minWorkers": 2, "maxWorkers": 2}}}),
}


def test_unset_variables_leave_the_config_as_written():
    settings = DeploymentSettings.from_environment({})
    assert settings.apply(PROPERTIES) == PROPERTIES
    assert settings.describe() == ""


def test_the_environment_sets_addresses_workers_and_token_authorization():
    settings = DeploymentSettings.from_environment(
        {"TSV_BIND_ADDRESS": "0.0.0.0", "TSV_WORKERS": "3", "TSV_TOKEN_AUTHORIZATION": "off"})
    applied = settings.apply(PROPERTIES)
    assert applied["inference_address"] == "http://0.0.0.0:8080"
    assert applied["metrics_address"] == "http://0.0.0.0:8082"
    assert json.loads(applied["models"])["m"]["1.0"] == {"minWorkers": 3, "maxWorkers": 3}
    assert applied["disable_token_authorization"] == "true"
    assert local_url(applied["inference_address"]) == "http://127.0.0.1:8080"
    assert settings.describe() == "addresses bound to 0.0.0.0, 3 workers per model, token authorization off"
    ipv6 = DeploymentSettings.from_environment({"TSV_BIND_ADDRESS": "::"}).apply(PROPERTIES)
    assert ipv6["inference_address"] == "http://[::]:8080"
    assert local_url(ipv6["inference_address"]) == "http://[::1]:8080"


def test_the_jvm_is_sized_for_the_processors_the_environment_gives():
    settings = DeploymentSettings.from_environment({"TSV_JAVA_PROCESSORS": "3"})
    assert settings.apply(PROPERTIES)["vmargs"] == "-XX:ActiveProcessorCount=3"
    assert settings.apply({**PROPERTIES, "vmargs": "-Xmx1g"})["vmargs"] == "-Xmx1g -XX:ActiveProcessorCount=3"
    assert settings.describe() == "the JVM sized for 3 processors"


@pytest.mark.parametrize("environment", [
    {"TSV_BIND_ADDRESS": "example.com"}, {"TSV_WORKERS": "0"}, {"TSV_WORKERS": "two"},
    {"TSV_TOKEN_AUTHORIZATION": "maybe"}, {"TSV_JAVA_PROCESSORS": "$(CPU_REQUEST)"},
    {"TSV_JAVA_PROCESSORS": "0"},
])
def test_unusable_values_are_refused(environment):
    with pytest.raises(SettingsError):
        DeploymentSettings.from_environment(environment)


def test_probes_answer_from_the_last_check_and_readiness_turns_false_when_draining():
    reason: list[str | None] = ["m: 0 of 1 workers READY"]
    alive = threading.Event()
    alive.set()
    health = PodHealth(check=lambda: reason[0], frontend_alive=alive.is_set, poll_s=0.05)
    with ProbeEndpoint(health, "127.0.0.1", 0) as endpoint:
        url = f"http://127.0.0.1:{endpoint.port}"

        def ready() -> tuple[int, dict]:
            answer = requests.get(url + "/ready", timeout=5)
            return answer.status_code, answer.json()

        assert ready() == (503, {"ready": False, "reason": "TorchServe is starting"})
        assert requests.get(url + "/live", timeout=5).status_code == 200
        health.started.set()
        health.refresh()      # what the poller does every poll_s
        assert ready() == (503, {"ready": False, "reason": "m: 0 of 1 workers READY"})
        reason[0] = None
        health.refresh()
        assert ready() == (200, {"ready": True})
        health.draining.set()
        assert ready() == (503, {"ready": False, "reason": "draining"})
        alive.clear()
        assert requests.get(url + "/live", timeout=5).status_code == 503
        assert requests.get(url + "/other", timeout=5).status_code == 404


def test_a_stale_check_is_not_ready():
    health = PodHealth(check=lambda: None, frontend_alive=lambda: True, stale_s=-1.0)
    health.started.set()
    health.refresh()
    assert health.not_ready_reason() is not None and "not checked" in str(health.not_ready_reason())
