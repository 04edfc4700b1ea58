"""One process's error ends every process of a multi-process job, promptly and with its exit code.

Most errors reach every process alike (the config is the same everywhere, checked by
`job_sync.check_same_config`; a damaged checkpoint is verified collectively). Some reach one
process only: its share of the data files is empty or damaged, a file is missing on its host, its
disk is full, its devices run out of memory. Before, that process printed its error and then
waited in JAX's shutdown barrier for the others, while they waited for it in a barrier or a
collective: the whole job sat there until the barrier's timeout aborted it in C++ (5 minutes or
more, no exit code of ours), or until the hang watchdog fired (`step_timeout_seconds`, 30 minutes
by default).

Now the failing process publishes "<exit code> <its error line>" in the coordinator's key-value
store (FAILED_KEY; the first writer wins) and leaves at once (`os._exit`, no shutdown barrier).
The same goes for a stop signal outside the training loop (compiling, loading), where the loop's
collective stop does not reach. Every other process runs a `FailureWatch` thread from the moment
the processes found their configs equal; it polls the key once a second and, when it appears,
prints `job error: process 1 stopped with: data error: ...; this process stops too (exit code 2)`
and leaves with the same exit code. A process whose own collective failed because the failing
one left first reads the key before saying anything (`follow_earlier_failure`). Process 0 hosts
the coordinator, so it leaves last: whether it failed or follows another's failure, it first waits
(up to ACK_SECONDS) for the others to say they read the key, then LEAVE_GRACE_SECONDS for them to
be gone.
"""

from __future__ import annotations

import os
import sys
import threading
import time

FAILED_KEY = "tessera/failed"
ACK_PREFIX = "tessera/failed_read/"
WAITS_PREFIX = "tessera/failed_waits/"  # set by a failing process that waits for the others before it leaves
POLL_SECONDS = 1.0
ACK_SECONDS = 10.0
# after the others acknowledged, process 0 gives them this long to leave: its exit stops the coordination
# service, and a process still alive then is aborted by JAX's error poll in C++ (SIGABRT, not its exit code)
LEAVE_GRACE_SECONDS = 1.0


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


def end_job(code: int, line: str, wait_for_others: bool = False) -> None:
    """In a multi-process job: publish this process's error (`line`, as printed) with its exit
    `code`, and leave now; every other process's `FailureWatch` then leaves with the same code.
    When another process published its failure first, this error is most often its consequence (a
    collective or a save whose peer left): leave with that one's code and line, as `FailureWatch`
    would. `wait_for_others`: every process, not only process 0, waits (up to ACK_SECONDS) for the
    others to read the error before leaving, so that they do not fail first in a collective with
    this process (a second stop signal, which leaves in the middle of a step or a save).
    Returns at once in a single process (the caller exits normally)."""
    client, me, count = _client()
    if client is None:
        return
    if wait_for_others:  # before the failure is public: process 0, following it, then waits for this process
        _set(client, f"{WAITS_PREFIX}{me}")
    try:
        client.key_value_set(FAILED_KEY, f"{code} {me} {line}")
    except Exception:  # noqa: BLE001 - ALREADY_EXISTS: another process failed first and the others follow it
        found = _published(client)
        if found and found[1] != me:  # process 0 still waits below: the coordinator leaves with it
            code = found[0]
            _say_following(*found)
    _acknowledge(client, me)  # (a process that fails too knows of it: process 0 need not wait for it)
    if me == 0 or wait_for_others:  # process 0, the coordinator, leaves with this process: the others read first
        _wait_for_the_others(client, me, count)
    _leave(code)


def _wait_for_the_others(client, me: int, count: int, gone: int | None = None) -> None:
    """Wait until every other process said it read the published failure (up to ACK_SECONDS for each; once
    one does not answer in time, the rest are not waited for); process 0 then gives them LEAVE_GRACE_SECONDS
    more to be gone, since its exit stops the coordination service. `gone`: a process that left already (the
    failing one, when it did not wait), not waited for."""
    wait_ms, read = int(ACK_SECONDS * 1000), 0
    for other in range(count):
        if other in (me, gone):
            continue
        try:
            client.blocking_key_value_get(f"{ACK_PREFIX}{other}", wait_ms)
            read += 1
        except Exception:  # noqa: BLE001 - that process is gone or stuck; it is not waited for again
            wait_ms = 1
    if me == 0 and read:  # they leave right after acknowledging; on a loaded host that can take a moment
        time.sleep(LEAVE_GRACE_SECONDS)


def _acknowledge(client, me: int) -> None:
    _set(client, f"{ACK_PREFIX}{me}")  # (only process 0's wait is shortened by it)


def _set(client, key: str) -> None:
    try:
        client.key_value_set(key, "1")
    except Exception:  # noqa: BLE001 - set already, or the coordinator is gone
        pass


def _published(client) -> tuple[int, int, str] | None:
    """(exit code, process, line) of the failure a process published, or None."""
    try:
        value = client.key_value_try_get(FAILED_KEY)
    except Exception:  # noqa: BLE001 - NOT_FOUND: no process has failed
        return None
    code, process, line = value.split(" ", 2)
    return int(code), int(process), line


def _say_following(code: int, process: int, line: str) -> None:
    print(f"job error: process {process} stopped with: {line}; this process stops too (exit code {code})",
          file=sys.stderr, flush=True)


def _follow(client, me: int, code: int, process: int, line: str) -> None:
    """Leave with another process's published failure. Process 0 leaves last, as when it fails itself: the
    failing process may still be waiting for the acknowledgements (a second stop signal), and a process
    alive when the coordination service stops is aborted by JAX's error poll (SIGABRT, exit -6, not the
    job's code; seen in CI when process 0 followed process 1's second SIGTERM at once)."""
    _acknowledge(client, me)
    _say_following(code, process, line)
    if me == 0:  # the failing process itself left at once unless it said it waits
        _wait_for_the_others(client, me, _client()[2], gone=None if _is_set(client, f"{WAITS_PREFIX}{process}")
                             else process)
    _leave(code)


def _is_set(client, key: str) -> bool:
    try:
        client.key_value_try_get(key)
        return True
    except Exception:  # noqa: BLE001 - NOT_FOUND
        return False


def follow_earlier_failure(seconds: float = 3.0) -> None:
    """In a multi-process job: when another process has published its failure, or does within
    `seconds`, leave as `FailureWatch` would, with its exit code. For an error of this process that
    may be the consequence of another's: a collective fails at once when a peer leaves, often
    before this process's watch has read the peer's error (its poll is once a second)."""
    client, me, _ = _client()
    if client is None:
        return
    deadline = time.monotonic() + seconds
    while True:
        found = _published(client)
        if found and found[1] != me:
            _follow(client, me, *found)
        if found or time.monotonic() >= deadline:
            return
        time.sleep(0.1)


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
            found = _published(client)
            if found is None:
                continue
            if found[1] == me:  # this process's own failure: end_job is leaving already
                return
            _follow(client, me, *found)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
