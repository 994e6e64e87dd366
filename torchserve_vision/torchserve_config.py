"""Read and write TorchServe's `config.properties` (Java properties with `\\` line continuations),
including the `load_models=` / `models=` entries generated from the model descriptions."""

from __future__ import annotations

import json
import os
import random
import socket
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torchserve_vision.errors import CommandError
from torchserve_vision.model_descriptions import ModelDescription


class ConfigError(CommandError, RuntimeError):
    """A config file cannot be read or updated as asked."""


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


# Where the kernel takes the local ports of outgoing connections (Linux's default is 32768-60999).
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_CHOSEN_PORT = 15000       # well above the usual fixed services' ports (8080, 9090, 6379, ...)
# "INDEX/COUNT": this process draws its ports from the INDEX-th of COUNT equal parts of the range,
# so that processes started side by side (the test run's, which set it) never draw the same one.
PORT_SHARE_VARIABLE = "TSV_FREE_PORT_SHARE"
# The ports this process handed out lately: each is bound only when its server starts, seconds
# later, and until then a later call could draw it again.
HANDED_OUT: deque[int] = deque(maxlen=2000)


def ephemeral_range_start(range_file: Path = EPHEMERAL_RANGE_FILE) -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        return int(range_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def chosen_range(share: str | None = None, range_file: Path = EPHEMERAL_RANGE_FILE) -> range:
    """The ports free_ports draws from: LOWEST_CHOSEN_PORT up to the start of the kernel's
    ephemeral range, or this process's share of them (`share`, else PORT_SHARE_VARIABLE's
    value: "INDEX/COUNT"). ConfigError for a share that is not one."""
    ports = range(LOWEST_CHOSEN_PORT, ephemeral_range_start(range_file))
    share = os.environ.get(PORT_SHARE_VARIABLE) if share is None else share
    if not share:
        return ports
    try:
        index, count = (int(part) for part in share.split("/"))
    except ValueError:
        raise ConfigError(f"{PORT_SHARE_VARIABLE}={share!r} is not INDEX/COUNT") from None
    if not 0 <= index < count:
        raise ConfigError(f"{PORT_SHARE_VARIABLE}={share!r}: INDEX must be from 0 to COUNT - 1")
    size = len(ports) // count
    return ports[index * size:(index + 1) * size]


def free_ports(count: int, ports: range | None = None) -> list[int]:
    """`count` distinct TCP ports free on 127.0.0.1 right now, none handed out by this process
    lately (HANDED_OUT), chosen at random from `ports` (default: chosen_range()). A port of the
    ephemeral range, as binding port 0 gives, can become the local end of any outgoing connection
    in the seconds before the server binds it: a test pod's TorchServe once failed to start with
    its management port 'already in use' that way. Another draw of this process, or of another
    process drawing from the same range, could take a port in those seconds too (a test pod's
    gRPC port was found in use once): hence HANDED_OUT and the shares of PORT_SHARE_VARIABLE.
    Where `ports` are fewer than 1,000, the kernel's choice (port 0) is taken instead."""
    ports = chosen_range() if ports is None else ports
    if len(ports) < 1000:
        return free_ports_from_kernel(count)
    draw = random.SystemRandom()
    chosen: list[int] = []
    for _ in range(100 * count):
        port = draw.choice(ports)
        if port not in chosen and port not in HANDED_OUT and port_free(port):
            chosen.append(port)
            if len(chosen) == count:
                HANDED_OUT.extend(chosen)
                return chosen
    raise ConfigError(f"fewer than {count} free ports on 127.0.0.1 from {ports.start} to {ports.stop - 1}")


def port_free(port: int) -> bool:
    """Whether a listening socket could bind `port` on 127.0.0.1 now."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports_from_kernel(count: int) -> list[int]:
    """`count` ports the kernel hands out for port 0 (from its ephemeral range)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def server_config(directory: Path, model_store: Path, base_config: Path, **overrides: str) -> Path:
    """`base_config` on free 127.0.0.1 ports, loading from `model_store`, written into
    `directory` (for a second instance beside a running one: tests, benchmarks)."""
    inference, management, metrics, grpc_inference, grpc_management = free_ports(5)
    properties = read_properties(base_config)
    properties.update({
        "inference_address": f"http://127.0.0.1:{inference}",
        "management_address": f"http://127.0.0.1:{management}",
        "metrics_address": f"http://127.0.0.1:{metrics}",
        "grpc_inference_port": str(grpc_inference),
        "grpc_management_port": str(grpc_management),
        "model_store": str(model_store),
    })
    properties.update(overrides)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "config.properties"
    path.write_text(render_properties(properties))
    return path


def started(descriptions: Sequence[ModelDescription]) -> list[ModelDescription]:
    """The models a server loads at start (`start: true`, the default); the others are built
    into the model store and registered on demand."""
    return [description for description in descriptions if description.start]


def models_entry(descriptions: Sequence[ModelDescription]) -> dict[str, Any]:
    """The `models=` JSON TorchServe reads at start: batch and worker settings per model version."""
    entry: dict[str, Any] = {}
    for description in started(descriptions):
        serving = description.serving
        entry.setdefault(description.name, {})[description.version] = {
            "defaultVersion": True,
            "marName": description.archive_name,
            "minWorkers": serving.min_workers,
            "maxWorkers": serving.max_workers,
            "batchSize": serving.batch_size,
            "maxBatchDelay": serving.max_batch_delay_ms,
            "responseTimeout": serving.response_timeout_s,
        }
    return entry


def render_models_block(descriptions: Sequence[ModelDescription]) -> str:
    lines = json.dumps(models_entry(descriptions), indent=2).splitlines()
    names = ",".join(description.archive_name for description in started(descriptions))
    return f"load_models={names}\nmodels=" + "\\\n".join(lines) + "\n"


def write_models_block(config_path: Path, descriptions: Sequence[ModelDescription]) -> None:
    """Replace the `load_models=` and `models=` entries (which must come last) of config_path."""
    text = config_path.read_text(encoding="utf-8")
    start = text.find("\nload_models=")
    if start < 0:
        raise ConfigError(f"{config_path} has no 'load_models=' line to replace")
    config_path.write_text(text[: start + 1] + render_models_block(descriptions), encoding="utf-8")


def config_in_sync(config_path: Path, descriptions: Sequence[ModelDescription]) -> bool:
    return models_property(config_path) == models_entry(descriptions)
