"""docs/kubernetes.md checked command by command, offline: every shell command of its `bash`
blocks and every command in its inline code is read as the program it runs would read it, and
what it names is checked against the repository (files, overlays, the Dockerfile's build
arguments, the rendered manifests' names, labels and ports, the adapter's metrics, the served
models); `torchserve-vision` commands are parsed by the command's own parser. Its YAML blocks
are patches for an overlay: applied with kustomize and validated strictly. A command of a
program the checks do not know fails the test, so nothing on the page goes unchecked."""

from __future__ import annotations

import copy
import functools
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from tests.deployment_files import (
    DEPLOY,
    KUBECTL,
    OVERLAYS,
    REPO,
    Dockerfile,
    container,
    image_check_script,
    rendered,
    resource,
)
from torchserve_vision import paths
from torchserve_vision.cli import command_parser
from torchserve_vision.model_descriptions import load_descriptions

DOC = REPO / "docs" / "kubernetes.md"
IMAGE_CHECK = image_check_script()
ADAPTER_VALUES = DEPLOY / "prometheus-adapter" / "values.yaml"
SHELL_OPERATORS = {"&&", "|", ";", "||"}
CUSTOM_METRICS = re.compile(r"^/apis/custom\.metrics\.k8s\.io/v1beta1/namespaces/([^/]+)/pods/\*/([^/]+)$")
PROBE_PORT = 8090


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, re.S)


def yaml_blocks(text: str) -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", text, re.S)


def inline_commands(text: str) -> list[str]:
    """Commands in inline code outside the fenced blocks (e.g. the troubleshooting table): a
    program and at least two words, or curl and its URL (`kubectl logs` alone names the tool, it
    is no command)."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return [code.replace("\\|", "|")
            for code in re.findall(r"`(curl [^`]+|(?:kubectl|docker|helm|kustomize)(?: [^` ]+){2,})`", prose)]


def simple_commands(script: str) -> list[list[str]]:
    """The simple commands of a shell script: continuations joined, comments dropped, split at
    `&&`, `|`, `;`; a subshell's parentheses removed."""
    commands: list[list[str]] = []
    for line in re.sub(r"\\\n\s*", " ", script).splitlines():
        words = [word for word in shlex.split(line, comments=True)]
        current: list[str] = []
        for word in words:
            if word in SHELL_OPERATORS:
                commands.append(current)
                current = []
                continue
            current.append(word.removeprefix("(") if not current else word.removesuffix(")"))
        commands.append(current)
    return [command for command in commands if command]


@dataclass
class Cluster:
    """What the page has set up so far, as the commands run in order."""
    variables: dict[str, str] = field(default_factory=dict)
    directory: Path = REPO
    built_images: set[str] = field(default_factory=set)
    helm_repositories: set[str] = field(default_factory=set)
    monitoring_namespace: str | None = None
    forwarded_ports: set[int] = field(default_factory=set)


@functools.cache
def rendered_once() -> dict[str, list[dict[str, Any]]]:
    return {name: rendered(name) for name in OVERLAYS}


def manifests() -> dict[str, list[dict[str, Any]]]:
    """Every overlay's resources, rendered by kubectl once per test process (a second each); each
    checker gets its own copy."""
    return copy.deepcopy(rendered_once())


class DocChecker:
    """`check(words)` returns what is wrong with one command (empty: nothing)."""

    def __init__(self) -> None:
        self.cluster = Cluster()
        self.rendered = manifests()
        self.cpu = self.rendered["cpu"]
        self.adapter = yaml.safe_load(ADAPTER_VALUES.read_text())
        self.build_argument_defaults = Dockerfile.read().build_arguments()
        self.build_arguments = set(self.build_argument_defaults)
        self.checks: dict[str, Callable[[list[str]], list[str]]] = {
            "cd": self.cd, "docker": self.docker, "podman": self.docker, "kustomize": self.kustomize,
            "helm": self.helm, "kubectl": self.kubectl, "curl": self.curl,
            "torchserve-vision": self.torchserve_vision, "bash": self.bash, "grep": lambda words: [],
        }

    def check(self, words: list[str]) -> list[str]:
        words = [self.expanded(word) for word in words]
        if re.fullmatch(r"[A-Z_]+=\S+", words[0]) and len(words) == 1:
            name, _, value = words[0].partition("=")
            self.cluster.variables[name] = value
            return []
        check = self.checks.get(words[0])
        if check is None:
            return [f"no check for the program of {shlex.join(words)}"]
        try:
            problems = check(words)
        except (IndexError, ValueError, StopIteration):
            problems = ["incomplete: an argument the check reads is missing"]
        return [f"{shlex.join(words)}: {problem}" for problem in problems]

    def expanded(self, word: str) -> str:
        for name, value in self.cluster.variables.items():
            word = word.replace(f"${name}", value)
        return word

    # --- the programs ---------------------------------------------------------------------
    def cd(self, words: list[str]) -> list[str]:
        target = REPO / words[1]
        self.cluster.directory = target
        return [] if target.is_dir() else [f"{words[1]} is not a directory"]

    def bash(self, words: list[str]) -> list[str]:
        """A script of the repository; image-check.sh's arguments as its parser reads them."""
        script = REPO / words[1]
        if not script.is_file() or script.parent != REPO / "scripts":
            return [f"{words[1]} is not a script of scripts/"]
        if script.name == "image-check.sh":
            try:
                IMAGE_CHECK.arguments(words[2:])
            except SystemExit:
                return ["arguments scripts/image_check.py refuses"]
        return []

    def docker(self, words: list[str]) -> list[str]:
        """docker and podman: the same build command line."""
        if words[1] == "push":
            return [] if words[2] in self.cluster.built_images else ["pushes an image not built above"]
        if words[1:4] == ["buildx", "imagetools", "inspect"]:
            base = self.build_argument_defaults["PYTHON_IMAGE"]
            return [] if words[4] == base else [f"{words[4]} is not the base image, {base}"]
        if words[1] != "build":
            return [f"{words[0]} {words[1]} is not checked"]
        problems = []
        dockerfile = words[words.index("-f") + 1]
        if not (REPO / dockerfile).is_file():
            problems.append(f"{dockerfile} does not exist")
        named = {words[i + 1].partition("=")[0] for i, word in enumerate(words) if word == "--build-arg"}
        if not named <= self.build_arguments:
            problems.append(f"build arguments not in the Dockerfile: {named - self.build_arguments}")
        tag = words[words.index("-t") + 1]
        if tag.endswith("-gpu") and "TARGET=gpu" not in words:
            problems.append("a GPU image must be built with TARGET=gpu")
        self.cluster.built_images.add(tag)
        return problems

    def kustomize(self, words: list[str]) -> list[str]:
        if words[1:4] != ["edit", "set", "image"]:
            return [f"kustomize {' '.join(words[1:3])} is not checked"]
        overlays = {path: name for name, path in OVERLAYS.items()}
        overlay = overlays.get(self.cluster.directory)
        if overlay is None:
            return [f"{self.cluster.directory} is not an overlay"]
        name = re.split(r"[=:]", words[4], maxsplit=1)[0]
        image = container(self.rendered[overlay])["image"].rsplit(":", 1)[0]
        problems = [] if name == image else [f"image {name!r} is not the manifests' {image!r}"]
        if "=" in words[4] and words[4].partition("=")[2] not in self.cluster.built_images:
            problems.append("sets an image not built above")
        return problems

    def helm(self, words: list[str]) -> list[str]:
        if words[1:3] == ["repo", "add"]:
            self.cluster.helm_repositories.add(words[3])
            return [] if words[4].startswith("https://") else ["a chart repository over https"]
        if words[1] != "install":
            return [f"helm {words[1]} is not checked"]
        problems = []
        chart = words[3]
        if chart.split("/")[0] not in self.cluster.helm_repositories:
            problems.append(f"{chart}: its repository was not added above")
        namespace = words[words.index("--namespace") + 1]
        for index, word in enumerate(words):
            if word == "-f" and not (REPO / words[index + 1]).is_file():
                problems.append(f"{words[index + 1]} does not exist")
        if chart.endswith("/kube-prometheus-stack"):
            self.cluster.monitoring_namespace = namespace
            pod_monitor = resource(self.cpu, "PodMonitor")
            if ("release" not in pod_monitor["metadata"].get("labels", {})
                    and "prometheus.prometheusSpec.podMonitorSelectorNilUsesHelmValues=false" not in words):
                problems.append("the chart's Prometheus would ignore the unlabelled PodMonitor")
            rule = resource(self.cpu, "PrometheusRule")
            if ("release" not in rule["metadata"].get("labels", {})
                    and "prometheus.prometheusSpec.ruleSelectorNilUsesHelmValues=false" not in words):
                problems.append("the chart's Prometheus would ignore the unlabelled PrometheusRule")
        if chart.endswith("/prometheus-adapter"):
            host = urlsplit(self.adapter["prometheus"]["url"]).hostname or ""
            if host.split(".")[1:2] != [namespace]:
                problems.append(f"the adapter's values look for Prometheus in {host}, not in {namespace}")
        return problems

    def kubectl(self, words: list[str]) -> list[str]:
        verb, rest = words[1], words[2:]
        named = {"apply": self.kubectl_apply, "delete": self.kubectl_apply, "label": self.kubectl_label,
                 "rollout": self.kubectl_rollout, "get": self.kubectl_get, "logs": self.kubectl_logs,
                 "port-forward": self.kubectl_port_forward, "describe": self.kubectl_describe}
        if verb not in named:
            return [f"kubectl {verb} is not checked"]
        return named[verb](rest)

    def kubectl_apply(self, rest: list[str]) -> list[str]:
        if rest[0] == "-k":
            return [] if REPO / rest[1] in OVERLAYS.values() else [f"{rest[1]} is not an overlay"]
        if rest[:2] == ["-f", "-"]:
            return []
        return [] if (REPO / rest[1]).is_file() else [f"{rest[1]} does not exist"]

    def kubectl_label(self, rest: list[str]) -> list[str]:
        namespace, label = rest[1], rest[2]
        key, _, value = label.partition("=")
        selector = resource(self.cpu, "NetworkPolicy")["spec"]["ingress"]
        labels = {k: v for rule in selector for peer in rule.get("from", [])
                  for k, v in peer.get("namespaceSelector", {}).get("matchLabels", {}).items()}
        problems = [] if labels.get(key) == value else [f"{label} is no label the NetworkPolicy admits"]
        if namespace != self.cluster.monitoring_namespace:
            problems.append(f"{namespace} is not where Prometheus was installed")
        return problems

    def kubectl_rollout(self, rest: list[str]) -> list[str]:
        return self.names_the_deployment(rest[1])

    def names_the_deployment(self, reference: str) -> list[str]:
        if reference.startswith("<"):
            return []
        kind, _, name = reference.partition("/")
        names = {r["metadata"]["name"] for resources in self.rendered.values() for r in resources
                 if r["kind"] == "Deployment"}
        return [] if kind == "deployment" and name in names else [f"{reference} is no Deployment here"]

    def kubectl_get(self, rest: list[str]) -> list[str]:
        if rest[0] == "--raw":
            match = CUSTOM_METRICS.match(rest[1])
            if match is None:
                return [f"{rest[1]} is not a custom metrics path"]
            namespace, metric = match.groups()
            metrics = {rule["name"]["as"] for rule in self.adapter["rules"]["custom"]}
            problems = [] if metric in metrics else [f"{metric} is not an adapter metric"]
            if namespace != (self.cpu[0]["metadata"].get("namespace") or "default"):
                problems.append(f"the pods are not in {namespace}")
            return problems
        if rest[0] == "hpa":
            return [] if rest[1] == resource(self.cpu, "HorizontalPodAutoscaler")["metadata"]["name"] \
                else [f"{rest[1]} is not the HPA"]
        if rest[0] == "pods":
            key, _, value = rest[rest.index("-l") + 1].partition("=")
            template = resource(self.cpu, "Deployment")["spec"]["template"]["metadata"]["labels"]
            return [] if template.get(key) == value else ["the label selects none of the pods"]
        return [] if rest[0] == "nodes" else [f"kubectl get {rest[0]} is not checked"]

    def kubectl_logs(self, rest: list[str]) -> list[str]:
        return self.names_the_deployment(rest[0])

    def kubectl_describe(self, rest: list[str]) -> list[str]:
        return [] if rest[0] == "pod" else [f"kubectl describe {rest[0]} is not checked"]

    def kubectl_port_forward(self, rest: list[str]) -> list[str]:
        target, (local, remote) = rest[0], map(int, rest[1].split(":"))
        self.cluster.forwarded_ports.add(local)
        if target.startswith("service/"):
            service = resource(self.cpu, "Service")
            ports = {port["port"] for port in service["spec"]["ports"]}
            if target.removeprefix("service/") != service["metadata"]["name"] or remote not in ports:
                return [f"{rest[0]} {rest[1]} is not a port of the Service"]
            return []
        ports = {port["containerPort"] for port in container(self.cpu)["ports"]}
        return [] if target.startswith("pod/") and remote in ports else [f"{rest[1]}: no such pod port"]

    def curl(self, words: list[str]) -> list[str]:
        url = urlsplit(next(word for word in words if word.startswith("http")))
        if url.port not in self.cluster.forwarded_ports:
            return [f"nothing forwarded to port {url.port}"]
        if url.port == PROBE_PORT:
            return [] if url.path in ("/ready", "/live") else [f"{url.path} is not a probe"]
        served = {d.name for d in load_descriptions(paths.MODEL_DESCRIPTIONS) if d.start}
        model = url.path.removeprefix("/predictions/")
        return [] if model in served else [f"{url.path}: {model} is not served"]

    def torchserve_vision(self, words: list[str]) -> list[str]:
        command_parser().parse_args(words[1:])       # exits (SystemExit) on an unknown flag
        return []


def doc_problems(text: str) -> list[str]:
    checker = DocChecker()
    problems = []
    for script in [*bash_blocks(text), *inline_commands(text)]:
        for words in simple_commands(script):
            problems += checker.check(words)
    return problems


def test_every_command_on_the_page_names_what_the_repository_has():
    text = DOC.read_text()
    assert len(bash_blocks(text)) >= 8 and len(inline_commands(text)) >= 3
    assert doc_problems(text) == []


@pytest.mark.parametrize("wrong, right", [
    ("kubectl rollout status deployment/torchserve-vision ", "kubectl rollout status deployment/torchserve "),
    ("pods/*/ts_requests_waiting", "pods/*/ts_requests_queued"),
    ("kubectl label namespace monitoring torchserve-vision/metrics-scraper=true",
     "kubectl label namespace monitoring prometheus=true"),
    ("podMonitorSelectorNilUsesHelmValues=false", "podMonitorSelectorNilUsesHelmValues=true"),
    ("ruleSelectorNilUsesHelmValues=false", "ruleSelectorNilUsesHelmValues=true"),
    ("--build-arg TARGET=gpu", "--build-arg TARGETS=gpu"),
    ("/predictions/efficientnet_lite0", "/predictions/resnet50"),
    ("service/torchserve-vision 8080:8080", "service/torchserve-vision 8080:80"),
    ("kubectl apply -k deploy/kubernetes\n", "kubectl apply -k deploy/k8s\n"),
    ("bash scripts/image-check.sh --base", "bash scripts/image-check.sh --base-image"),
    ("bash scripts/debian-base-image.sh", "bash scripts/debian-base.sh"),
])
def test_a_wrong_name_on_the_page_is_found(wrong, right):
    text = DOC.read_text()
    assert wrong in text
    assert doc_problems(text.replace(wrong, right, 1))


def dockerfile_builds() -> list[str]:
    """The `docker build` commands of the Dockerfile's own header comment, continuations kept."""
    comments = "\n".join(line.lstrip("#").strip() for line in (DEPLOY / "Dockerfile").read_text().splitlines()
                         if line.startswith("#"))
    return re.findall(r"docker build (?:[^\n]*\\\n)*[^\n]*", comments)


def test_the_dockerfiles_own_build_commands_pass_the_same_checks():
    builds = dockerfile_builds()
    assert len(builds) >= 2 and any("-gpu" in build for build in builds)
    assert doc_problems("```bash\n" + "\n".join(builds) + "\n```\n") == []


def test_a_program_the_checks_do_not_know_fails_the_page():
    assert doc_problems("```bash\nterraform apply\n```\n") == ["no check for the program of terraform apply"]


def test_every_manifest_on_the_page_patches_the_gpu_overlay_into_valid_kubernetes(tmp_path):
    blocks = yaml_blocks(DOC.read_text())
    assert blocks
    shutil.copytree(DEPLOY, tmp_path / "deploy")
    for index, block in enumerate(blocks):
        overlay = tmp_path / "deploy" / f"patched-{index}"
        overlay.mkdir()
        (overlay / "patch.yaml").write_text(block)
        (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": [f"../{OVERLAYS['gpu'].name}"], "patches": [{"path": "patch.yaml"}]}))
        result = subprocess.run([str(KUBECTL), "kustomize", str(overlay)], capture_output=True,
                                text=True, check=True, timeout=120)
        resources = [document for document in yaml.safe_load_all(result.stdout) if document]
        patch = yaml.safe_load(block)
        patched = resource(resources, patch["kind"])
        assert patched["spec"]["template"]["spec"]["runtimeClassName"] == "nvidia"
        kubernetes_validate.validate(patched, "1.36.0", strict=True)
