"""`torchserve-vision models shadow`, `shadow-report` and `canary`: a candidate beside production,
mirrored or answering a share (the table is in cli/models.py)."""

from __future__ import annotations

import argparse
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import yaml

from torchserve_vision.canary import (
    Gates,
    canary_of,
    change_split,
    promote_canary,
    settle_split_change,
    walk_canary,
)
from torchserve_vision.canary_route import canary_httproute
from torchserve_vision.cli.models_common import (
    add_candidate,
    changing,
    planned_batching,
    planned_deadline_ms,
    show,
    worker_counts,
)
from torchserve_vision.client import TorchServeClient
from torchserve_vision.model_descriptions import QUEUED, ServingSettings
from torchserve_vision.prometheus_text import scrape
from torchserve_vision.rollout import (
    RolloutError,
)
from torchserve_vision.rollout_history import (
    CanarySplit,
    Journal,
    half_done_text,
    split_text,
)
from torchserve_vision.server_state import default_version, versions_of
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


def command_shadow_report(client: TorchServeClient, args: argparse.Namespace) -> None:
    reports = [report for report in shadow_reports(scrape(args.metrics_url), args.model, args.top)
               if args.candidate in (None, report.candidate)]
    if not reports:
        print(f"no shadow comparison of {args.model} in {args.metrics_url}/metrics yet")
    show([asdict(report) for report in reports], args.json,
         [line for report in reports for line in report.lines()])


# --- arguments ----------------------------------------------------------------------------------
def shadow_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model")
    parser.add_argument("archive", nargs="?", help="the candidate's .mar in the model store")
    parser.add_argument("--percent", type=float,
                        help="share of the default version's requests copied to the candidate")
    parser.add_argument("--queue-size", type=int, default=64,
                        help="copies waiting per worker before more are dropped (counted)")
    parser.add_argument("--off", action="store_true", help="stop mirroring")
    parser.add_argument("--retire", action="store_true",
                        help="with --off: also unregister the candidate")
    add_candidate(parser)


def canary_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model")
    parser.add_argument("archive", nargs="?",
                        help="the candidate's .mar (default: the running canary's or shadow's "
                             "version, or the one other registered version)")
    parser.add_argument("--percent", type=int, help="share of unversioned requests it answers")
    parser.add_argument("--promote", action="store_true",
                        help="the candidate becomes the default; the old default stays "
                             "registered for `models rollback`")
    parser.add_argument("--off", action="store_true", help="remove the split")
    canary_walk_arguments(parser)
    kubernetes = parser.add_argument_group(
        "Kubernetes", "print the split as a Gateway API HTTPRoute instead of changing a server")
    kubernetes.add_argument("--httproute", action="store_true")
    kubernetes.add_argument("--gateway", default="inference-gateway", help="the parent Gateway")
    kubernetes.add_argument("--stable-service", default="torchserve-vision")
    kubernetes.add_argument("--canary-service", default="torchserve-vision-canary")
    kubernetes.add_argument("--mirror-percent", type=int, default=0,
                            help="also copy this share to the candidate (the Gateway's "
                                 "RequestMirror: answers not compared)")
    add_candidate(parser)


def canary_walk_arguments(parser: argparse.ArgumentParser) -> None:
    walk = parser.add_argument_group(
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


def shadow_report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model")
    parser.add_argument("--top", type=int, default=10, help="label flips shown")
    parser.add_argument("--candidate", help="one candidate version (default: every candidate "
                                            "since the server started)")
