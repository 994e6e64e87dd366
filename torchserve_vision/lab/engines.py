"""Every runner of a classifier archive side by side, in one process, on this CPU: ms per batch
at batch 1 and the model's batch size (interleaved rounds, best of each), top-1 agreement with
the eager fp32 network on the photos (26 images x 4 orientations), whether the worker's check
passes, the order these figures give for this CPU's kind (fastest first by the geometric mean of
the two batch sizes' times: paste it into `compile.runner_order` or runner_order.py), and the
runner a worker would choose here against the best of ONNX Runtime and OpenVINO at their defaults
(ONNX Runtime: fp32; OpenVINO: bf16 where the CPU has it natively, else f32).

    torchserve-vision lab engines                        # model_store/efficientnet_lite0-1.0.mar
    torchserve-vision lab engines --threads 2 --rounds 5
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 torchserve-vision lab engines   # avx2's order

Every runner runs at the same thread count (default: the archive's `torch_threads`, what a
worker runs with). The forced-AVX2 rehearsal holds torch's kernels and OpenVINO's (its oneDNN
reads ONEDNN_MAX_CPU_ISA: the int8 layers then run without VNNI, as on an AVX2-only EPYC) to
AVX2; ONNX Runtime picks its kernels from the CPU whatever the variables say.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from handlers.model.classifier_model import ClassifierModel
from handlers.model.compiled_model import (
    CompiledModelRefused,
    MachineTarget,
    check_answers,
    load_probe_photos,
    reference_answers,
)
from handlers.model.model_loading import cpu_has_native_bf16
from handlers.model.runner_order import ENGINE_PRECISIONS, RunnerName, order_for
from handlers.model.runner_selection import (
    ArchiveRunners,
    candidates,
    checked_precisions,
    load_candidate,
    resolved,
)
from handlers.model.settings import ClassifierSettings, parse_classifier_settings
from torchserve_vision.lab.compile_speed import Forward, best_ms_interleaved
from torchserve_vision.local_handler import archive_context, extract_archive


@dataclass
class EngineFigures:
    cpu: str
    cpu_kind: str
    threads: int
    batch_sizes: list[int]
    best_ms: dict[str, dict[int, float]]      # runner -> batch size -> best ms per batch
    agreement: dict[str, dict[str, float]]    # runner -> photos / all -> top-1 agreement with fp32
    passes_check: dict[str, bool]
    chosen: str                               # what a worker chooses here
    archive_order: list[str]
    defaults: dict[str, str] = field(default_factory=dict)   # engine -> its default runner here

    def measured_order(self) -> list[str]:
        """The compiled runners, fastest first (geometric mean over the batch sizes), that pass
        the check."""
        compiled = [name for name in self.best_ms if name != "eager-fp32" and self.passes_check[name]]
        return sorted(compiled, key=lambda name: math.prod(self.best_ms[name].values()))

    def ratios_to_defaults(self) -> dict[int, float]:
        """batch size -> the chosen runner's speed / the best default engine's."""
        defaults = [name for name in self.defaults.values() if name in self.best_ms]
        return {b: min(self.best_ms[name][b] for name in defaults) / self.best_ms[self.chosen][b]
                for b in self.batch_sizes if self.chosen in self.best_ms and defaults}

    def table(self) -> str:
        header = " ".join(f"{f'batch {b} ms (img/s)':>22}" for b in self.batch_sizes)
        lines = [f"{self.cpu}; CPU kind {self.cpu_kind}; {self.threads} thread(s)",
                 f"{'runner':<18} {header} {'top-1 = fp32 (photos, all)':>27} {'check':>6}"]
        for name, by_batch in self.best_ms.items():
            cells = " ".join(f"{f'{ms:.2f} ({b * 1000 / ms:.0f})':>22}" for b, ms in by_batch.items())
            check = "passes" if self.passes_check.get(name, True) else "fails"
            agreement = self.agreement[name]
            shares = f"{agreement['photos']:.1%}, {agreement['all']:.1%}"
            lines.append(f"{name:<18} {cells} {shares:>27} {check:>6}")
        lines.append(f"order from these figures: {self.measured_order()}")
        lines.append(f"the archive's order for {self.cpu_kind}: {self.archive_order}; "
                     f"a worker here serves {self.chosen}")
        ratios = ", ".join(f"batch {b}: {ratio:.2f}x" for b, ratio in self.ratios_to_defaults().items())
        lines.append(f"{self.chosen} vs the best of {sorted(self.defaults.values())} "
                     f"(their defaults): {ratios}")
        return "\n".join(lines)


def every_runner(runners: ArchiveRunners) -> ArchiveRunners:
    """The archive's models with an order that names every runner (for measuring them all; an
    int8 model is measured where the archive has one)."""
    names = tuple(RunnerName(engine, precision) for engine, precisions in ENGINE_PRECISIONS.items()
                  for precision in precisions)
    return ArchiveRunners(runners.packages, runners.engine_models, {"avx2": names})


def cpu_model_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    for line in cpuinfo.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return "unknown CPU"


def photo_agreement(forwards: dict[str, Forward], settings: ClassifierSettings, batch_size: int
                    ) -> dict[str, dict[str, float]]:
    """runner -> {"photos": share, "all": share}: how many of the photos of ImageNet subjects
    (`photos.CLASSIFIER_PHOTOS`), and of every image (scans, micrographs and textures too), in
    4 orientations each, keep the eager fp32 network's top-1 class, answered in batches of
    `batch_size`."""
    from torchserve_vision.lab.precision_spread import is_photo, photo_batch, probabilities

    names, images = photo_batch(settings)
    photos = torch.tensor([is_photo(name) for name in names])
    reference = probabilities(forwards["eager-fp32"], images, batch_size).argmax(dim=1)
    agreement = {}
    for name, forward in forwards.items():
        same = probabilities(forward, images, batch_size).argmax(dim=1) == reference
        agreement[name] = {"photos": float(same[photos].float().mean()), "all": float(same.float().mean())}
    return agreement


def measure_engines(archive: Path, threads: int | None, batch_sizes: Sequence[int], repeats: int,
                    rounds: int) -> EngineFigures:
    """Load the archive's classifier as a worker does (its choice), then every runner of the
    archive this CPU may run, each checked as a worker checks it; time them all."""
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = extract_archive(archive, Path(tmp))
        context = archive_context(model_dir)
        settings = parse_classifier_settings((context.model_yaml_config or {})["handler"])
        threads = threads or settings_threads(context.model_yaml_config or {})
        torch.set_num_threads(threads)
        classifier = ClassifierModel(settings, model_dir, context.manifest["model"]["serializedFile"],
                                     torch.device("cpu"))
        machine = MachineTarget.here(classifier.device, classifier.precision)
        probe = classifier.crops_input(load_probe_photos(model_dir).float())
        forwards: dict[str, Forward] = {"eager-fp32": classifier.network}
        passes: dict[str, bool] = {}
        runners = settings.archive_runners
        expected = reference_answers(classifier.network, worker_layout("eager-fp32", probe, settings))
        for candidate in candidates(every_runner(runners), machine, "avx2"):
            name = str(candidate.name)
            try:
                forwards[name] = load_candidate(resolved(candidate, runners, machine), model_dir,
                                                machine, threads)
                check_answers(forwards[name], expected, worker_layout(name, probe, settings),
                              *checked_precisions(candidate.name.precision, machine.precision))
                passes[name] = True
            except CompiledModelRefused:
                passes[name] = False
        agreement = photo_agreement(forwards, settings, max(batch_sizes))
        batches = {b: torch.randn(b, 3, settings.input_size, settings.input_size) for b in batch_sizes}
        best = best_ms_interleaved(forwards, batches, repeats, rounds,
                                   lambda name, batch: worker_layout(name, batch, settings))
    kind = classifier.runner.cpu_kind or "avx2"
    native_bf16 = cpu_has_native_bf16() and "openvino-bf16" in best
    openvino_default = "openvino-bf16" if native_bf16 else "openvino-fp32"
    order = [str(name) for name in order_for(kind, runners.order_table())]
    return EngineFigures(cpu_model_name(), kind, threads, list(batch_sizes), best, agreement, passes,
                         classifier.runner.runner, order,
                         {"onnxruntime": "onnxruntime-fp32", "openvino": openvino_default})


def worker_layout(runner: str, batch: torch.Tensor, settings: ClassifierSettings) -> torch.Tensor:
    """`batch` as a worker hands it to `runner`: channels-last for torch's runners when the
    archive asks for it, plain NCHW for the other engines (handlers.model.classifier_model)."""
    if settings.channels_last and (runner == "eager-fp32" or runner.startswith("aoti-")):
        return batch.contiguous(memory_format=torch.channels_last)
    return batch


def settings_threads(model_yaml: dict[str, Any]) -> int:
    """The archive's `torch_threads` (what its workers run with), else torch's default here."""
    return int((model_yaml.get("handler") or {}).get("torch_threads") or torch.get_num_threads())
