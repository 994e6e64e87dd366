"""Ctrl-C delivered to this test process, for the unit tests of what a change does with it
(their SIGINT handler is set by tests/conftest.py's `ctrl_c_raises`)."""

from __future__ import annotations

import os
import signal


def interrupt_now() -> None:
    """SIGINT to this process: Python runs its handler at once, between two of the caller's lines."""
    os.kill(os.getpid(), signal.SIGINT)
