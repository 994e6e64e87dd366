"""The canary split: a share of a model's unversioned requests answered by a candidate version,
done by the front (HAProxy, `server run --front-port`; torchserve_vision.front_proxy).

The split lives in two HAProxy maps in the server's traffic directory (model -> candidate
version, model -> percent). `set_canary` changes them through HAProxy's runtime API on the
admin socket there (no reload: open connections and requests in flight are untouched) and
rewrites the files (a restarted front keeps the split). Widening a split writes the version
before the percent and narrowing it the percent before the version, so no request is ever sent
to a version the maps do not name. A client that sends `X-Canary-Key` is placed by the key's
hash: the same key always gets the same side while the percent stays, and stays on the
candidate as the percent grows.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path

from torchserve_vision.client import TorchServeClient
from torchserve_vision.errors import CommandError
from torchserve_vision.front_proxy import ADMIN_SOCKET, CANARY_PERCENT_MAP, CANARY_VERSION_MAP
from torchserve_vision.model_descriptions import ServingSettings
from torchserve_vision.rollout import server_identity
from torchserve_vision.rollout_history import HistoryEntry, Journal, now_text
from torchserve_vision.server_state import default_version


class CanaryError(CommandError, RuntimeError):
    """The split could not be read or changed; the message says why."""


def admin_command(traffic_dir: Path, command: str, timeout_s: float = 5.0) -> str:
    """One command on the front's admin socket; its answer."""
    path = traffic_dir / ADMIN_SOCKET
    if not path.exists():
        raise CanaryError(f"no front serves this server ({path} is missing): a canary needs "
                          "`torchserve-vision server run --probe-port P --front-port F`, and its "
                          "clients on the front's port")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.settimeout(timeout_s)
        try:
            connection.connect(str(path))
            connection.sendall(command.encode() + b"\n")
            chunks = []
            while chunk := connection.recv(65536):
                chunks.append(chunk)
        except OSError as error:
            raise CanaryError(f"the front's admin socket {path}: {error}") from None
    return b"".join(chunks).decode(errors="replace")


def live_map(traffic_dir: Path, name: str) -> dict[str, str]:
    """A map as the running front holds it (`show map`: `<id> <key> <value>` per line)."""
    entries = {}
    for line in admin_command(traffic_dir, f"show map {traffic_dir / name}").splitlines():
        fields = line.split()
        if len(fields) == 3:
            entries[fields[1]] = fields[2]
    return entries


def set_entry(traffic_dir: Path, name: str, key: str, value: str | None) -> None:
    """Set (None: remove) one key of a map, in the running front and in its file."""
    path = traffic_dir / name
    admin_command(traffic_dir, f"del map {path} {key}")   # "Key not found." when absent: fine
    if value is not None:
        answer = admin_command(traffic_dir, f"add map {path} {key} {value}").strip()
        if answer:
            raise CanaryError(f"the front refused {key} -> {value} in {name}: {answer}")
    entries = {k: v for k, v in (line.split(maxsplit=1) for line in
                                 path.read_text(encoding="utf-8").splitlines() if line.strip())}
    entries.pop(key, None)
    if value is not None:
        entries[key] = value
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(f"{k} {v}\n" for k, v in entries.items()), encoding="utf-8")
    os.replace(partial, path)


def set_canary(traffic_dir: Path, model: str, version: str, percent: int) -> None:
    """`percent` % of `model`'s unversioned requests to `version` (0: none, the split removed)."""
    if not 0 <= percent <= 100:
        raise CanaryError(f"the canary percent must be in [0, 100], got {percent}")
    if percent > 0:
        set_entry(traffic_dir, CANARY_VERSION_MAP, model, version)
        set_entry(traffic_dir, CANARY_PERCENT_MAP, model, str(percent))
    else:
        set_entry(traffic_dir, CANARY_PERCENT_MAP, model, None)
        set_entry(traffic_dir, CANARY_VERSION_MAP, model, None)


def canary_of(traffic_dir: Path, model: str) -> tuple[str, int] | None:
    """(candidate version, percent) of `model`'s split in the running front; None: no split."""
    percent = live_map(traffic_dir, CANARY_PERCENT_MAP).get(model)
    version = live_map(traffic_dir, CANARY_VERSION_MAP).get(model)
    return (version, int(percent)) if percent is not None and version is not None else None


def promote_canary(client: TorchServeClient, model: str, traffic_dir: Path, journal: Journal,
                   log: Callable[[str], None]) -> HistoryEntry:
    """The canary's version becomes the default (every unversioned request), the split is
    removed, and the previous default stays registered on standby: `models rollback` makes it
    the default again at once. Recorded in the history as a rollout."""
    split = canary_of(traffic_dir, model)
    stable = default_version(client, model)
    if split is None or stable is None:
        raise CanaryError(f"{model} has no canary to promote")
    version = split[0]
    candidate = client.describe(model, version)[0]
    intent = journal.begin(HistoryEntry(
        kind="rollout", model=model, to_version=version, to_archive=candidate["modelUrl"],
        to_settings=ServingSettings.of_version(candidate), from_version=stable["modelVersion"],
        from_archive=stable["modelUrl"], from_settings=ServingSettings.of_version(stable),
        time=now_text(), server=server_identity(client, model, stable["modelVersion"])))
    client.set_default(model, version)
    log(f"{model} {version} is the default; {stable['modelVersion']} stays registered for rollback")
    set_canary(traffic_dir, model, version, 0)
    return journal.end(intent, "done")
