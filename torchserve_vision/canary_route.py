"""The canary split for Kubernetes: a Gateway API HTTPRoute (gateway.networking.k8s.io/v1, as of
Gateway API v1.6) that sends a share of a model's unversioned requests to the candidate's
Service and the rest to the stable one, the same policy the front applies on one machine
(torchserve_vision.canary).

The stable and the candidate are two Deployments of the same manifests with their own image tag
(a new version is a new image: docs/kubernetes.md), each behind its Service, each serving its
version as the model's default. Only `/predictions/{model}` and `/v2/models/{model}/infer` are
split; everything else (versioned requests, health, metadata, other models) goes to the stable
Service. With `mirror_percent`, the Gateway also copies that share of the stable requests to
the candidate (its RequestMirror filter): the Gateway discards the candidate's answers, so
nothing is compared; the comparing shadow is the workers' (`models shadow`, docs/rollouts.md).
"""

from __future__ import annotations

from typing import Any

INFERENCE_PORT = 8080


def backend(service: str, weight: int | None = None) -> dict[str, Any]:
    reference: dict[str, Any] = {"name": service, "port": INFERENCE_PORT}
    if weight is not None:
        reference["weight"] = weight
    return reference


def canary_httproute(model: str, gateway: str, stable_service: str, canary_service: str,
                     percent: int, mirror_percent: int = 0) -> dict[str, Any]:
    """The HTTPRoute: `percent` % (0..100) of `model`'s unversioned requests to
    `canary_service`, the rest to `stable_service`; `mirror_percent` % of the stable share copied
    to the candidate. ValueError for a percent outside 0..100."""
    for name, value in (("percent", percent), ("mirror_percent", mirror_percent)):
        if not 0 <= value <= 100:
            raise ValueError(f"{name} must be in [0, 100], got {value}")
    split: dict[str, Any] = {
        "matches": [{"path": {"type": "Exact", "value": f"/predictions/{model}"}},
                    {"path": {"type": "Exact", "value": f"/v2/models/{model}/infer"}}],
        "backendRefs": [backend(stable_service, 100 - percent), backend(canary_service, percent)]}
    if mirror_percent:
        split["filters"] = [{"type": "RequestMirror",
                             "requestMirror": {"backendRef": backend(canary_service),
                                               "percent": mirror_percent}}]
    rest = {"matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
            "backendRefs": [backend(stable_service)]}
    return {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
            "metadata": {"name": f"{model.replace('_', '-')}-canary",
                         "labels": {"app.kubernetes.io/name": "torchserve-vision"}},
            "spec": {"parentRefs": [{"name": gateway}], "rules": [split, rest]}}
