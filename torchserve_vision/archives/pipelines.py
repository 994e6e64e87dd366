"""Pipeline archives: models of archives already in the model store ("stages"), in one archive.

A cascade's stages are two classifier archives (`first`, `second`); a detect-then-classify
pipeline's are a detector archive and a classifier archive. Each stage's weights, class names,
compiled packages and `handler:` section are copied as they are into `stages/<role>/` of the new
archive, so the pipeline serves exactly the models that were built and checked on their own
(and the build takes seconds: nothing is compiled again).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import yaml

from handlers.ground.limits import SettingsError
from handlers.model.compiled_model import COMPILED_DIRECTORY
from torchserve_vision.model_descriptions import ModelDescription
from torchserve_vision.model_kinds import kind_of


class PipelineError(ValueError):
    """A pipeline's stages are missing or of the wrong kind."""


def stage_archive_path(description: ModelDescription, role: str, store: Path) -> Path:
    path = store / f"{description.stages[role]}.mar"
    if not path.is_file():
        name = description.stages[role].rsplit("-", 1)[0]
        raise PipelineError(f"{description.name}: stage '{role}' is {path.name}, which is not in "
                            f"{store}; build it first (torchserve-vision build --only {name})")
    return path


def copy_stage(description: ModelDescription, role: str, mar_path: Path,
               target: Path) -> dict[str, Any]:
    """Copy one stage archive's model files into `target`; return its `stages.<role>` section."""
    with tempfile.TemporaryDirectory(prefix="stage-") as tmp, zipfile.ZipFile(mar_path) as archive:
        archive.extractall(tmp)
        unpacked = Path(tmp)
        manifest = json.loads((unpacked / "MAR-INF" / "MANIFEST.json").read_text())["model"]
        stage_task = description.kind.stages[role]
        if Path(manifest.get("handler", "")).name != kind_of(stage_task).entry_module:
            raise PipelineError(f"{description.name}: stage '{role}' must be a "
                                f"{stage_task} archive; {mar_path.name} "
                                f"has the handler {manifest.get('handler')!r}")
        handler = yaml.safe_load((unpacked / manifest["configFile"]).read_text())["handler"]
        target.mkdir(parents=True)
        serialized = manifest["serializedFile"]
        for relative in [serialized, handler["labels_file"]]:
            (target / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(unpacked / relative, target / relative)
        if handler.get("compiled_packages") or handler.get("engine_models"):
            # the compiled models and the probe photos they are checked on
            shutil.copytree(unpacked / COMPILED_DIRECTORY, target / COMPILED_DIRECTORY)
    return {"archive": mar_path.stem, "directory": f"stages/{role}", "serialized_file": serialized,
            "handler": handler}


def pipeline_handler_section(description: ModelDescription, store: Path, extra: Path) -> dict[str, Any]:
    """Copy every stage into `extra/stages/` and return the archive YAML's `handler:` section,
    checked with the handler's own parser."""
    stages = {role: copy_stage(description, role, stage_archive_path(description, role, store),
                               extra / "stages" / role)
              for role in description.stages}
    section = {**description.handler_options, "stages": stages}
    try:
        description.kind.parse_settings(section)
    except SettingsError as error:
        raise PipelineError(f"{description.name}: {error}") from None
    if description.kind.stages_share_classes:
        labels = [json.loads((extra / "stages" / role / stages[role]["handler"]["labels_file"]).read_text())
                  for role in stages]
        if any(other != labels[0] for other in labels[1:]):
            raise PipelineError(f"{description.name}: the cascade's stages have different classes")
    return section
