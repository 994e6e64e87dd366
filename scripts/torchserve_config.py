"""Read and write TorchServe's `config.properties` (Java properties with `\\` line continuations)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any


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
