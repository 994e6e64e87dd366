"""`torchserve-vision models ...`: manage models on a live TorchServe: list, describe, register,
scale, set-default, unregister, and safe versioned rollouts and rollbacks."""

from __future__ import annotations

import argparse
import json
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import yaml

from torchserve_vision import paths
from torchserve_vision.archives.versions import (
    ArchiveError,
    archive_batching,
    archive_deadline_ms,
    archive_manifest,
    archive_with_version,
    settings_version,
)
from torchserve_vision.canary import (
    Gates,
    canary_of,
    change_split,
    promote_canary,
    settle_split_change,
    undo_canary_step,
    walk_canary,
)
from torchserve_vision.canary_route import canary_httproute
from torchserve_vision.cli.common import (
    client_from,
    connection_flags,
    json_flag,
    model_store_flag,
    subcommand,
)
from torchserve_vision.client import TorchServeClient
from torchserve_vision.model_descriptions import BATCHING_POLICIES, QUEUED, ServingSettings
from torchserve_vision.model_lock import model_lock
from torchserve_vision.photos import photo_path
from torchserve_vision.prometheus_text import scrape
from torchserve_vision.rollout import (
    WORKERS_DEADLINE_MARGIN_S,
    RolloutError,
    RolloutPlan,
    abort,
    rollback,
    rollout,
    scale,
    wait_for_workers,
)
from torchserve_vision.rollout_history import (
    CanarySplit,
    HistoryEntry,
    Journal,
    canary_step_to_undo,
    half_done_text,
    read_history,
    split_text,
)
from torchserve_vision.server_state import default_version, local_gpu_count, versions_of
from torchserve_vision.shadow import (
    ShadowPlan,
    register_candidate,
    shadow_reports,
    shadow_totals,
    start_shadow,
    stop_shadow,
    traffic_dir_of,
    worker_shadow_state,
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


# --- output -------------------------------------------------------------------------------------
def batching_text(description: dict[str, Any]) -> str:
    if description.get("continuousBatching"):
        deadline_ms = description.get("clientTimeoutInMills") or 0
        deadline = f", deadline {deadline_ms} ms" if deadline_ms else ", no deadline"
        return f"queued batching (no delay{deadline})"
    return f"max batch delay {description['maxBatchDelay']} ms"


def describe_lines(description: dict[str, Any]) -> list[str]:
    queue = description.get("jobQueueStatus", {})
    lines = [f"{description['modelName']} {description['modelVersion']}  ({description['modelUrl']})",
             f"  batch size {description['batchSize']}, {batching_text(description)},"
             f" workers min {description['minWorkers']} / max {description['maxWorkers']},"
             f" response timeout {description['responseTimeout']} s",
             f"  queue: {queue.get('pendingRequests', '?')} pending,"
             f" {queue.get('remainingCapacity', '?')} free"]
    for worker in description.get("workers", []):
        device = f"GPU {worker.get('gpuUsage')}" if worker.get("gpu") else "CPU"
        lines.append(f"  worker {worker['id']}: {worker['status']}, pid {worker.get('pid')}, {device}")
    handler = description.get("customizedMetadata")
    if isinstance(handler, dict):
        lines.append(f"  a worker's handler: {handler.get('device')}, {handler.get('precision')}")
        for role, runner in (handler.get("runners") or {}).items():
            lines.extend(runner_lines(role, runner))
    return lines


def runner_lines(role: str, runner: dict[str, Any]) -> list[str]:
    """One network's runner as a worker describes it: what serves, from which file, on which
    CPU kind's order, then each runner refused on the way and why."""
    served = runner.get("file") or "no compiled model serves"
    kind = f", {runner['cpu_kind']} order" if "cpu_kind" in runner else ""
    lines = [f"    {role}: {runner.get('runner')} ({served}{kind})"]
    for refusal in runner.get("refused") or []:
        lines.append(f"      refused {refusal.get('runner')} ({refusal.get('reason')}): "
                     f"{refusal.get('message')}")
    return lines


def say(answer: Any) -> None:
    """Print a management answer's status line."""
    print(answer.get("status", answer) if isinstance(answer, dict) else answer)


def show(value: Any, as_json: bool, lines: list[str]) -> None:
    print(json.dumps(value, indent=2) if as_json else "\n".join(lines))


# --- worker counts ------------------------------------------------------------------------------
def gpu_count(client: TorchServeClient, gpus: int | None) -> int:
    """GPUs of the server host: --gpus, or this machine's when the server is on loopback."""
    if gpus is not None:
        return gpus
    host = urlparse(client.management_url).hostname or ""
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise RolloutError("the server is not on this machine: say how many GPUs it has with --gpus")
    return local_gpu_count()


def worker_counts(args: argparse.Namespace, client: TorchServeClient,
                  fallback: tuple[int, int]) -> tuple[int, int]:
    """(min, max) workers from --workers-per-gpu, --min/--max or --workers, else `fallback`."""
    if getattr(args, "workers_per_gpu", None):
        gpus = gpu_count(client, args.gpus)
        if gpus == 0:
            raise RolloutError("this host has no GPU: give worker counts with --min/--max instead")
        total = args.workers_per_gpu * gpus
        return total, total
    low = getattr(args, "min", None) or getattr(args, "workers", None) or fallback[0]
    high = getattr(args, "max", None) or max(low, getattr(args, "workers", None) or fallback[1])
    if high < low:
        raise RolloutError(f"--max ({high}) is below --min ({low})")
    return low, high


# --- commands -----------------------------------------------------------------------------------
def command_list(client: TorchServeClient, args: argparse.Namespace) -> None:
    models = client.list_models()
    described = [v for m in models for v in client.describe(m["modelName"], "all")]
    lines = [line for d in described for line in describe_lines(d)] or ["no models registered"]
    journal = Journal(args.history)
    half_done = [half_done_text(entry) for entry in
                 filter(None, (journal.pending(m["modelName"]) for m in models))]
    show(described, args.json, lines + [f"half-done: {text}" for text in half_done])


def command_describe(client: TorchServeClient, args: argparse.Namespace) -> None:
    if args.handler and args.version == "all":
        raise RolloutError("--handler asks one version's worker: give --version (or 'default')")
    version = None if args.version == "default" else args.version
    described = client.describe(args.model, version, customized=args.handler)
    show(described, args.json, [line for d in described for line in describe_lines(d)])


def command_register(client: TorchServeClient, args: argparse.Namespace) -> None:
    manifest = archive_manifest(args.model_store / args.archive)
    low, high = worker_counts(args, client, (1, 1))
    say(client.register(args.archive, args.batch_size, args.max_batch_delay, low,
                        args.response_timeout, args.startup_timeout))
    client.scale(manifest["modelName"], manifest["modelVersion"], low, high)
    wait_for_workers(client, manifest["modelName"], manifest["modelVersion"], low,
                     args.timeout or args.startup_timeout + WORKERS_DEADLINE_MARGIN_S)
    print(f"{manifest['modelName']} {manifest['modelVersion']}: {low} worker(s) ready")


def changing(client: TorchServeClient, args: argparse.Namespace) -> AbstractContextManager[None]:
    """The model's lock for a change (none for a dry run): see torchserve_vision.model_lock."""
    return nullcontext() if client.dry_run else model_lock(args.history, args.model)


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


def planned_batching(args: argparse.Namespace, archive: str, base: ServingSettings) -> str:
    """--batching (for a copy of the current archive), else the archive's own policy (the
    current version's when the archive cannot say: TorchServe then refuses it at registration,
    and the rollout undoes itself)."""
    if getattr(args, "batching", None):
        return str(args.batching)
    path = args.model_store / archive
    try:
        return archive_batching(path) if archive and path.is_file() else base.batching
    except ArchiveError:
        return base.batching


def planned_deadline_ms(args: argparse.Namespace, archive: str, batching: str,
                        base: ServingSettings) -> int:
    """--deadline-ms (for a copy of the current archive), else the archive's own (the current
    version's when the archive cannot say); none with delayed batching, which cannot answer one."""
    requested = getattr(args, "deadline_ms", None)
    if batching != QUEUED:
        if requested:
            raise RolloutError("--deadline-ms needs queued batching (TorchServe's own batching "
                               "drops an expired request without answering it)")
        return 0
    if requested is not None:
        if requested < 0:
            raise RolloutError(f"--deadline-ms must be 0 (none) or more, got {requested}")
        return int(requested)
    path = args.model_store / archive
    try:
        return archive_deadline_ms(path) if archive and path.is_file() else base.deadline_ms
    except ArchiveError:
        return base.deadline_ms


def planned_delay_ms(args: argparse.Namespace, batching: str, base: ServingSettings) -> int:
    """--max-batch-delay, else the current version's. Queued batching uses none (ServingSettings
    makes it 0); a delayed archive after a queued version needs one said."""
    if batching == QUEUED:
        if args.max_batch_delay:
            print(f"note: the new version batches queued (it never waits): --max-batch-delay "
                  f"{args.max_batch_delay} is unused")
        return 0
    if args.max_batch_delay is not None:
        return int(args.max_batch_delay)
    if base.batching == QUEUED:
        raise RolloutError("the new version batches with a delay (serving.batching: delayed) and "
                           "the current one does not: give --max-batch-delay")
    return base.max_batch_delay_ms


def rollout_plan(client: TorchServeClient, args: argparse.Namespace, archive: str) -> RolloutPlan:
    current = default_version(client, args.model)
    base = ServingSettings.of_version(current) if current else ServingSettings()
    low, high = worker_counts(args, client, (base.min_workers, base.max_workers))
    batching = planned_batching(args, archive, base)
    settings = ServingSettings(
        batch_size=args.batch_size or base.batch_size,
        max_batch_delay_ms=planned_delay_ms(args, batching, base),
        min_workers=low, max_workers=high,
        response_timeout_s=args.response_timeout or base.response_timeout_s,
        startup_timeout_s=args.startup_timeout or base.startup_timeout_s,
        batching=batching, deadline_ms=planned_deadline_ms(args, archive, batching, base))
    return RolloutPlan(model=args.model, archive=archive, settings=settings,
                       smoke_image=args.smoke_image.read_bytes(),
                       expect_labels=frozenset(args.expect_label or ()),
                       compare_with_current=args.compare_with_current, keep_old=args.keep_old,
                       drain_timeout_s=args.drain_timeout, drain_grace_s=args.drain_grace,
                       workers_timeout_s=args.timeout)


def command_rollout(client: TorchServeClient, args: argparse.Namespace) -> None:
    with changing(client, args):
        rollout_locked(client, args)


def rollout_locked(client: TorchServeClient, args: argparse.Namespace) -> None:
    if args.abort:
        if args.archive or args.same_archive:
            raise RolloutError("--abort undoes the half-done change recorded for the model: give "
                               "no archive")
        journal = Journal(args.history)
        pending = journal.pending(args.model)
        if pending is not None and pending.changes_split:
            if client.dry_run:   # the split is changed on the front's socket, not through the client
                print(f"[dry-run] would abort the half-done change of {args.model}'s split "
                      f"({pending.kind}): {split_text(pending.from_split)} again")
                return
            settle_split_change(pending, split_traffic_dir(client, args.model), journal, finish=False)
            print(f"aborted the half-done change of {args.model}'s split ({pending.kind}): "
                  f"{split_text(pending.from_split)} again")
            return
        entry = abort(client, args.model, journal, args.model_store,
                      rollout_plan(client, args, archive=""), print)
        print(f"aborted the {entry.kind} of {args.model} to {entry.to_version}")
        return
    archive = args.archive
    if args.same_archive:
        current = default_version(client, args.model)
        if current is None:
            raise RolloutError(f"{args.model} is not registered: nothing to re-roll")
        plan = rollout_plan(client, args, current["modelUrl"])
        version = settings_version(current["modelVersion"], plan.settings)
        archive = (f"{args.model}-{version}.mar" if client.dry_run
                   else archive_with_version(args.model_store, current["modelUrl"], version,
                                             frontend_changes={
                                                 "continuousBatching": plan.settings.batching == QUEUED,
                                                 "clientTimeoutInMills": plan.settings.deadline_ms}))
        print(f"new batch settings as version {version} ({archive})")
    elif archive is None:
        raise RolloutError("give the new archive, or --same-archive with new batch settings")
    elif args.batching or args.deadline_ms is not None:
        raise RolloutError("--batching and --deadline-ms apply to --same-archive: a new archive "
                           "brings its own (serving.batching, serving.deadline_ms in "
                           "config/models.yaml)")
    plan = rollout_plan(client, args, archive)
    if client.dry_run and args.same_archive:
        print(f"[dry-run] would copy {plan.archive} and roll it out with {plan.settings}")
        return
    entry = rollout(client, plan, args.model_store, print, Journal(args.history))
    print(f"rolled out {args.model} {entry.to_version} (was {entry.from_version})")


def command_rollback(client: TorchServeClient, args: argparse.Namespace) -> None:
    with changing(client, args):
        rollback_locked(client, args)


def rollback_locked(client: TorchServeClient, args: argparse.Namespace) -> None:
    """The latest canary step is undone first (one step per rollback), then rollouts and
    scalings (torchserve_vision.rollout.rollback)."""
    journal = Journal(args.history)
    pending = journal.pending(args.model)
    if pending is not None and pending.changes_split:
        if pending.kind != "rollback":
            raise RolloutError(half_done_text(pending))
        if client.dry_run:   # the split is changed on the front's socket, not through the client
            print(f"[dry-run] would finish the rollback of {args.model}'s canary: "
                  f"{split_text(pending.split)}")
            return
        settled = settle_split_change(pending, split_traffic_dir(client, args.model), journal,
                                      finish=True)
        print(f"finished the rollback of {args.model}'s canary: {split_text(settled.split)}")
        return
    step = canary_step_to_undo(journal.history_file, args.model)
    if step is not None:
        undone = undo_canary_step(client, step, split_traffic_dir(client, args.model), journal, print)
        if undone is not None:
            print(f"rolled back {args.model}'s canary to {split_text(undone.split)}")
        return
    template = rollout_plan(client, args, archive="")
    entry = rollback(client, args.model, journal, args.model_store, template, print)
    if entry is None:
        return
    print(f"rolled back {args.model} to {entry.to_version}")


def split_traffic_dir(client: TorchServeClient, model: str) -> Path:
    """Where the front serving `model`'s default version keeps its split."""
    stable = default_version(client, model)
    if stable is None:
        raise RolloutError(f"{model} is not registered")
    return traffic_dir_of(client, model, stable["modelVersion"])


def command_shadow(client: TorchServeClient, args: argparse.Namespace) -> None:
    with changing(client, args):
        shadow_locked(client, args)


def candidate_plan(client: TorchServeClient, args: argparse.Namespace, percent: float) -> ShadowPlan:
    """How a candidate archive is registered beside the default version: the default's batch
    settings (the archive's batching policy), its own worker counts (default 1)."""
    current = default_version(client, args.model)
    base = ServingSettings.of_version(current) if current else ServingSettings()
    low, high = worker_counts(args, client, (1, 1))
    batching = planned_batching(args, args.archive, base)
    settings = replace(base, min_workers=low, max_workers=high, batching=batching,
                       max_batch_delay_ms=0 if batching == QUEUED else base.max_batch_delay_ms,
                       deadline_ms=planned_deadline_ms(args, args.archive, batching, base))
    return ShadowPlan(args.model, args.archive, percent, settings, args.smoke_image.read_bytes(),
                      getattr(args, "queue_size", 64))


def shadow_locked(client: TorchServeClient, args: argparse.Namespace) -> None:
    if args.off:
        if args.archive:
            raise RolloutError("--off stops the model's shadow: give no archive")
        stop_shadow(client, args.model, args.retire, print)
        return
    if args.archive is None or args.percent is None:
        raise RolloutError("give the candidate's archive and --percent (or --off)")
    if not 0 < args.percent <= 100:
        raise RolloutError(f"--percent must be in (0, 100], got {args.percent:g}")
    start_shadow(client, candidate_plan(client, args, args.percent), args.model_store, print)


def command_canary(client: TorchServeClient, args: argparse.Namespace) -> None:
    if args.httproute:
        if args.percent is None or args.archive or args.promote or args.off:
            raise RolloutError("--httproute renders the split for Kubernetes: give --percent "
                               "(and the services), no archive, --promote or --off")
        route = canary_httproute(args.model, args.gateway, args.stable_service,
                                 args.canary_service, args.percent, args.mirror_percent)
        print(yaml.safe_dump(route, sort_keys=False), end="")
        return
    with changing(client, args):
        canary_locked(client, args)


def canary_locked(client: TorchServeClient, args: argparse.Namespace) -> None:
    stable = default_version(client, args.model)
    if stable is None:
        raise RolloutError(f"{args.model} is not registered")
    traffic_dir = traffic_dir_of(client, args.model, stable["modelVersion"])
    if client.dry_run:   # the split is changed on the front's socket, not through the client
        action = ("promote the canary" if args.promote else "remove the split" if args.off else
                  f"walk {args.steps}" if args.steps else f"answer {args.percent}% from the candidate")
        now = split_text(canary_of(traffic_dir, args.model))
        print(f"[dry-run] would {action} of {args.model} (now {now})")
        return
    journal = Journal(args.history)
    pending = journal.pending(args.model)
    if pending is not None:
        if not pending.changes_split:
            raise RolloutError(half_done_text(pending))
        settle_split_change(pending, traffic_dir, journal, finish=False)
        print(f"the half-done {pending.kind} of {pending.time} is undone: "
              f"{split_text(pending.from_split)} again")
    if args.promote or args.off:
        if args.archive or args.percent is not None:
            raise RolloutError("--promote and --off act on the canary in place: give no archive "
                               "or --percent")
        if args.promote:
            entry = promote_canary(client, args.model, traffic_dir, journal, print)
            print(f"promoted {args.model} {entry.to_version} (was {entry.from_version}; "
                  "`models rollback` returns to it)")
            return
        change_split(client, journal, traffic_dir, args.model, None)
        print(f"{args.model}: no canary; {stable['modelVersion']} answers every request")
        return
    if args.steps is not None:
        if not args.auto or args.percent is not None:
            raise RolloutError("--steps walks the canary by itself: give --auto, and no --percent")
        version = canary_version(client, args, traffic_dir, stable)
        gates = Gates(args.max_failure_increase, args.max_p99_ratio, args.p99_slack,
                      args.min_requests, args.min_agreement)
        entry = walk_canary(client, args.model, version, traffic_dir, args.steps, args.hold, gates,
                            journal, print,
                            None if args.min_agreement is None
                            else lambda: shadow_totals(scrape(args.metrics_url), args.model, version))
        print(f"promoted {args.model} {entry.to_version} after {len(args.steps)} steps (was "
              f"{entry.from_version}; `models rollback` returns to it)")
        return
    if args.percent is None or not 0 < args.percent <= 100:
        raise RolloutError("give --percent in (0, 100], or --steps with --auto (or --promote / --off)")
    version = canary_version(client, args, traffic_dir, stable)
    change_split(client, journal, traffic_dir, args.model, CanarySplit(version, args.percent))
    print(f"{args.model}: {args.percent}% of requests to {version}, the rest to "
          f"{stable['modelVersion']}")


def percent_steps(text: str) -> list[int]:
    """`10,25,50,100` -> [10, 25, 50, 100]: increasing, in (0, 100], ending at 100."""
    try:
        steps = [int(step) for step in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"steps are whole percents separated by commas: {text!r}") from None
    if steps != sorted(set(steps)) or steps[0] <= 0 or steps[-1] != 100:
        raise argparse.ArgumentTypeError(f"steps must increase, start above 0 and end at 100: {text!r}")
    return steps


def canary_version(client: TorchServeClient, args: argparse.Namespace, traffic_dir: Path,
                   stable: dict[str, Any]) -> str:
    """The archive's version (registered and smoke-tested if needed); else the version of the
    running canary, of the shadow, or the one other registered version."""
    if args.archive:
        return register_candidate(client, candidate_plan(client, args, 0.0), stable,
                                  args.model_store, print)
    split = canary_of(traffic_dir, args.model)
    if split is not None:
        return split.version
    shadow = worker_shadow_state(client, args.model, stable["modelVersion"]).get("policy")
    if shadow:
        return str(shadow["candidate_version"])
    others = [v["modelVersion"] for v in versions_of(client, args.model)
              if v["modelVersion"] != stable["modelVersion"]]
    if len(others) != 1:
        raise RolloutError(f"name the candidate's archive: {args.model} has "
                           f"{len(others)} other registered versions")
    return str(others[0])


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


def command_shadow_report(client: TorchServeClient, args: argparse.Namespace) -> None:
    reports = [report for report in shadow_reports(scrape(args.metrics_url), args.model, args.top)
               if args.candidate in (None, report.candidate)]
    if not reports:
        print(f"no shadow comparison of {args.model} in {args.metrics_url}/metrics yet")
    show([asdict(report) for report in reports], args.json,
         [line for report in reports for line in report.lines()])


# --- arguments ----------------------------------------------------------------------------------
def add_workers(parser: argparse.ArgumentParser, with_total: bool) -> None:
    parser.add_argument("--min", type=int, help="minimum workers")
    parser.add_argument("--max", type=int, help="maximum workers")
    if with_total:
        parser.add_argument("--workers", type=int, help="workers (min = max)")
    parser.add_argument("--workers-per-gpu", type=int,
                        help="k workers on each GPU of the host: min = max = k x GPUs")
    parser.add_argument("--gpus", type=int, help="GPUs of the server host (default: this machine's)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds to wait for workers (default: the version's start-up "
                             f"timeout + {WORKERS_DEADLINE_MARGIN_S:.0f} s)")


def add_candidate(parser: argparse.ArgumentParser) -> None:
    """How `shadow` and `canary` register a candidate archive (see `candidate_plan`)."""
    parser.add_argument("--smoke-image", type=Path, default=photo_path(),
                        help="the candidate's smoke test (default: scikit-image's chelsea.png)")
    add_workers(parser, with_total=True)
    parser.set_defaults(batching=None)


def add_batching(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--max-batch-delay", type=int, help="milliseconds")
    parser.add_argument("--response-timeout", type=int, help="seconds")
    parser.add_argument("--startup-timeout", type=int,
                        help="seconds a worker may take to load before TorchServe restarts it")


def register(commands: argparse._SubParsersAction) -> None:
    common = argparse.ArgumentParser(add_help=False, parents=[connection_flags(), json_flag(),
                                                              model_store_flag()])
    common.add_argument("--dry-run", action="store_true", help="print changing calls, do not send")
    common.add_argument("--history", type=Path, default=paths.ROLLOUT_HISTORY,
                        help=f"rollout history file, for rollback (default: {paths.ROLLOUT_HISTORY})")
    parser = subcommand(commands, "models",
                        "list, register, scale, roll out and roll back model versions", DESCRIPTION)
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    actions.add_parser("list", parents=[common], help="models, versions, workers, queues")
    describe = actions.add_parser("describe", parents=[common], help="one model's versions")
    describe.add_argument("model")
    describe.add_argument("--version", default="all", help="a version, 'all' or 'default'")
    describe.add_argument("--handler", action="store_true",
                          help="also ask a worker of the version what its handler runs: device, "
                               "precision, and each network's runner (compiled package or eager, "
                               "and why)")
    register = actions.add_parser("register", parents=[common], help="register an archive")
    register.add_argument("archive", help="a .mar file name in the model store")
    add_workers(register, with_total=True)
    register.add_argument("--batch-size", type=int, default=8)
    register.add_argument("--max-batch-delay", type=int, default=20, help="milliseconds")
    register.add_argument("--response-timeout", type=int, default=60, help="seconds")
    register.add_argument("--startup-timeout", type=int, default=120,
                          help="seconds a worker may take to load before TorchServe restarts it")
    scale = actions.add_parser("scale", parents=[common], help="set a version's worker counts")
    scale.add_argument("model")
    scale.add_argument("--version", default=None, help="default: the default version")
    add_workers(scale, with_total=True)
    set_default = actions.add_parser("set-default", parents=[common], help="make a version the default")
    set_default.add_argument("model")
    set_default.add_argument("--version", required=True)
    unregister = actions.add_parser("unregister", parents=[common], help="remove a version")
    unregister.add_argument("model")
    unregister.add_argument("--version", required=True)
    for name in ("rollout", "rollback"):
        sub = actions.add_parser(name, parents=[common],
                                 help="safe version swap" if name == "rollout"
                                 else "back to the version before the current one")
        sub.add_argument("model")
        if name == "rollout":
            sub.add_argument("archive", nargs="?", help="the new version's .mar in the model store")
            sub.add_argument("--same-archive", action="store_true",
                             help="re-roll the current archive with new batch settings")
            sub.add_argument("--batching", choices=BATCHING_POLICIES,
                             help="with --same-archive: queued (take what is queued, never wait) "
                                  "or delayed (TorchServe's: wait up to --max-batch-delay)")
            sub.add_argument("--deadline-ms", type=int,
                             help="with --same-archive and queued batching: a queued request "
                                  "that can no longer be answered within this many ms is "
                                  "answered 504, never computed (0: none; default: the current "
                                  "version's)")
            sub.add_argument("--expect-label", action="append",
                             help="smoke test passes only with this top label (repeatable)")
            sub.add_argument("--compare-with-current", action="store_true",
                             help="smoke test passes only with the current version's top label")
            sub.add_argument("--keep-old", action="store_true", help="leave the old version registered")
            sub.add_argument("--abort", action="store_true",
                             help="undo the change of the model that a command which died "
                                  "half-way left (recorded in the history): the version it "
                                  "started from serves again, the new one is unregistered")
        add_batching(sub)
        add_workers(sub, with_total=True)
        sub.add_argument("--smoke-image", type=Path, default=photo_path(),
                         help="default: scikit-image's chelsea.png")
        sub.add_argument("--drain-timeout", type=float, default=120.0)
        sub.add_argument("--drain-grace", type=float, default=2.0,
                         help="seconds to wait after the old queue empties for its last batch, "
                              "only where batches cannot be seen (a version served without the "
                              "frontend agent's queued batching, or no --metrics-url); else the "
                              "rollout waits until the batch is answered")
        sub.set_defaults(expect_label=None, compare_with_current=False, keep_old=False,
                         same_archive=False, archive=None, abort=False, batching=None,
                         deadline_ms=None)
    shadow = actions.add_parser("shadow", parents=[common],
                                help="mirror a share of real requests to a candidate version")
    shadow.add_argument("model")
    shadow.add_argument("archive", nargs="?", help="the candidate's .mar in the model store")
    shadow.add_argument("--percent", type=float,
                        help="share of the default version's requests copied to the candidate")
    shadow.add_argument("--queue-size", type=int, default=64,
                        help="copies waiting per worker before more are dropped (counted)")
    shadow.add_argument("--off", action="store_true", help="stop mirroring")
    shadow.add_argument("--retire", action="store_true",
                        help="with --off: also unregister the candidate")
    add_candidate(shadow)
    canary = actions.add_parser("canary", parents=[common],
                                help="answer a share of requests from a candidate version (the "
                                     "front splits them)")
    canary.add_argument("model")
    canary.add_argument("archive", nargs="?",
                        help="the candidate's .mar (default: the running canary's or shadow's "
                             "version, or the one other registered version)")
    canary.add_argument("--percent", type=int, help="share of unversioned requests it answers")
    canary.add_argument("--promote", action="store_true",
                        help="the candidate becomes the default; the old default stays "
                             "registered for `models rollback`")
    canary.add_argument("--off", action="store_true", help="remove the split")
    walk = canary.add_argument_group(
        "stepped", "walk the steps, judge the candidate against the stable version over each "
                   "step's window (from the front's request log), promote after the last or "
                   "remove the split at the first failed gate")
    walk.add_argument("--steps", type=percent_steps, help="e.g. 10,25,50,100")
    walk.add_argument("--auto", action="store_true")
    walk.add_argument("--hold", type=float, default=60.0, help="seconds per step")
    walk.add_argument("--max-failure-increase", type=float, default=Gates.max_failure_increase,
                      help="candidate's non-2xx rate above the stable one's (fraction)")
    walk.add_argument("--max-p99-ratio", type=float, default=Gates.max_p99_ratio)
    walk.add_argument("--p99-slack", type=float, default=Gates.p99_slack_ms, help="milliseconds")
    walk.add_argument("--min-requests", type=int, default=Gates.min_requests,
                      help="the candidate's fewest requests per step to judge it")
    walk.add_argument("--min-agreement", type=float,
                      help="with a shadow of the same candidate running (`models shadow`): its "
                           "agreement with production over each step at least this")
    kubernetes = canary.add_argument_group(
        "Kubernetes", "print the split as a Gateway API HTTPRoute instead of changing a server")
    kubernetes.add_argument("--httproute", action="store_true")
    kubernetes.add_argument("--gateway", default="inference-gateway", help="the parent Gateway")
    kubernetes.add_argument("--stable-service", default="torchserve-vision")
    kubernetes.add_argument("--canary-service", default="torchserve-vision-canary")
    kubernetes.add_argument("--mirror-percent", type=int, default=0,
                            help="also copy this share to the candidate (the Gateway's "
                                 "RequestMirror: answers not compared)")
    add_candidate(canary)
    history = actions.add_parser("history", parents=[common],
                                 help="the recorded changes: rollouts, scalings, canary steps, "
                                      "rollbacks, and how each ended")
    history.add_argument("model", nargs="?", help="one model (default: every model)")
    history.add_argument("--last", type=int, default=20, help="the latest N changes")
    report = actions.add_parser("shadow-report", parents=[common],
                                help="how a shadowed candidate's answers compare with production's")
    report.add_argument("model")
    report.add_argument("--top", type=int, default=10, help="label flips shown")
    report.add_argument("--candidate", help="one candidate version (default: every candidate "
                                            "since the server started)")
    parser.set_defaults(run=run)


COMMANDS = {"list": command_list, "describe": command_describe, "register": command_register,
            "scale": command_scale, "set-default": command_set_default,
            "unregister": command_unregister, "rollout": command_rollout, "rollback": command_rollback,
            "shadow": command_shadow, "shadow-report": command_shadow_report,
            "history": command_history,
            "canary": command_canary}


def run(args: argparse.Namespace) -> int:
    COMMANDS[args.action](client_from(args, args.dry_run), args)
    return 0
