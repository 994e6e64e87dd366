"""Architectures defined in this project, by the name `config/models.yaml` gives them under
`source: project` (built untrained; the archive's state dict fills them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from handlers.ground.limits import SettingsError
from handlers.model import tf_ssd_mobilenet

PROJECT_ARCHITECTURES: dict[str, Callable[..., nn.Module]] = {
    tf_ssd_mobilenet.ARCHITECTURE: tf_ssd_mobilenet.ssd_mobilenet_v2_tf,
}


def create_project_architecture(name: str, **kwargs: Any) -> nn.Module:
    """The untrained network `name`; SettingsError for a name this project does not define."""
    if name not in PROJECT_ARCHITECTURES:
        raise SettingsError(f"unknown project architecture {name!r}; "
                            f"known: {', '.join(PROJECT_ARCHITECTURES)}")
    return PROJECT_ARCHITECTURES[name](**kwargs)
