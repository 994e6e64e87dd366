"""Candidate versions for the shadow and canary tests, made from the served archive."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

from torchserve_vision.archives.versions import archive_with_version


def reversed_labels_copy(store: Path, archive: str, version: str) -> str:
    """A copy of `archive` as `version` whose labels.json lists the class names in reverse."""
    copy = archive_with_version(store, archive, version)
    source = store / copy
    target = source.with_suffix(".tmp")
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as new:
        for item in old.infolist():
            data = old.read(item.filename)
            if item.filename == "labels.json":
                data = json.dumps(list(reversed(json.loads(data)))).encode()
            new.writestr(item, data)
    target.replace(source)
    return copy
