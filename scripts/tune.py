"""Recommend batch size, max batch delay and workers per GPU for a p99 target and a request rate,
from a measured t(B) profile (and a sweep, when given); optionally verify the recommendation with
an open-loop run on a live server, write it into config/models.yaml, and apply it as a rollout.

    python scripts/tune.py model_store/efficientnet_lite0-1.0.mar --p99-ms 300 --rate 25
    python scripts/tune.py model_store/efficientnet_lite0-1.0.mar --p99-ms 300 --max-throughput \\
        --verify --duration 20          # needs the model served (scripts/demo.sh)
    python scripts/tune.py ... --sweep .run/sweep.json --write-config --apply
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from scripts.batch_model import MAX_UTILISATION, Recommendation, recommend  # noqa: E402
from scripts.benchmark_images import benchmark_jpeg  # noqa: E402
from scripts.build_archives import (  # noqa: E402
    DEFAULT_CONFIGS,
    DEFAULT_DESCRIPTIONS,
    load_descriptions,
    write_models_block,
)
from scripts.loadgen import LoadTarget, Report, run_open_loop  # noqa: E402
from scripts.management_client import TorchServeClient  # noqa: E402
from scripts.profile_model import profile_archive  # noqa: E402
from scripts.rollout import ServingSettings, archive_manifest, default_version  # noqa: E402
from scripts.sweep import (  # noqa: E402
    SweepPoint,
    apply_settings,
    choose_operating_point,
)


def from_sweep(path: Path, p99_target_ms: float, rate_rps: float | None) -> Recommendation | None:
    """The measured point that meets the target (at the rate, when given) with the most headroom."""
    document = json.loads(path.read_text())
    points = [SweepPoint(**p) for p in document["points"]]
    if rate_rps is not None:
        points = [p for p in points if p.throughput_rps >= rate_rps]
    best = choose_operating_point(points, p99_target_ms)
    if best is None:
        return None
    return Recommendation(True, best.batch_size, best.max_batch_delay_ms, best.workers, best.p99_ms,
                          best.throughput_rps, f"measured by the sweep ({best.clients} clients)")


def update_models_yaml(path: Path, model: str, batch_size: int, delay_ms: int) -> None:
    """Set `serving.batch_size` / `max_batch_delay_ms` of one model, keeping the file's comments."""
    text = path.read_text()
    blocks = re.split(r"(?m)^(?=  - name: )", text)
    for index, block in enumerate(blocks):
        if re.match(rf"  - name: {re.escape(model)}\s*$", block.splitlines()[0] if block else ""):
            block = re.sub(r"(?m)^(\s+batch_size:) \d+", rf"\1 {batch_size}", block)
            blocks[index] = re.sub(r"(?m)^(\s+max_batch_delay_ms:) \d+", rf"\1 {delay_ms}", block)
            path.write_text("".join(blocks))
            return
    raise SystemExit(f"{model} is not described in {path}")


def verify(client: TorchServeClient, model: str, store: Path, recommendation: Recommendation,
           rate_rps: float, duration_s: float) -> Report:
    """Serve the model with the recommended settings and drive it open-loop at `rate_rps`."""
    current = default_version(client, model)
    if current is None:
        raise SystemExit(f"{model} is not served at {client.management_url}: start the server first")
    image = benchmark_jpeg("small")
    settings = replace(ServingSettings.of_version(current), batch_size=recommendation.batch_size,
                       max_batch_delay_ms=recommendation.max_batch_delay_ms,
                       min_workers=recommendation.workers, max_workers=recommendation.workers)
    apply_settings(client, model, store, settings, image)
    target = LoadTarget(f"{client.inference_url}/predictions/{model}", [image])
    run_open_loop(target, rate_rps, 2.0, 10**6)  # warm up
    return run_open_loop(target, rate_rps, duration_s, 10**7)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("archive", type=Path)
    parser.add_argument("--p99-ms", type=float, required=True, help="p99 latency target")
    goal = parser.add_mutually_exclusive_group(required=True)
    goal.add_argument("--rate", type=float, help="expected requests per second")
    goal.add_argument("--max-throughput", action="store_true")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--workers", type=int, default=1,
                        help="workers (per GPU on a GPU host); 1 on a CPU host")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--sweep", type=Path, help="sweep results JSON (scripts/sweep.py)")
    parser.add_argument("--verify", action="store_true", help="open-loop run on the live server")
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--apply", action="store_true", help="keep the settings on the live server")
    parser.add_argument("--write-config", action="store_true",
                        help="write the settings into config/models.yaml and config.properties")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    model = archive_manifest(args.archive)["modelName"]
    profile = profile_archive(args.archive, args.max_batch, 5, benchmark_jpeg("small"), "small JPEG",
                              args.device)
    recommendation = recommend(profile.handler_fit, args.p99_ms, args.rate, args.max_batch, args.workers)
    measured = from_sweep(args.sweep, args.p99_ms, args.rate) if args.sweep else None
    chosen = measured or recommendation
    result: dict[str, object] = {"model": model, "profile": asdict(profile.handler_fit),
                                 "recommendation": asdict(chosen), "from_profile": asdict(recommendation)}
    if args.verify:
        client = TorchServeClient.from_environment()
        rate = args.rate or MAX_UTILISATION * chosen.capacity_rps
        current = default_version(client, model)
        report = verify(client, model, args.archive.parent, chosen, rate, args.duration)
        result["verification"] = asdict(report)
        result["target_met"] = report.latency_ms["p99"] <= args.p99_ms and not report.errors
        if not args.apply and current is not None:
            apply_settings(client, model, args.archive.parent, ServingSettings.of_version(current),
                           benchmark_jpeg("small"))
    if args.write_config:
        update_models_yaml(DEFAULT_DESCRIPTIONS, model, chosen.batch_size, chosen.max_batch_delay_ms)
        for config in DEFAULT_CONFIGS:
            write_models_block(config, load_descriptions(DEFAULT_DESCRIPTIONS))
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(profile.table())
    verdict = "meets" if chosen.feasible else "CANNOT meet"
    print(f"\n{model}: {verdict} p99 <= {args.p99_ms:.0f} ms"
          f"{f' at {args.rate:.0f} req/s' if args.rate else ' at maximum throughput'}: "
          f"batch size {chosen.batch_size}, max batch delay {chosen.max_batch_delay_ms} ms, "
          f"{chosen.workers} worker(s); predicted p99 {chosen.predicted_p99_ms:.0f} ms, "
          f"capacity {chosen.capacity_rps:.1f} req/s ({chosen.reason})")
    if "verification" in result:
        print(f"verified: {report.table()}\ntarget met: {result['target_met']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
