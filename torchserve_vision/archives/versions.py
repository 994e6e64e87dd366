"""New versions of an archive in the model store: the same files under another manifest version.

TorchServe keys versions by the manifest's `modelVersion` and fixes batch size and delay at
registration, so new batch settings for the same archive need a new version: a copy of the
archive with only the manifest's version changed.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import yaml

from torchserve_vision.errors import CommandError
from torchserve_vision.model_descriptions import DELAYED, QUEUED, ServingSettings


class ArchiveError(CommandError, RuntimeError):
    """A file in the model store is not a readable model archive."""


def archive_manifest(path: Path) -> dict[str, Any]:
    """The `model` section of an archive's MANIFEST.json (modelName, modelVersion, ...)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return dict(json.loads(archive.read("MAR-INF/MANIFEST.json"))["model"])
    except (OSError, KeyError, zipfile.BadZipFile, ValueError) as error:
        raise ArchiveError(f"{path} is not a readable model archive: {error}") from None


def archive_with_version(store: Path, archive: str, version: str,
                         handler_changes: dict[str, Any] | None = None,
                         frontend_changes: dict[str, Any] | None = None) -> str:
    """Copy `archive` in the model store as `<name>-<version>.mar` with that manifest version
    (and, with `handler_changes`, those top-level keys of its YAML's `handler:` section replaced,
    e.g. {"cache": {...}}: a setting changed without rebuilding or recompiling; with
    `frontend_changes`, those top-level keys of the YAML, e.g. {"asyncCommunication": True}).

    TorchServe fixes batch size and delay at registration and keys versions by the manifest's
    version, so new batch settings for the same archive need a new version: this is it.
    Files that deflate poorly in `archive` (weights, compiled models) are stored, not deflated
    again: a copy of the Lite0 archive takes 0.8 s of a core instead of 3.5 and is 14 % larger
    (`copied_compression`).
    """
    source = store / archive
    manifest = archive_manifest(source)
    target_name = f"{manifest['modelName']}-{version}.mar"
    config_file = manifest.get("configFile")
    with (tempfile.NamedTemporaryFile(dir=store, suffix=".tmp", delete=False) as tmp,
          zipfile.ZipFile(source) as old, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as new):
        for item in old.infolist():
            data = old.read(item.filename)
            if item.filename == "MAR-INF/MANIFEST.json":
                document = json.loads(data)
                document["model"]["modelVersion"] = version
                data = json.dumps(document, indent=2).encode()
            elif (handler_changes or frontend_changes) and item.filename == config_file:
                model_yaml = {**yaml.safe_load(data), **(frontend_changes or {})}
                model_yaml["handler"] = {**model_yaml.get("handler", {}), **(handler_changes or {})}
                data = yaml.safe_dump(model_yaml).encode()
            item.compress_type = copied_compression(item)
            new.writestr(item, data)
    shutil.move(tmp.name, store / target_name)
    return target_name


def copied_compression(item: zipfile.ZipInfo) -> int:
    """How a copy stores `item`: deflated where deflating saved at least half of it (code, YAML
    and labels save 70-95 %), else stored (weights and compiled models save 7-30 %, not worth
    deflating again in each copy)."""
    if item.compress_type == zipfile.ZIP_DEFLATED and item.compress_size < 0.5 * item.file_size:
        return zipfile.ZIP_DEFLATED
    return zipfile.ZIP_STORED


def archive_digest(path: Path) -> str:
    """SHA-256 of the archive file, hex: what a journal records of the archive a change brings."""
    digest = hashlib.sha256()
    with path.open("rb") as archive:
        for chunk in iter(lambda: archive.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def archive_frontend_settings(path: Path) -> dict[str, Any]:
    """The top-level keys of the archive's YAML (what TorchServe's frontend reads); {} for an
    archive without one."""
    config_file = archive_manifest(path).get("configFile")
    if not config_file:
        return {}
    try:
        with zipfile.ZipFile(path) as archive:
            model_yaml = yaml.safe_load(archive.read(config_file)) or {}
    except (OSError, KeyError, zipfile.BadZipFile, yaml.YAMLError) as error:
        raise ArchiveError(f"{path}: its {config_file} is not readable: {error}") from None
    if not isinstance(model_yaml, dict):
        raise ArchiveError(f"{path}: its {config_file} is not a mapping")
    return {key: value for key, value in model_yaml.items() if key != "handler"}


def archive_batching(path: Path) -> str:
    """The archive's batching policy: `queued` when its YAML asks for TorchServe's
    ContinuousBatching, which the frontend agent answers with queued batching; else `delayed`."""
    return QUEUED if archive_frontend_settings(path).get("continuousBatching") else DELAYED


def archive_deadline_ms(path: Path) -> int:
    """The archive's request deadline in ms (its YAML's `clientTimeoutInMills`; 0: none), which
    only queued batching answers."""
    settings = archive_frontend_settings(path)
    return int(settings.get("clientTimeoutInMills") or 0) if settings.get("continuousBatching") else 0


def settings_version(base_version: str, settings: ServingSettings) -> str:
    """`1.0` + batch 16, delay 5 ms -> `1.0-bs16-d5`; queued batching -> `1.0-bs16-q`, with a
    deadline of 800 ms `1.0-bs16-q-t800`, with a queue of its own of 24 `1.0-bs16-q-j24` (a
    previous suffix is replaced)."""
    batching = "q" if settings.batching == QUEUED else f"d{settings.max_batch_delay_ms}"
    deadline = f"-t{settings.deadline_ms}" if settings.deadline_ms else ""
    queue = f"-j{settings.job_queue_size}" if settings.job_queue_size else ""
    return f"{base_version.split('-bs')[0]}-bs{settings.batch_size}-{batching}{deadline}{queue}"
