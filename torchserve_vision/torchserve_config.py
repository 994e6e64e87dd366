"""Read and write TorchServe's `config.properties` (Java properties with `\\` line continuations),
including the `load_models=` / `models=` entries generated from the model descriptions."""

from __future__ import annotations

import json
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torchserve_vision.errors import CommandError
from torchserve_vision.model_descriptions import ModelDescription


class ConfigError(CommandError, RuntimeError):
    """A config file cannot be read or updated as asked."""


def parse_properties(text: str) -> dict[str, str]:
    """Key/value pairs of a Java properties text: `#`/`!` comments, `key=value`, `\\` continuations."""
    properties: dict[str, str] = {}
    logical = ""
    for raw_line in text.splitlines():
        line = raw_line.strip() if not logical else raw_line.lstrip()
        if not logical and (not line or line.startswith(("#", "!"))):
            continue
        if line.endswith("\\"):
            logical += line[:-1]
            continue
        logical += line
        key, _, value = logical.partition("=")
        properties[key.strip()] = value.strip()
        logical = ""
    return properties


def read_properties(path: Path) -> dict[str, str]:
    return parse_properties(path.read_text(encoding="utf-8"))


def models_property(path: Path) -> dict[str, Any]:
    """The parsed `models=` JSON of a config file ({} when absent)."""
    value = read_properties(path).get("models", "")
    return json.loads(value) if value else {}


def render_properties(properties: Mapping[str, str]) -> str:
    """Properties text, one `key=value` per line (values must not contain newlines)."""
    return "".join(f"{key}={value}\n" for key, value in properties.items())


def free_ports(count: int) -> list[int]:
    """`count` TCP ports free on 127.0.0.1 right now."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def server_config(directory: Path, model_store: Path, base_config: Path, **overrides: str) -> Path:
    """`base_config` on free 127.0.0.1 ports, loading from `model_store`, written into
    `directory` (for a second instance beside a running one: tests, benchmarks)."""
    inference, management, metrics, grpc_inference, grpc_management = free_ports(5)
    properties = read_properties(base_config)
    properties.update({
        "inference_address": f"http://127.0.0.1:{inference}",
        "management_address": f"http://127.0.0.1:{management}",
        "metrics_address": f"http://127.0.0.1:{metrics}",
        "grpc_inference_port": str(grpc_inference),
        "grpc_management_port": str(grpc_management),
        "model_store": str(model_store),
    })
    properties.update(overrides)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "config.properties"
    path.write_text(render_properties(properties))
    return path


def started(descriptions: Sequence[ModelDescription]) -> list[ModelDescription]:
    """The models a server loads at start (`start: true`, the default); the others are built
    into the model store and registered on demand."""
    return [description for description in descriptions if description.start]


def models_entry(descriptions: Sequence[ModelDescription]) -> dict[str, Any]:
    """The `models=` JSON TorchServe reads at start: batch and worker settings per model version."""
    entry: dict[str, Any] = {}
    for description in started(descriptions):
        serving = description.serving
        entry.setdefault(description.name, {})[description.version] = {
            "defaultVersion": True,
            "marName": description.archive_name,
            "minWorkers": serving.min_workers,
            "maxWorkers": serving.max_workers,
            "batchSize": serving.batch_size,
            "maxBatchDelay": serving.max_batch_delay_ms,
            "responseTimeout": serving.response_timeout_s,
        }
    return entry


def render_models_block(descriptions: Sequence[ModelDescription]) -> str:
    lines = json.dumps(models_entry(descriptions), indent=2).splitlines()
    names = ",".join(description.archive_name for description in started(descriptions))
    return f"load_models={names}\nmodels=" + "\\\n".join(lines) + "\n"


def write_models_block(config_path: Path, descriptions: Sequence[ModelDescription]) -> None:
    """Replace the `load_models=` and `models=` entries (which must come last) of config_path."""
    text = config_path.read_text(encoding="utf-8")
    start = text.find("\nload_models=")
    if start < 0:
        raise ConfigError(f"{config_path} has no 'load_models=' line to replace")
    config_path.write_text(text[: start + 1] + render_models_block(descriptions), encoding="utf-8")


def config_in_sync(config_path: Path, descriptions: Sequence[ModelDescription]) -> bool:
    return models_property(config_path) == models_entry(descriptions)
