"""The classifier's model alone, in one process: eager vs torch.compile at start (the worker-start
path this project used before: static shapes, Inductor freezing) vs the archive's ahead-of-time
package (what workers load now). Prints ms per batch and the ratios, and how long the
torch.compile warm-up took here.

    torchserve-vision lab compile-speed              # model_store/efficientnet_lite0-1.0.mar
    torchserve-vision lab compile-speed --threads 1 --batch-sizes 1 8 --repeats 30
    torchserve-vision lab compile-speed --targets avx2 avx512   # packages per CPU target

Interleaved rounds (eager, compiled, package, for each batch size) so machine noise hits all three.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from handlers.model.compiled_model import load_aoti_package
from torchserve_vision.local_handler import eager_classifier, extract_archive

Forward = Callable[[torch.Tensor], torch.Tensor]


def ms_per_batch(forward: Forward, batch: torch.Tensor, repeats: int) -> float:
    with torch.inference_mode():
        forward(batch)
        started = time.perf_counter()
        for _ in range(repeats):
            forward(batch)
    return (time.perf_counter() - started) / repeats * 1000


def best_ms_interleaved(forwards: dict[str, Forward], batches: dict[int, torch.Tensor], repeats: int,
                        rounds: int, input_for: Callable[[str, torch.Tensor], torch.Tensor] | None = None
                        ) -> dict[str, dict[int, float]]:
    """name -> batch size -> the best ms per batch over `rounds`, each round timing every
    forward at every batch size in turn, so that machine noise hits them all. `input_for(name,
    batch)` gives a forward its batch in the layout it reads (made before any timing)."""
    inputs = {(name, b): input_for(name, batch) if input_for else batch
              for b, batch in batches.items() for name in forwards}
    timings: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for b in batches:
            for name, forward in forwards.items():
                timings.setdefault((name, b), []).append(ms_per_batch(forward, inputs[(name, b)], repeats))
    return {name: {b: min(timings[(name, b)]) for b in batches} for name in forwards}


@dataclass
class CompileSpeed:
    threads: int
    batch_sizes: list[int]
    compile_warm_up_s: float
    best_ms: dict[str, dict[int, float]]    # runner -> batch size -> best ms per batch

    def table(self) -> str:
        lines = [f"torch.compile warm-up for batch sizes {self.batch_sizes}: "
                 f"{self.compile_warm_up_s:.1f} s ({self.threads} thread(s))",
                 f"{'batch':>5} {'eager ms':>9} {'compile ms':>11} {'package ms':>11} "
                 f"{'package/compile speed':>22} {'package/eager speed':>20}"]
        for b in self.batch_sizes:
            eager, compiled, package = (self.best_ms[name][b] for name in RUNNERS)
            lines.append(f"{b:>5} {eager:>9.1f} {compiled:>11.1f} {package:>11.1f} "
                         f"{compiled / package:>22.2f} {eager / package:>20.2f}")
        return "\n".join(lines)


RUNNERS = ("eager", "torch.compile", "package")


def measure_compile_speed(archive: Path, threads: int, batch_sizes: Sequence[int], repeats: int,
                          rounds: int) -> CompileSpeed:
    """Time the three runners, interleaved, on random batches; best of `rounds` per runner."""
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = extract_archive(archive, Path(tmp))
        settings, eager = eager_classifier(model_dir)
        fp32 = next(p for p in settings.compiled_packages if p.target.precision == "fp32")
        package = load_aoti_package(model_dir / fp32.file)
        import torch._inductor.config as inductor_config

        inductor_config.freezing = True
        compiled = torch.compile(eager, dynamic=False)
        size = settings.input_size
        batches = {b: torch.randn(b, 3, size, size).contiguous(memory_format=torch.channels_last)
                   for b in batch_sizes}
        started = time.perf_counter()
        with torch.inference_mode():
            for batch in batches.values():
                compiled(batch)
        warm_up_s = time.perf_counter() - started
        forwards: dict[str, Forward] = dict(zip(RUNNERS, (eager, compiled, package), strict=True))
        best = best_ms_interleaved(forwards, batches, repeats, rounds)
    return CompileSpeed(threads, list(batch_sizes), warm_up_s, best)


# --- CPU targets: is a package built for this CPU's richer instruction set faster? ----------------
@dataclass
class TargetSpeed:
    threads: int
    batch_sizes: list[int]
    best_ms: dict[str, dict[int, float]]    # "<precision>-<target>" -> batch size -> best ms

    def table(self) -> str:
        names = list(self.best_ms)
        lines = [f"{'batch':>5} " + " ".join(f"{name:>13}" for name in names)]
        for b in self.batch_sizes:
            lines.append(f"{b:>5} " + " ".join(f"{self.best_ms[name][b]:>10.1f} ms" for name in names))
        for precision in sorted({name.split("-")[0] for name in names}):
            baseline = f"{precision}-avx2"
            for name in names:
                if name.startswith(f"{precision}-") and name != baseline and baseline in self.best_ms:
                    ratios = ", ".join(f"batch {b}: {self.best_ms[baseline][b] / self.best_ms[name][b]:.2f}x"
                                       for b in self.batch_sizes)
                    lines.append(f"{name} vs {baseline} (speed): {ratios}")
        return "\n".join(lines)


def measure_cpu_targets(archive: Path, targets: Sequence[str], precisions: Sequence[str], threads: int,
                        batch_sizes: Sequence[int], repeats: int, rounds: int) -> TargetSpeed:
    """Build the archive's network as a package for each CPU target x precision (as the archive
    builder does, into a temporary folder), then time them interleaved; best of `rounds`."""
    from torchserve_vision.archives.compile_ahead import CompileRequest, compile_package

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        settings, network = eager_classifier(extract_archive(archive, Path(tmp) / "model"))
        size = settings.input_size
        forwards: dict[str, Forward] = {}
        for precision in precisions:
            for target in targets:
                request = CompileRequest(precision, target, max(batch_sizes), (3, size, size),
                                         settings.channels_last, settings.resize_size)
                path = Path(tmp) / f"{precision}-{target}.pt2"
                compile_package(network, request, precision, path)
                forwards[f"{precision}-{target}"] = load_aoti_package(path)
        batches = {b: torch.randn(b, 3, size, size).contiguous(memory_format=torch.channels_last)
                   for b in batch_sizes}
        best = best_ms_interleaved(forwards, batches, repeats, rounds)
    return TargetSpeed(threads, list(batch_sizes), best)
