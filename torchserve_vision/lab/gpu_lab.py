"""`torchserve-vision lab gpu`: what a GPU machine is measured by, in one run, with JSON for the
record (docs/benchmarks.md, "GPU").

1. Builds config/models-gpu.yaml's archives with `--target gpu` (ResNet-50 fp16, SSDlite320 and
   the default detector, SSD MobileNetV2 COCO with real weights, served; EfficientNet-Lite0 with
   real weights for the answer check), cache off. `--weights ssd_mobilenet_v2=FILE` builds the
   default detector from the half-precision weights `lab gpu-weights` writes, where its package
   is not installed (a GPU host).
2. The answer check: the Lite0 archive on the GPU at fp32, tf32, fp16 and bf16 against the same
   archive at fp32 on this machine's CPU, on the project's photos, their variants and turned
   JPEGs, by the rule of handlers.model.answer_agreement (lab/device_answers.py); at fp32 also
   from the CPU's decoded pixels and, where it is installed, decoded by nvImageCodec.
3. In-process on the same GPU, no handler (lab/gpu_reference.py): the classifier's model alone
   (autocast; half weights; half weights with its batch norms folded, as a worker runs it), the
   batched decode alone (torchvision's, nvImageCodec's; and for 4 s under `nvidia-smi dmon`,
   whether it runs on the JPEG engines), the CPU-exact resize alone (matrix products, gathers),
   the exact preprocessing of a 720x720 4:2:0 batch (chroma, resize, crop, normalisation) by
   tensor operations and by the Triton kernels, its plain pipeline from JPEG bytes to top-5, the
   detector's plain pipeline and its network alone, for each detector.
4. The load generator (several processes: lab/process_load.py) against a trivial responder that
   is not TorchServe: its own ceiling.
5. A TorchServe from the built archives (workers READY timed from the start), and on it: the echo
   model (no work, queued batching as ours) at the most clients; ours at each load with the
   time per stage from its batch log; TorchServe's built-in `image_classifier` handler on the
   same weights at 1..16 workers (torch threads = cores / workers, batch and delay fixed), the
   best at the most clients measured at each load; each detector at each load.
6. The levers of a GPU batch (`levers`, `syncs`, `echo_workers`): each archive variant of LEVERS
   (`--levers` picks some: the classifier with its preprocessing as Triton kernels, with CUDA
   graphs, with autocast over float32 weights instead of half weights, with its batch norms
   unfolded, decoding with nvImageCodec, at 2 or 4 workers, at batch 128; the detector with its
   chroma by the Triton kernels, with torchvision's per-image postprocess instead of the batched
   one, with nvImageCodec, at batch 16 with 1 worker or 64 with 2) served at the most clients
   beside the base archive, with its workers' cycle split from their batch log (`batch_ms`,
   `waited_ms`); in-process on the same GPU, for the served models and each variant that changes
   the handler, the host synchronisations of one batch (torch.cuda's sync debug mode), a
   torch.profiler trace of it (Chrome trace JSON in the work directory, for what happens inside
   torchvision and nvJPEG) and the handler's own images/s without TorchServe; the echo model at
   2, 4 and 8 workers. `planned_s` estimates a run's length before it starts.

Load: one image per request, cycling through `images` distinct 720x720 JPEGs (4:2:0, quality 90)
made from the project's photos. Without a GPU the same run rehearses on the CPU (slowly: use
small loads and durations), every figure labelled with the device it ran on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from handlers.request import nvimgcodec_decoder
from torchserve_vision import paths
from torchserve_vision.archives import ARCHIVER
from torchserve_vision.archives.build import build_archive
from torchserve_vision.client import TorchServeClient
from torchserve_vision.lab.batch_log import logged_batches, stage_means
from torchserve_vision.lab.benchmark_images import distinct_jpegs
from torchserve_vision.lab.compare import register, unregister_all
from torchserve_vision.lab.device_answers import answer_check_images, compare_devices
from torchserve_vision.lab.echo_archive import ECHO_QUEUED, build_echo_archive
from torchserve_vision.lab.gpu_reference import (
    classifier_pipeline,
    decode_engine_use,
    decode_only,
    detector_network_only,
    detector_pipeline,
    exact_preprocessing_only,
    images_per_s,
    model_only,
    resize_only,
)
from torchserve_vision.lab.loadgen import Report
from torchserve_vision.lab.process_load import default_processes, run_processes, trivial_responder
from torchserve_vision.local_handler import eager_classifier, extract_archive
from torchserve_vision.model_descriptions import ModelDescription, ServingSettings, load_descriptions
from torchserve_vision.server_process import TorchServeInstance, instance_for, start, stop
from torchserve_vision.torchserve_config import server_config, write_models_block

GPU_MODELS = Path("config/models-gpu.yaml")
CLASSIFIER, DETECTOR, ANSWERS_MODEL = "resnet50", "ssdlite320", "efficientnet_lite0"
COCO_DETECTOR = "ssd_mobilenet_v2"          # the project's default detector, real COCO weights
BUILTIN = "builtin_resnet50"
GOAL_IMAGES_PER_S = 10_000
# What one run measures, in order; a run may ask for some of them (the ratios need them all).
STEPS = ("answers", "in_process", "load_generator", "echo", "classifier", "builtin", "detector")
# Beside them: the default detector served (its reference figures come with `in_process`).
EXTRA_STEPS = ("coco_detector",)
LEVER_STEPS = ("syncs", "levers", "echo_workers")
# Archive variants of the served models: (model, variant name, handler settings over its own;
# "serving" overrides the description's serving settings, as absolute values: since 2026-11-28
# config/models-gpu.yaml serves the classifier at 4 workers and the detector at batch 64 with 2,
# so `4_workers` and `batch_64_2_workers` are the base archives' settings and `2_workers` and
# `batch_16_1_worker` the earlier ones). Those decoding with nvImageCodec are measured where it is
# installed.
LEVERS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    (CLASSIFIER, "preprocess_kernels", {"cuda_preprocess_kernels": True}),
    (CLASSIFIER, "graphs", {"cuda_graphs": True}),
    (CLASSIFIER, "autocast", {"cuda_half_weights": False}),
    (CLASSIFIER, "unfolded_batch_norm", {"cuda_fold_batch_norm": False}),
    (CLASSIFIER, "nvimgcodec", {"jpeg_decoder": "nvimgcodec"}),
    (CLASSIFIER, "nvimgcodec_4_workers", {"jpeg_decoder": "nvimgcodec",
                                          "serving": {"min_workers": 4, "max_workers": 4}}),
    (CLASSIFIER, "4_workers", {"serving": {"min_workers": 4, "max_workers": 4}}),
    (CLASSIFIER, "2_workers", {"serving": {"min_workers": 2, "max_workers": 2}}),
    (CLASSIFIER, "nvimgcodec_batch_128_4_workers", {"jpeg_decoder": "nvimgcodec", "serving": {
        "batch_size": 128, "min_workers": 4, "max_workers": 4}}),
    (DETECTOR, "preprocess_kernels", {"cuda_preprocess_kernels": True}),
    (DETECTOR, "per_image_postprocess", {"detection": {"postprocess": "per-image"}}),
    (DETECTOR, "nvimgcodec", {"jpeg_decoder": "nvimgcodec"}),
    (DETECTOR, "batch_64_2_workers", {"serving": {"batch_size": 64, "min_workers": 2, "max_workers": 2}}),
    (DETECTOR, "batch_16_1_worker", {"serving": {"batch_size": 16, "min_workers": 1, "max_workers": 1}}),
)
# Seconds a step spends apart from its measured loads (building a variant, registering it, its
# workers starting), rounded up from a rehearsal on a 2-core CPU machine (2026-11-28: the three
# steps in 93 s, builds included): what `planned_s` adds per variant, per server and per model
# whose batch `syncs` measures.
VARIANT_OVERHEAD_S = 15.0
SERVER_OVERHEAD_S = 20.0
SYNCS_PER_MODEL_S = 6.0
HANDLER_BATCH_REPEATS = 8
HANDLER_BATCH_WARM_UP = 2


@dataclass(frozen=True)
class GpuLabSettings:
    work_dir: Path
    duration_s: float = 8.0
    warm_up_s: float = 2.0
    loads: tuple[int, ...] = (1, 64, 256)
    builtin_workers: tuple[int, ...] = (1, 2, 4, 8, 16)
    builtin_batch_delay_ms: int = 5
    images: int = 1000
    processes: int = dataclasses.field(default_factory=default_processes)
    precisions: tuple[str, ...] = ("fp32", "tf32", "fp16", "bf16")
    reference_batches: tuple[int, ...] = (64, 128, 256)
    detector_batches: tuple[int, ...] = (16, 64)
    models: Path = GPU_MODELS
    steps: tuple[str, ...] = (*STEPS, *EXTRA_STEPS, *LEVER_STEPS)
    # (model, weights file) in place of the descriptions' weights: the default detector's,
    # carried to a GPU host in half precision (`lab gpu-weights`), where its package is not
    weights: tuple[tuple[str, str], ...] = ()
    echo_workers: tuple[int, ...] = (2, 4, 8)
    # The variants `levers` and `syncs` measure, by name (`<model>_<variant>`); None: all of LEVERS.
    levers: tuple[str, ...] | None = None


def lab_device() -> torch.device:
    return torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")


def gpu_id_of(device: torch.device) -> int | None:
    """The gpu_id TorchServe gives a worker on `device` (None on the CPU)."""
    return (device.index or 0) if device.type == "cuda" else None


def synchronisations(run: Callable[[], Any]) -> int:
    """The host synchronisations torch.cuda's sync debug mode warns of while `run()` runs."""
    import warnings

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(warning.message) for warning in caught)


def built(description: ModelDescription, store: Path) -> Path:
    """The archive of `description` in `store`, built for GPU workers first if it is not there."""
    archive = store / description.archive_name
    if not archive.is_file():
        build_archive(description, store, "gpu", reference_requests=0)
    return archive


def machine(device: torch.device) -> dict[str, Any]:
    import torchvision

    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "torchvision": torchvision.__version__,
            "cpus": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
            "when": datetime.now().isoformat(timespec="seconds")}


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def summary(report: Report) -> dict[str, Any]:
    return {"images_per_s": report.throughput_rps, "p50_ms": report.latency_ms.get("p50"),
            "p99_ms": report.latency_ms.get("p99"), "errors": report.errors}


# --- steps -----------------------------------------------------------------------------------------
def with_weights(descriptions: Sequence[ModelDescription],
                 weights: dict[str, str]) -> list[ModelDescription]:
    """`descriptions` with the weights of the models named in `weights` replaced by those files."""
    return [dataclasses.replace(d, weights=weights[d.name]) if d.name in weights else d
            for d in descriptions]


def build_models(descriptions: Sequence[ModelDescription], store: Path) -> None:
    for description in descriptions:
        say(f"building {description.name} for GPU workers")
        build_archive(description, store, "gpu", reference_requests=0)


def answer_check(store: Path, work: Path, device: torch.device,
                 precisions: Sequence[str]) -> list[dict[str, Any]]:
    model_dir = extract_archive(store / f"{ANSWERS_MODEL}-1.0.mar", work / "answers-model")
    threads = torch.get_num_threads()
    try:
        results = compare_devices(model_dir, gpu_id_of(device), precisions, answer_check_images(),
                                  decode_share=True, nvimgcodec=nvimgcodec_decoder.available())
    finally:
        torch.set_num_threads(threads)
    for result in results:
        say(f"answers {result.precision} ({result.decoded_on} decode): max change "
            f"{result.max_change:.4f} (bound {result.bound}), top-1 changed {result.top1_changes}, "
            f"outside {len(result.disagreements)} of {result.images}")
    return [result.to_dict() for result in results]


def in_process(store: Path, work: Path, jpegs: Sequence[bytes], device: torch.device,
               settings: GpuLabSettings) -> dict[str, Any]:
    """The classifier's model alone (as loaded; with half weights where the archive runs fp16 or
    bf16 on CUDA; and that with its batch norms folded, as its workers run it) and plain
    pipeline; the batched JPEG decode alone, by torchvision and by nvImageCodec where it is
    installed; the CPU-exact resize alone, both ways; the detector's plain pipeline and its
    network alone (backbone and head)."""
    from handlers.model.model_loading import load_model
    from handlers.model.settings import parse_detector_settings
    from torchserve_vision.local_handler import archive_context

    classifier_dir = extract_archive(store / f"{CLASSIFIER}-1.0.mar", work / "reference-classifier")
    cls, network = eager_classifier(classifier_dir)
    network = network.to(device)
    precision = cls.precision if device.type == "cuda" else "fp32"
    batches = settings.reference_batches
    result: dict[str, Any] = {
        "classifier_model_only": model_only(network, cls.input_size, precision, cls.channels_last,
                                            batches, device),
        "classifier_model_half_weights": model_only(network, cls.input_size, precision, cls.channels_last,
                                                    batches, device, half_weights=True),
        "classifier_model_as_served": model_only(network, cls.input_size, precision, cls.channels_last,
                                                 batches, device, half_weights=True, fold_batch_norm=True),
        "decode_torchvision": decode_only(jpegs, batches[:2], device, "torchvision"),
        "resize_matmul": resize_only(batches[:1], device, "matmul"),
        "resize_gathers": resize_only(batches[:1], device, "gathers"),
        "preprocess_tensor_ops": exact_preprocessing_only(batches[:1], device, kernels=False),
        "classifier_pipeline": classifier_pipeline(network, jpegs, cls.resize_size, cls.input_size,
                                                   cls.mean, cls.std, precision, cls.channels_last,
                                                   batches[:2], device)}
    if device.type == "cuda":     # on a CPU Triton's interpreter runs them: minutes, and meaningless
        result["preprocess_kernels"] = exact_preprocessing_only(batches[:1], device, kernels=True)
    result[f"{ENGINE_USE}torchvision"] = decode_engine_use(jpegs, batches[0], device, "torchvision")
    if nvimgcodec_decoder.available():
        result["decode_nvimgcodec"] = decode_only(jpegs, batches[:2], device, "nvimgcodec")
        result[f"{ENGINE_USE}nvimgcodec"] = decode_engine_use(jpegs, batches[0], device, "nvimgcodec")
    for name, prefix in ((DETECTOR, "detector"), (COCO_DETECTOR, "coco_detector")):
        if not (store / f"{name}-1.0.mar").exists():
            continue
        detector_dir = extract_archive(store / f"{name}-1.0.mar", work / f"reference-{name}")
        context = archive_context(detector_dir)
        detector_settings = parse_detector_settings((context.model_yaml_config or {})["handler"])
        detector = load_model(detector_settings.model,
                              detector_dir / context.manifest["model"]["serializedFile"], device)
        result[f"{prefix}_pipeline"] = detector_pipeline(detector, jpegs, detector_settings.precision,
                                                         settings.detector_batches, device)
        result[f"{prefix}_network_only"] = detector_network_only(detector, detector_settings.precision,
                                                                 settings.detector_batches, device)
    say(f"in-process: {json.dumps(result)}")
    return result


def load_generator_ceiling(jpegs: Sequence[bytes], work: Path, settings: GpuLabSettings) -> dict[str, Any]:
    with trivial_responder(settings.processes) as url:
        report = run_processes(url, jpegs, max(settings.loads), settings.processes,
                               settings.duration_s, settings.warm_up_s, work)
    say(f"load generator against a trivial responder: {report.table()}")
    return summary(report)


@contextlib.contextmanager
def lab_server(work: Path, store: Path,
               descriptions: Sequence[ModelDescription]) -> Iterator[tuple[TorchServeInstance, float]]:
    """A TorchServe serving the started models from `store` (model API on, a deep queue for the
    most clients); yields it and the seconds from start to every worker READY."""
    config = server_config(work / "server", store, paths.DEVELOPMENT_CONFIG, job_queue_size="4096")
    write_models_block(config, descriptions)
    instance = instance_for(config, work / "run")
    started = time.perf_counter()
    start(instance, store, timeout_s=900)
    ready_s = time.perf_counter() - started
    say(f"server started, every worker READY in {ready_s:.1f} s")
    try:
        yield instance, ready_s
    finally:
        stop(instance)


def drive(url: str, jpegs: Sequence[bytes], clients: int, work: Path, settings: GpuLabSettings,
          label: str) -> tuple[Report, list[datetime]]:
    started = datetime.now()
    report = run_processes(url, jpegs, clients, settings.processes, settings.duration_s,
                           settings.warm_up_s, work)
    say(f"  {label}, {clients} clients: {report.table()}")
    return report, [started, datetime.now()]


def served(client: TorchServeClient, model: str, jpegs: Sequence[bytes], work: Path,
           settings: GpuLabSettings, log: Path | None = None) -> dict[str, Any]:
    """`model` at each load; with `log`, the stage times of its batches at each load (at one
    client: where a lone request's time goes)."""
    by_load: dict[str, Any] = {}
    for clients in settings.loads:
        report, window = drive(client.prediction_url(model), jpegs, clients, work, settings, model)
        by_load[str(clients)] = summary(report)
        if log is not None and log.is_file():
            with log.open(encoding="utf-8", errors="replace") as lines:
                batches = [batch for batch in logged_batches(lines, model, "1.0")
                           if window[0] <= batch.at <= window[1]]
            by_load[str(clients)]["stages"] = stage_means(batches)
    return by_load


def echo_ceiling(client: TorchServeClient, store: Path, jpegs: Sequence[bytes], work: Path,
                 settings: GpuLabSettings, workers: int) -> dict[str, Any]:
    archive = build_echo_archive(store, ECHO_QUEUED)
    register(client, store, archive, ECHO_QUEUED,
             ServingSettings(batch_size=64, max_batch_delay_ms=0, min_workers=workers, max_workers=workers))
    try:
        report, _ = drive(client.prediction_url(ECHO_QUEUED), jpegs, max(settings.loads), work,
                          settings, f"echo ({workers} workers)")
    finally:
        unregister_all(client, ECHO_QUEUED)
    return {"workers": workers, **summary(report)}


BUILTIN_HANDLER = '''import torch
from ts.torch_handler.image_classifier import ImageClassifier


class Builtin(ImageClassifier):
    """TorchServe's image_classifier, its torch threads set from the archive's YAML."""

    def initialize(self, context):
        torch.set_num_threads(int(context.model_yaml_config["torchThreads"]))
        super().initialize(context)
'''


def build_builtin_archives(store: Path, work: Path, workers: Sequence[int]) -> dict[int, str]:
    """The classifier's network traced to TorchScript for TorchServe's image_classifier handler,
    one archive per worker count (its torch threads = cores / workers)."""
    from torchserve_vision.model_descriptions import resolve_labels

    _, network = eager_classifier(extract_archive(store / f"{CLASSIFIER}-1.0.mar", work / "builtin"))
    staging = work / "builtin-staging"
    staging.mkdir(parents=True, exist_ok=True)
    program = staging / "model.pt"
    with torch.inference_mode():
        torch.jit.save(torch.jit.trace(network.float().eval(), torch.zeros(1, 3, 224, 224)), str(program))
    labels = staging / "index_to_name.json"
    labels.write_text(json.dumps({str(i): n for i, n in enumerate(resolve_labels("imagenet"))}))
    handler = staging / "builtin_handler.py"
    handler.write_text(BUILTIN_HANDLER)
    archives = {}
    for count in workers:
        name = f"{BUILTIN}_w{count}"
        config = staging / f"{name}.yaml"
        config.write_text(f"torchThreads: {max(1, (os.cpu_count() or 1) // count)}\n")
        subprocess.run([str(ARCHIVER), "--model-name", name, "--version", "1.0", "--serialized-file",
                        str(program), "--handler", str(handler), "--extra-files", str(labels),
                        "--config-file", str(config), "--export-path", str(store), "--force"],
                       check=True, capture_output=True)
        archives[count] = f"{name}.mar"
    return archives


def builtin_sweep(client: TorchServeClient, store: Path, jpegs: Sequence[bytes], work: Path,
                  settings: GpuLabSettings, batch_size: int) -> dict[str, Any]:
    """Every worker count at the most clients; then the best at every load."""
    archives = build_builtin_archives(store, work, settings.builtin_workers)
    most, sweep = max(settings.loads), {}

    def registered(count: int) -> None:
        register(client, store, archives[count], BUILTIN,
                 ServingSettings(batch_size=batch_size, max_batch_delay_ms=settings.builtin_batch_delay_ms,
                                 min_workers=count, max_workers=count, batching="delayed"))

    for count in archives:
        registered(count)
        try:
            report, _ = drive(client.prediction_url(BUILTIN), jpegs, most, work, settings,
                              f"built-in, {count} workers")
            sweep[count] = summary(report)
        finally:
            unregister_all(client, BUILTIN)
    best = max(sweep, key=lambda count: sweep[count]["images_per_s"])
    by_load = {str(most): sweep[best]}
    registered(best)
    try:
        for clients in settings.loads:
            if clients != most:
                by_load[str(clients)] = summary(drive(client.prediction_url(BUILTIN), jpegs, clients, work,
                                                      settings, f"built-in, {best} workers")[0])
    finally:
        unregister_all(client, BUILTIN)
    return {"sweep_at_most_clients": {str(count): row for count, row in sweep.items()},
            "best_workers": best, "best": by_load, "batch_size": batch_size,
            "max_batch_delay_ms": settings.builtin_batch_delay_ms}


def variant_description(description: ModelDescription, variant: str,
                        overrides: dict[str, Any]) -> ModelDescription:
    """`description` under the name `<name>_<variant>`, its handler settings updated by
    `overrides` (a nested section merged into its own; "serving" replaces serving settings)."""
    options = dict(description.handler_options)
    serving = description.serving
    for key, value in overrides.items():
        if key == "serving":
            serving = dataclasses.replace(serving, **value)
        else:
            options[key] = {**options.get(key, {}), **value} if isinstance(value, dict) else value
    return dataclasses.replace(description, name=f"{description.name}_{variant}", handler_options=options,
                               serving=serving)


def lever_variants(descriptions: Sequence[ModelDescription],
                   chosen: Sequence[str] | None = None) -> list[tuple[str, ModelDescription]]:
    """(the served model it varies, the variant's description) for each of LEVERS, or of those
    named in `chosen`; those that decode with nvImageCodec only where it is installed."""
    by_name = {description.name: description for description in descriptions}
    return [(model, variant_description(by_name[model], variant, overrides))
            for model, variant, overrides in LEVERS
            if model in by_name and (chosen is None or f"{model}_{variant}" in chosen)
            and (overrides.get("jpeg_decoder") != "nvimgcodec" or nvimgcodec_decoder.available())]


def handler_variants(descriptions: Sequence[ModelDescription],
                     chosen: Sequence[str] | None = None) -> list[ModelDescription]:
    """The variants of `lever_variants` that change their model's handler settings (not only its
    serving settings): those whose batch `syncs` measures in-process."""
    by_name = {description.name: description for description in descriptions}
    return [variant for model, variant in lever_variants(descriptions, chosen)
            if variant.handler_options != by_name[model].handler_options]


def served_variants(client: TorchServeClient, store: Path, jpegs: Sequence[bytes], work: Path,
                    settings: GpuLabSettings, descriptions: Sequence[ModelDescription],
                    log: Path) -> dict[str, Any]:
    """Each variant registered beside the base archive and driven at the most clients, with its
    workers' stage times and cycle split; then unregistered."""
    results: dict[str, Any] = {}
    most = max(settings.loads)
    for _, variant in lever_variants(descriptions, settings.levers):
        register(client, store, built(variant, store).name, variant.name, variant.serving)
        try:
            report, window = drive(client.prediction_url(variant.name), jpegs, most, work, settings,
                                   variant.name)
            row = summary(report)
            with log.open(encoding="utf-8", errors="replace") as lines:
                batches = [batch for batch in logged_batches(lines, variant.name, variant.version)
                           if window[0] <= batch.at <= window[1]]
            row["stages"] = stage_means(batches)
            results[variant.name] = row
        finally:
            unregister_all(client, variant.name)
    return results


def batch_synchronisations(store: Path, work: Path, jpegs: Sequence[bytes], device: torch.device,
                           descriptions: Sequence[ModelDescription],
                           chosen: Sequence[str] | None = None) -> dict[str, Any]:
    """In-process on `device`: for each served model and each of its variants (`chosen`) that
    changes its handler's settings (not only its serving settings), one
    batch of its batch size under torch.cuda's sync debug mode (the synchronisations it warns
    of) and under torch.profiler (a Chrome trace in `work`/traces), and the handler's images/s
    on such batches of distinct images in one process, without TorchServe (the best of
    HANDLER_BATCH_REPEATS): what one worker's handler could serve if nothing else took time."""
    import base64

    from torchserve_vision.local_handler import archive_context, load_handler

    traces = work / "traces"
    traces.mkdir(parents=True, exist_ok=True)
    served = [description for description in descriptions if description.start]
    candidates = [*served, *handler_variants(descriptions, chosen)]
    results: dict[str, Any] = {}
    for description in candidates:
        handler = load_handler(extract_archive(built(description, store), work / "syncs" / description.name),
                               description.serving.batch_size, gpu_id_of(device))
        body = ((lambda jpeg: {"body": {"data": base64.b64encode(jpeg).decode()}})
                if description.kind.network == "detector" else (lambda jpeg: {"body": bytearray(jpeg)}))
        batch = description.serving.batch_size
        rows = [body(jpeg) for jpeg in jpegs[:batch]]

        def run_batch(handler: Any = handler, rows: list[dict[str, Any]] = rows) -> None:
            handler.handle(rows, archive_context(handler.model_dir, request_headers=[{} for _ in rows]))

        # each timed round's requests and context made beforehand: only `handle` is timed
        rounds = [([body(jpegs[(round_index * batch + offset) % len(jpegs)]) for offset in range(batch)],
                   archive_context(handler.model_dir, request_headers=[{} for _ in range(batch)]))
                  for round_index in range(HANDLER_BATCH_WARM_UP + HANDLER_BATCH_REPEATS)]

        def timed_batch(round_index: int, handler: Any = handler, rounds: Any = rounds) -> None:
            handler.handle(*rounds[round_index])

        run_batch()
        counted = synchronisations(run_batch) if device.type == "cuda" else 0
        trace = traces / f"{description.name}.json"
        activities = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with torch.profiler.profile(activities=activities, with_stack=True) as profiler:
            run_batch()
        profiler.export_chrome_trace(str(trace))
        ranges = range_times(profiler.key_averages())
        rate = images_per_s(timed_batch, batch, device, repeats=HANDLER_BATCH_REPEATS,
                            warm_up=HANDLER_BATCH_WARM_UP)
        results[description.name] = {"batch": len(rows), "synchronisations": counted,
                                     "trace": str(trace), "handler_images_per_s": rate,
                                     "ranges_ms": ranges}
        say(f"syncs {description.name}: {counted} in a batch of {len(rows)} (trace {trace}); "
            f"its handler in-process {rate:.0f} images/s")
    return results


# The handler's profiler ranges (handlers/batch/batch_record.py's stages, the decode call and the
# chroma interpolation in handlers/request/decode.py).
RANGE_PREFIXES = ("stage:", "decode:")


def range_times(averages: Sequence[Any]) -> dict[str, dict[str, float]]:
    """Per handler range of one profiled batch: the host's time inside it and the GPU time of the
    kernels launched inside it (torch.profiler's key averages, in ms; 0 on a CPU)."""
    times = {}
    for average in averages:
        if average.key.startswith(RANGE_PREFIXES):
            # torch >= 2.4 names the GPU's total device_time_total (the GPU host's 2.11 too)
            name = "device_time_total" if hasattr(average, "device_time_total") else "cuda_time_total"
            device_us = float(getattr(average, name, 0.0))
            times[average.key] = {"host_ms": round(average.cpu_time_total / 1000, 3),
                                  "device_ms": round(device_us / 1000, 3), "calls": average.count}
    return times


def echo_at_workers(client: TorchServeClient, store: Path, jpegs: Sequence[bytes], work: Path,
                    settings: GpuLabSettings) -> list[dict[str, Any]]:
    return [echo_ceiling(client, store, jpegs, work, settings, workers) for workers in settings.echo_workers]


def planned_s(settings: GpuLabSettings, descriptions: Sequence[ModelDescription]) -> float:
    """About how long a run of `settings` takes apart from building the served archives and the
    answer check: each measured load is a warm-up and a duration, each variant, server and
    measured batch their overhead (VARIANT_OVERHEAD_S, SERVER_OVERHEAD_S, SYNCS_PER_MODEL_S)."""
    load_s = settings.warm_up_s + settings.duration_s
    wanted = set(settings.steps)
    plan = 0.0
    if wanted & {"echo", "classifier", "builtin", "detector", "coco_detector", "levers", "echo_workers"}:
        plan += SERVER_OVERHEAD_S
    plan += load_s * (("echo" in wanted) + len(settings.loads) * (("classifier" in wanted)
                                                                  + ("detector" in wanted)
                                                                  + ("coco_detector" in wanted)))
    if "builtin" in wanted:
        plan += (load_s + VARIANT_OVERHEAD_S) * len(settings.builtin_workers) + load_s * len(settings.loads)
    if "levers" in wanted:
        plan += (load_s + VARIANT_OVERHEAD_S) * len(lever_variants(descriptions, settings.levers))
    if "echo_workers" in wanted:
        plan += (load_s + VARIANT_OVERHEAD_S) * len(settings.echo_workers)
    if "syncs" in wanted:
        served = [description for description in descriptions if description.start]
        plan += SYNCS_PER_MODEL_S * (len(handler_variants(descriptions, settings.levers)) + len(served))
    if "load_generator" in wanted:
        plan += load_s
    return plan


def ratios(record: dict[str, Any], loads: Sequence[int]) -> dict[str, Any]:
    most = str(max(loads))
    ours = record["served"][CLASSIFIER][most]["images_per_s"]
    reference = max(record["in_process"]["classifier_pipeline"].values())
    detector_reference = max(record["in_process"]["detector_pipeline"].values())
    detector = max(row["images_per_s"] for row in record["served"][DETECTOR].values())
    builtin = max(row["images_per_s"] for row in record["builtin"]["best"].values())
    coco: dict[str, float] = {}
    if record["served"].get(COCO_DETECTOR) and "coco_detector_pipeline" in record["in_process"]:
        served_coco = max(row["images_per_s"] for row in record["served"][COCO_DETECTOR].values())
        coco = {"coco_detector_over_its_reference": served_coco / max(
                    record["in_process"]["coco_detector_pipeline"].values()),
                "coco_detector_over_its_network": served_coco / max(
                    record["in_process"]["coco_detector_network_only"].values())}
    return {
        **coco,
        "ours_images_per_s": ours, "goal_images_per_s": GOAL_IMAGES_PER_S,
        "ours_over_reference_pipeline": ours / reference,
        "ours_over_builtin": ours / builtin,
        "one_client_p50_ms": record["served"][CLASSIFIER].get("1", {}).get("p50_ms"),
        "detector_over_its_reference": detector / detector_reference,
        "load_generator_ceiling_over_ours": record["load_generator"]["images_per_s"] / ours,
        "echo_over_ours": record["echo"]["images_per_s"] / ours,
        "answers_agree": all(result["agrees"] for result in record["answers"]),
    }


def run_gpu_lab(settings: GpuLabSettings,
                on_step: Callable[[dict[str, Any]], None] = lambda record: None) -> dict[str, Any]:
    """Every step in turn; `on_step` sees the record after each (a run cut short keeps what it
    measured). A step that fails is recorded under "failed" and the steps that do not need it run."""
    device = lab_device()
    work, store = settings.work_dir, settings.work_dir / "store"
    store.mkdir(parents=True, exist_ok=True)
    os.environ.pop("TSV_CACHE", None)            # the cache off: every request computed
    descriptions = with_weights(load_descriptions(settings.models), dict(settings.weights))
    record: dict[str, Any] = {"machine": machine(device), "settings": {
        key: str(value) if isinstance(value, Path) else value
        for key, value in dataclasses.asdict(settings).items()}}

    def step(name: str, measure: Callable[[], Any], into: dict[str, Any] = record,
             key: str | None = None) -> None:
        """`measure` into `into[key or name]` when the run asks for `name`."""
        if name not in wanted:
            return
        try:
            into[key or name] = measure()
        except Exception as error:   # noqa: BLE001 - recorded, and the lab exits non-zero
            record.setdefault("failed", {})[name] = f"{type(error).__name__}: {error}"
            say(f"{name} FAILED: {type(error).__name__}: {error}")
        on_step(record)

    say(f"lab gpu on {record['machine']['device']} (torch {torch.__version__}), about "
        f"{planned_s(settings, descriptions) / 60:.1f} minutes besides building and the answer check")
    jpegs = distinct_jpegs(settings.images)
    wanted = set(settings.steps)
    build_models([d for d in descriptions if d.start or (d.name == ANSWERS_MODEL and "answers" in wanted)],
                 store)
    step("answers", lambda: answer_check(store, work, device, settings.precisions))
    step("in_process", lambda: in_process(store, work, jpegs, device, settings))
    step("load_generator", lambda: load_generator_ceiling(jpegs, work, settings))
    step("syncs", lambda: batch_synchronisations(store, work, jpegs, device, descriptions, settings.levers))
    if wanted & {"echo", "classifier", "builtin", "detector", "coco_detector", "levers", "echo_workers"}:
        classifier = next(d for d in descriptions if d.start and d.name == CLASSIFIER)
        with lab_server(work, store, descriptions) as (instance, ready_s):
            client, log = instance.client(timeout_s=60), instance.log_dir / "model_log.log"
            record["server_start_to_ready_s"] = ready_s
            served_by_model = record["served"] = {}
            step("echo", lambda: echo_ceiling(client, store, jpegs, work, settings,
                                              classifier.serving.min_workers))
            step("classifier", lambda: served(client, CLASSIFIER, jpegs, work, settings, log),
                 served_by_model, CLASSIFIER)
            step("builtin", lambda: builtin_sweep(client, store, jpegs, work, settings,
                                                  classifier.serving.batch_size))
            step("detector", lambda: served(client, DETECTOR, jpegs, work, settings, log),
                 served_by_model, DETECTOR)
            if any(d.start and d.name == COCO_DETECTOR for d in descriptions):
                step("coco_detector", lambda: served(client, COCO_DETECTOR, jpegs, work, settings, log),
                     served_by_model, COCO_DETECTOR)
            step("levers", lambda: served_variants(client, store, jpegs, work, settings, descriptions, log))
            step("echo_workers", lambda: echo_at_workers(client, store, jpegs, work, settings))
    if wanted >= set(STEPS):
        wanted.add("ratios")
        step("ratios", lambda: ratios(record, settings.loads))
    return record


ENGINE_USE = "decode_engines_"       # in-process entries of decode_engine_use, not rates


def engine_use_line(name: str, use: dict[str, Any]) -> str:
    if not use["measured"]:
        return f"{name}: not measured ({use['why']})"
    return (f"{name}: busiest sample {use['busiest_percent']} over {use['samples']} s, "
            f"{use['images_per_s']:.0f} images/s, on the JPEG engines: {use['on_jpeg_engines']}")


def as_text(record: dict[str, Any]) -> str:
    """The record as lines; a step that did not run or failed is left out (see "failed")."""
    lines = [f"lab gpu: {record['machine']['device']}, torch {record['machine']['torch']}, "
             f"torchvision {record['machine']['torchvision']}, {record['machine']['cpus']} CPUs"]
    for result in record.get("answers", []):
        lines.append(f"answers {result['precision']:>4} ({result['decoded_on']} decode) vs CPU fp32: "
                     f"max change {result['max_change']:.4f} "
                     f"(bound {result['bound']:g}), top-1 changed {result['top1_changes']}, "
                     f"outside {len(result['disagreements'])} of {result['images']}")
    if "in_process" in record:
        lines.append("in-process images/s: " + "; ".join(
            f"{name} " + ", ".join(f"b{batch} {rate:.0f}" for batch, rate in rates.items())
            for name, rates in record["in_process"].items() if not name.startswith(ENGINE_USE)))
        lines.extend(engine_use_line(name, use) for name, use in record["in_process"].items()
                     if name.startswith(ENGINE_USE))
    if "load_generator" in record:
        lines.append(f"load generator ceiling (trivial responder): "
                     f"{record['load_generator']['images_per_s']:.0f}/s")
    if "echo" in record:
        lines.append(f"echo model ({record['echo']['workers']} workers): "
                     f"{record['echo']['images_per_s']:.0f}/s")
    if "server_start_to_ready_s" in record:
        lines.append(f"workers READY {record['server_start_to_ready_s']:.1f} s after server start")
    for model, by_load in record.get("served", {}).items():
        for clients, row in by_load.items():
            lines.append(f"{model} {clients:>3} clients: {row['images_per_s']:.0f} images/s, "
                         f"p50 {row['p50_ms']:.1f} ms, p99 {row['p99_ms']:.1f} ms, errors {row['errors']}"
                         + (f"\n    stages {json.dumps(row['stages'])}" if "stages" in row else ""))
    if "builtin" in record:
        builtin = record["builtin"]
        sweep = builtin["sweep_at_most_clients"]
        lines.append(f"built-in image_classifier: best {builtin['best_workers']} workers; sweep "
                     + ", ".join(f"{w}: {row['images_per_s']:.0f}" for w, row in sweep.items()))
        for clients, row in builtin["best"].items():
            lines.append(f"built-in {clients:>3} clients: {row['images_per_s']:.0f} images/s, "
                         f"p50 {row['p50_ms']:.1f} ms")
    for name, row in record.get("levers", {}).items():
        lines.append(f"lever {name}: {row['images_per_s']:.0f} images/s, p50 {row['p50_ms']:.1f} ms"
                     + (f"\n    stages {json.dumps(row['stages'])}" if row.get("stages") else ""))
    for name, row in record.get("syncs", {}).items():
        lines.append(f"synchronisations {name}: {row['synchronisations']} in a batch of {row['batch']}")
    for row in record.get("echo_workers", []):
        lines.append(f"echo model ({row['workers']} workers): {row['images_per_s']:.0f}/s")
    lines += [f"{name}: {value:.3f}" if isinstance(value, float) else f"{name}: {value}"
              for name, value in record.get("ratios", {}).items()]
    lines += [f"FAILED {name}: {why}" for name, why in record.get("failed", {}).items()]
    return "\n".join(lines)


def default_work_dir() -> Path:
    return Path(tempfile.gettempdir()) / "tsv-gpu-lab"
