"""What Tessera's command lines share: `--help` text, `--option value` pairs, paths typed as
arguments, and progress lines during long work that prints nothing of its own.

This module imports nothing heavy (no JAX, no NumPy), so that `--help` answers at once and
never starts a device backend.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

HELP_FLAGS = ("-h", "--help")
EXIT_OK = 0
TRAIN_KEYS = ("run_name", "model_name", "steps", "per_device_batch_size", "max_target_length", "learning_rate",
              "dataset_type", "dtype", "remat_policy", "ici_fsdp_parallelism", "ici_tensor_parallelism",
              "base_output_directory", "checkpoint_period", "load_parameters_path")


class UsageError(Exception):
    """The command line cannot be used as typed; the message says what to change (exit code 2)."""


# --------------------------------------------------------------------------- help


def wants_help(argv: Sequence[str]) -> bool:
    return any(arg in HELP_FLAGS for arg in argv)


def key_lines(names: Iterable[str]) -> list[str]:
    """`  name=default  comment` for each config key, from the schema that generates configs/base.yml."""
    from tessera.config.schema import all_fields

    fields = all_fields()
    rows = []
    for name in names:
        f = fields[name][1]
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        rows.append((f"{name}={default}", f.metadata["doc"]))
    width = max(len(left) for left, _ in rows)
    return [f"  {left:<{width}}  {doc}" for left, doc in rows]


def help_text(usage: str, about: str, options: Sequence[tuple[str, str]] = (), keys: Sequence[str] = (),
              docs: Sequence[str] = ()) -> str:
    """The --help page: usage, what the command does, its options, its most-used config keys (one
    line each) and the files that document the rest."""
    parts = [f"usage: {usage}", "", about.strip()]
    if options:
        width = max(len(flag) for flag, _ in options)
        parts += ["", "options:", *(f"  {flag:<{width}}  {text}" for flag, text in options)]
    return "\n".join(parts) + "\n\n" + config_epilog(keys, docs)


def config_epilog(keys: Sequence[str], docs: Sequence[str]) -> str:
    """The most-used config keys (one line each) and the files that document the rest; also the
    epilog of the commands whose help argparse writes."""
    parts = []
    if keys:
        parts += ["most-used config keys (key=value; every key, its default and comment: configs/base.yml):",
                  *key_lines(keys), ""]
    if docs:
        parts += ["documentation: " + ", ".join(docs)]
    return "\n".join(parts) + "\n"


def train_help() -> str:
    """--help of `train.py` and `tessera.train.main` (here, so that it needs no JAX)."""
    return help_text(
        ".venv/bin/python train.py configs/base.yml [key=value ...]",
        "Train a decoder LLM. The YAML file gives every key; configs/models/<model_name>.yml, then\n"
        "key=value arguments, then M_<KEY> environment variables override it, later wins. The same\n"
        "command again resumes from the run's newest checkpoint. `.venv/bin/python -m tessera.config` with the\n"
        "same arguments prints the resolved config without training.",
        keys=TRAIN_KEYS, docs=("README.md", "getting_started/First_run.md", "getting_started/Checkpointing.md"))


def prepare_training_process(argv: Sequence[str]) -> None:
    """What `train.py` and `.venv/bin/python -m tessera.train` do before JAX starts: answer --help (instant,
    no device probing), go to the CPU on hosts without accelerators, and on the CPU start again
    with mimalloc preloaded (`tessera.host_malloc`; a bad TESSERA_HOST_MALLOC exits 2)."""
    exit_if_help(argv, train_help)
    from tessera.host_malloc import reexec
    from tessera.platforms import use_cpu_on_hosts_without_accelerators

    use_cpu_on_hosts_without_accelerators()
    exit_if_ctrl_c_was_held()  # a new process would not know of it
    reexec()


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


EXIT_NOT_INSTALLED = 1  # this Python lacks a package Tessera needs (Python's own code for an ImportError)
REPO_VENV = Path(__file__).resolve().parents[3] / ".venv"  # where setup.sh installs (its default VENV)
EXIT_BAD_VARIABLE = 2  # a JAX_* variable JAX cannot read, as a config error


def unreadable_jax_variable(message: str) -> str | None:
    """'JAX_NAME=value' when `message` is JAX's refusal of an environment variable at import (an enum,
    integer or boolean flag's), else None."""
    flag = re.fullmatch(r'Invalid value "(.*)" for JAX flag (jax_\w+)', message)
    if flag:
        return f"{flag.group(2).upper()}={flag.group(1)}"
    truth = re.fullmatch(r"invalid truth value '(.*)' for environment '(\w+)'", message)
    return f"{truth.group(2)}={truth.group(1)}" if truth else None


@contextlib.contextmanager
def packages_installed(script: str):
    """A package this interpreter lacks, met while an entry script imports Tessera, is one line and
    exit code 1: `python3 train.py ...` with a Python other than the project's `.venv/bin/python`
    was a ModuleNotFoundError traceback from deep in the imports ("No module named 'jax'"). So is a
    JAX_* variable that `import jax` cannot read (exit code 2): JAX_OPTIMIZATION_LEVEL=o1 was a
    ValueError traceback."""
    try:
        yield
    except ValueError as e:
        variable = unreadable_jax_variable(str(e))
        if variable is None:
            raise
        print(f"config error: {variable} in the environment is a value JAX cannot read ({e}); correct it or unset "
              "it", file=sys.stderr)
        sys.exit(EXIT_BAD_VARIABLE)
    except ModuleNotFoundError as e:
        package = (e.name or "").split(".")[0]
        if not package or package == "tessera":
            raise
        if Path(sys.prefix).resolve() == REPO_VENV.resolve():
            fix = "the install is incomplete: run `bash setup.sh` again (`.venv/bin/python -m tessera.doctor` checks)"
        elif (REPO_VENV / "bin" / "python").exists():
            fix = f"run it with the project's interpreter, {REPO_VENV / 'bin' / 'python'} {script} ..."
        else:
            fix = (f"install the project first (`bash setup.sh` in {REPO_VENV.parent}), then run "
                   f"`.venv/bin/python {script} ...`")
        print(f"error: {sys.executable} (Python {sys.version.split()[0]}) has no module '{package}', which Tessera "
              f"needs; {fix} (exit code {EXIT_NOT_INSTALLED})", file=sys.stderr)
        sys.exit(EXIT_NOT_INSTALLED)


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
    is blocked in compiled code by then, the thread above ends the process `grace` seconds later."""
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
    handlers[signum] is installed has the signal sent again RESEND_SECONDS later, from another
    thread (sent from the hook, the handler would run inside it at once, and be swallowed again);
    anything else goes to `previous_hook`. The handler's run is forgotten (`ran`), so the watcher
    waits for the next one: if the main thread is blocked in compiled code by then, it cannot come,
    and the watcher ends the process `grace` seconds later."""
    def hook(unraisable) -> None:
        for signum, handler in handlers.items():
            if isinstance(unraisable.exc_value, kinds[signum]) and signal.getsignal(signum) is handler:
                ran[signum].clear()
                resend = threading.Timer(RESEND_SECONDS, os.kill, args=(os.getpid(), signum))
                resend.daemon = True
                resend.start()
                return
        previous_hook(unraisable)

    return hook


class _BlockedSignalWatcher:
    """The thread behind sigterm_raises' `grace`: woken through the signal module's wake-up file
    descriptor, which the interpreter writes from its C-level handler even while the main thread
    is blocked."""

    WHAT = {signal.SIGTERM: "stopped by SIGTERM", signal.SIGINT: "interrupted (Ctrl-C)"}

    def __init__(self, handlers: dict, ran: dict, grace: float):
        self.handlers, self.ran, self.grace = handlers, ran, grace
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.write_fd, False)
        self.previous_fd = signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name="signal-watcher", daemon=True).start()

    def _watch(self) -> None:
        while data := os.read(self.read_fd, 64):  # b"": stop() closed the pipe
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


def exit_if_help(argv: Sequence[str], text: Callable[[], str]) -> None:
    """Print `text()` and exit 0 when argv asks for help."""
    if wants_help(argv):
        print(text(), end="")
        raise SystemExit(EXIT_OK)


EXIT_CLOSED_PIPE = 141  # 128 + SIGPIPE, the code a C tool gets when its reader goes away (`yes | head`)
EXIT_WRITE_FAILED = 1  # stdout could not be written (a full disk under `> configs/base.yml`)


def run_printing(main: Callable[[list[str]], int], argv: list[str]) -> int:
    """`main(argv)`'s exit code, for a command whose output is a report on stdout: when the reader
    of a pipe goes away before the end (`... | head`), the rest of the report is dropped quietly and
    the code is EXIT_CLOSED_PIPE, as for a C tool; Python printed a BrokenPipeError traceback. When
    stdout cannot be written otherwise (a full disk), one line says so and the code is EXIT_WRITE_FAILED."""
    try:
        code = main(argv)
        sys.stdout.flush()  # inside: a report still buffered meets the closed pipe here, not at exit
        return code
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the flush at exit goes nowhere
        return EXIT_CLOSED_PIPE
    except OSError as e:
        if not _is_stdout_error(e):
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print(f"error: the output could not be written ({e.strerror or e}); what was written of it is incomplete: "
              "free space (or choose another file) and run the command again", file=sys.stderr)
        return EXIT_WRITE_FAILED


def _is_stdout_error(e: OSError) -> bool:
    """`e` came from writing stdout (print and flush raise it without a file name)."""
    return e.filename is None and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG)


# --------------------------------------------------------------------------- arguments


def take_options(argv: Sequence[str], defaults: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """(the value of each `--option value` or `--option=value` in `defaults`, the other arguments).
    An option without a value, or one not in `defaults`, is a UsageError."""
    values, rest = dict(defaults), []
    args = list(argv)
    while args:
        arg = args.pop(0)
        if not arg.startswith("--"):
            rest.append(arg)
            continue
        name, sep, value = arg.partition("=")
        if name not in defaults:
            raise UsageError(f"unknown option {name}; the options are {', '.join(defaults)} "
                             "(config keys are given as key=value)")
        if not sep:
            if not args or args[0].startswith("--"):
                raise UsageError(f"{name} needs a value, e.g. {name} {defaults[name] or 'VALUE'}")
            value = args.pop(0)
        values[name] = value
    return values, rest


OVERRIDE = re.compile(r"-{0,2}[A-Za-z_][A-Za-z0-9_]*=")  # key=value; a path such as runs/lr=3e-4 is not one


def split_overrides(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """(positional arguments, key=value overrides): an override's key is a name, so a folder whose
    path holds '=' (runs/lr=3e-4/checkpoints/100) is a positional argument."""
    overrides = [a for a in args if OVERRIDE.match(a)]
    return [a for a in args if not OVERRIDE.match(a)], overrides


def resolve_path(text: str, what: str, must_exist: bool = True) -> str:
    """`text` as typed, made absolute against the working directory (URLs such as gs://... are
    kept as they are). UsageError naming the resolved path when `must_exist` and nothing is there."""
    if "://" in text:
        return text
    path = Path(os.path.abspath(Path(text).expanduser()))
    if must_exist and not path.exists():
        typed = "" if Path(text).is_absolute() else f" ({text!r} from the working directory {Path.cwd()})"
        repo = REPO_VENV.parent  # the docs' commands run from the repository root
        fix = (f"the repository's is {repo / text}: run the command from {repo}, as the docs do, or give that path"
               if typed and (repo / text).exists() else "check the path")
        raise UsageError(f"{what} {path} does not exist{typed}; {fix}")
    return str(path)


def resolve_config_file(args: Sequence[str]) -> list[str]:
    """`args` of load_config (a YAML file, then key=value) with the file resolved as by `resolve_path`."""
    args = list(args)
    if args and args[0].strip() and "=" not in args[0] and not args[0].startswith("-"):  # "": load_config says
        args[0] = resolve_path(args[0], "config file")
    return args


# --------------------------------------------------------------------------- progress


def format_seconds(seconds: float) -> str:
    """45s, 2m05s, 1h02m."""
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Heartbeat:
    """While a `with` block runs, says every `period` seconds how long it has been running:
    `<what>: 2m30s elapsed[, <detail()>]`, from a background thread that stops with the block.
    These are log lines, not a bar: they read the same on a terminal and in a log file."""

    def __init__(self, what: str, period: float = 30.0, detail: Callable[[], str] | None = None,
                 emit: Callable[[str], None] | None = None):
        self.what, self.period, self.detail = what, period, detail
        self.emit = emit or (lambda line: print(line, flush=True))
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="tessera-heartbeat", daemon=True)
        self.start = 0.0

    def __enter__(self) -> Heartbeat:
        self.start = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def line(self) -> str:
        text = f"{self.what}: {format_seconds(time.monotonic() - self.start)} elapsed"
        extra = self.detail() if self.detail else ""
        return f"{text}, {extra}" if extra else text

    def _beat(self) -> None:
        while not self._done.wait(self.period):
            self.emit(self.line())
