"""The `torchserve-vision` command: one entry point with a subcommand per job.

Each module here turns flags into calls of the library layers and prints the outcome; none
imports another command. Exit status: 0 done, 1 failed (the message says why; a failed rollout
has been undone), 2 bad arguments, 130 interrupted (and undone).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from torchserve_vision.archives.build import BuildError
from torchserve_vision.archives.versions import ArchiveError
from torchserve_vision.cli import build, lab, models, predict, server
from torchserve_vision.client import ManagementError
from torchserve_vision.lab.pods import PodError
from torchserve_vision.model_descriptions import DescriptionError
from torchserve_vision.rollout import RolloutError, RolloutInterrupted
from torchserve_vision.server_process import ServerError
from torchserve_vision.torchserve_config import ConfigError

FAILURES = (ArchiveError, BuildError, ConfigError, DescriptionError, ManagementError, PodError,
            RolloutError, ServerError, TimeoutError)

DESCRIPTION = """\
Serve vision models with TorchServe: build archives, run a server, send images, manage model
versions, and measure serving settings.

  torchserve-vision build                     # archives of config/models.yaml into model_store/
  torchserve-vision server start              # TorchServe from config/config.properties
  torchserve-vision predict photo.jpg         # classify a photo
  torchserve-vision models rollout efficientnet_lite0 efficientnet_lite0-2.0.mar
  torchserve-vision lab load --clients 16     # closed-loop load against the server

Paths default to the project's layout (config/, model_store/, .run/) under the current
directory. Servers are addressed with --inference-url / --management-url / --key-file or
TS_INFERENCE_URL / TS_MANAGEMENT_URL / TS_KEY_FILE.
"""


def command_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchserve-vision", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (build, server, predict, models, lab):
        module.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = command_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except RolloutInterrupted as error:
        print(f"error: {error}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except FAILURES as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
