"""deploy/ checked offline: every Kubernetes resource against the API schemas of pinned Kubernetes
versions (kubernetes-validate, strict: unknown fields are errors), the KServe InferenceService
against its published CRD schema, and the manifests against the config, the command line and
the Dockerfile they rely on. (That TorchServe's /metrics has the series the autoscaler uses is
checked on a real server in tests/server/test_deployment_image.py.)"""

from __future__ import annotations

import copy
import fnmatch
import json
import math
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.deployment_files import (
    DEPLOY,
    REPO,
    Dockerfile,
    closed_schema,
    container,
    container_environment,
    container_ports,
    cpu_cores,
    rendered,
    resource,
)
from tests.kserve_merge import isvc_container, merged_container, resource_problems
from torchserve_vision import paths
from torchserve_vision.archives import BUILD_TARGETS
from torchserve_vision.cli import command_parser
from torchserve_vision.cli import main as command
from torchserve_vision.deployment_settings import DeploymentSettings
from torchserve_vision.model_descriptions import load_descriptions
from torchserve_vision.server_process import ForegroundOptions
from torchserve_vision.torchserve_config import read_properties

KUBERNETES_VERSIONS = ("1.33.0", "1.36.0")
ISVC_SCHEMA = REPO / "tests" / "schemas" / "kserve-v0.20.0-inferenceservice-v1beta1.schema.json"
ISVC = DEPLOY / "kserve" / "inferenceservice.yaml"
ADAPTER_VALUES = DEPLOY / "prometheus-adapter" / "values.yaml"
PODMONITOR_SCHEMA = REPO / "tests" / "schemas" / "prometheus-operator-v0.93.0-podmonitor-v1.schema.json"


@pytest.fixture(scope="module", params=["cpu", "gpu", "canary"])
def overlay(request) -> tuple[str, list[dict[str, Any]]]:
    return request.param, rendered(request.param)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_resource_is_valid_kubernetes_in_strict_mode(overlay, version):
    name, resources = overlay
    kinds = sorted(r["kind"] for r in resources)
    # the canary's series are the stable overlay's rules' to read (tests/unit/test_monitoring_rules.py)
    rules = [] if name == "canary" else ["PrometheusRule"]
    assert kinds == ["Deployment", "HorizontalPodAutoscaler", "NetworkPolicy",
                     "PodDisruptionBudget", "PodMonitor", *rules, "Service"]
    for manifest in resources:
        if manifest["kind"] not in ("PodMonitor", "PrometheusRule"):   # CRDs': their own schemas
            kubernetes_validate.validate(manifest, version, strict=True)
    assert resource(resources, "HorizontalPodAutoscaler")["apiVersion"] == "autoscaling/v2"


def test_strict_validation_rejects_a_misspelt_field():
    deployment = copy.deepcopy(resource(rendered("cpu"), "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)


@pytest.fixture(scope="module")
def isvc_validator() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(closed_schema(json.loads(ISVC_SCHEMA.read_text())))


def test_the_inference_service_matches_kserves_published_schema(isvc_validator):
    service = yaml.safe_load(ISVC.read_text())
    assert (service["apiVersion"], service["kind"]) == ("serving.kserve.io/v1beta1", "InferenceService")
    errors = [error.message for error in isvc_validator.iter_errors(service)]
    assert errors == []
    misspelt = copy.deepcopy(service)
    model = misspelt["spec"]["predictor"]["model"]
    model["storageURI"] = model.pop("storageUri")
    assert list(isvc_validator.iter_errors(misspelt))
    wrong_type = copy.deepcopy(service)
    wrong_type["spec"]["predictor"]["minReplicas"] = "two"
    assert list(isvc_validator.iter_errors(wrong_type))


def run_arguments(arguments: list[str]):
    parsed = command_parser().parse_args(arguments)
    assert (parsed.command, parsed.action) == ("server", "run")
    return parsed


def served_config(spec: dict[str, Any]) -> dict[str, str]:
    """The TorchServe config the container runs: its --config with its environment applied."""
    return DeploymentSettings.from_environment(container_environment(spec)).apply(
        read_properties(REPO / run_arguments(spec["args"]).config))


def test_the_container_runs_the_entrypoint_with_a_config_the_image_has(overlay):
    _, resources = overlay
    spec = container(resources)
    dockerfile = Dockerfile.read()
    assert spec["args"] == dockerfile.exec_form("CMD")
    assert dockerfile.exec_form("ENTRYPOINT") == ["torchserve-vision"]
    parsed = run_arguments(spec["args"])
    assert (REPO / parsed.config).is_file()


def test_ports_probes_and_network_policy_agree_with_the_config(overlay):
    _, resources = overlay
    spec = container(resources)
    environment = container_environment(spec)
    config = served_config(spec)
    ports = container_ports(spec)
    for name, key in (("http", "inference_address"), ("management", "management_address"),
                      ("metrics", "metrics_address")):
        assert config[key] == f"http://0.0.0.0:{ports[name]}"
    assert ports["probes"] == int(environment["TSV_PROBE_PORT"])
    assert spec["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "probes"}
    assert spec["livenessProbe"]["httpGet"] == {"path": "/live", "port": "probes"}
    service = resource(resources, "Service")
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]
    policy_ports = {port["port"] for rule in resource(resources, "NetworkPolicy")["spec"]["ingress"]
                    for port in rule["ports"]}
    assert policy_ports == {"http", "management", "metrics"}
    open_rules = [rule for rule in resource(resources, "NetworkPolicy")["spec"]["ingress"]
                  if "from" not in rule]
    assert [port["port"] for rule in open_rules for port in rule["ports"]] == ["http"]
    annotations = resource(resources, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == ports["metrics"]
    monitor = resource(resources, "PodMonitor")["spec"]
    assert [endpoint["port"] for endpoint in monitor["podMetricsEndpoints"]] == ["metrics"]
    pod_labels = resource(resources, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert monitor["selector"]["matchLabels"].items() <= pod_labels.items()
    assert set(Dockerfile.read().all("EXPOSE")[-1].split()) == {str(p) for p in ports.values()}
    assert Dockerfile.read().environment()["TSV_PROBE_PORT"] == environment["TSV_PROBE_PORT"]


def test_the_grace_period_outlasts_prestop_and_the_drain_bound(overlay):
    _, resources = overlay
    pod = resource(resources, "Deployment")["spec"]["template"]["spec"]
    spec = container(resources)
    parsed = run_arguments(spec["args"])
    options = ForegroundOptions(drain_delay_s=parsed.drain_delay, drain_timeout_s=parsed.drain_timeout)
    pre_stop = spec["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] > float(pre_stop[1]) + options.stop_bound_s
    strategy = resource(resources, "Deployment")["spec"]["strategy"]["rollingUpdate"]
    assert strategy["maxUnavailable"] == 0


def test_workers_times_threads_fit_the_cpu_request(overlay):
    name, resources = overlay
    spec = container(resources)
    environment = container_environment(spec)
    config = served_config(spec)
    threads = {description.name: description.handler_options.get("torch_threads")
               for description in load_descriptions(paths.MODEL_DESCRIPTIONS)}
    default_threads = int(environment["OMP_NUM_THREADS"])
    used = 0
    for model, versions in json.loads(config["models"]).items():
        for entry in versions.values():
            used += entry["maxWorkers"] * (threads.get(model) or default_threads)
    assert used <= cpu_cores(spec["resources"]["requests"]["cpu"]), (name, used)
    if name == "gpu":
        assert spec["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert environment["TSV_WORKERS"] == "2"


def test_the_autoscaler_uses_the_metrics_the_adapter_rules_define(overlay):
    """CPU pods scale on the planned request rate and the queue; GPU pods on the queue alone
    (the rate target was measured on CPU pods, a fraction of a GPU pod's capacity)."""
    name, resources = overlay
    values = yaml.safe_load(ADAPTER_VALUES.read_text())
    assert values["rules"]["default"] is True       # the chart's rules (resource metrics) stay
    rules = values["rules"]["custom"]
    defined = {rule["name"]["as"] for rule in rules}
    used = {metric["pods"]["metric"]["name"]
            for metric in resource(resources, "HorizontalPodAutoscaler")["spec"]["metrics"]}
    assert defined == {"ts_inference_requests_per_second", "ts_requests_waiting"}
    assert used == ({"ts_requests_waiting"} if name == "gpu" else defined)


def test_the_dockerfile_copies_files_that_exist_and_runs_as_a_user():
    dockerfile = Dockerfile.read()
    for arguments in dockerfile.all("COPY"):
        if arguments.startswith("--from"):
            continue
        *sources, _target = arguments.split()
        for source in sources:
            assert (REPO / source).exists(), source
    user = [arguments for name, arguments in dockerfile.final_stage() if name == "USER"]
    assert user and not user[-1].startswith(("0", "root"))
    # the writable run directory: group 0, group-writable (any UID in group 0 can run the image)
    runs = " ".join(arguments for name, arguments in dockerfile.final_stage() if name == "RUN")
    assert "chown serve:0 .run" in runs and "chmod g+rwX .run" in runs
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".run" in ignored


def test_the_autoscaler_alone_owns_the_replica_count(overlay):
    _, resources = overlay
    assert "replicas" not in resource(resources, "Deployment")["spec"]
    assert resource(resources, "HorizontalPodAutoscaler")["spec"]["minReplicas"] >= 2


def test_replicas_spread_over_nodes_and_zones(overlay):
    _, resources = overlay
    pod = resource(resources, "Deployment")["spec"]["template"]
    spread = {c["topologyKey"]: c for c in pod["spec"]["topologySpreadConstraints"]}
    assert spread["kubernetes.io/hostname"]["whenUnsatisfiable"] == "DoNotSchedule"
    assert "topology.kubernetes.io/zone" in spread
    for constraint in spread.values():
        assert constraint["maxSkew"] == 1
        assert constraint["labelSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()


def test_scratch_space_is_bounded_and_requested(overlay):
    _, resources = overlay
    pod = resource(resources, "Deployment")["spec"]["template"]["spec"]
    limits = [volume["emptyDir"]["sizeLimit"] for volume in pod["volumes"] if "emptyDir" in volume]
    assert len(limits) == len([volume for volume in pod["volumes"] if "emptyDir" in volume]) > 0
    gibibytes = sum(float(limit.removesuffix("Gi")) for limit in limits)
    requested = container(resources)["resources"]["requests"]["ephemeral-storage"]
    assert float(requested.removesuffix("Gi")) >= gibibytes


def test_the_jvm_sees_the_cpu_request_not_the_nodes_cores(overlay):
    _, resources = overlay
    spec = container(resources)
    variables = {variable["name"]: variable for variable in spec["env"]}
    source = variables["TSV_JAVA_PROCESSORS"]["valueFrom"]["resourceFieldRef"]
    assert (source["resource"], source["divisor"], source["containerName"]) == (
        "requests.cpu", "1", spec["name"])
    requested = math.ceil(cpu_cores(spec["resources"]["requests"]["cpu"]))   # divisor 1 rounds up
    settings = DeploymentSettings.from_environment({"TSV_JAVA_PROCESSORS": str(requested)})
    assert f"-XX:ActiveProcessorCount={requested}" in settings.apply({})["vmargs"].split()


def test_no_value_depends_on_an_expansion_only_kubernetes_performs(overlay):
    """`$(VAR)` in an env value or args is expanded by the kubelet alone; Podman's `kube play`
    passes it on as written (a JVM refused `-XX:ActiveProcessorCount=$(CPU_REQUEST)`)."""
    _, resources = overlay
    spec = container(resources)
    values = [variable.get("value", "") for variable in spec["env"]] + list(spec["args"])
    assert not [value for value in values if "$(" in value]


def test_a_pod_that_is_not_ready_never_blocks_a_node_drain(overlay):
    _, resources = overlay
    assert resource(resources, "PodDisruptionBudget")["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


# --- KServe: the runtime and the InferenceService as KServe merges them -----------------------------
SERVING_RUNTIME = DEPLOY / "kserve" / "servingruntime.yaml"
SERVING_RUNTIME_SCHEMA = REPO / "tests" / "schemas" / "kserve-v0.20.0-servingruntime-v1alpha1.schema.json"
# KServe v0.20.0's own TorchServe runtime (config/runtimes/kserve-torchserve.yaml), the fields
# that clashed with this project's InferenceService when it used that runtime.
KSERVE_TORCHSERVE_CONTAINER = {
    "name": "kserve-container", "image": "kserve-torchserve:replace",
    "args": ["torchserve", "--start", "--model-store=/mnt/models/model-store",
             "--ts-config=/mnt/models/config/config.properties"],
    "securityContext": {"runAsUser": 1000, "runAsNonRoot": True},
    "resources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"cpu": "1", "memory": "2Gi"}}}


def merged_pod(runtime_container: dict[str, Any], model: dict[str, Any]) -> dict[str, Any]:
    container = merged_container(runtime_container, isvc_container(model))
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "torchserve-vision-predictor"},
            "spec": {"containers": [container]}}


def test_the_serving_runtime_matches_kserves_published_schema():
    runtime = yaml.safe_load(SERVING_RUNTIME.read_text())
    validator = jsonschema.Draft7Validator(closed_schema(json.loads(SERVING_RUNTIME_SCHEMA.read_text())))
    assert [error.message for error in validator.iter_errors(runtime)] == []
    misspelt = copy.deepcopy(runtime)
    misspelt["spec"]["supportedModelFormat"] = misspelt["spec"].pop("supportedModelFormats")
    assert list(validator.iter_errors(misspelt))


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_kserve_merges_runtime_and_inference_service_into_a_valid_pod(version):
    runtime = yaml.safe_load(SERVING_RUNTIME.read_text())
    model = yaml.safe_load(ISVC.read_text())["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"]["name"] in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]
    pod = merged_pod(runtime["spec"]["containers"][0], model)
    kubernetes_validate.validate(pod, version, strict=True)
    container_spec = pod["spec"]["containers"][0]
    assert resource_problems(container_spec) == []
    parsed = run_arguments(container_spec["args"])
    assert parsed.model_store == Path("/mnt/models/model-store")
    assert parsed.config == Path("/mnt/models/config/config.properties")
    assert container_spec["securityContext"]["runAsUser"] == 10001   # the image's user, who owns .run
    probes = {container_spec[probe]["httpGet"]["port"] for probe in ("readinessProbe", "livenessProbe")}
    assert probes == {int(container_environment(container_spec)["TSV_PROBE_PORT"])}


def test_the_merge_check_refuses_what_kserves_torchserve_runtime_made_of_the_old_service():
    """The InferenceService as it was (args, a 3-CPU request) on KServe's TorchServe runtime:
    the args run together and the CPU limit of 1 sits under a request of 3."""
    old_model = {"args": ["server", "run", "--config", "/mnt/models/config/config.properties"],
                 "resources": {"requests": {"cpu": "3", "memory": "4Gi"}, "limits": {"memory": "6Gi"}}}
    container_spec = merged_pod(KSERVE_TORCHSERVE_CONTAINER, old_model)["spec"]["containers"][0]
    assert container_spec["args"][:2] == ["torchserve", "--start"] and "server" in container_spec["args"]
    assert resource_problems(container_spec) == ["cpu: request 3 > limit 1"]
    with pytest.raises(SystemExit):
        command_parser().parse_args(container_spec["args"])


# --- Prometheus: the PodMonitor and the adapter's rate windows ----------------------------------------
def duration_s(text: str) -> float:
    return sum(float(number) * {"s": 1, "m": 60, "h": 3600}[unit]
               for number, unit in re.findall(r"(\d+)([smh])", text))


def test_the_pod_monitor_matches_the_prometheus_operators_published_schema(overlay):
    _, resources = overlay
    monitor = resource(resources, "PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    validator = jsonschema.Draft7Validator(closed_schema(json.loads(PODMONITOR_SCHEMA.read_text())))
    assert [error.message for error in validator.iter_errors(monitor)] == []
    misspelt = copy.deepcopy(monitor)
    misspelt["spec"]["podMetricsEndpoint"] = misspelt["spec"].pop("podMetricsEndpoints")
    assert list(validator.iter_errors(misspelt))


def test_every_rate_window_holds_at_least_four_scrapes(overlay):
    _, resources = overlay
    intervals = [duration_s(endpoint["interval"])
                 for endpoint in resource(resources, "PodMonitor")["spec"]["podMetricsEndpoints"]]
    windows = [duration_s(window) for rule in yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]
               for window in re.findall(r"\[(\w+)\]", rule["metricsQuery"])]
    assert windows and intervals
    assert min(windows) >= 4 * max(intervals)


def test_the_network_policy_lets_in_a_labelled_prometheus_namespace_not_a_named_one(overlay):
    _, resources = overlay
    metrics_rule = next(rule for rule in resource(resources, "NetworkPolicy")["spec"]["ingress"]
                        if rule["ports"] == [{"port": "metrics"}])
    selectors = [source["namespaceSelector"]["matchLabels"] for source in metrics_rule["from"]]
    assert selectors == [{"torchserve-vision/metrics-scraper": "true"}]


def test_the_image_installs_its_dependencies_before_it_copies_the_sources():
    """A change to the sources or the docs must not reinstall torch: the dependencies' layer comes
    from the locks (hashes checked, nothing resolved; deploy/install-image-packages.sh) and
    pyproject.toml alone, and the package is installed after the sources, without dependencies."""
    instructions = Dockerfile.read().instructions
    (dependencies,) = [i for i, (name, arguments) in enumerate(instructions)
                       if name == "RUN" and "install-image-packages.sh" in arguments]
    (package,) = [i for i, (name, arguments) in enumerate(instructions)
                  if name == "RUN" and "pip install" in arguments]
    copied_before = {source for name, arguments in instructions[:dependencies] if name == "COPY"
                     for source in arguments.split()[:-1]}
    assert copied_before == {"pyproject.toml", "deploy/requirements-cpu.lock", "deploy/requirements-gpu.lock",
                             "deploy/install-image-packages.sh"}
    step = instructions[dependencies][1]
    assert 'install-image-packages.sh /opt/venv "${TARGET}" "${TORCH_INDEX_URL}"' in step
    sources = [i for i, (name, arguments) in enumerate(instructions)
               if name == "COPY" and arguments.split()[0] in ("handlers", "torchserve_vision")]
    assert dependencies < min(sources) and max(sources) < package
    assert "--no-deps" in instructions[package][1]


def test_pips_settings_reach_the_build_as_secrets_only():
    """An index or certificate of the builder's reaches the install step as a secret mounted for
    that step alone: not a build argument (kept in the image's history) nor a copied file."""
    dockerfile = Dockerfile.read()
    (install,) = [arguments for arguments in dockerfile.all("RUN")
                  if "install-image-packages.sh" in arguments]
    assert "--mount=type=secret,id=pip-conf,target=/run/secrets/pip-conf" in install
    assert "--mount=type=secret,id=pip-cert,target=/run/secrets/pip-cert" in install
    assert "PIP_CONFIG_FILE=/run/secrets/pip-conf" in install
    assert not [name for name in dockerfile.build_arguments() if "PIP" in name.upper()]
    copied = " ".join(dockerfile.all("COPY"))
    assert "pip" not in copied.replace("install-image-packages", "")


def test_the_build_context_leaves_out_built_jars():
    """A jar from the checkout (an older layout built it beside the sources) must not stand in
    for the one the image compiles against its own TorchServe."""
    ignored = [line for line in (REPO / ".dockerignore").read_text().splitlines()
               if line and not line.startswith("#")]
    for built in ("torchserve_vision/frontend/build/frontend-agent-0123456789abcdef.jar",
                  "somewhere/else/agent.jar"):
        assert any(fnmatch.fnmatch(built, pattern) for pattern in ignored), built


def test_the_agent_jar_is_built_into_the_environment_the_runtime_stage_copies():
    dockerfile = Dockerfile.read()
    build_stage = dockerfile.instructions[:dockerfile.instructions.index(dockerfile.final_stage()[0])]
    (agent_step,) = [arguments for name, arguments in build_stage
                     if name == "RUN" and "torchserve_vision.frontend.agent" in arguments]
    assert "/opt/venv/bin/python" in agent_step
    assert ("COPY", "--from=build /opt/venv /opt/venv") in dockerfile.final_stage()


def shell_expanded(words: str, variables: dict[str, str]) -> list[str]:
    """`words` as /bin/sh expands them (variables, `$(...)`) with only `variables` set, in the
    repository (the build context's files)."""
    result = subprocess.run(["sh", "-c", f"printf '%s\\n' {words}"], capture_output=True, text=True,
                            check=True, cwd=REPO, env={"PATH": os.environ["PATH"], **variables})
    return result.stdout.split()


def test_the_image_builds_its_archives_for_the_target_named_at_build_time():
    """TARGET (default cpu) becomes `build --target`, a value the command accepts, and
    decides whether the build stage installs a C++ compiler: only the cpu target compiles."""
    dockerfile = Dockerfile.read()
    assert dockerfile.build_arguments()["TARGET"] == "cpu"
    (build,) = [arguments for arguments in dockerfile.all("RUN") if "torchserve-vision build" in arguments]
    (install,) = [arguments for arguments in dockerfile.all("RUN")
                  if "openjdk-17-jdk-headless" in arguments]
    packages = install.split("--no-install-recommends", 1)[1].split("&&", 1)[0]
    for target in BUILD_TARGETS:
        assert ("g++" in shell_expanded(packages, {"TARGET": target})) == (target == "cpu")
        program, *argv = shell_expanded(build, {"TARGET": target})
        assert program.endswith("/torchserve-vision")
        assert command_parser().parse_args(argv).target == target


HTTPROUTE_SCHEMA = REPO / "tests" / "schemas" / "gateway-api-v1.6.1-httproute-v1.schema.json"


@pytest.fixture(scope="module")
def httproute_validator() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(closed_schema(json.loads(HTTPROUTE_SCHEMA.read_text())))


def rendered_httproute(capsys: pytest.CaptureFixture[str], *options: str) -> dict[str, Any]:
    """What `models canary --httproute` prints (it changes no server)."""
    capsys.readouterr()
    assert command(["models", "canary", "efficientnet_lite0", "--httproute", *options]) == 0
    return dict(yaml.safe_load(capsys.readouterr().out))


def test_the_canary_httproute_matches_the_gateway_apis_published_schema(httproute_validator, capsys):
    route = rendered_httproute(capsys, "--percent", "10", "--mirror-percent", "5")
    assert [error.message for error in httproute_validator.iter_errors(route)] == []
    split, rest = route["spec"]["rules"]
    assert [(b["name"], b["weight"]) for b in split["backendRefs"]] == [
        ("torchserve-vision", 90), ("torchserve-vision-canary", 10)]
    assert {m["path"]["value"] for m in split["matches"]} == {
        "/predictions/efficientnet_lite0", "/v2/models/efficientnet_lite0/infer"}
    (mirror,) = split["filters"]
    assert mirror["requestMirror"] == {"backendRef": {"name": "torchserve-vision-canary",
                                                      "port": 8080}, "percent": 5}
    assert rest["backendRefs"] == [{"name": "torchserve-vision", "port": 8080}]
    # the Services the route sends the two shares to are the ones the manifests define
    for overlay, name in (("cpu", "torchserve-vision"), ("canary", "torchserve-vision-canary")):
        service = resource(rendered(overlay), "Service")
        assert (service["metadata"]["name"], service["spec"]["ports"][0]["port"]) == (name, 8080)


def pod_selectors(resources: list[dict[str, Any]]) -> list[tuple[str, dict[str, str]]]:
    """Every selector of the overlay's own pods: (where, its labels)."""
    found = []
    for item in resources:
        kind, spec = item["kind"], item["spec"]
        if kind == "Service":
            found.append((kind, spec["selector"]))
        elif kind in ("Deployment", "PodDisruptionBudget", "PodMonitor"):
            found.append((kind, spec["selector"]["matchLabels"]))
        elif kind == "NetworkPolicy":
            found.append((kind, spec["podSelector"]["matchLabels"]))
        if kind == "Deployment":
            found += [("topology spread", spread["labelSelector"]["matchLabels"])
                      for spread in spec["template"]["spec"]["topologySpreadConstraints"]]
    return found


def test_the_canary_and_the_stable_deployment_never_select_each_others_pods():
    """deploy/kubernetes-canary beside deploy/kubernetes: every selector of each takes its own
    pods and never the other's; no name is shared; both let the same operators in."""
    stable, canary = rendered("cpu"), rendered("canary")

    def pod_labels(resources: list[dict[str, Any]]) -> dict[str, str]:
        return dict(resource(resources, "Deployment")["spec"]["template"]["metadata"]["labels"])

    for own, other in ((stable, canary), (canary, stable)):
        assert len(pod_selectors(own)) == 7
        for where, selector in pod_selectors(own):
            assert selector.items() <= pod_labels(own).items(), where
            assert not selector.items() <= pod_labels(other).items(), where
    assert {(r["kind"], r["metadata"]["name"]) for r in stable}.isdisjoint(
        {(r["kind"], r["metadata"]["name"]) for r in canary})
    assert resource(canary, "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]["name"] == \
        resource(canary, "Deployment")["metadata"]["name"]
    assert [resource(r, "NetworkPolicy")["spec"]["ingress"] for r in (stable, canary)] == \
        [resource(stable, "NetworkPolicy")["spec"]["ingress"]] * 2
    assert container(canary)["image"] != container(stable)["image"]


def test_the_schema_refuses_what_the_gateway_would(httproute_validator, capsys):
    route = rendered_httproute(capsys, "--percent", "100")
    assert "filters" not in route["spec"]["rules"][0] and not list(httproute_validator.iter_errors(route))
    wrong = copy.deepcopy(route)
    wrong["spec"]["rules"][0]["backendRefs"][0]["weight"] = 1_000_001   # above the schema's maximum
    assert list(httproute_validator.iter_errors(wrong))
    misspelt = copy.deepcopy(route)
    misspelt["spec"]["rules"][0]["backendRefs"][0]["wieght"] = 1
    assert list(httproute_validator.iter_errors(misspelt))
