"""What the benchmark scripts' command lines share, so that a bad argument stops a script before
it measures anything: argparse's usage line and one error line, exit code 2.

- `at_least(n)`: an argparse type for counts (`--steps`, `--rounds`, `--repeats`);
- `checked_out(parser, path)`: an `--out` file that can be written (its folder is made);
- `key_values(parser, extra)`: the trainer's `key=value` settings given after the options;
- `checked_config(parser, argv)`: the trainer's config, its errors as a usage error;
- `chosen_recipes(doc, argv)`: the TPU recipes whose path contains one of the arguments;
- `read_results(path)`, `write_results(path, data)`: a results file read back (one line, exit 2, when
  it is not JSON) and written whole or not at all;
- `run_main(main)`: the script's `main`, a Ctrl-C, a SIGTERM or a stop of the trainer (a signal, a
  non-finite loss) ending it with one line and its exit code (130, 143, the trainer's).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path


def at_least(low: int):
    """An argparse type: a whole number >= `low`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is too small; give at least {low}")
        return value

    return parse


def checked_out(parser: argparse.ArgumentParser, path: str) -> Path:
    """`path` as the results file, its folder made; a usage error when it cannot be written."""
    out = Path(path)
    if not path:
        parser.error("--out is empty; give the path of a .json file")
    if out.is_dir():
        parser.error(f"--out {path} is a folder; give the path of a .json file")
    blocker = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        parser.error(f"--out {path}: {blocker} is a file, not a folder; choose another --out")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        parser.error(f"--out {path}: its folder cannot be made ({e.strerror}); choose another --out")
    if not os.access(out.parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        parser.error(f"--out {path} cannot be written (permissions); choose another --out")
    return out


def key_values(parser: argparse.ArgumentParser, extra: list[str]) -> dict[str, str]:
    """The `key=value` trainer settings among `extra` (what parse_known_args left over)."""
    bad = [a for a in extra if "=" not in a or a.startswith("-")]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)} (trainer settings are given as key=value)")
    return dict(a.split("=", 1) for a in extra)


def checked_config(parser: argparse.ArgumentParser, argv: list[str]):
    """`load_config(argv)`; a config error (unknown key, bad value) is a usage error."""
    from tessera.config import ConfigError, load_config

    try:
        return load_config(argv, env={})
    except ConfigError as e:
        parser.error(str(e))


def chosen_recipes(doc: str, argv: list[str]) -> list[Path]:
    """The configs/tpu/*/*.sh recipes whose path contains one of `argv`'s words (all without any);
    `--help` prints `doc`, and a word no recipe's path contains is a usage error."""
    recipes = sorted((Path(__file__).resolve().parent.parent / "configs" / "tpu").glob("*/*.sh"))
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("filters", nargs="*", metavar="PART",
                        help="run only the recipes whose path contains one of these (e.g. v5p/128b v6e)")
    filters = parser.parse_args(argv).filters
    unknown = [f for f in filters if not any(f in str(r) for r in recipes)]
    if unknown:
        names = ", ".join(str(r.relative_to(r.parents[3])) for r in recipes[:3])
        parser.error(f"no recipe's path contains {unknown[0]!r} (the recipes are configs/tpu/<generation>/<name>.sh, "
                     f"e.g. {names}); leave the arguments out for every recipe")
    return [r for r in recipes if not filters or any(f in str(r) for f in filters)]


def read_results(path: Path, default: dict) -> dict:
    """The JSON of a results file this run adds to (`default` when there is none); one line and exit 2
    when it is not JSON (cut short, a merge's conflict markers), before anything is measured."""
    if not path.is_file():
        return default
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        print(f"{Path(sys.argv[0]).name}: error: {path} is not valid JSON ({e}); restore it (git checkout -- {path}) "
              f"or remove it to start a new one", file=sys.stderr)
        sys.exit(2)


def write_results(path: Path, data: dict) -> None:
    """`data` as `path`'s JSON, through a temporary file renamed over it: a stop or a full disk while it is
    written leaves the previous file, never a cut-off one. A path that is not a regular file (/dev/stdout,
    a pipe) is written directly: a rename would replace it."""
    text = json.dumps(data, indent=2) + "\n"
    path = Path(os.path.realpath(path))  # a symbolic link's target is written, the link kept
    if path.exists() and not path.is_file():
        with open(path, "w") as f:
            f.write(text)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        part.write_text(text)
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)


class Terminated(BaseException):  # like KeyboardInterrupt: no `except Exception` swallows it
    """SIGTERM outside the trainer's loop."""


def run_main(main, *args, unfinished: str = "no results written"):
    """`main(*args)`, whose return value is the exit code (None: 0). Ctrl-C or SIGTERM outside the
    trainer's loop exits 130 or 143 (a child process `subprocess.run` waits for is killed), and a run
    the trainer stopped (`TrainingStopped`: SIGTERM or SIGINT between steps, 128 + the signal's number;
    a non-finite loss) exits with its code, each with one line, not a traceback, which says what is
    left (`unfinished`: most scripts write their results only at the end)."""
    def terminated(signum, frame):  # outside the trainer's loop, whose own handler takes over while it runs
        raise Terminated

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        return main(*args)
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT
        print(f"interrupted (Ctrl-C): {unfinished} (exit code {code})", file=sys.stderr)
        return code
    except Terminated:
        code = 128 + signal.SIGTERM
        print(f"stopped by SIGTERM: {unfinished} (exit code {code})", file=sys.stderr)
        return code
    except Exception as e:
        stop = sys.modules.get("tessera.stop_signals")  # imported by the trainer, which raised it
        if stop is None or not isinstance(e, stop.TrainingStopped):
            raise
        print(f"{e}: the benchmark ends here, {unfinished} (exit code {e.exit_code})", file=sys.stderr)
        return e.exit_code
    finally:
        signal.signal(signal.SIGTERM, previous)
