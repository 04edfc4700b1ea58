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
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

from tessera.tools.cli_signals import exit_if_ctrl_c_was_held

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


def parse_with_keys(parser, argv: Sequence[str]):
    """`parser.parse_intermixed_args(argv)`, where an argument argparse does not know that names a config key
    as an option (`--steps=5`, `--max_target_length 2048`) is refused with the key=value form to write
    (argparse printed its usage and "unrecognized arguments: --steps=5"). Exit code 2, as argparse's."""
    from tessera.config.schema import all_fields

    args, unknown = parser.parse_known_intermixed_args(argv)
    keys = all_fields()
    for arg in unknown:
        name, sep, value = arg.lstrip("-").partition("=")
        if arg.startswith("-") and name in keys:
            after = [*argv[list(argv).index(arg) + 1:], "-"][0]  # `--key value`: argparse took the value as an override
            value = value if sep else (after if "=" not in after and after[:1] != "-" else "<value>")
            parser.exit(2, f"config error: {arg!r} is the config key {name} written as an option; config keys are "
                           f"key=value arguments without dashes: {name}={value}\n")
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


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
    no device probing), go to the CPU on hosts without accelerators, on the CPU start again with
    mimalloc preloaded (`tessera.host_malloc`; a bad TESSERA_HOST_MALLOC exits 2), and end on a config
    that does not load (`exit_if_config_error`; exit code 2)."""
    exit_if_help(argv, train_help)
    from tessera.host_malloc import reexec
    from tessera.platforms import use_cpu_on_hosts_without_accelerators

    use_cpu_on_hosts_without_accelerators()
    exit_if_ctrl_c_was_held()  # a new process would not know of it
    reexec()
    exit_if_config_error(argv)


EXIT_USER_ERROR = 2  # train.py's exit code for a bad input (a config, data or checkpoint error)


def exit_if_config_error(argv: Sequence[str], check=None) -> None:
    """A config that does not load ends `train.py` before it imports JAX, Flax and Orbax: the same log
    lines, the same `config error: ...` line and exit code as when `tessera.train.main` reads it, in a
    fraction of a second instead of the seconds those imports take. The config is read quietly first;
    only when it fails is it read again with the command's logging (its notes, then the error). A config
    that loads is read again by `main`, which logs its notes once. `check` (of the loaded config, raising
    a ConfigError) is a command's own condition on it, checked the same way."""
    from tessera.config import ConfigError

    if config_loads(argv, check):
        return
    exit_if_ctrl_c_was_held()  # a Ctrl-C held while starting wins, as it did before the config was read
    with command_logging():
        try:
            _load_and_check(argv, check)
        except ConfigError as e:
            print(f"config error: {e}", file=sys.stderr)
            sys.exit(EXIT_USER_ERROR)


def config_loads(argv: Sequence[str], check=None) -> bool:
    """False when `load_config(argv)`, or `check` of the config it returns, raises a ConfigError; read
    with logging off (a config that loads is read again for use, and logs its notes then). Another
    exception is a bug of ours, which the command reports where it reads the config for use: True here."""
    import logging

    from tessera.config import ConfigError

    before = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        _load_and_check(argv, check)
    except ConfigError:
        return False
    except Exception:  # noqa: BLE001
        return True
    finally:
        logging.disable(before)
    return True


def _load_and_check(argv: Sequence[str], check) -> None:
    from tessera.config import load_config

    cfg = load_config(list(argv))
    if check is not None:
        check(cfg)


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


LOG_FORMAT, LOG_TIME = "%(asctime)s %(levelname).1s %(message)s", "%H:%M:%S"  # a command's log lines


@contextlib.contextmanager
def command_logging(quiet: Sequence[str] = ("jax", "absl")):
    """The command's log lines (INFO and up, one timed line each) on the stderr of this moment while the
    block runs, the loggers in `quiet` at WARNING; afterwards the root logger's handlers and level, and
    those loggers' levels, are the caller's again. Called from a notebook or a sweep, `main` used
    logging.basicConfig(force=True): it closed the caller's own handlers (a log file) and left its own,
    on the stderr of that call, and INFO, for the rest of the process."""
    import logging

    root = logging.getLogger()
    theirs, levels = list(root.handlers), [(lg, lg.level) for lg in (root, *map(logging.getLogger, quiet))]
    ours = logging.StreamHandler(sys.stderr)
    ours.setFormatter(logging.Formatter(LOG_FORMAT, datefmt=LOG_TIME))
    for handler in theirs:
        root.removeHandler(handler)
    root.addHandler(ours)
    root.setLevel(logging.INFO)
    for name in quiet:
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        yield
    finally:
        root.removeHandler(ours)
        for handler in theirs:
            root.addHandler(handler)
        for logger, level in levels:
            logger.setLevel(level)


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
    kept as they are). UsageError naming the resolved path when `must_exist` and nothing is there,
    and for an empty `text`, a file: URL (no client reads one) or a name too long for file systems."""
    from tessera.config.paths import file_url_path, is_file_url, too_long_name

    if not text.strip():
        raise UsageError(f"the {what} is an empty string ({text!r}); give a path")
    if is_file_url(text):
        raise UsageError(f"{what} {text} is a file: URL, which is not read as a local path; write the path "
                         f"itself, {file_url_path(text)}")
    if "://" in text:
        return text
    path = Path(os.path.abspath(Path(text).expanduser()))
    long_name = too_long_name(str(path))
    if long_name:  # path.exists() raised OSError "File name too long"
        raise UsageError(f"the {what} {long_name}; use a shorter name")
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
