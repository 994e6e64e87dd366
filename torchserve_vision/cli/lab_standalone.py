"""`torchserve-vision lab ...` that need no running server: in-process profiles, compile speed,
engines, detector parts, precision, the GPU, near-duplicates, and those that start servers of
their own (start-up, the rollout drill, the rolling update, protocols); the table is in
cli/lab.py."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from handlers.model.compiled_model import CPU_TARGETS
from torchserve_vision import paths
from torchserve_vision.archives.versions import archive_with_version
from torchserve_vision.cli.common import (
    DEFAULT_MODEL,
    image_size_flag,
    model_flag,
)
from torchserve_vision.errors import LabError
from torchserve_vision.lab import (
    compile_speed,
    detector_parts,
    detector_resize,
    engines,
    gpu_lab,
    near_duplicates,
    opencv_detector,
    precision_spread,
    profile,
    protocol_cost,
    rolling_update,
    rollout_drill,
    startup,
    ultralytics_serving,
)
from torchserve_vision.lab.benchmark_images import benchmark_jpeg
from torchserve_vision.server_process import configured_model_store


# --- profile ------------------------------------------------------------------------------------
def profile_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("archive", type=Path)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--image", type=Path, help="a JPEG to send (default: --image-size)")
    image_size_flag(parser)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")


def run_profile(args: argparse.Namespace) -> int:
    image = args.image.read_bytes() if args.image else benchmark_jpeg(args.image_size)
    name = args.image.name if args.image else f"{args.image_size} JPEG"
    measured = profile.profile_archive(args.archive, args.max_batch, args.repeats, image, name,
                                       args.device)
    print(json.dumps(asdict(measured), indent=2) if args.json else measured.table())
    return 0


# --- compile-speed ------------------------------------------------------------------------------
def compile_speed_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--archive", type=Path, default=paths.MODEL_STORE / "efficientnet_lite0-1.0.mar")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--targets", nargs="+", choices=sorted(CPU_TARGETS),
                        help="instead: build the archive's network for these CPU targets (and "
                             "--precisions) and time the packages against each other")
    parser.add_argument("--precisions", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"])


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
def engines_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--archive", type=Path, default=paths.MODEL_STORE / "efficientnet_lite0-1.0.mar")
    parser.add_argument("--threads", type=int, default=None,
                        help="default: the archive's torch_threads (what its workers run with)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)


def run_engines(args: argparse.Namespace) -> int:
    figures = engines.measure_engines(args.archive, args.threads, args.batch_sizes, args.repeats,
                                      args.rounds)
    print(json.dumps({**asdict(figures), "measured_order": figures.measured_order(),
                      "ratios_to_defaults": figures.ratios_to_defaults()}, indent=2)
          if args.json else figures.table())
    return 0


# --- detector parts ---------------------------------------------------------------------------
def detector_parts_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--archive", type=Path, default=paths.MODEL_STORE / "ssd_mobilenet_v2-1.0.mar")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)


def run_detector_parts(args: argparse.Namespace) -> int:
    try:
        figures = detector_parts.measure(args.archive, args.threads, args.batch_sizes, args.repeats,
                                         args.rounds)
    except ValueError as error:
        raise LabError(str(error)) from None
    print(json.dumps(figures, indent=2) if args.json else detector_parts.table(figures))
    return 0


# --- detector resize ------------------------------------------------------------------------------
def detector_resize_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--variants", type=int, default=30, help="seeded variants of the photos")
    parser.add_argument("--threshold", type=float, default=0.3, help="the score threshold compared at")
    parser.add_argument("--margin", type=float, default=0.01,
                        help="detections this close to the threshold count for neither side")


def run_detector_resize(args: argparse.Namespace) -> int:
    shifts = detector_resize.measure(args.variants, args.threshold, args.margin)
    print(json.dumps(detector_resize.as_json(shifts), indent=2) if args.json
          else detector_resize.table(shifts))
    return 0


# --- gpu ----------------------------------------------------------------------------------------
def gpu_arguments(parser: argparse.ArgumentParser) -> None:
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
    parser.add_argument("--steps", nargs="+", default=list(defaults.steps),
                        choices=(*gpu_lab.STEPS, *gpu_lab.EXTRA_STEPS, *gpu_lab.LEVER_STEPS),
                        help="measure only these (default: all; the ratios need the first seven, "
                             "syncs, levers and echo_workers measure a GPU batch's levers)")
    parser.add_argument("--weights", nargs="+", default=[], metavar="MODEL=FILE",
                        help="build MODEL from this weights file (e.g. ssd_mobilenet_v2=FILE from "
                             "`lab gpu-weights`, where its package is not installed)")
    parser.add_argument("--echo-workers", type=int, nargs="+", default=list(defaults.echo_workers),
                        help="worker counts of the echo_workers step")
    parser.add_argument("--levers", nargs="+",
                        choices=[f"{model}_{variant}" for model, variant, _ in gpu_lab.LEVERS],
                        help="the archive variants the levers and syncs steps measure (default: all)")


def model_weights(pairs: list[str]) -> tuple[tuple[str, str], ...]:
    """MODEL=FILE pairs; LabError for one that is not, or whose file does not exist."""
    weights = []
    for pair in pairs:
        model, _, file = pair.partition("=")
        if not model or not file:
            raise LabError(f"--weights takes MODEL=FILE, got {pair!r}")
        if not Path(file).is_file():
            raise LabError(f"--weights {model}: no such file {file}")
        weights.append((model, file))
    return tuple(weights)


def gpu_weights_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", type=Path, help="the weights file to write (.pt)")


def run_gpu_weights(args: argparse.Namespace) -> int:
    from torchserve_vision.archives.tf_ssd_weights import write_half_precision_weights

    size = write_half_precision_weights(args.out)
    print(f"wrote {args.out} ({size / 2**20:.1f} MiB): build with "
          f"`lab gpu --weights ssd_mobilenet_v2={args.out.name}`")
    return 0


def run_gpu(args: argparse.Namespace) -> int:
    settings = gpu_lab.GpuLabSettings(
        args.work_dir, args.duration, args.warm_up, tuple(args.loads), tuple(args.builtin_workers),
        images=args.images, processes=args.processes, precisions=tuple(args.precisions),
        reference_batches=tuple(args.reference_batches), detector_batches=tuple(args.detector_batches),
        models=args.models, steps=tuple(args.steps), echo_workers=tuple(args.echo_workers),
        levers=tuple(args.levers) if args.levers else None, weights=model_weights(args.weights))
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


def precision_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("archives", type=Path, nargs="*",
                        default=[paths.MODEL_STORE / name for name in PRECISION_ARCHIVES],
                        help="classifier archives (default: EfficientNet-Lite0/1/2 in model_store/)")
    parser.add_argument("--threads", type=int, default=1)


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


def startup_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="the model killed, scaled and registered again")


def run_startup(args: argparse.Namespace) -> int:
    store = own_server_store(args)
    figures = startup.measure(args.config, store, args.model)
    print(json.dumps(figures, indent=2) if args.json else startup.markdown(figures))
    return 0


def rollout_drill_arguments(parser: argparse.ArgumentParser) -> None:
    model_flag(parser)
    parser.add_argument("--load-fraction", type=float, default=0.25,
                        help="offered load as a fraction of the measured capacity")
    parser.add_argument("--canary", action="store_true",
                        help="through the front: shadow, canary steps, promotion, an aborted walk")


def run_rollout_drill(args: argparse.Namespace) -> int:
    store = own_server_store(args)
    outcome = rollout_drill.drill(args.config, store, args.model, args.load_fraction, args.canary)
    if args.json:
        print(json.dumps(outcome, indent=2))
    else:
        print(f"capacity {outcome['capacity_rps']} requests/s; offered {outcome['rate_rps']}/s")
        print(rollout_drill.markdown(outcome["steps"]))  # type: ignore[arg-type]
    return 0


# --- rolling-update -----------------------------------------------------------------------------
def rolling_update_arguments(parser: argparse.ArgumentParser) -> None:
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
def protocols_arguments(parser: argparse.ArgumentParser) -> None:
    model_flag(parser)
    image_size_flag(parser)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per way and round")
    parser.add_argument("--rounds", type=int, default=2)


def run_protocols(args: argparse.Namespace) -> int:
    figures = protocol_cost.measure(args.config, own_server_store(args), args.model,
                                    benchmark_jpeg(args.image_size), args.clients, args.duration,
                                    args.rounds,
                                    on_step=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps([asdict(figure) for figure in figures], indent=2) if args.json
          else protocol_cost.markdown(figures))
    return 0


def near_duplicates_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--archive", type=Path, default=paths.MODEL_STORE / "efficientnet_lite0-1.0.mar")
    parser.add_argument("--inputs", type=int, default=320)


def run_near_duplicates(args: argparse.Namespace) -> int:
    report = near_duplicates.measure(args.archive, args.inputs)
    print(near_duplicates.as_json(report) if args.json else near_duplicates.markdown(report))
    return 0


# --- ultralytics ----------------------------------------------------------------------------------
def ultralytics_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--weights", type=Path, nargs="+", required=True,
                        help="Ultralytics exports (.torchscript, .onnx) to serve and to predict with")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per load and per way")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8],
                        help="Ultralytics' predict on batches of these sizes")
    parser.add_argument("--batch-size", type=int, default=4, help="the served archive's batch size")
    parser.add_argument("--workers", type=int, default=1, help="the served archive's workers")
    parser.add_argument("--torch-threads", type=int, default=None, help="each worker's torch threads")


def run_ultralytics(args: argparse.Namespace) -> int:
    from torchserve_vision.model_descriptions import ServingSettings

    settings = ultralytics_serving.UltralyticsLabSettings(
        tuple(args.clients), args.duration, tuple(args.batch_sizes),
        ServingSettings(args.batch_size, 1, args.workers, args.workers), args.torch_threads)
    figures = ultralytics_serving.measure(args.weights, settings)
    print(json.dumps(figures, indent=2) if args.json else ultralytics_serving.markdown(figures))
    return 0


# --- opencv -------------------------------------------------------------------------------------
def opencv_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per load and per way")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8],
                        help="OpenCV's forward pass on batches of these sizes")
    parser.add_argument("--workers", type=int, help="the served detector's workers (default: "
                                                    "config/models.yaml's)")
    parser.add_argument("--batch-size", type=int, help="the served detector's batch size (default: "
                                                       "config/models.yaml's)")


def run_opencv(args: argparse.Namespace) -> int:
    settings = opencv_detector.OpenCvLabSettings(tuple(args.clients), args.duration, tuple(args.batch_sizes),
                                                 args.workers, args.batch_size)
    figures = opencv_detector.measure(own_server_store(args), settings)
    print(json.dumps(figures, indent=2) if args.json else opencv_detector.markdown(figures))
    return 0
