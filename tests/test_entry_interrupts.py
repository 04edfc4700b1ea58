"""Ctrl-C or SIGTERM while train.py or decode.py is still importing: one line and exit code 130 or 143.

Raised inside an import, the KeyboardInterrupt was a traceback, or jaxlib's extension turned it
into an ImportError that an optional import caught, and a run interrupted 1.5 s after its start
trained to the end; sent as the CPU run restarts itself with mimalloc (`os.execve`), it was lost.
Here the signal is sent by the process itself at a chosen point, so every case is exact."""

import os
import subprocess
import sys

import pytest

from conftest import REPO

WRAPPER = """
import importlib.abc, os, runpy, signal, sys
# Ctrl-C as a process started from a terminal has it (a test run started with `&` passes it on ignored)
signal.signal(signal.SIGINT, signal.default_int_handler)
WHEN, SCRIPT = os.environ["CTRL_C_AT"], sys.argv[1]
SIGNAL = getattr(signal, os.environ.get("SIGNAL", "SIGINT"))

class CtrlC(importlib.abc.MetaPathFinder):  # the user's Ctrl-C, as the module named is first imported
    def find_spec(self, name, path=None, target=None):
        if name == WHEN:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), SIGNAL)
        return None

if WHEN == "execve":  # just before the restart with mimalloc (once: the restarted process has no restart)
    real_execve = os.execve
    def execve(*args):
        os.kill(os.getpid(), SIGNAL)
        real_execve(*args)
    os.execve = execve
else:
    sys.meta_path.insert(0, CtrlC())
sys.argv = sys.argv[1:]
runpy.run_path(SCRIPT, run_name="__main__")
"""


@pytest.mark.parametrize("script, when, malloc", [
    ("train.py", "jax", "system"),            # inside JAX's import
    ("train.py", "tessera.host_malloc", "mimalloc"),  # before the restart: it does not happen
    ("train.py", "execve", "mimalloc"),       # as the process restarts: the restarted one stops
    ("decode.py", "jax", "system"),
])
def test_ctrl_c_while_starting_is_one_line_and_exit_130(tmp_path, script, when, malloc):
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(WRAPPER)
    args = ([str(REPO / "configs" / "base.yml"), "run_name=r", "steps=1"] if script == "train.py" else
            [str(REPO / "configs" / "base.yml"), "load_parameters_path=outputs/r/checkpoints/1", "--tokens", "1,2"])
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
    env.update(CTRL_C_AT=when, TESSERA_HOST_MALLOC=malloc, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(wrapper), str(REPO / script), *args], capture_output=True,
                          text=True, cwd=tmp_path, env=env, timeout=300)
    assert (proc.returncode, proc.stderr, proc.stdout) == (
        130, "interrupted (Ctrl-C) while starting: nothing was run (exit code 130)\n", "")
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("script, when, malloc", [
    ("train.py", "jax", "system"),
    ("train.py", "execve", "mimalloc"),
    ("decode.py", "jax", "system"),
])
def test_sigterm_while_starting_is_one_line_and_exit_143(tmp_path, script, when, malloc):
    """A SIGTERM (a preemption, `timeout`) before main's handler is installed ended the process by the
    signal itself: no line, and a Python parent saw -15 instead of 143."""
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(WRAPPER)
    args = ([str(REPO / "configs" / "base.yml"), "run_name=r", "steps=1"] if script == "train.py" else
            [str(REPO / "configs" / "base.yml"), "load_parameters_path=outputs/r/checkpoints/1", "--tokens", "1,2"])
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
    env.update(CTRL_C_AT=when, SIGNAL="SIGTERM", TESSERA_HOST_MALLOC=malloc, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(wrapper), str(REPO / script), *args], capture_output=True,
                          text=True, cwd=tmp_path, env=env, timeout=300)
    assert (proc.returncode, proc.stderr, proc.stdout) == (
        143, "stopped by SIGTERM while starting: nothing was run (exit code 143)\n", "")
    assert not (tmp_path / "outputs").exists()
