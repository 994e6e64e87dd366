"""The table of model kinds is complete: every kind names an entry module with its one handler
class, a settings parser, a frozen options dataclass that the handler parses, and stages of
kinds that exist."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from pathlib import Path

import pytest

import handlers
from handlers.serving import BatchedImageHandler
from torchserve_vision.model_kinds import (
    KINDS,
    UnknownKind,
    import_attribute,
    kind_of,
    kind_of_entry_module,
)

HANDLERS = Path(handlers.__file__).parent


@pytest.mark.parametrize("task", sorted(KINDS))
def test_every_kind_is_complete(task):
    kind = KINDS[task]
    assert (HANDLERS / kind.entry_module).is_file()
    handler = kind.handler_class()
    assert issubclass(handler, BatchedImageHandler) and not inspect.isabstract(handler)
    assert Path(inspect.getfile(handler)).name == kind.entry_module
    assert callable(import_attribute(kind.settings_parser))
    options = kind.options_type()
    assert dataclasses.is_dataclass(options) and options.__dataclass_params__.frozen  # type: ignore[attr-defined]
    assert typing.get_type_hints(handler.parse_options)["return"] is options
    assert kind_of_entry_module(f"/tmp/models/abc/{kind.entry_module}") is kind
    assert (kind.network is None) == kind.is_pipeline
    for stage_task in kind.stages.values():
        assert not KINDS[stage_task].is_pipeline


@pytest.mark.parametrize("task", sorted(KINDS))
def test_every_kind_refuses_an_empty_handler_section(task):
    from handlers.ground.limits import SettingsError

    with pytest.raises(SettingsError):
        KINDS[task].parse_settings({})


def test_an_unknown_kind_says_which_exist():
    with pytest.raises(UnknownKind, match="classification"):
        kind_of("segmentation")
    with pytest.raises(UnknownKind):
        kind_of_entry_module("my_handler.py")


@pytest.mark.parametrize("task", sorted(task for task, kind in KINDS.items() if kind.is_pipeline))
def test_a_pipelines_stage_roles_are_its_settings_stages(task):
    """The handler's settings (shipped alone in the archive, so they cannot read this table)
    hold one stage per role the table names."""
    from handlers.model.pipeline_settings import StageArchive

    kind = KINDS[task]
    settings_type = typing.get_type_hints(import_attribute(kind.settings_parser))["return"]
    hints = typing.get_type_hints(settings_type)
    assert {role for role in kind.stages if hints.get(role) is StageArchive} == set(kind.stages)
