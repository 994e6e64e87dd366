"""`torchserve-vision lab ...`: load, profile, sweep, tune, compare, and the start-up, compile and
rollout measurements behind docs/benchmarks.md and docs/robustness.md."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from handlers.model.compiled_model import CPU_TARGETS
from torchserve_vision import paths
from torchserve_vision.archives.versions import archive_with_version
from torchserve_vision.cli.common import (
    DEFAULT_MODEL,
    client_from,
    connection_flags,
    json_flag,
    model_store_flag,
    subcommand,
)
from torchserve_vision.errors import LabError
from torchserve_vision.lab import (
    batching_policies,
    cache_benchmark,
    capacity_plan,
    cascade_tradeoff,
    compare,
    compile_speed,
    detector_parts,
    drift_detection,
    engines,
    goodput,
    gpu_lab,
    loadgen,
    near_duplicates,
    precision_spread,
    profile,
    protocol_cost,
    rolling_update,
    rollout_drill,
    shadow_cost,
    startup,
    sweep,
    tune,
)
from torchserve_vision.lab.benchmark_images import SIZES, benchmark_jpeg
from torchserve_vision.model_descriptions import load_descriptions
from torchserve_vision.photo_sets import PhotoSetError
from torchserve_vision.photos import photo_path
from torchserve_vision.server_process import configured_model_store
from torchserve_vision.waiting import wait_until

DESCRIPTION = """\
The serving lab: drive a server with load, profile an archive in-process, sweep and tune batch
settings, compare with TorchServe's built-in handler, measure start-up and rollouts, and plan a
deployment's replicas and autoscaling targets.
"""


def register(commands: argparse._SubParsersAction, summary: str) -> None:
    parser = subcommand(commands, "lab", summary, DESCRIPTION)
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    for add in (add_load, add_profile, add_sweep, add_tune, add_compare, add_policies, add_compile_speed,
                add_engines, add_detector_parts, add_goodput, add_precision, add_startup, add_rollout_drill,
                add_plan, add_rolling_update, add_cascade, add_cache, add_near_duplicates,
                add_protocols, add_shadow, add_drift, add_gpu):
        add(actions)


def model_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"default: {DEFAULT_MODEL}")


def image_size_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--image-size", choices=sorted(SIZES), default="small",
                        help="the JPEG sent: small (720x720) or phone (12 MP)")


# --- load ---------------------------------------------------------------------------------------
def add_load(actions: argparse._SubParsersAction) -> None:
    parser = subcommand(actions, "load",
                        "closed- or open-loop load against a served model", loadgen.__doc__ or "",
                        [connection_flags(), json_flag()])
    model_flag(parser)
    parser.add_argument("--version")
    parser.add_argument("--image", type=Path, action="append",
                        help="image file(s) to send, in turn (default: scikit-image's chelsea.png)")
    parser.add_argument("--clients", type=int, default=8, help="closed loop: concurrent clients")
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
    parser.set_defaults(run=run_load)


def add_goodput(actions: argparse._SubParsersAction) -> None:
    parser = subcommand(actions, "goodput",
                        "answers within the client's timeout per second, at 1x-3x capacity, "
                        "with and without deadlines", goodput.__doc__ or "",
                        [connection_flags(), json_flag()])
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
    parser.set_defaults(run=run_goodput)


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
        report = loadgen.run_closed_loop(target, args.clients, args.duration, args.max_requests, progress)
    if progress:
        print(file=sys.stderr)
    report.extra["images_per_request"] = args.images_per_request
    report.extra["images_per_s"] = report.throughput_rps * args.images_per_request
    print(json.dumps(asdict(report), indent=2) if args.json else
          f"{report.table()}\n  images/s: {report.extra['images_per_s']:.1f} "
          f"({args.images_per_request} per request)")
    return 0


# --- profile ------------------------------------------------------------------------------------
def add_profile(actions: argparse._SubParsersAction) -> None:
    parser = subcommand(actions, "profile",
                        "time per batch t(B) of an archive, in-process", profile.__doc__ or "", [json_flag()])
    parser.add_argument("archive", type=Path)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--image", type=Path, help="a JPEG to send (default: --image-size)")
    image_size_flag(parser)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.set_defaults(run=run_profile)


def run_profile(args: argparse.Namespace) -> int:
    image = args.image.read_bytes() if args.image else benchmark_jpeg(args.image_size)
    name = args.image.name if args.image else f"{args.image_size} JPEG"
    measured = profile.profile_archive(args.archive, args.max_batch, args.repeats, image, name,
                                       args.device)
    print(json.dumps(asdict(measured), indent=2) if args.json else measured.table())
    return 0


# --- sweep --------------------------------------------------------------------------------------
def add_sweep(actions: argparse._SubParsersAction) -> None:
    parser = subcommand(actions, "sweep",
                        "throughput vs p99 over batch size x delay x workers, on a live server",
                        sweep.__doc__ or "",
                        [connection_flags(), model_store_flag()])
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
    parser.set_defaults(run=run_sweep)


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
def add_tune(actions: argparse._SubParsersAction) -> None:
    parser = subcommand(actions, "tune",
                        "recommend batch size, delay and workers for a p99 target", tune.__doc__ or "",
                        [connection_flags(), json_flag()])
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
    parser.set_defaults(run=run_tune)


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
def add_compare(actions: argparse._SubParsersAction) -> None:
    parser = subcommand(actions, "compare",
                        "ours vs TorchServe's built-in handler vs single sessions of our engine "
                        "and of ONNX Runtime, at every load",
                        compare.__doc__ or "",
                        [connection_flags(), model_store_flag(), json_flag()])
    model_flag(parser)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per setup and load")
    image_size_flag(parser)
    parser.add_argument("--model-log", type=Path, default=paths.RUN_DIR / "logs" / "model_log.log",
                        help="the server's model_log.log, read for the served / in-process "
                             "breakdown (default: the demo server's)")
    parser.set_defaults(run=run_compare)


def add_policies(actions: argparse._SubParsersAction) -> None:
    parser = subcommand(actions, "policies",
                        "frontend batching settings vs continuous batching vs one shared "
                        "session, at every load",
                        batching_policies.__doc__ or "",
                        [connection_flags(), model_store_flag(), json_flag()])
    model_flag(parser)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--delays", type=int, nargs="+",
                        default=list(batching_policies.FRONTEND_DELAYS_MS),
                        help="frontend max_batch_delay settings to compare, ms")
    parser.add_argument("--open-loop", type=float, nargs="*", default=[],
                        help="also Poisson arrivals at these fractions of the measured capacity")
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per policy and load")
    image_size_flag(parser)
    parser.set_defaults(run=run_policies)


def run_policies(args: argparse.Namespace) -> int:
    result = batching_policies.compare_policies(client_from(args), args.model_store, args.model,
                                                benchmark_jpeg(args.image_size), args.clients,
                                                args.duration, args.delays, args.open_loop)
    result["image"] = args.image_size
    print(json.dumps(result, indent=2) if args.json else batching_policies.as_text(result))
    return 0


def add_shadow(actions: argparse._SubParsersAction) -> None:
    parser = subcommand(actions, "shadow",
                        "shadow agreement offline vs online, and its cost on production's p99",
                        shadow_cost.__doc__ or "", [connection_flags(), model_store_flag(), json_flag()])
    model_flag(parser)
    parser.add_argument("--candidate", help="the candidate's archive in the model store")
    parser.add_argument("--candidate-precision", choices=["fp32", "bf16", "fp16"],
                        help="instead: the served archive with this precision, as the candidate")
    parser.add_argument("--rate", type=float, default=40.0, help="open-loop requests/s")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per shadow share")
    parser.add_argument("--percents", type=float, nargs="+", default=[0, 5, 20])
    image_size_flag(parser)
    parser.set_defaults(run=run_shadow)


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


# --- compile-speed ------------------------------------------------------------------------------
def add_compile_speed(actions: argparse._SubParsersAction) -> None:
    parser = subcommand(actions, "compile-speed",
                        "eager vs torch.compile vs the ahead-of-time package, in-process",
                        compile_speed.__doc__ or "",
                        [json_flag()])
    parser.add_argument("--archive", type=Path, default=paths.MODEL_STORE / "efficientnet_lite0-1.0.mar")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--targets", nargs="+", choices=sorted(CPU_TARGETS),
                        help="instead: build the archive's network for these CPU targets (and "
                             "--precisions) and time the packages against each other")
    parser.add_argument("--precisions", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"])
    parser.set_defaults(run=run_compile_speed)


def run_compile_speed(args: argparse.Namespace) -> int:
    speed: compile_speed.CompileSpeed | compile_speed.TargetSpeed
    if args.targets:
        speed = compile_speed.measure_cpu_targets(args.archive, args.targets, args.precisions,
                                                  args.threads, args.batch_sizes, args.repeats,
                                                  args.rounds)
    else:
        speed = compile_speed.measure_compile_speed(args.archive, args.threads, args.batch_sizes,
                                                    args.repeats, args.rounds)
    print(json.dumps(asdict(speed), indent=2) if args.json else speed.table())
    return 0


# --- engines ------------------------------------------------------------------------------------
def add_engines(actions: argparse._SubParsersAction) -> None:
    parser = subcommand(actions, "engines",
                        "every runner of an archive (AOTInductor, OpenVINO, ONNX Runtime) in-process",
                        engines.__doc__ or "", [json_flag()])
    parser.add_argument("--archive", type=Path, default=paths.MODEL_STORE / "efficientnet_lite0-1.0.mar")
    parser.add_argument("--threads", type=int, default=None,
                        help="default: the archive's torch_threads (what its workers run with)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.set_defaults(run=run_engines)


def run_engines(args: argparse.Namespace) -> int:
    figures = engines.measure_engines(args.archive, args.threads, args.batch_sizes, args.repeats,
                                      args.rounds)
    print(json.dumps({**asdict(figures), "measured_order": figures.measured_order(),
                      "ratios_to_defaults": figures.ratios_to_defaults()}, indent=2)
          if args.json else figures.table())
    return 0


# --- detector parts ---------------------------------------------------------------------------
def add_detector_parts(actions: argparse._SubParsersAction) -> None:
    parser = subcommand(actions, "detector-parts",
                        "where a detector's time goes, and what its engines save",
                        detector_parts.__doc__ or "", [json_flag()])
    parser.add_argument("--archive", type=Path, default=paths.MODEL_STORE / "ssdlite320-1.0.mar")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.set_defaults(run=run_detector_parts)


def run_detector_parts(args: argparse.Namespace) -> int:
    try:
        figures = detector_parts.measure(args.archive, args.threads, args.batch_sizes, args.repeats,
                                         args.rounds)
    except ValueError as error:
        raise LabError(str(error)) from None
    print(json.dumps(figures, indent=2) if args.json else detector_parts.table(figures))
    return 0


# --- gpu ----------------------------------------------------------------------------------------
def add_gpu(actions: argparse._SubParsersAction) -> None:
    parser = subcommand(actions, "gpu", "everything a GPU machine is measured by, in one run",
                        gpu_lab.__doc__ or "", [json_flag()])
    defaults = gpu_lab.GpuLabSettings(Path("."))
    parser.add_argument("--work-dir", type=Path, default=gpu_lab.default_work_dir(),
                        help="archives, server run directory and logs (default: %(default)s)")
    parser.add_argument("--record", type=Path, help="also write the JSON record to this file")
    parser.add_argument("--duration", type=float, default=defaults.duration_s, help="measured s per load")
    parser.add_argument("--warm-up", type=float, default=defaults.warm_up_s, help="s before each measurement")
    parser.add_argument("--loads", type=int, nargs="+", default=list(defaults.loads), help="clients")
    parser.add_argument("--builtin-workers", type=int, nargs="+", default=list(defaults.builtin_workers))
    parser.add_argument("--images", type=int, default=defaults.images, help="distinct 720x720 JPEGs")
    parser.add_argument("--processes", type=int, default=defaults.processes,
                        help="load generator (and trivial responder) processes")
    parser.add_argument("--precisions", nargs="+", default=list(defaults.precisions),
                        choices=("fp32", "tf32", "fp16", "bf16"), help="of the answer check")
    parser.add_argument("--reference-batches", type=int, nargs="+", default=list(defaults.reference_batches))
    parser.add_argument("--detector-batches", type=int, nargs="+", default=list(defaults.detector_batches))
    parser.add_argument("--models", type=Path, default=defaults.models)
    parser.add_argument("--steps", nargs="+", default=list(defaults.steps), choices=gpu_lab.STEPS,
                        help="measure only these (default: all; the ratios need all)")
    parser.set_defaults(run=run_gpu)


def run_gpu(args: argparse.Namespace) -> int:
    settings = gpu_lab.GpuLabSettings(
        args.work_dir, args.duration, args.warm_up, tuple(args.loads), tuple(args.builtin_workers),
        images=args.images, processes=args.processes, precisions=tuple(args.precisions),
        reference_batches=tuple(args.reference_batches), detector_batches=tuple(args.detector_batches),
        models=args.models, steps=tuple(args.steps))
    def keep(record: dict) -> None:
        if args.record:
            args.record.write_text(json.dumps(record, indent=2))

    record = gpu_lab.run_gpu_lab(settings, on_step=keep)
    keep(record)
    print(json.dumps(record, indent=2) if args.json else gpu_lab.as_text(record))
    return 1 if record.get("failed") else 0


# --- precision ----------------------------------------------------------------------------------
PRECISION_ARCHIVES = ("efficientnet_lite0-1.0.mar", "efficientnet_lite1-1.0.mar",
                      "efficientnet_lite2-1.0.mar")


def add_precision(actions: argparse._SubParsersAction) -> None:
    parser = subcommand(actions, "precision",
                        "how far bf16 and compiled packages move answers, on real photos",
                        precision_spread.__doc__ or "", [json_flag()])
    parser.add_argument("archives", type=Path, nargs="*",
                        default=[paths.MODEL_STORE / name for name in PRECISION_ARCHIVES],
                        help="classifier archives (default: EfficientNet-Lite0/1/2 in model_store/)")
    parser.add_argument("--threads", type=int, default=1)
    parser.set_defaults(run=run_precision)


def run_precision(args: argparse.Namespace) -> int:
    spreads = [spread for archive in args.archives
               for spread in precision_spread.measure_archive(archive, args.threads)]
    print(json.dumps([asdict(s) for s in spreads], indent=2) if args.json
          else precision_spread.spreads_table(spreads))
    return 0


# --- startup and rollout-drill (each starts its own server) ------------------------------------
def own_server_flags() -> argparse.ArgumentParser:
    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument("--config", type=Path, default=paths.DEVELOPMENT_CONFIG,
                       help=f"base config, run on free 127.0.0.1 ports (default: {paths.DEVELOPMENT_CONFIG})")
    flags.add_argument("--model-store", type=Path, default=None, help="default: the config's")
    return flags


def own_server_store(args: argparse.Namespace) -> Path:
    """The model store of a lab command that starts its own servers (`own_server_flags`)."""
    return Path(args.model_store or configured_model_store(args.config)).resolve()


def add_startup(actions: argparse._SubParsersAction) -> None:
    parser = subcommand(actions, "startup",
                        "seconds to READY: cold and warm start, killed worker, scale-up, new version",
                        startup.__doc__ or "",
                        [own_server_flags(), json_flag()])
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="the model killed, scaled and registered again")
    parser.set_defaults(run=run_startup)


def run_startup(args: argparse.Namespace) -> int:
    store = own_server_store(args)
    figures = startup.measure(args.config, store, args.model)
    print(json.dumps(figures, indent=2) if args.json else startup.markdown(figures))
    return 0


def add_rollout_drill(actions: argparse._SubParsersAction) -> None:
    parser = subcommand(actions, "rollout-drill",
                        "rollouts, rollbacks, scaling and a killed worker under open-loop load",
                        rollout_drill.__doc__ or "",
                        [own_server_flags(), json_flag()])
    model_flag(parser)
    parser.add_argument("--load-fraction", type=float, default=0.25,
                        help="offered load as a fraction of the measured capacity")
    parser.add_argument("--canary", action="store_true",
                        help="through the front: shadow, canary steps, promotion, an aborted walk")
    parser.set_defaults(run=run_rollout_drill)


def run_rollout_drill(args: argparse.Namespace) -> int:
    store = own_server_store(args)
    outcome = rollout_drill.drill(args.config, store, args.model, args.load_fraction, args.canary)
    if args.json:
        print(json.dumps(outcome, indent=2))
    else:
        print(f"capacity {outcome['capacity_rps']} requests/s; offered {outcome['rate_rps']}/s")
        print(rollout_drill.markdown(outcome["steps"]))  # type: ignore[arg-type]
    return 0


# --- plan ---------------------------------------------------------------------------------------
def add_plan(actions: argparse._SubParsersAction) -> None:
    parser = subcommand(actions, "plan",
                        "per-pod capacity, replicas and HPA targets from a measured server",
                        capacity_plan.__doc__ or "", [connection_flags(), json_flag()])
    model_flag(parser)
    parser.add_argument("--p99-ms", type=float, required=True, help="latency target per request")
    parser.add_argument("--target-rps", type=float, required=True,
                        help="requests per second the whole deployment must serve")
    parser.add_argument("--headroom", type=float, default=0.3,
                        help="fraction of a pod's capacity kept free (default 0.3)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per load level")
    parser.add_argument("--image", type=Path, help="image to send (default: scikit-image's chelsea.png)")
    parser.set_defaults(run=run_plan)


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


# --- rolling-update -----------------------------------------------------------------------------
def add_rolling_update(actions: argparse._SubParsersAction) -> None:
    parser = subcommand(actions, "rolling-update",
                        "pods behind HAProxy stopped and restarted in turn under load",
                        rolling_update.__doc__ or "", [own_server_flags(), json_flag()])
    parser.add_argument("--pods", type=int, default=2)
    parser.add_argument("--rate", type=float, default=20.0, help="requests per second offered")
    parser.add_argument("--drain-delay", type=float, default=2.0,
                        help="each pod's --drain-delay (HAProxy checks readiness every 250 ms, "
                             "a pod out after two failures)")
    parser.add_argument("--load-models", default="efficientnet_lite0-1.0.mar",
                        help="the archives each pod loads (default: the classifier)")
    parser.add_argument("--stock-stop", action="store_true",
                        help="stop pods with `torchserve --stop` (no drain), for comparison")
    parser.add_argument("--new-version", help="roll out this version: each pod comes back serving "
                        "a copy of its archives as this version (as a new image would carry it)")
    parser.set_defaults(run=run_rolling_update)


def run_rolling_update(args: argparse.Namespace) -> int:
    store = own_server_store(args)
    rolled = None
    if args.new_version:
        rolled = ",".join(archive_with_version(store, archive, args.new_version)
                          for archive in args.load_models.split(","))
    report = rolling_update.rehearse(args.config, store, args.pods, args.rate, args.drain_delay,
                                     load_models=args.load_models, graceful=not args.stock_stop,
                                     rolled_load_models=rolled,
                                     on_step=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps(rolling_update.report_document(report), indent=2) if args.json else report.table())
    return 0 if report.failed == 0 and all(step.exit_code == 0 for step in report.steps) else 1


# --- protocols ----------------------------------------------------------------------------------
def add_protocols(actions: argparse._SubParsersAction) -> None:
    parser = subcommand(actions, "protocols",
                        "tritonclient over HTTP (direct, through the front) and gRPC (the gRPC front)",
                        protocol_cost.__doc__ or "", [own_server_flags(), json_flag()])
    model_flag(parser)
    image_size_flag(parser)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per way and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.set_defaults(run=run_protocols)


def run_protocols(args: argparse.Namespace) -> int:
    figures = protocol_cost.measure(args.config, own_server_store(args), args.model,
                                    benchmark_jpeg(args.image_size), args.clients, args.duration,
                                    args.rounds,
                                    on_step=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps([asdict(figure) for figure in figures], indent=2) if args.json
          else protocol_cost.markdown(figures))
    return 0


# --- cascade ------------------------------------------------------------------------------------
def add_cascade(actions: argparse._SubParsersAction) -> None:
    parser = subcommand(actions, "cascade",
                        "a cascade's top-1 agreement vs served throughput over thresholds",
                        cascade_tradeoff.__doc__ or "",
                        [connection_flags(), model_store_flag(), json_flag()])
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
    parser.set_defaults(run=run_cascade)


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
def add_cache(actions: argparse._SubParsersAction) -> None:
    parser = subcommand(actions, "cache",
                        "the response cache: 0/50/90 % repeats, off vs memory vs Redis, an outage",
                        cache_benchmark.__doc__ or "",
                        [connection_flags(), model_store_flag(), json_flag()])
    model_flag(parser)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per run")
    parser.set_defaults(run=run_cache)


def run_cache(args: argparse.Namespace) -> int:
    result = cache_benchmark.benchmark(client_from(args), args.model_store.resolve(), args.model,
                                       args.clients, args.duration)
    print(json.dumps(result, indent=2) if args.json else cache_benchmark.markdown(result))
    return 0


def add_near_duplicates(actions: argparse._SubParsersAction) -> None:
    parser = subcommand(actions, "near-duplicates",
                        "perceptual-hash hits and wrong answers on real photos and variants",
                        near_duplicates.__doc__ or "", [json_flag()])
    parser.add_argument("--archive", type=Path, default=paths.MODEL_STORE / "efficientnet_lite0-1.0.mar")
    parser.add_argument("--inputs", type=int, default=320)
    parser.set_defaults(run=run_near_duplicates)


def run_near_duplicates(args: argparse.Namespace) -> int:
    report = near_duplicates.measure(args.archive, args.inputs)
    print(near_duplicates.as_json(report) if args.json else near_duplicates.markdown(report))
    return 0


def add_drift(actions: argparse._SubParsersAction) -> None:
    parser = subcommand(actions, "drift",
                        "drift readings: false alarms on in-distribution traffic, requests to "
                        "detect shifted traffic, the counting's cost",
                        drift_detection.__doc__ or "", [connection_flags(), json_flag()])
    model_flag(parser)
    parser.add_argument("--archive", type=Path,
                        help="the archive whose handler and reference profile are used offline "
                             "(default: the model's 1.0 in the model store)")
    parser.add_argument("--images", type=Path, metavar="DIR",
                        help="the photos the archive's reference was recorded from (default: the project's)")
    parser.add_argument("--windows", type=int, default=20,
                        help="in-distribution windows replayed offline for the false-alarm rate")
    parser.add_argument("--offline", action="store_true", help="no server: false alarms and cost only")
    parser.set_defaults(run=run_drift)


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
