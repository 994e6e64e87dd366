"""`torchserve-vision models ...`: manage models on a live TorchServe: list, describe, register,
scale, set-default, unregister, and safe versioned rollouts and rollbacks."""

from __future__ import annotations

import argparse

import torchserve_vision.cli.models_rollouts as rollouts
import torchserve_vision.cli.models_splits as splits
from torchserve_vision.archives.versions import (
    archive_manifest,
)
from torchserve_vision.cli.common import (
    Subcommand,
    register_table,
    subcommand,
)
from torchserve_vision.cli.models_common import (
    add_workers,
    changing,
    describe_lines,
    model_flags,
    say,
    show,
    with_client,
    worker_counts,
)
from torchserve_vision.client import TorchServeClient
from torchserve_vision.photos import photo_path
from torchserve_vision.rollout import (
    WORKERS_DEADLINE_MARGIN_S,
    RolloutError,
    scale,
    wait_for_workers,
)
from torchserve_vision.rollout_history import (
    HistoryEntry,
    Journal,
    half_done_text,
    read_history,
    split_text,
)

DESCRIPTION = """\
Manage models on a live TorchServe: list, describe, register, scale, set-default, unregister,
and safe versioned rollouts and rollbacks (each undone on failure, recorded for rollback).

  torchserve-vision models list
  torchserve-vision models describe efficientnet_lite0 --json
  torchserve-vision models describe efficientnet_lite0 --version default --handler   # what it runs
  torchserve-vision models register efficientnet_lite0-2.0.mar --batch-size 8 --workers 1
  torchserve-vision models scale efficientnet_lite0 --version 2.0 --min 2 --max 2
  torchserve-vision models scale efficientnet_lite0 --workers-per-gpu 2
  torchserve-vision models rollout efficientnet_lite0 efficientnet_lite0-2.0.mar \\
      --expect-label "tiger cat" --expect-label tabby --expect-label "Egyptian cat"
  torchserve-vision models rollout efficientnet_lite0 --same-archive --batch-size 16 \\
      --max-batch-delay 5          # new batch settings, rolled out as a new version
  torchserve-vision models rollback efficientnet_lite0 --dry-run
  torchserve-vision models rollout efficientnet_lite0 --abort   # undo what a dead command left
  torchserve-vision models shadow efficientnet_lite0 efficientnet_lite0-2.0.mar --percent 5
  torchserve-vision models shadow-report efficientnet_lite0     # agreement, latency, flips
  torchserve-vision models shadow efficientnet_lite0 --off --retire
  torchserve-vision models canary efficientnet_lite0 efficientnet_lite0-2.0.mar --percent 10
  torchserve-vision models canary efficientnet_lite0 --promote   # or --off
  torchserve-vision models canary efficientnet_lite0 efficientnet_lite0-2.0.mar --steps 10,25,50,100 --auto
  torchserve-vision models canary efficientnet_lite0 --percent 10 --httproute   # for Kubernetes

A subcommand that acts on one model takes its name first. --dry-run prints the calls that would
change the server (reads still run). Exit status: 0 done, 1 the server refused or a rollout
failed (and was undone), 2 bad arguments, 130 interrupted (and undone).
"""


# --- commands -----------------------------------------------------------------------------------
def command_list(client: TorchServeClient, args: argparse.Namespace) -> None:
    models = client.list_models()
    described = [v for m in models for v in client.describe(m["modelName"], "all")]
    in_batch = client.requests_in_batch()
    lines = [line for d in described for line in describe_lines(d, in_batch)] or ["no models registered"]
    journal = Journal(args.history)
    half_done = [half_done_text(entry) for entry in
                 filter(None, (journal.pending(m["modelName"]) for m in models))]
    show(described, args.json, lines + [f"half-done: {text}" for text in half_done])


def command_describe(client: TorchServeClient, args: argparse.Namespace) -> None:
    if args.handler and args.version == "all":
        raise RolloutError("--handler asks one version's worker: give --version (or 'default')")
    version = None if args.version == "default" else args.version
    described = client.describe(args.model, version, customized=args.handler)
    in_batch = client.requests_in_batch()
    show(described, args.json, [line for d in described for line in describe_lines(d, in_batch)])


def command_register(client: TorchServeClient, args: argparse.Namespace) -> None:
    manifest = archive_manifest(args.model_store / args.archive)
    low, high = worker_counts(args, client, (1, 1))
    say(client.register(args.archive, args.batch_size, args.max_batch_delay, low,
                        args.response_timeout, args.startup_timeout))
    client.scale(manifest["modelName"], manifest["modelVersion"], low, high)
    wait_for_workers(client, manifest["modelName"], manifest["modelVersion"], low,
                     args.timeout or args.startup_timeout + WORKERS_DEADLINE_MARGIN_S)
    print(f"{manifest['modelName']} {manifest['modelVersion']}: {low} worker(s) ready")


def command_scale(client: TorchServeClient, args: argparse.Namespace) -> None:
    with changing(client, args):
        scale_locked(client, args)


def scale_locked(client: TorchServeClient, args: argparse.Namespace) -> None:
    current = client.describe(args.model, args.version)[0]
    low, high = worker_counts(args, client, (current["minWorkers"], current["maxWorkers"]))
    scale(client, args.model, current["modelVersion"], low, high, args.model_store,
          photo_path().read_bytes(), print, args.timeout, Journal(args.history))


def command_set_default(client: TorchServeClient, args: argparse.Namespace) -> None:
    say(client.set_default(args.model, args.version))


def command_unregister(client: TorchServeClient, args: argparse.Namespace) -> None:
    say(client.unregister(args.model, args.version))


def command_history(client: TorchServeClient, args: argparse.Namespace) -> None:
    entries = [entry for entry in read_history(args.history)
               if args.model in (None, entry.model)][-args.last:]
    show([entry.to_json() for entry in entries], args.json,
         [history_line(entry) for entry in entries] or [f"no changes recorded in {args.history}"])


def history_line(entry: HistoryEntry) -> str:
    """`time state kind model what`, one line per change."""
    if entry.changes_split:
        what = f"{split_text(entry.from_split)} -> {split_text(entry.split)} (default {entry.from_version})"
    elif entry.from_version == entry.to_version:   # a scaling, or the rollback of one
        before = entry.from_settings or entry.to_settings
        what = (f"{entry.to_version}: workers {before.min_workers}/{before.max_workers} -> "
                f"{entry.to_settings.min_workers}/{entry.to_settings.max_workers}")
    else:
        what = f"{entry.from_version or 'nothing'} -> {entry.to_version} ({entry.to_archive})"
    note = f"; {entry.note}" if entry.note else ""
    return f"{entry.time}  {entry.state:<8} {entry.kind:<8} {entry.model}  {what}{note}"


# --- arguments ----------------------------------------------------------------------------------
def no_arguments(parser: argparse.ArgumentParser) -> None:
    """A subcommand with only the common flags."""


def describe_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model")
    parser.add_argument("--version", default="all", help="a version, 'all' or 'default'")
    parser.add_argument("--handler", action="store_true",
                        help="also ask a worker of the version what its handler runs: device, "
                             "precision, and each network's runner (compiled package or eager, "
                             "and why)")


def register_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("archive", help="a .mar file name in the model store")
    add_workers(parser, with_total=True)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-batch-delay", type=int, default=20, help="milliseconds")
    parser.add_argument("--response-timeout", type=int, default=60, help="seconds")
    parser.add_argument("--startup-timeout", type=int, default=120,
                        help="seconds a worker may take to load before TorchServe restarts it")


def scale_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model")
    parser.add_argument("--version", default=None, help="default: the default version")
    add_workers(parser, with_total=True)


def version_arguments(parser: argparse.ArgumentParser) -> None:
    """`set-default` and `unregister`: a model and one of its versions."""
    parser.add_argument("model")
    parser.add_argument("--version", required=True)


def history_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", help="one model (default: every model)")
    parser.add_argument("--last", type=int, default=20, help="the latest N changes")


# --- the table: one entry per subcommand ---------------------------------------------------------
TABLE = (
    Subcommand("list", "models, versions, workers, queues", no_arguments, with_client(command_list),
               flags=model_flags),
    Subcommand("describe", "one model's versions", describe_arguments, with_client(command_describe),
               flags=model_flags),
    Subcommand("register", "register an archive", register_arguments, with_client(command_register),
               flags=model_flags),
    Subcommand("scale", "set a version's worker counts", scale_arguments, with_client(command_scale),
               flags=model_flags),
    Subcommand("set-default", "make a version the default", version_arguments,
               with_client(command_set_default), flags=model_flags),
    Subcommand("unregister", "remove a version", version_arguments, with_client(command_unregister),
               flags=model_flags),
    Subcommand("rollout", "safe version swap", rollouts.rollout_arguments,
               with_client(rollouts.command_rollout), flags=model_flags),
    Subcommand("rollback", "back to the version before the current one", rollouts.rollback_arguments,
               with_client(rollouts.command_rollback), flags=model_flags),
    Subcommand("shadow", "mirror a share of real requests to a candidate version",
               splits.shadow_arguments, with_client(splits.command_shadow), flags=model_flags),
    Subcommand("canary", "answer a share of requests from a candidate version (the front splits "
                         "them)", splits.canary_arguments, with_client(splits.command_canary),
               flags=model_flags),
    Subcommand("history", "the recorded changes: rollouts, scalings, canary steps, rollbacks, and "
                          "how each ended", history_arguments, with_client(command_history),
               flags=model_flags),
    Subcommand("shadow-report", "how a shadowed candidate's answers compare with production's",
               splits.shadow_report_arguments, with_client(splits.command_shadow_report),
               flags=model_flags),
)


def register(commands: argparse._SubParsersAction) -> None:
    parser = subcommand(commands, "models",
                        "list, register, scale, roll out and roll back model versions", DESCRIPTION)
    register_table(parser.add_subparsers(dest="action", required=True, metavar="ACTION"), TABLE)
