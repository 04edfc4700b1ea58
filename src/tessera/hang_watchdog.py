"""The hang watchdog: a thread that ends a process whose training steps stopped (a peer of a
multi-process job gone, a collective that never completes, a device that no longer answers),
with the Python stack of every thread and exit code 5, instead of waiting for ever."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
from typing import NoReturn

EXIT_HANG = 5  # the watchdog saw no step finish in time


def _seconds(value: float) -> str:
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"  # sub-second timeouts show as 0.3, not 0


class HangWatchdog:
    """Ends a process whose steps stopped: after `timeout` seconds without `beat()`, dump every
    thread's Python stack to stderr and exit with EXIT_HANG. A timeout of 0 disables it.

    Work that blocks the loop as one piece, longer than a step (a checkpoint save), runs inside
    `allowing(what, seconds)`: the watchdog then waits that many seconds more, and names it."""

    def __init__(self, timeout: float):
        self.timeout, self._last = timeout, time.monotonic()
        self._allowance: tuple[str, float] | None = None  # (what blocks the loop, its extra seconds)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)

    def __enter__(self):
        if self.timeout > 0:
            self._last = time.monotonic()
            self._thread.start()
        return self

    def beat(self) -> None:
        self._last = time.monotonic()

    @contextlib.contextmanager
    def allowing(self, what: str, seconds: float):
        """Within this block the loop may wait `seconds` longer than the timeout for `what` (e.g.
        "checkpoint save of step 400") before the watchdog ends the process, naming it."""
        self.beat()
        self._allowance = (what, max(0.0, seconds))
        try:
            yield
        finally:
            self._allowance = None
            self.beat()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout / 4)):
            allowance, idle = self._allowance, time.monotonic() - self._last
            if idle > self.timeout + (allowance[1] if allowance else 0.0):
                if allowance:
                    reason = (f"{allowance[0]} did not finish in {_seconds(idle)} s (step_timeout_seconds="
                              f"{self.timeout:g} plus {_seconds(allowance[1])} s allowed for it)")
                else:
                    reason = (f"no training step finished in {_seconds(idle)} s (step_timeout_seconds={self.timeout:g}): "
                              "raise step_timeout_seconds if a step, or a batch of the input pipeline, takes that long")
                self._end(f"{reason}; Python stacks of every thread follow", stacks=True)

    def fail(self, reason: str, exit_code: int = EXIT_HANG, kind: str = "hang watchdog") -> NoReturn:
        """End the process now, as when the watchdog fires, for a step of a multi-process job that
        failed instead of hanging (a collective whose peer is gone raises on some runs and blocks on
        others; a device ran out of memory). Leaving normally would run JAX's shutdown barrier, which
        waits for the other processes until the heartbeat timeout and then aborts the process
        (SIGABRT, no exit code of ours)."""
        self._end(reason, stacks=False, exit_code=exit_code, kind=kind)

    @staticmethod
    def _end(reason: str, stacks: bool, exit_code: int = EXIT_HANG, kind: str = "hang watchdog") -> NoReturn:
        then = ", then" if stacks else ";"
        print(f"{kind}: {reason}{then} exit code {exit_code}", file=sys.stderr, flush=True)
        if stacks:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)

    def __exit__(self, *exc):
        self._stop.set()
