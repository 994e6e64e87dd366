"""`torchserve-vision models rollout` and `rollback`: a safe version swap and its way back (the
table is in cli/models.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from torchserve_vision.archives.versions import (
    archive_with_version,
    settings_version,
)
from torchserve_vision.canary import (
    settle_split_change,
    undo_canary_step,
)
from torchserve_vision.cli.models_common import (
    add_batching,
    add_workers,
    changing,
    planned_batching,
    planned_deadline_ms,
    split_traffic_dir,
    worker_counts,
)
from torchserve_vision.client import TorchServeClient
from torchserve_vision.model_descriptions import BATCHING_POLICIES, QUEUED, ServingSettings
from torchserve_vision.photos import photo_path
from torchserve_vision.rollout import (
    RolloutError,
    RolloutPlan,
    abort,
    rollback,
    rollout,
)
from torchserve_vision.rollout_history import (
    Journal,
    canary_step_to_undo,
    half_done_text,
    split_text,
)
from torchserve_vision.server_state import default_version


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
        batching=batching, deadline_ms=planned_deadline_ms(args, archive, batching, base),
        job_queue_size=args.job_queue_size or 0)   # 0: the copied archive's own, unchanged
    return RolloutPlan(model=args.model, archive=archive, settings=settings,
                       smoke_image=args.smoke_image.read_bytes(),
                       expect_labels=frozenset(args.expect_label or ()),
                       compare_with_current=args.compare_with_current, keep_old=args.keep_old,
                       drain_timeout_s=args.drain_timeout, drain_grace_s=args.drain_grace,
                       workers_timeout_s=args.timeout)


def queue_settings(settings: ServingSettings) -> dict[str, object]:
    """The archive YAML's keys of a version's queue: queued batching, its deadline, its size."""
    changes: dict[str, object] = {"continuousBatching": settings.batching == QUEUED,
                                  "clientTimeoutInMills": settings.deadline_ms}
    if settings.job_queue_size:
        changes["jobQueueSize"] = settings.job_queue_size
    return changes


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
                                             frontend_changes=queue_settings(plan.settings)))
        print(f"new batch settings as version {version} ({archive})")
    elif archive is None:
        raise RolloutError("give the new archive, or --same-archive with new batch settings")
    elif args.batching or args.deadline_ms is not None or args.job_queue_size is not None:
        raise RolloutError("--batching, --deadline-ms and --job-queue-size apply to --same-archive: "
                           "a new archive brings its own (serving.batching, serving.deadline_ms, "
                           "serving.job_queue_size in config/models.yaml)")
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


# --- arguments ----------------------------------------------------------------------------------
def swap_arguments(parser: argparse.ArgumentParser) -> None:
    """What `rollout` and `rollback` both take: batch settings, workers, the smoke test, the drain."""
    add_batching(parser)
    add_workers(parser, with_total=True)
    parser.add_argument("--smoke-image", type=Path, default=photo_path(),
                        help="default: scikit-image's chelsea.png")
    parser.add_argument("--drain-timeout", type=float, default=120.0)
    parser.add_argument("--drain-grace", type=float, default=2.0,
                        help="seconds to wait after the old queue empties for its last batch, "
                             "only where batches cannot be seen (a version served without the "
                             "frontend agent's queued batching, or no --metrics-url); else the "
                             "rollout waits until the batch is answered")
    parser.set_defaults(expect_label=None, compare_with_current=False, keep_old=False,
                        same_archive=False, archive=None, abort=False, batching=None,
                        deadline_ms=None, job_queue_size=None)


def rollout_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model")
    parser.add_argument("archive", nargs="?", help="the new version's .mar in the model store")
    parser.add_argument("--same-archive", action="store_true",
                        help="re-roll the current archive with new batch settings")
    parser.add_argument("--batching", choices=BATCHING_POLICIES,
                        help="with --same-archive: queued (take what is queued, never wait) "
                             "or delayed (TorchServe's: wait up to --max-batch-delay)")
    parser.add_argument("--deadline-ms", type=int,
                        help="with --same-archive and queued batching: a queued request "
                             "that can no longer be answered within this many ms is "
                             "answered 504, never computed (0: none; default: the current "
                             "version's)")
    parser.add_argument("--job-queue-size", type=int,
                        help="with --same-archive: requests the new version queues before it answers "
                             "503 (default: the current archive's, else the server's job_queue_size)")
    parser.add_argument("--expect-label", action="append",
                        help="smoke test passes only with this top label (repeatable)")
    parser.add_argument("--compare-with-current", action="store_true",
                        help="smoke test passes only with the current version's top label")
    parser.add_argument("--keep-old", action="store_true", help="leave the old version registered")
    parser.add_argument("--abort", action="store_true",
                        help="undo the change of the model that a command which died "
                             "half-way left (recorded in the history): the version it "
                             "started from serves again, the new one is unregistered")
    swap_arguments(parser)


def rollback_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model")
    swap_arguments(parser)
