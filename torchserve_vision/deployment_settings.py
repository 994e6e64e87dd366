"""What a deployment changes in a TorchServe config from its environment (a container's `env:`),
and nothing else: the bind address, workers per model, token authorization and the processors
the frontend's JVM sizes itself for. The model store and the health port are flags of `server
run` with environment defaults (see cli/server.py).

Unset variables leave the config as written, so the production config keeps its defaults (token
authorization on, loopback addresses) unless a deployment says otherwise, explicitly.

  TSV_BIND_ADDRESS=0.0.0.0        inference, management and metrics addresses on this host
  TSV_WORKERS=2                   minWorkers = maxWorkers of every model in `models=`
  TSV_TOKEN_AUTHORIZATION=on|off  TorchServe's token authorization
  TSV_JAVA_PROCESSORS=3           the JVM's -XX:ActiveProcessorCount (its GC threads, TorchServe's
                                  Netty threads): a pod's CPU request, not the node's cores

The last is read here rather than written into JAVA_TOOL_OPTIONS as `$(VAR)` in a manifest:
that expansion is Kubernetes' alone (Podman's `kube play` passes it to the JVM as written).
"""

from __future__ import annotations

import ipaddress
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from torchserve_vision.errors import CommandError

ADDRESS_KEYS = ("inference_address", "management_address", "metrics_address")
ENVIRONMENT_VARIABLES = ("TSV_BIND_ADDRESS", "TSV_WORKERS", "TSV_TOKEN_AUTHORIZATION", "TSV_JAVA_PROCESSORS")
SWITCH_VALUES = {"on": True, "true": True, "1": True, "off": False, "false": False, "0": False}


class SettingsError(CommandError, ValueError):
    """An environment variable has a value that cannot be used."""


@dataclass(frozen=True)
class DeploymentSettings:
    bind_address: str | None = None
    workers: int | None = None
    token_authorization: bool | None = None
    java_processors: int | None = None

    @classmethod
    def from_environment(cls, environment: Mapping[str, str] = os.environ) -> DeploymentSettings:
        bind = environment.get("TSV_BIND_ADDRESS", "").strip() or None
        if bind is not None:
            try:
                ipaddress.ip_address(bind)
            except ValueError:
                raise SettingsError(f"TSV_BIND_ADDRESS={bind!r} is not an IP address") from None
        token_text = environment.get("TSV_TOKEN_AUTHORIZATION", "").strip().lower()
        if token_text and token_text not in SWITCH_VALUES:
            raise SettingsError(f"TSV_TOKEN_AUTHORIZATION={token_text!r}: use on or off")
        return cls(bind, positive_whole_number(environment, "TSV_WORKERS"),
                   SWITCH_VALUES[token_text] if token_text else None,
                   positive_whole_number(environment, "TSV_JAVA_PROCESSORS"))

    def apply(self, properties: Mapping[str, str]) -> dict[str, str]:
        """`properties` with these settings applied."""
        changed = dict(properties)
        if self.bind_address is not None:
            host = f"[{self.bind_address}]" if ":" in self.bind_address else self.bind_address
            for key in ADDRESS_KEYS:
                if key in changed:
                    changed[key] = with_host(changed[key], host)
        if self.workers is not None and changed.get("models"):
            models = json.loads(changed["models"])
            for versions in models.values():
                for entry in versions.values():
                    entry["minWorkers"] = entry["maxWorkers"] = self.workers
            changed["models"] = json.dumps(models)
        if self.token_authorization is not None:
            changed["disable_token_authorization"] = "false" if self.token_authorization else "true"
        if self.java_processors is not None:
            option = f"-XX:ActiveProcessorCount={self.java_processors}"
            changed["vmargs"] = " ".join(filter(None, [changed.get("vmargs", ""), option]))
        return changed

    def describe(self) -> str:
        """One line for the log: what the environment changed ("" when nothing)."""
        parts = []
        if self.bind_address is not None:
            parts.append(f"addresses bound to {self.bind_address}")
        if self.workers is not None:
            parts.append(f"{self.workers} workers per model")
        if self.token_authorization is not None:
            parts.append(f"token authorization {'on' if self.token_authorization else 'off'}")
        if self.java_processors is not None:
            parts.append(f"the JVM sized for {self.java_processors} processors")
        return ", ".join(parts)


AS_WRITTEN = DeploymentSettings()  # no changes


def positive_whole_number(environment: Mapping[str, str], name: str) -> int | None:
    text = environment.get(name, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise SettingsError(f"{name}={text!r} is not a positive whole number")
    return int(text)


def with_host(url: str, host: str) -> str:
    parts = urlsplit(url)
    port = f":{parts.port}" if parts.port else ""
    return urlunsplit((parts.scheme, host + port, parts.path, parts.query, parts.fragment))


def local_url(url: str) -> str:
    """The URL this host's own clients use for an address: a wildcard bind is reached on loopback."""
    host = urlsplit(url).hostname or "127.0.0.1"
    if host in ("0.0.0.0", "::"):
        return with_host(url, "127.0.0.1" if host == "0.0.0.0" else "[::1]")
    return url
