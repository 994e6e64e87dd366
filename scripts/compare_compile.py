"""The classifier's model alone, in one process: eager vs torch.compile at start (the worker-start
path this project used before: static shapes, Inductor freezing) vs the archive's ahead-of-time
package (what workers load now). Prints ms per batch and the ratios, and how long the
torch.compile warm-up took here.

    python scripts/compare_compile.py                      # model_store/efficientnet_lite0-1.0.mar
    python scripts/compare_compile.py --threads 1 --batch-sizes 1 8 --repeats 30

Interleaved rounds (eager, compiled, package, for each batch size) so machine noise hits all three.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from handlers.compiled_model import load_aoti_package  # noqa: E402
from handlers.model_loading import load_model  # noqa: E402
from handlers.settings import parse_classifier_settings  # noqa: E402
from scripts.local_handler import archive_context, extract_archive  # noqa: E402

Forward = Callable[[torch.Tensor], torch.Tensor]


def ms_per_batch(forward: Forward, batch: torch.Tensor, repeats: int) -> float:
    with torch.inference_mode():
        forward(batch)
        started = time.perf_counter()
        for _ in range(repeats):
            forward(batch)
    return (time.perf_counter() - started) / repeats * 1000


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archive", type=Path,
                        default=REPO_ROOT / "model_store" / "efficientnet_lite0-1.0.mar")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = extract_archive(args.archive, Path(tmp))
        context = archive_context(model_dir)
        settings = parse_classifier_settings((context.model_yaml_config or {})["handler"])
        fp32 = next(p for p in settings.compiled_packages if p.target.precision == "fp32")
        weights = model_dir / context.manifest["model"]["serializedFile"]
        eager = load_model(settings.model, weights, torch.device("cpu"))
        eager = eager.to(memory_format=torch.channels_last) if settings.channels_last else eager
        package = load_aoti_package(model_dir / fp32.file)
        import torch._inductor.config as inductor_config

        inductor_config.freezing = True
        compiled = torch.compile(eager, dynamic=False)
        size = settings.input_size
        batches = {b: torch.randn(b, 3, size, size).contiguous(memory_format=torch.channels_last)
                   for b in args.batch_sizes}
        started = time.perf_counter()
        with torch.inference_mode():
            for batch in batches.values():
                compiled(batch)
        print(f"torch.compile warm-up for batch sizes {args.batch_sizes}: "
              f"{time.perf_counter() - started:.1f} s ({args.threads} thread(s))")
        forwards: dict[str, Forward] = {"eager": eager, "torch.compile": compiled, "package": package}
        timings: dict[tuple[str, int], list[float]] = {}
        for _ in range(args.rounds):
            for b, batch in batches.items():
                for name, forward in forwards.items():
                    timings.setdefault((name, b), []).append(ms_per_batch(forward, batch, args.repeats))
    print(f"{'batch':>5} {'eager ms':>9} {'compile ms':>11} {'package ms':>11} "
          f"{'package/compile speed':>22} {'package/eager speed':>20}")
    for b in args.batch_sizes:
        best = {name: min(timings[(name, b)]) for name in forwards}
        print(f"{b:>5} {best['eager']:>9.1f} {best['torch.compile']:>11.1f} {best['package']:>11.1f} "
              f"{best['torch.compile'] / best['package']:>22.2f} {best['eager'] / best['package']:>20.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
