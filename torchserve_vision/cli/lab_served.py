"""`torchserve-vision lab ...` against a running server: load, goodput, sweep, tune, compare,
policies, plan, cascade, cache, shadow and drift (the table is in cli/lab.py)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from torchserve_vision import paths
from torchserve_vision.cli.common import (
    client_from,
    image_size_flag,
    model_flag,
)
from torchserve_vision.errors import LabError
from torchserve_vision.lab import (
    batching_policies,
    cache_benchmark,
    capacity_plan,
    cascade_tradeoff,
    compare,
    drift_detection,
    goodput,
    loadgen,
    shadow_cost,
    sweep,
    tune,
)
from torchserve_vision.lab.benchmark_images import benchmark_jpeg
from torchserve_vision.model_descriptions import load_descriptions
from torchserve_vision.photo_sets import PhotoSetError
from torchserve_vision.photos import photo_path
from torchserve_vision.waiting import wait_until


# --- load ---------------------------------------------------------------------------------------
def load_arguments(parser: argparse.ArgumentParser) -> None:
    model_flag(parser)
    parser.add_argument("--version")
    parser.add_argument("--image", type=Path, action="append",
                        help="image file(s) to send, in turn (default: scikit-image's chelsea.png)")
    parser.add_argument("--clients", type=int, default=8, help="closed loop: concurrent clients")
    parser.add_argument("--on-refusal", choices=loadgen.REFUSAL_MODES, default="resend",
                        help="closed loop: after a 503, send again at once (resend), or after its "
                             "Retry-After (retry-after)")
    parser.add_argument("--rate", type=float, help="open loop: Poisson arrivals per second")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds")
    parser.add_argument("--max-requests", type=int, default=1_000_000)
    parser.add_argument("--max-in-flight", type=int, default=256, help="open loop: client threads")
    parser.add_argument("--header", action="append", default=[], help="extra header, NAME=VALUE")
    parser.add_argument("--images-per-request", type=int, default=1,
                        help="more than 1: KServe v1 `instances` bodies of this many images each "
                             "(the report adds images/s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--self-test", action="store_true",
                        help="measure the client's own ceiling against an instant local server")


def goodput_arguments(parser: argparse.ArgumentParser) -> None:
    model_flag(parser)
    parser.add_argument("--version")
    parser.add_argument("--image", type=Path, help="a JPEG to send (default: --image-size)")
    image_size_flag(parser)
    parser.add_argument("--timeout-ms", type=float, default=1000.0,
                        help="how long a client waits (and, with deadlines, its deadline)")
    parser.add_argument("--load", type=float, action="append",
                        help="offered load as a multiple of capacity (repeatable; default 1, 2, 3)")
    parser.add_argument("--high-share", type=float, default=0.0,
                        help="also a run with deadlines where this share of the requests asks "
                             "for high priority (X-Request-Priority: high), e.g. 0.2")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per run")
    parser.add_argument("--seed", type=int, default=0)


def run_goodput(args: argparse.Namespace) -> int:
    client = client_from(args)
    body = args.image.read_bytes() if args.image else benchmark_jpeg(args.image_size)
    target = loadgen.LoadTarget(client.prediction_url(args.model, args.version), [body],
                                client.inference_headers())
    version = client.describe(args.model, args.version)[0]["modelVersion"]

    def drain() -> None:
        wait_until(lambda: int(client.describe(args.model, version)[0]["jobQueueStatus"]
                               ["pendingRequests"]) == 0, 300, "an empty queue", interval_s=0.2)
        time.sleep(1.0)        # the last batches finish

    try:
        capacity, rows = goodput.measure_goodput(target, args.timeout_ms, args.load or [1.0, 2.0, 3.0],
                                                 args.duration, drain, args.seed, args.high_share)
    except ValueError as error:
        raise LabError(str(error)) from None
    if args.json:
        print(json.dumps({"capacity_rps": capacity, "timeout_ms": args.timeout_ms,
                          "rows": [asdict(row) for row in rows]}, indent=2))
        return 0
    print(f"capacity {capacity:.1f} requests/s (closed loop, {goodput.CAPACITY_CLIENTS} clients); "
          f"client timeout {args.timeout_ms:.0f} ms")
    for row in rows:
        print(row.line(capacity))
    return 0


def progress_printer() -> loadgen.Progress:
    last = [0.0]

    def show(done: int) -> None:
        now = time.monotonic()
        if now - last[0] >= 1.0:
            last[0] = now
            print(f"\r  {done} answers", end="", file=sys.stderr, flush=True)
    return show


def run_load(args: argparse.Namespace) -> int:
    bodies = [path.read_bytes() for path in args.image or [photo_path()]]
    if args.self_test:
        _server, url = loadgen.instant_server()
        headers = {"Content-Type": "application/octet-stream"}
    else:
        client = client_from(args)
        url, headers = client.prediction_url(args.model, args.version), client.inference_headers()
    if args.images_per_request > 1:
        bodies = loadgen.instances_bodies(bodies, args.images_per_request)
        headers["Content-Type"] = "application/json"
    headers.update(dict(item.split("=", 1) for item in args.header))
    target = loadgen.LoadTarget(url, bodies, headers)
    progress = None if args.json else progress_printer()
    if args.rate:
        report = loadgen.run_open_loop(target, args.rate, args.duration, args.max_requests,
                                       args.max_in_flight, args.seed, progress)
    else:
        report = loadgen.run_closed_loop(target, args.clients, args.duration, args.max_requests, progress,
                                         args.on_refusal)
    if progress:
        print(file=sys.stderr)
    report.extra["images_per_request"] = args.images_per_request
    report.extra["images_per_s"] = report.throughput_rps * args.images_per_request
    refused = (f"\n  refused: {report.extra['refused_per_s']}/s (503, {args.on_refusal} after each)"
               if "refused_per_s" in report.extra else "")
    print(json.dumps(asdict(report), indent=2) if args.json else
          f"{report.table()}\n  images/s: {report.extra['images_per_s']:.1f} "
          f"({args.images_per_request} per request){refused}")
    return 0


# --- sweep --------------------------------------------------------------------------------------
def sweep_arguments(parser: argparse.ArgumentParser) -> None:
    model_flag(parser)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--delays", type=int, nargs="+", default=[5, 20], help="max batch delay, ms")
    parser.add_argument("--workers", type=int, nargs="+", default=[1])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 32],
                        help="closed-loop load levels")
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per load level")
    parser.add_argument("--sla-ms", type=float, default=500.0, help="p99 latency target")
    image_size_flag(parser)
    parser.add_argument("--out", type=Path, default=paths.RUN_DIR / "sweep",
                        help="results: <out>.json, .csv, .png")


def run_sweep(args: argparse.Namespace) -> int:
    points = sweep.run_sweep(client_from(args), args.model, args.model_store, args.batch_sizes,
                             args.delays, args.workers, args.clients, args.duration,
                             benchmark_jpeg(args.image_size))
    chosen = sweep.choose_operating_point(points, args.sla_ms)
    sweep.write_results(points, chosen, args.sla_ms, args.out,
                        f"{args.model}: throughput vs p99 ({args.image_size} JPEG)")
    print(sweep.points_table(points))
    print(f"chosen (p99 <= {args.sla_ms:.0f} ms, highest throughput): {chosen}")
    print(f"wrote {args.out.with_suffix('.json')}, .csv, .png")
    return 0


# --- tune ---------------------------------------------------------------------------------------
def tune_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("archive", type=Path)
    parser.add_argument("--p99-ms", type=float, required=True, help="p99 latency target")
    goal = parser.add_mutually_exclusive_group(required=True)
    goal.add_argument("--rate", type=float, help="expected requests per second")
    goal.add_argument("--max-throughput", action="store_true")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--workers", type=int, default=1,
                        help="workers (per GPU on a GPU host); 1 on a CPU host")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--sweep", type=Path, help="sweep results JSON (torchserve-vision lab sweep)")
    parser.add_argument("--verify", action="store_true", help="open-loop run on the live server")
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--apply", action="store_true", help="keep the settings on the live server")
    parser.add_argument("--write-config", action="store_true",
                        help=f"write the settings into {paths.MODEL_DESCRIPTIONS} and the server configs")


def run_tune(args: argparse.Namespace) -> int:
    tuning = tune.tune(args.archive, args.p99_ms, args.rate, args.max_batch, args.workers,
                       args.device, args.sweep)
    if args.verify:
        tune.verify_on_server(client_from(args), tuning, args.archive.parent, args.p99_ms, args.rate,
                              args.duration, keep=args.apply)
    if args.write_config:
        tune.write_recommendation(tuning, paths.MODEL_DESCRIPTIONS, paths.SERVER_CONFIGS)
    if args.json:
        print(json.dumps(tuning.to_dict(), indent=2))
        return 0
    chosen = tuning.chosen
    print(tuning.profile.table())
    print(f"\n{tuning.model}: {'meets' if chosen.feasible else 'CANNOT meet'} p99 <= {args.p99_ms:.0f} ms"
          f"{f' at {args.rate:.0f} req/s' if args.rate else ' at maximum throughput'}: "
          f"batch size {chosen.batch_size}, max batch delay {chosen.max_batch_delay_ms} ms, "
          f"{chosen.workers} worker(s); predicted p99 {chosen.predicted_p99_ms:.0f} ms, "
          f"capacity {chosen.capacity_rps:.1f} req/s ({chosen.reason})")
    if tuning.verification is not None:
        print(f"verified: {tuning.verification.table()}\ntarget met: {tuning.target_met}")
    return 0


# --- compare ------------------------------------------------------------------------------------
def compare_arguments(parser: argparse.ArgumentParser) -> None:
    model_flag(parser)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per setup and load")
    image_size_flag(parser)
    parser.add_argument("--model-log", type=Path, default=paths.RUN_DIR / "logs" / "model_log.log",
                        help="the server's model_log.log, read for the served / in-process "
                             "breakdown (default: the demo server's)")


def policies_arguments(parser: argparse.ArgumentParser) -> None:
    model_flag(parser)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--delays", type=int, nargs="+",
                        default=list(batching_policies.FRONTEND_DELAYS_MS),
                        help="frontend max_batch_delay settings to compare, ms")
    parser.add_argument("--open-loop", type=float, nargs="*", default=[],
                        help="also Poisson arrivals at these fractions of the measured capacity")
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per policy and load")
    image_size_flag(parser)


def run_policies(args: argparse.Namespace) -> int:
    result = batching_policies.compare_policies(client_from(args), args.model_store, args.model,
                                                benchmark_jpeg(args.image_size), args.clients,
                                                args.duration, args.delays, args.open_loop)
    result["image"] = args.image_size
    print(json.dumps(result, indent=2) if args.json else batching_policies.as_text(result))
    return 0


def shadow_arguments(parser: argparse.ArgumentParser) -> None:
    model_flag(parser)
    parser.add_argument("--candidate", help="the candidate's archive in the model store")
    parser.add_argument("--candidate-precision", choices=["fp32", "bf16", "fp16"],
                        help="instead: the served archive with this precision, as the candidate")
    parser.add_argument("--rate", type=float, default=40.0, help="open-loop requests/s")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per shadow share")
    parser.add_argument("--percents", type=float, nargs="+", default=[0, 5, 20])
    image_size_flag(parser)


def run_shadow(args: argparse.Namespace) -> int:
    if bool(args.candidate) == bool(args.candidate_precision):
        raise LabError("give one of --candidate and --candidate-precision")
    result = shadow_cost.measure(client_from(args), args.model_store, args.model,
                                 args.metrics_url.rstrip("/"), benchmark_jpeg(args.image_size),
                                 args.candidate, args.candidate_precision, args.rate,
                                 args.duration, args.percents)
    print(json.dumps(result, indent=2) if args.json else shadow_cost.as_text(result))
    return 0


def run_compare(args: argparse.Namespace) -> int:
    result = compare.compare(client_from(args), args.model_store, args.model,
                             benchmark_jpeg(args.image_size), args.clients, args.duration,
                             args.model_log)
    result["image"] = args.image_size
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{args.model}, {args.image_size} JPEG, settings {result['settings']}")
    print(compare.as_text(result))
    return 0


# --- plan ---------------------------------------------------------------------------------------
def plan_arguments(parser: argparse.ArgumentParser) -> None:
    model_flag(parser)
    parser.add_argument("--p99-ms", type=float, required=True, help="latency target per request")
    parser.add_argument("--target-rps", type=float, required=True,
                        help="requests per second the whole deployment must serve")
    parser.add_argument("--headroom", type=float, default=0.3,
                        help="fraction of a pod's capacity kept free (default 0.3)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per load level")
    parser.add_argument("--image", type=Path, help="image to send (default: scikit-image's chelsea.png)")


def run_plan(args: argparse.Namespace) -> int:
    if not 0 <= args.headroom < 1:
        raise LabError("--headroom must be in [0, 1)")
    client = client_from(args)
    body = (args.image or photo_path()).read_bytes()
    target = loadgen.LoadTarget(client.prediction_url(args.model, None), [body],
                                client.inference_headers())
    plan = capacity_plan.plan_deployment(
        target, args.metrics_url.rstrip("/"), args.model, args.p99_ms, args.target_rps,
        args.headroom, args.duration, on_step=lambda line: print(line, file=sys.stderr, flush=True))
    if plan is None:
        print(f"no load level met p99 <= {args.p99_ms:g} ms: the target is below what one pod "
              "can do even lightly loaded", file=sys.stderr)
        return 1
    print(json.dumps(capacity_plan.plan_document(plan), indent=2) if args.json else plan.table())
    return 0


# --- cascade ------------------------------------------------------------------------------------
def cascade_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cascade", default="efficientnet_cascade",
                        help=f"a cascade of {paths.MODEL_DESCRIPTIONS} (its archives built)")
    parser.add_argument("--models", type=Path, default=paths.MODEL_DESCRIPTIONS)
    parser.add_argument("--inputs", type=int, default=320, help="distinct inputs (at least 300)")
    parser.add_argument("--images", type=Path, metavar="DIR",
                        help="make the inputs from the photos in DIR (default: ten of "
                             "scikit-image's images)")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--duration", type=float, default=15.0, help="seconds per point")
    parser.add_argument("--out", type=Path, default=Path("docs/cascade-cpu"),
                        help="writes OUT.json and OUT.png")


def run_cascade(args: argparse.Namespace) -> int:
    described = {d.name: d for d in load_descriptions(args.models)}
    cascade = described.get(args.cascade)
    if cascade is None or cascade.task != "cascade":
        raise LabError(f"{args.cascade} is not a cascade in {args.models}")
    try:
        inputs = cascade_tradeoff.cascade_inputs(args.inputs, images_dir=args.images)
    except PhotoSetError as error:
        raise LabError(str(error)) from None
    points = cascade_tradeoff.tradeoff(client_from(args), args.model_store.resolve(), cascade,
                                       inputs, args.clients, args.duration)
    title = (f"{cascade.stages['first']} -> {cascade.stages['second']}, {len(inputs)} inputs, "
             f"{args.clients} clients")
    cascade_tradeoff.save(points, args.out, title)
    second_alone = points[-1].throughput_rps
    print(json.dumps([asdict(p) for p in points], indent=2) if args.json
          else cascade_tradeoff.markdown(points, second_alone))
    return 0


# --- cache --------------------------------------------------------------------------------------
def cache_arguments(parser: argparse.ArgumentParser) -> None:
    model_flag(parser)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per run")


def run_cache(args: argparse.Namespace) -> int:
    result = cache_benchmark.benchmark(client_from(args), args.model_store.resolve(), args.model,
                                       args.clients, args.duration)
    print(json.dumps(result, indent=2) if args.json else cache_benchmark.markdown(result))
    return 0


def drift_arguments(parser: argparse.ArgumentParser) -> None:
    model_flag(parser)
    parser.add_argument("--archive", type=Path,
                        help="the archive whose handler and reference profile are used offline "
                             "(default: the model's 1.0 in the model store)")
    parser.add_argument("--images", type=Path, metavar="DIR",
                        help="the photos the archive's reference was recorded from (default: the project's)")
    parser.add_argument("--windows", type=int, default=20,
                        help="in-distribution windows replayed offline for the false-alarm rate")
    parser.add_argument("--offline", action="store_true", help="no server: false alarms and cost only")


def run_drift(args: argparse.Namespace) -> int:
    archive = args.archive or paths.MODEL_STORE / f"{args.model}-1.0.mar"
    url = version = None
    headers: dict[str, str] = {}
    if not args.offline:
        client = client_from(args)
        version = client.describe(args.model, None)[0]["modelVersion"]   # the default version
        url, headers = client.prediction_url(args.model, version), client.inference_headers()
    try:
        result = drift_detection.measure(archive, args.images, url, headers,
                                         None if args.offline else args.metrics_url.rstrip("/"),
                                         args.model, version, args.windows)
    except (PhotoSetError, ValueError) as error:
        raise LabError(str(error)) from None
    print(json.dumps(result, indent=2) if args.json else drift_detection.as_text(result))
    return 0
