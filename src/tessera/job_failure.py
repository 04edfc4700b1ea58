"""One process's error ends every process of a multi-process job, promptly and with its exit code.

Most errors reach every process alike (the config is the same everywhere, checked by
`distributed.check_same_config`; a damaged checkpoint is verified collectively). Some reach one
process only: its share of the data files is empty or damaged, a file is missing on its host, its
disk is full, its devices run out of memory. Before, that process printed its error and then
waited in JAX's shutdown barrier for the others, while they waited for it in a barrier or a
collective: the whole job sat there until the barrier's timeout aborted it in C++ (5 minutes or
more, no exit code of ours), or until the hang watchdog fired (`step_timeout_seconds`, 30 minutes
by default).

Now the failing process publishes "<exit code> <its error line>" in the coordinator's key-value
store (FAILED_KEY; the first writer wins) and leaves at once (`os._exit`, no shutdown barrier).
Every other process runs a `FailureWatch` thread from the moment it joins the job; it polls the
key once a second and, when it appears, prints
`job error: process 1 stopped with: data error: ...; this process stops too (exit code 2)`
and leaves with the same exit code. Process 0 hosts the coordinator, so when it is the one that
fails it first waits (up to ACK_SECONDS) for the others to say they read the key.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger("tessera")

FAILED_KEY = "tessera/failed"
ACK_PREFIX = "tessera/failed_read/"
POLL_SECONDS = 1.0
ACK_SECONDS = 10.0


def _client():
    from jax._src.distributed import global_state  # the runtime's client; None in a single process

    return global_state.client, global_state.process_id, global_state.num_processes


def _leave(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def in_job() -> bool:
    """Whether this process is one of a multi-process job (joined through `distributed.initialize`)."""
    return _client()[0] is not None


def end_job(code: int, line: str) -> None:
    """In a multi-process job: publish this process's error (`line`, as printed) with its exit
    `code`, and leave now; every other process's `FailureWatch` then leaves with the same code.
    Returns at once in a single process (the caller exits normally)."""
    client, me, count = _client()
    if client is None:
        return
    try:
        client.key_value_set(FAILED_KEY, f"{code} {me} {line}")
    except Exception:  # noqa: BLE001 - ALREADY_EXISTS: another process failed first and the others follow it
        pass
    if me == 0:  # the coordinator leaves with this process: give the others time to read the key
        wait_ms = int(ACK_SECONDS * 1000)
        for other in range(1, count):
            try:
                client.blocking_key_value_get(f"{ACK_PREFIX}{other}", wait_ms)
            except Exception:  # noqa: BLE001 - that process is gone or stuck; it is not waited for again
                wait_ms = 1
    _leave(code)


class FailureWatch:
    """The thread that ends this process when another process of the job published its failure
    (`end_job`). A no-op in a single process. `stop()` before a normal exit."""

    def __init__(self):
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> FailureWatch:
        client, me, _ = _client()
        if client is not None:
            self._thread = threading.Thread(target=self._watch, args=(client, me), name="job-failure-watch",
                                            daemon=True)
            self._thread.start()
        return self

    def _watch(self, client, me: int) -> None:
        while not self._stop.wait(POLL_SECONDS):
            try:
                value = client.key_value_try_get(FAILED_KEY)
            except Exception:  # noqa: BLE001 - NOT_FOUND: no process has failed
                continue
            code_text, process, line = value.split(" ", 2)
            if int(process) == me:  # this process's own failure: end_job is leaving already
                return
            try:
                client.key_value_set(f"{ACK_PREFIX}{me}", "1")
            except Exception:  # noqa: BLE001 - only process 0's wait is shortened by it
                pass
            code = int(code_text)
            print(f"job error: process {process} stopped with: {line}; this process stops too (exit code {code})",
                  file=sys.stderr, flush=True)
            _leave(code)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
