"""How KServe v0.20.0 builds the predictor's container from a ServingRuntime and an
InferenceService (`MergeRuntimeContainers` in pkg/controller/v1beta1/inferenceservice/utils/
utils.go, `MergeContainerWithPatch` in pkg/utils/container_merge.go): the InferenceService's
container is a strategic merge patch on the runtime's (lists with a merge key merged by it,
objects and maps merged field by field, other lists and scalars replaced), then `args` are the
runtime's followed by the InferenceService's. Enough of Kubernetes' strategic merge for a
container, which is all KServe merges here."""

from __future__ import annotations

import copy
import re
from typing import Any

# corev1.Container's lists that strategic merge joins by a key (patchMergeKey in the API types).
MERGE_KEYS = {"env": "name", "ports": "containerPort", "volumeMounts": "mountPath",
              "volumeDevices": "devicePath", "envFrom": None}
# Fields of an InferenceService's `predictor.model` that are not the container's.
MODEL_FIELDS = {"modelFormat", "runtime", "protocolVersion", "storageUri", "storage"}


def strategic_merge(base: Any, patch: Any, key: str | None = None) -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = copy.deepcopy(base)
        for name, value in patch.items():
            if value is None:
                merged.pop(name, None)
            elif name in merged:
                merged[name] = strategic_merge(merged[name], value, name)
            else:
                merged[name] = copy.deepcopy(value)
        return merged
    if isinstance(base, list) and isinstance(patch, list) and MERGE_KEYS.get(key or ""):
        merge_key = MERGE_KEYS[key or ""]
        merged_list = copy.deepcopy(base)
        for item in patch:
            at = next((i for i, old in enumerate(merged_list)
                       if old.get(merge_key) == item.get(merge_key)), None)
            if at is None:
                merged_list.append(copy.deepcopy(item))
            else:
                merged_list[at] = strategic_merge(merged_list[at], item)
        return merged_list
    return copy.deepcopy(patch)


def merged_container(runtime_container: dict[str, Any], isvc_container: dict[str, Any]) -> dict[str, Any]:
    merged = strategic_merge(runtime_container, isvc_container)
    merged["args"] = [*runtime_container.get("args", []), *isvc_container.get("args", [])]
    if not merged["args"]:
        del merged["args"]
    return merged


def isvc_container(model: dict[str, Any]) -> dict[str, Any]:
    """The container part of an InferenceService's `predictor.model` (KServe names it
    kserve-container)."""
    return {"name": "kserve-container", **{k: v for k, v in model.items() if k not in MODEL_FIELDS}}


def quantity(text: str | int | float) -> float:
    """A Kubernetes quantity as a number (cores, bytes)."""
    match = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(text))
    assert match, text
    number, unit = float(match[1]), match[2]
    scale = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}[unit]
    return number * scale


def resource_problems(container: dict[str, Any]) -> list[str]:
    """What the API server refuses in a container's resources (a request above its limit)."""
    resources = container.get("resources", {})
    requests, limits = resources.get("requests", {}), resources.get("limits", {})
    return [f"{name}: request {requests[name]} > limit {limit}" for name, limit in limits.items()
            if name in requests and quantity(requests[name]) > quantity(limit)]
