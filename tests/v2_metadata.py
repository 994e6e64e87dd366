"""Checking a v2 answer against the model's v2 metadata (the handler's `describe()["v2"]`)."""

from __future__ import annotations

from typing import Any


def assert_outputs_follow_metadata(outputs: list[dict[str, Any]], metadata: dict[str, Any],
                                   images: int) -> None:
    """Every output is declared (name, datatype, rank, fixed sides), leads with the number of
    images, and every declared output but the `_shapes` ones is present."""
    declared = {output["name"]: output for output in metadata["outputs"]}
    for output in outputs:
        spec = declared.get(output["name"])
        assert spec is not None, f"{output['name']} is not in the metadata {sorted(declared)}"
        assert output["datatype"] == spec["datatype"], output["name"]
        assert len(output["shape"]) == len(spec["shape"]), output["name"]
        assert output["shape"][0] == images, output["name"]
        for side, declared_side in zip(output["shape"], spec["shape"], strict=True):
            assert declared_side in (-1, side), (output["name"], output["shape"], spec["shape"])
    always = {name for name in declared if not name.endswith("_shapes")}
    assert always <= {output["name"] for output in outputs}
    assert metadata["inputs"] == [{"name": "image", "datatype": "BYTES", "shape": [-1]}]
