"""A rollout's request deadline (`models rollout`, torchserve_vision/cli/models_common.py): carried from
the archive, changed only by --deadline-ms, refused where TorchServe's own batching would drop
expired requests unanswered."""

from __future__ import annotations

import argparse
import json
import zipfile
from pathlib import Path

import pytest
import yaml

from torchserve_vision.cli.models_common import planned_deadline_ms
from torchserve_vision.model_descriptions import ServingSettings
from torchserve_vision.rollout import RolloutError

QUEUED_BASE = ServingSettings(8, 0, 2, 2, 60, batching="queued", deadline_ms=300)


def archive(store: Path, name: str, model_yaml: dict[str, object] | None) -> str:
    """A minimal archive: a manifest, and `model-config.yaml` when `model_yaml` is given."""
    model: dict[str, object] = {"modelName": "m", "modelVersion": "2.0"}
    if model_yaml is not None:
        model["configFile"] = "model-config.yaml"
    with zipfile.ZipFile(store / name, "w") as mar:
        mar.writestr("MAR-INF/MANIFEST.json", json.dumps({"model": model}))
        if model_yaml is not None:
            mar.writestr("model-config.yaml", yaml.safe_dump(model_yaml))
    return name


def rollout_args(store: Path, deadline_ms: int | None = None) -> argparse.Namespace:
    return argparse.Namespace(model_store=store, deadline_ms=deadline_ms)


def test_a_new_archive_brings_its_own_deadline(tmp_path):
    name = archive(tmp_path, "m-2.0.mar", {"continuousBatching": True, "clientTimeoutInMills": 800})
    assert planned_deadline_ms(rollout_args(tmp_path), name, "queued", QUEUED_BASE) == 800
    none = archive(tmp_path, "m-3.0.mar", {"continuousBatching": True})
    assert planned_deadline_ms(rollout_args(tmp_path), none, "queued", QUEUED_BASE) == 0


def test_an_archive_that_cannot_say_keeps_the_current_versions_deadline(tmp_path):
    (tmp_path / "broken.mar").write_bytes(b"not a zip file")
    assert planned_deadline_ms(rollout_args(tmp_path), "broken.mar", "queued", QUEUED_BASE) == 300
    assert planned_deadline_ms(rollout_args(tmp_path), "missing.mar", "queued", QUEUED_BASE) == 300


def test_the_flag_sets_it_and_is_refused_where_it_cannot_be_answered(tmp_path):
    name = archive(tmp_path, "m-2.0.mar", {"continuousBatching": True, "clientTimeoutInMills": 800})
    assert planned_deadline_ms(rollout_args(tmp_path, 250), name, "queued", QUEUED_BASE) == 250
    assert planned_deadline_ms(rollout_args(tmp_path, 0), name, "queued", QUEUED_BASE) == 0
    with pytest.raises(RolloutError, match="0 \\(none\\) or more"):
        planned_deadline_ms(rollout_args(tmp_path, -1), name, "queued", QUEUED_BASE)
    with pytest.raises(RolloutError, match="needs queued batching"):
        planned_deadline_ms(rollout_args(tmp_path, 250), name, "delayed", QUEUED_BASE)
    # Delayed batching has no deadline, whatever the archive or the current version had.
    assert planned_deadline_ms(rollout_args(tmp_path), name, "delayed", QUEUED_BASE) == 0
