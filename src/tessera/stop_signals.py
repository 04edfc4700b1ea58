"""Stopping a run on purpose: SIGTERM and SIGINT between steps (save, then exit with 128 + the
signal's number) and outside the loop, and `TrainingStopped`, which carries the exit code."""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import NoReturn

import jax

from tessera.job_sync import eval_stop_requested, request_eval_stop, request_stop, stop_requested
from tessera.job_failure import end_job

log = logging.getLogger("tessera")


class TrainingStopped(Exception):
    """The run ended early on purpose; `exit_code` says why."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class TerminatedOutsideLoop(BaseException):  # like KeyboardInterrupt: no `except Exception` swallows it
    """SIGTERM while no training loop runs (start-up, compilation, the final save): stop with a line."""


class StopSignal:
    """SIGTERM or SIGINT (Ctrl-C) -> a flag the loop checks between steps: the step in flight
    finishes, it is saved, and the run exits with 128 + the signal's number. A second signal
    stops at once (same exit code, no traceback); an async save still in flight is then left
    as a temporary folder, which the next start sets aside and never loads.

    In a multi-process job the signalled process publishes the step to stop after, and every
    process checks for it after each step (job_sync.request_stop / stop_requested), so all of
    them save the same step together even when only one was signalled. A second signal ends the
    job as an error of this process does (job_failure.end_job): the others follow with the same
    exit code within about a second, instead of failing in a collective without it (a save then
    said exit 6, "free some space")."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum: int | None = None  # the signal this process received
        self.stop_at: tuple[int, int] | None = None  # (step, signal) the whole job stops after
        self._previous = {}
        self._leaving = False  # a second signal is ending the job

    def __enter__(self):
        for signum in self.SIGNALS:
            try:
                self._previous[signum] = signal.signal(signum, self._handle)
            except ValueError:  # not the main thread: leave signal handling to the caller
                pass
        return self

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self._leaving:  # a third signal while the others are told: leave now
            os._exit(128 + signum)
        if self.signum is not None:
            self._leaving = True
            line = (f"{name} received again: stopping now, without waiting for a save in flight (an unfinished "
                    f"save is set aside at the next start; exit code {128 + signum})")
            print(line, file=sys.stderr, flush=True)
            end_job(128 + signum, line, wait_for_others=True)  # a job: every process leaves with this code
            os._exit(128 + signum)
        self.signum = signum  # before the log line: a second signal can come while it is written
        log.warning("%s received: finishing this step, then saving a checkpoint and exiting "
                    "(send it again to stop at once)", name)

    def stop_after(self, step: int) -> bool:
        """True when the job should save `step` and stop (checked after every step)."""
        if self.stop_at is None and jax.process_count() == 1:
            self.stop_at = (step, self.signum) if self.signum is not None else None
        elif self.stop_at is None:
            self.stop_at = request_stop(step, self.signum) if self.signum is not None else stop_requested()
        return self.stop_at is not None and step >= self.stop_at[0]

    def interrupts_evaluation(self, step: int) -> "EvaluationStop":
        """For `Evaluator.run(interrupted=...)` at `step`: a stop signal ends the evaluation early."""
        return EvaluationStop(self, step)

    def __exit__(self, *exc):
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)


class EvaluationStop:
    """Called after each eval batch with the number finished: True when the evaluation of `step`
    should end there, because a stop signal came (the save comes first: a long evaluation must not eat
    into a preemption's grace period).

    One process stops at once. In a job every process must leave after the same batch: the signalled
    process agrees with the others to stop after this very step (no process can be past it while it
    evaluates) and publishes "after batch B+1"; the others read that after each batch. When the job
    had already agreed on a later step (the signal came while the step ran), the evaluation is left
    the same way, unrecorded, and the job trains on to that step and stops there (a long evaluation
    used to run to its end first)."""

    def __init__(self, stop: StopSignal, step: int):
        self.stop, self.step, self.until = stop, step, None

    def __call__(self, batches: int) -> bool:
        if self.until is None:
            self.until = self._last_batch(batches)
        return self.until is not None and batches >= self.until

    def _last_batch(self, batches: int) -> int | None:
        stop = self.stop
        if stop.stop_at is not None and stop.stop_at[0] <= self.step:  # every process knew before evaluating
            return batches
        if jax.process_count() == 1:
            return batches if stop.signum is not None else None
        if stop.signum is not None and stop.stop_at is None:
            stop.stop_at = request_stop(self.step, stop.signum, slack=0)
        if stop.stop_at is not None:  # this step, or a later one every process will stop at
            return request_eval_stop(self.step, batches)
        return eval_stop_requested(self.step)


def stop_after_signal(step: int, stop: StopSignal, ckpt) -> NoReturn:
    """TrainingStopped (128 + the signal's number) once `step`, the step the job stops after, is saved."""
    signum = stop.stop_at[1]
    name = signal.Signals(signum).name + ("" if stop.signum else " (sent to another process of this job)")
    if ckpt is None:
        raise TrainingStopped(f"stopped by {name} after step {step} (checkpointing is off: nothing saved)",
                              128 + signum)
    ckpt.wait()
    raise TrainingStopped(f"stopped by {name} after step {step}; checkpoint {ckpt.step_path(step)}", 128 + signum)
