"""Flags that mean the same thing in every subcommand, and the client built from them."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from torchserve_vision import paths
from torchserve_vision.client import DEFAULT_METRICS_URL, TorchServeClient

DEFAULT_MODEL = "efficientnet_lite0"


def connection_flags() -> argparse.ArgumentParser:
    """--inference-url, --management-url, --metrics-url and --key-file (environment:
    TS_INFERENCE_URL, TS_MANAGEMENT_URL, TS_METRICS_URL, TS_KEY_FILE)."""
    flags = argparse.ArgumentParser(add_help=False)
    group = flags.add_argument_group("server")
    group.add_argument("--inference-url", help="default: $TS_INFERENCE_URL or http://127.0.0.1:8080")
    group.add_argument("--management-url", help="default: $TS_MANAGEMENT_URL or http://127.0.0.1:8081")
    group.add_argument("--metrics-url", default=os.environ.get("TS_METRICS_URL", DEFAULT_METRICS_URL),
                       help=f"TorchServe's metrics address (default: $TS_METRICS_URL or "
                            f"{DEFAULT_METRICS_URL})")
    group.add_argument("--key-file", help="TorchServe's key_file.json when token authorization is on "
                                          "(default: $TS_KEY_FILE)")
    return flags


def model_store_flag() -> argparse.ArgumentParser:
    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument("--model-store", type=Path, default=paths.MODEL_STORE,
                       help=f"where the archives are (default: {paths.MODEL_STORE})")
    return flags


def json_flag() -> argparse.ArgumentParser:
    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument("--json", action="store_true", help="print JSON instead of text")
    return flags


def client_from(args: argparse.Namespace, dry_run: bool = False) -> TorchServeClient:
    return TorchServeClient.from_environment(args.management_url, args.inference_url, args.key_file,
                                             dry_run, args.metrics_url)


def subcommand(commands: argparse._SubParsersAction, name: str, summary: str, description: str,
               parents: list[argparse.ArgumentParser] | None = None) -> argparse.ArgumentParser:
    """A subcommand: `summary` in its parent's list, `description` in its own --help. (argparse
    %-formats a help string: a literal `%` is doubled here.)"""
    return commands.add_parser(name, help=summary.replace("%", "%%"), description=description,
                               parents=parents or [],
                               formatter_class=argparse.RawDescriptionHelpFormatter)


def no_flags() -> list[argparse.ArgumentParser]:
    return []


@dataclass(frozen=True)
class Subcommand:
    """One subcommand as a table entry: its name, its line in the parent's list, its own --help
    text, the shared flag groups it takes (built when registered), its own arguments, and what
    runs it (returning the exit status)."""

    name: str
    summary: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    description: str = ""
    flags: Callable[[], list[argparse.ArgumentParser]] = field(default=no_flags)


def register_table(actions: argparse._SubParsersAction, table: Sequence[Subcommand]) -> None:
    """Every entry of `table` as a subcommand of `actions`, in order."""
    for entry in table:
        parser = subcommand(actions, entry.name, entry.summary, entry.description or entry.summary,
                            entry.flags())
        entry.arguments(parser)
        parser.set_defaults(run=entry.run)



def model_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"default: {DEFAULT_MODEL}")


def image_size_flag(parser: argparse.ArgumentParser) -> None:
    from torchserve_vision.lab.benchmark_images import SIZES  # the lab's, imported when it registers

    parser.add_argument("--image-size", choices=sorted(SIZES), default="small",
                        help="the JPEG sent: small (720x720) or phone (12 MP)")
