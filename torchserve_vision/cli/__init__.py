"""The `torchserve-vision` command: one entry point with a subcommand per job.

Each module here turns flags into calls of the library layers and prints the outcome; none
imports another command. Library layers raise `CommandError`s (torchserve_vision.errors); only
`main` turns them into messages and exit status: 0 done, 1 failed (the message says why; a
failed rollout has been undone), 2 bad arguments, 130 interrupted (and undone).

The command answers at once: `--help` and the `build`, `server`, `predict` and `models`
subcommands import no torch until they build an archive; the `lab` subcommands (most of which
load models) are registered only when the command line asks for `lab`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from torchserve_vision.cli import build, models, predict, server
from torchserve_vision.cli.common import subcommand
from torchserve_vision.errors import CommandError
from torchserve_vision.rollout import RolloutInterrupted

FAILURES = (CommandError, TimeoutError)
LAB_SUMMARY = "load, profile, sweep, tune, compare, measure"

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


def asks_for_lab(argv: Sequence[str]) -> bool:
    """Whether the command's first word (after any top-level options) is `lab`."""
    words = [word for word in argv if not word.startswith("-")]
    return bool(words) and words[0] == "lab"


def command_parser(with_lab: bool = True) -> argparse.ArgumentParser:
    """The whole command line; without `with_lab`, `lab` is listed but its actions (and the
    modules they import) are not registered."""
    parser = argparse.ArgumentParser(prog="torchserve-vision", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (build, server, predict, models):
        module.register(commands)
    if with_lab:
        from torchserve_vision.cli import lab

        lab.register(commands, LAB_SUMMARY)
    else:
        subcommand(commands, "lab", LAB_SUMMARY, "").add_argument("action", nargs=argparse.REMAINDER)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = command_parser(with_lab=asks_for_lab(argv)).parse_args(argv)
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
