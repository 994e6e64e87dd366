"""`torchserve-vision lab ...`: load, profile, sweep, tune, compare, and the start-up, compile and
rollout measurements behind docs/benchmarks.md and docs/robustness.md."""

from __future__ import annotations

import argparse

import torchserve_vision.cli.lab_served as served
import torchserve_vision.cli.lab_standalone as standalone
from torchserve_vision.cli.common import (
    Subcommand,
    connection_flags,
    json_flag,
    model_store_flag,
    register_table,
    subcommand,
)
from torchserve_vision.lab import (
    batching_policies,
    cache_benchmark,
    capacity_plan,
    cascade_tradeoff,
    compare,
    compile_speed,
    detector_parts,
    detector_resize,
    drift_detection,
    engines,
    goodput,
    gpu_lab,
    loadgen,
    near_duplicates,
    opencv_detector,
    precision_spread,
    profile,
    protocol_cost,
    rolling_update,
    rollout_drill,
    shadow_cost,
    startup,
    sweep,
    tune,
    ultralytics_serving,
)

GPU_WEIGHTS_HELP = """\
The default detector's weights (SSD MobileNetV2 COCO, converted from its package's frozen graph)
in half precision: 32 MB, 27 MB compressed, where the package (75 MB) and the float32 weights
(67 MB) do not fit one transfer to a GPU host. `lab gpu --weights ssd_mobilenet_v2=FILE` builds
the archive from it (widened to float32). Its answers are the float32 weights' within the
detector's bounds (docs/requests.md): measured on the project's photos and 24 variants, the same
labels, scores within 0.005, boxes within 0.4 px.

    torchserve-vision lab gpu-weights .gpu-weights/ssd_mobilenet_v2-fp16.pt
"""

DESCRIPTION = """\
The serving lab: drive a server with load, profile an archive in-process, sweep and tune batch
settings, compare with TorchServe's built-in handler, measure start-up and rollouts, and plan a
deployment's replicas and autoscaling targets.
"""


def register(commands: argparse._SubParsersAction, summary: str) -> None:
    parser = subcommand(commands, "lab", summary, DESCRIPTION)
    register_table(parser.add_subparsers(dest="action", required=True, metavar="ACTION"), TABLE)


# --- the table: one entry per subcommand ---------------------------------------------------------
TABLE = (
    Subcommand("load", "closed- or open-loop load against a served model",
               served.load_arguments, served.run_load,
               description=loadgen.__doc__ or "",
               flags=lambda: [connection_flags(), json_flag()]),
    Subcommand("profile", "time per batch t(B) of an archive, in-process",
               standalone.profile_arguments, standalone.run_profile,
               description=profile.__doc__ or "",
               flags=lambda: [json_flag()]),
    Subcommand("sweep", "throughput vs p99 over batch size x delay x workers, on a live server",
               served.sweep_arguments, served.run_sweep,
               description=sweep.__doc__ or "",
               flags=lambda: [connection_flags(), model_store_flag()]),
    Subcommand("tune", "recommend batch size, delay and workers for a p99 target",
               served.tune_arguments, served.run_tune,
               description=tune.__doc__ or "",
               flags=lambda: [connection_flags(), json_flag()]),
    Subcommand("compare", "ours vs TorchServe's built-in handler vs single sessions of our engine and of "
                          "ONNX Runtime, at every load",
               served.compare_arguments, served.run_compare,
               description=compare.__doc__ or "",
               flags=lambda: [connection_flags(), model_store_flag(), json_flag()]),
    Subcommand("policies", "frontend batching settings vs continuous batching vs one shared session, at "
                           "every load",
               served.policies_arguments, served.run_policies,
               description=batching_policies.__doc__ or "",
               flags=lambda: [connection_flags(), model_store_flag(), json_flag()]),
    Subcommand("compile-speed", "eager vs torch.compile vs the ahead-of-time package, in-process",
               standalone.compile_speed_arguments, standalone.run_compile_speed,
               description=compile_speed.__doc__ or "",
               flags=lambda: [json_flag()]),
    Subcommand("engines", "every runner of an archive (AOTInductor, OpenVINO, ONNX Runtime) in-process",
               standalone.engines_arguments, standalone.run_engines,
               description=engines.__doc__ or "",
               flags=lambda: [json_flag()]),
    Subcommand("detector-parts", "where a detector's time goes, and what its engines save",
               standalone.detector_parts_arguments, standalone.run_detector_parts,
               description=detector_parts.__doc__ or "",
               flags=lambda: [json_flag()]),
    Subcommand("detector-resize", "what the resize to the default detector's input moves, on real photos",
               standalone.detector_resize_arguments, standalone.run_detector_resize,
               description=detector_resize.__doc__ or "",
               flags=lambda: [json_flag()]),
    Subcommand("gpu-weights", "the default detector's weights in half precision, to carry to a GPU host",
               standalone.gpu_weights_arguments, standalone.run_gpu_weights,
               description=GPU_WEIGHTS_HELP),
    Subcommand("goodput", "answers within the client's timeout per second, at 1x-3x capacity, with and "
                          "without deadlines",
               served.goodput_arguments, served.run_goodput,
               description=goodput.__doc__ or "",
               flags=lambda: [connection_flags(), json_flag()]),
    Subcommand("precision", "how far bf16 and compiled packages move answers, on real photos",
               standalone.precision_arguments, standalone.run_precision,
               description=precision_spread.__doc__ or "",
               flags=lambda: [json_flag()]),
    Subcommand("startup", "seconds to READY: cold and warm start, killed worker, scale-up, new version",
               standalone.startup_arguments, standalone.run_startup,
               description=startup.__doc__ or "",
               flags=lambda: [standalone.own_server_flags(), json_flag()]),
    Subcommand("rollout-drill", "rollouts, rollbacks, scaling and a killed worker under open-loop load",
               standalone.rollout_drill_arguments, standalone.run_rollout_drill,
               description=rollout_drill.__doc__ or "",
               flags=lambda: [standalone.own_server_flags(), json_flag()]),
    Subcommand("plan", "per-pod capacity, replicas and HPA targets from a measured server",
               served.plan_arguments, served.run_plan,
               description=capacity_plan.__doc__ or "",
               flags=lambda: [connection_flags(), json_flag()]),
    Subcommand("rolling-update", "pods behind HAProxy stopped and restarted in turn under load",
               standalone.rolling_update_arguments, standalone.run_rolling_update,
               description=rolling_update.__doc__ or "",
               flags=lambda: [standalone.own_server_flags(), json_flag()]),
    Subcommand("cascade", "a cascade's top-1 agreement vs served throughput over thresholds",
               served.cascade_arguments, served.run_cascade,
               description=cascade_tradeoff.__doc__ or "",
               flags=lambda: [connection_flags(), model_store_flag(), json_flag()]),
    Subcommand("cache", "the response cache: 0/50/90 % repeats, off vs memory vs Redis, an outage",
               served.cache_arguments, served.run_cache,
               description=cache_benchmark.__doc__ or "",
               flags=lambda: [connection_flags(), model_store_flag(), json_flag()]),
    Subcommand("near-duplicates", "perceptual-hash hits and wrong answers on real photos and variants",
               standalone.near_duplicates_arguments, standalone.run_near_duplicates,
               description=near_duplicates.__doc__ or "",
               flags=lambda: [json_flag()]),
    Subcommand("protocols", "tritonclient over HTTP (direct, through the front) and gRPC (the gRPC front)",
               standalone.protocols_arguments, standalone.run_protocols,
               description=protocol_cost.__doc__ or "",
               flags=lambda: [standalone.own_server_flags(), json_flag()]),
    Subcommand("shadow", "shadow agreement offline vs online, and its cost on production's p99",
               served.shadow_arguments, served.run_shadow,
               description=shadow_cost.__doc__ or "",
               flags=lambda: [connection_flags(), model_store_flag(), json_flag()]),
    Subcommand("drift", "drift readings: false alarms on in-distribution traffic, requests to detect "
                        "shifted traffic, the counting's cost",
               served.drift_arguments, served.run_drift,
               description=drift_detection.__doc__ or "",
               flags=lambda: [connection_flags(), json_flag()]),
    Subcommand("gpu", "everything a GPU machine is measured by, in one run",
               standalone.gpu_arguments, standalone.run_gpu,
               description=gpu_lab.__doc__ or "",
               flags=lambda: [json_flag()]),
    Subcommand("opencv", "the default detector served against one OpenCV dnn net on the same graph",
               standalone.opencv_arguments, standalone.run_opencv,
               description=opencv_detector.__doc__ or "",
               flags=lambda: [standalone.own_server_flags(), json_flag()]),
    Subcommand("ultralytics", "Ultralytics exports served against Ultralytics' own predict, in one run",
               standalone.ultralytics_arguments, standalone.run_ultralytics,
               description=ultralytics_serving.__doc__ or "",
               flags=lambda: [json_flag()]),
)
