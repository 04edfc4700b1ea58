"""Signals at the command line: Ctrl-C and SIGTERM held while an entry script imports JAX and
Tessera (`ctrl_c_held_while_starting`), and SIGTERM raising an exception of the caller's choice
while a command runs, with a watcher thread for a main thread busy in compiled code
(`sigterm_raises`). The training loop's own stop handling is `tessera.stop_signals`."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130, as train.py's and decode.py's Ctrl-C
HELD_WHILE_STARTING = {signal.SIGINT: "interrupted (Ctrl-C)", signal.SIGTERM: "stopped by SIGTERM"}


@contextlib.contextmanager
def ctrl_c_held_while_starting():
    """Ctrl-C or SIGTERM while an entry script imports JAX and Tessera waits for the imports to end,
    then exits with one line and code 130 or 143. Raised inside an import, the KeyboardInterrupt was
    a traceback, or jaxlib's extension turned it into an ImportError that an optional import caught:
    a Ctrl-C 1.5 s after `train.py` started was lost and the run trained to the end. SIGTERM, which
    no handler catches before the entry's `main`, ended the process by the signal itself, without a
    word (a Python parent saw -15, not 143).

    Both are blocked, not caught: a blocked signal stays pending through the mimalloc restart
    (`execve` keeps the mask and the pending set), where a Python handler's flag was lost. The entry
    script blocks them first thing, before this block (which blocks them again); they are unblocked at
    the end. Where a signal is ignored (SIGINT in a job a script started with `&`) a pending one is
    not a stop."""
    signal.pthread_sigmask(signal.SIG_BLOCK, set(HELD_WHILE_STARTING))
    yield  # an exception leaves them blocked: the process is ending, and a pending one would be a traceback
    exit_if_ctrl_c_was_held()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, set(HELD_WHILE_STARTING))


def exit_if_ctrl_c_was_held() -> None:
    """Exit with one line when a Ctrl-C or SIGTERM is pending (held by ctrl_c_held_while_starting)."""
    pending = signal.sigpending()
    for signum, what in HELD_WHILE_STARTING.items():
        if signum in pending and signal.getsignal(signum) is not signal.SIG_IGN:
            print(f"{what} while starting: nothing was run (exit code {128 + signum})", file=sys.stderr)
            sys.exit(128 + signum)


SIGTERM_GRACE_SECONDS = 10.0  # how long a SIGTERM may wait for a main thread busy in compiled code
RESEND_SECONDS = 0.05  # when a signal whose exception Python swallowed is sent again (sigterm_raises)


@contextlib.contextmanager
def sigterm_raises(exc_type: type[BaseException], grace: float = SIGTERM_GRACE_SECONDS):
    """While the block runs, SIGTERM raises `exc_type` in the main thread (so a command can stop with
    one line and exit 143 instead of dying silently); the previous handler comes back after. Off the
    main thread, where Python cannot set handlers, it does nothing.

    Python runs a signal handler only when the main thread is between two bytecodes, and it is not
    while XLA compiles, a device waits for memory, or a checkpoint is read: the handler can then wait
    for minutes, or forever (a start-up that hung under `ulimit -v` ignored SIGTERM, and `timeout`
    with it). So a thread that the signal wakes (`signal.set_wakeup_fd`) ends the process itself,
    with one line and exit code 143, when the handler has not run `grace` seconds later. Ctrl-C
    (SIGINT, which raises KeyboardInterrupt as Python's default does) gets the same, with exit code
    130. The thread only acts while this block's handlers are the ones installed: a training loop
    installs its own, which finish the step and save first.

    When the handler runs inside a garbage-collection callback (JAX registers one), Python cannot
    raise its exception there: it reports it as "ignored" and goes on, and the signal was lost (a
    start-up signalled so trained to the end and exited 0). The block's `sys.unraisablehook` has
    such a signal sent again, from another thread RESEND_SECONDS later, and the handler raises it
    at the next point where it can (outside the callback, or it is sent again); when the main thread
    is blocked in compiled code by then, the thread above ends the process `grace` seconds later.

    The kernel may hand a signal sent to the process to any of its threads (XLA starts dozens).
    Taken by another thread, it sets Python's flag, but a main thread asleep in a wait that a signal
    would cut short (`time.sleep`, a lock, `Event.wait`, a pipe) sleeps on: the handler waited for
    the wait's end, or the watcher ended the process `grace` seconds later with the line above (a CI
    run saw that; on its host, about one signal in 30 sent to a train.py held at start-up). So the
    watcher wakes the main thread itself with NUDGE_SIGNAL, whose handler does nothing: the wait is
    cut short and the pending handler runs.
    The nudge reaches the training loop's own handlers too (`tessera.stop_signals`): a second Ctrl-C
    while the loop waits for a save stops it at once, as that handler promises."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    ran = {signal.SIGTERM: threading.Event(), signal.SIGINT: threading.Event()}

    def terminate(signum, frame):
        ran[signum].set()
        raise exc_type()

    def interrupt(signum, frame):
        ran[signum].set()
        raise KeyboardInterrupt

    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, terminate)}
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # leave a caller's own Ctrl-C handler be
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, interrupt)
    handlers = {signal.SIGTERM: terminate, signal.SIGINT: interrupt}
    previous_hook = sys.unraisablehook
    sys.unraisablehook = _sending_again(handlers, {signal.SIGTERM: exc_type, signal.SIGINT: KeyboardInterrupt}, ran,
                                        previous_hook)
    watcher = _BlockedSignalWatcher(handlers, ran, grace)
    try:
        yield
    finally:
        watcher.stop()
        sys.unraisablehook = previous_hook
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _sending_again(handlers: dict, kinds: dict, ran: dict, previous_hook):
    """sigterm_raises' `sys.unraisablehook`: an exception of kinds[signum] that Python swallowed while
    handlers[signum] is installed has the signal sent again to the main thread RESEND_SECONDS later, from
    another thread (sent from the hook, the handler would run inside it at once, and be swallowed again);
    anything else goes to `previous_hook`. The handler's run is forgotten (`ran`), so the watcher
    waits for the next one: if the main thread is blocked in compiled code by then, it cannot come,
    and the watcher ends the process `grace` seconds later."""
    def hook(unraisable) -> None:
        for signum, handler in handlers.items():
            if isinstance(unraisable.exc_value, kinds[signum]) and signal.getsignal(signum) is handler:
                ran[signum].clear()
                resend = threading.Timer(RESEND_SECONDS, signal.pthread_kill,
                                         args=(threading.main_thread().ident, signum))
                resend.daemon = True
                resend.start()
                return
        previous_hook(unraisable)

    return hook


# Sent by the watcher to the main thread alone, to cut short a wait there (sigterm_raises). SIGURG's default
# is to be ignored and programs seldom use it; Go's runtime sends it to its own threads for the same reason.
NUDGE_SIGNAL = signal.SIGURG


def _nothing(signum, frame) -> None:
    """NUDGE_SIGNAL's handler: the signal's work is done by arriving (a wait cut short)."""


class _BlockedSignalWatcher:
    """The thread behind sigterm_raises' `grace`: woken through the signal module's wake-up file
    descriptor, which the interpreter writes from its C-level handler even while the main thread
    is blocked. It wakes the main thread for a Ctrl-C or SIGTERM that another thread took, whoever's
    handler is installed, when NUDGE_SIGNAL is free (its default, ignored)."""

    WHAT = {signal.SIGTERM: "stopped by SIGTERM", signal.SIGINT: "interrupted (Ctrl-C)"}

    def __init__(self, handlers: dict, ran: dict, grace: float):
        self.handlers, self.ran, self.grace = handlers, ran, grace
        self.main = threading.main_thread().ident
        self.previous_nudge = signal.getsignal(NUDGE_SIGNAL)
        self.nudge = self.previous_nudge in (signal.SIG_DFL, _nothing)  # another program's use of it is left alone
        if self.nudge:
            signal.signal(NUDGE_SIGNAL, _nothing)
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.write_fd, False)
        self.previous_fd = signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name="signal-watcher", daemon=True).start()

    def _watch(self) -> None:
        while data := os.read(self.read_fd, 64):  # b"": stop() closed the pipe
            if self.nudge and any(signum in data for signum in self.handlers):
                signal.pthread_kill(self.main, NUDGE_SIGNAL)  # a no-op where the main thread took it itself
            for signum in self.handlers:
                if signum in data and self._ours(signum) and not self.ran[signum].wait(self.grace) \
                        and self._ours(signum):
                    code = 128 + signum
                    print(f"{self.WHAT[signum]}: the process was busy in compiled code (compiling, loading, or "
                          f"waiting for memory) and did not reach its handler within {self.grace:g} s; stopping now "
                          f"(exit code {code})", file=sys.stderr, flush=True)
                    os._exit(code)
        os.close(self.read_fd)

    def _ours(self, signum: int) -> bool:
        return signal.getsignal(signum) is self.handlers[signum]

    def stop(self) -> None:
        signal.set_wakeup_fd(self.previous_fd)
        os.close(self.write_fd)
        if self.nudge:
            signal.signal(NUDGE_SIGNAL, self.previous_nudge)
