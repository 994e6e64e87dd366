"""Run a model archive's handler in-process, as a TorchServe worker would, without a server.

Used by the profiler and benchmarks (the "in-process handler path": JPEG bytes to JSON answer)
and by tests. `LocalContext` stands in for `ts.context.Context`: request headers in,
per-request statuses, content types and headers out.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from handlers.model.model_loading import load_model
from handlers.model.settings import ClassifierSettings, parse_classifier_settings
from handlers.serving import BatchedImageHandler
from torchserve_vision.model_kinds import kind_of_entry_module


class LocalContext:
    def __init__(self, model_dir: str, manifest: dict[str, Any], model_yaml_config: dict[str, Any],
                 batch_size: int = 8, request_headers: list[dict[str, str]] | None = None) -> None:
        self.manifest = manifest
        self.model_yaml_config: dict[str, Any] | None = model_yaml_config
        self._system_properties = {"model_dir": model_dir, "gpu_id": None, "batch_size": batch_size}
        self.request_headers = request_headers or []
        self.statuses: dict[int, tuple[int, str]] = {}
        self.content_types: dict[int, str] = {}
        self.response_headers: dict[int, dict[str, str]] = {}
        self.metrics: Any = None   # TorchServe's metrics cache; a recorder in tests

    @property
    def system_properties(self) -> dict[str, Any]:
        return self._system_properties

    def get_all_request_header(self, idx: int) -> dict[str, str]:
        return dict(self.request_headers[idx]) if idx < len(self.request_headers) else {}

    def set_response_status(self, code: int = 200, phrase: str = "", idx: int = 0) -> None:
        self.statuses[idx] = (code, phrase)

    def set_response_content_type(self, idx: int, value: str) -> None:
        self.content_types[idx] = value

    def set_response_header(self, idx: int, key: str, value: str) -> None:
        self.response_headers.setdefault(idx, {})[key] = value

    def status(self, idx: int) -> int:
        return self.statuses.get(idx, (200, ""))[0]


def extract_archive(mar_path: Path, target: Path) -> Path:
    target.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(mar_path) as archive:
        archive.extractall(target)
    return target


def eager_classifier(model_dir: Path) -> tuple[ClassifierSettings, nn.Module]:
    """A classifier archive's settings and its eager fp32 network (extracted in `model_dir`), on
    the CPU in eval mode and in the archive's memory format: what the lab times and compares."""
    context = archive_context(model_dir)
    settings = parse_classifier_settings((context.model_yaml_config or {})["handler"])
    network = load_model(settings.model, model_dir / context.manifest["model"]["serializedFile"],
                         torch.device("cpu"))
    if settings.channels_last:
        network = network.to(memory_format=torch.channels_last)
    return settings, network


def archive_context(model_dir: Path, batch_size: int = 8,
                    request_headers: list[dict[str, str]] | None = None,
                    gpu_id: int | None = None) -> LocalContext:
    """A context for the extracted archive in `model_dir`, as TorchServe would build it."""
    manifest = json.loads((model_dir / "MAR-INF" / "MANIFEST.json").read_text())
    model_yaml = yaml.safe_load((model_dir / manifest["model"]["configFile"]).read_text())
    context = LocalContext(str(model_dir), manifest, model_yaml, batch_size, request_headers)
    context.system_properties["gpu_id"] = gpu_id
    return context


def load_handler(model_dir: Path, batch_size: int = 8, gpu_id: int | None = None,
                 handler_settings: dict[str, Any] | None = None) -> BatchedImageHandler[Any, Any, Any, Any]:
    """The archive's handler class (from its manifest), initialized on the CPU or `gpu_id`,
    with `handler_settings` over its YAML's `handler:` section."""
    context = archive_context(model_dir, batch_size, gpu_id=gpu_id)
    if handler_settings and context.model_yaml_config is not None:
        section = context.model_yaml_config.setdefault("handler", {})
        section.update(handler_settings)
    handler: BatchedImageHandler[Any, Any, Any, Any] = \
        kind_of_entry_module(context.manifest["model"]["handler"]).handler_class()()
    handler.initialize(context)
    return handler
