"""The command started in a process of its own, as a user starts it from a terminal, for the
tests that interrupt it with Ctrl-C."""

from __future__ import annotations

import signal
import subprocess
import sys

from torchserve_vision.rollout import sigint_handled_by


def started_command(arguments: list[str]) -> subprocess.Popen[str]:
    """`python -m torchserve_vision *arguments`, output piped, with SIGINT's default action. A
    process started in the background of a shell without job control (`pytest ... &`) has
    SIGINT ignored, its children inherit that, and Python then never raises KeyboardInterrupt:
    a test of what Ctrl-C does would see the command go on. So the child is started while this
    process has a handler (which exec resets to the default) in place of an inherited ignore."""
    with sigint_handled_by(signal.default_int_handler):
        return subprocess.Popen([sys.executable, "-m", "torchserve_vision", *arguments],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
