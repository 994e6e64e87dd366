"""One change at a time per model, and a dead holder holds nothing: the lock is the kernel's."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from torchserve_vision.model_lock import ModelLocked, model_lock

HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from torchserve_vision.model_lock import model_lock
    with model_lock(Path(sys.argv[1]), "m"):
        print("held", flush=True)
        time.sleep(600)
""")


def test_a_second_command_is_refused_while_the_first_lives_and_served_once_it_is_killed(tmp_path: Path):
    history = tmp_path / "history.json"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(history)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with (pytest.raises(ModelLocked, match=f"m is being changed by pid {holder.pid} since"),
              model_lock(history, "m")):
            pass
        with model_lock(history, "another model"):    # other models are not held
            pass
    finally:
        holder.kill()
        holder.wait(timeout=30)
    # SIGKILL left no lock behind; and the lock excludes within one process too
    with model_lock(history, "m"), pytest.raises(ModelLocked), model_lock(history, "m"):
        pass
