"""`dump_hlo=true`: XLA's dump of the compiled programs, written as each one compiles.

The dump is XLA's own (`--xla_dump_to`): per program, its HLO before and after optimization, the
buffer assignment and the memory-usage report, and for a TPU the compiler's environment. It is
what a compiler bug report or a by-hand performance study needs. The flags are added to
XLA_FLAGS, which JAX reads when its backends start, so `apply_hlo_dump` runs before any device
is used (train.py and train_compile call it right after the config is loaded).

By default only the train step is dumped (`dump_hlo_module_name=jit_train_step`, MaxText's
default) into the run folder's `xla_dump/`. A program loaded from the persistent compilation
cache is not compiled, so not dumped: with dump_hlo, or a dump folder in XLA_FLAGS
(`--xla_dump_to`, as the A3 GPU recipes set), the cache is off for the run. Every process
writes its own dump; on a folder that several hosts share they write the same programs under the
same names.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import MutableMapping
from pathlib import Path

from tessera.config import Config, ConfigError
from tessera.config.derived import run_dir
from tessera.platforms import check_backends_not_started

log = logging.getLogger("tessera")
DUMP_FLAG = "--xla_dump_to"


def dump_folder(cfg: Config) -> Path:
    """Where the dump goes: dump_hlo_local_dir, else the run folder's xla_dump/."""
    return Path(cfg.profiler.dump_hlo_local_dir) if cfg.profiler.dump_hlo_local_dir else run_dir(cfg.run) / "xla_dump"


def dump_flags(cfg: Config) -> list[str]:
    """The XLA flags dump_hlo adds: dump_hlo_xla_flags when set, else the folder and the program filter."""
    p = cfg.profiler
    if p.dump_hlo_xla_flags:
        return _own_flags(p.dump_hlo_xla_flags)
    if "://" in p.dump_hlo_local_dir:  # Path() made gs://b/dump the local folder ./gs:/b/dump, without a word
        raise ConfigError(f"dump_hlo_local_dir={p.dump_hlo_local_dir} is a URL: XLA writes the dump to a local "
                          "folder; give a local path (or leave it empty for the run folder's xla_dump/), and copy "
                          "the dump where it should go (gcloud storage cp -r)")
    folder = str(dump_folder(cfg))
    if any(c.isspace() for c in folder):
        raise ConfigError(f"the HLO dump folder {folder!r} contains white space, which XLA_FLAGS cannot carry; "
                          "set dump_hlo_local_dir to a folder without spaces")
    return [f"{DUMP_FLAG}={folder}", *([f"--xla_dump_hlo_module_re={_module_pattern(p.dump_hlo_module_name)}"]
                                      if p.dump_hlo_module_name else [])]


def _own_flags(text: str) -> list[str]:
    """dump_hlo_xla_flags as flags, each --name or --name=value: XLA reads an XLA_FLAGS that does not start with
    "--" as the name of a file of flags and aborts the process when there is none (`xla_dump_to=/d`, the
    dashes left out, was a fatal "Could not open file" line from XLA), and a word after the first flag was
    dropped without a word."""
    flags = text.split()
    bad = [f for f in flags if not f.startswith("--") or len(f) < 3]
    if bad:
        raise ConfigError(f"dump_hlo_xla_flags={text!r}: {', '.join(repr(f) for f in bad)} "
                          f"{'is not an XLA flag' if len(bad) == 1 else 'are not XLA flags'}; give flags as "
                          "--name or --name=value separated by spaces, e.g. dump_hlo_xla_flags='--xla_dump_to=/tmp/"
                          "dump --xla_dump_hlo_as_text'")
    return flags


def _cache_off_for_the_dump(cfg: Config, environ: MutableMapping[str, str], why: str) -> None:
    """Turn JAX's persistent compilation cache off when one is set: the dump flags are not part of
    its key, so a program it holds would be loaded, neither compiled nor dumped."""
    import jax

    if jax.config.jax_compilation_cache_dir or environ.get("JAX_COMPILATION_CACHE_DIR") or cfg.run.jax_cache_dir:
        jax.config.update("jax_enable_compilation_cache", False)
        log.info("%s: the persistent compilation cache is off for this run, so that every program compiles", why)


def _module_pattern(name: str) -> str:
    """dump_hlo_module_name, checked: XLA reads it as an RE2 regular expression and, given one it
    cannot parse, logs an error per program and dumps nothing."""
    if any(c.isspace() for c in name):
        problem = "contains white space, which XLA_FLAGS cannot carry"
    elif re.search(r"\(\?<?[=!]|\\[1-9]", name):
        problem = "uses a lookaround or a back-reference, which XLA's regular expressions (RE2) do not have"
    else:
        try:
            re.compile(name)
            return name
        except re.error as e:
            problem = f"is not a regular expression ({e})"
    raise ConfigError(f"dump_hlo_module_name={name!r} {problem}; give a pattern of program names such as "
                      "jit_train_step or 'jit_train_step|jit_eval_step'")


def _probe(folder: Path) -> None:
    """ConfigError unless a file can be created in `folder`: XLA itself only logs each file it cannot write
    (hundreds of lines) and the run goes on. The folders made for the probe are removed again (XLA makes
    them as it dumps): a run that stops before compiling (a mesh that does not fit) left an empty run folder."""
    made = [p for p in (folder, *folder.parents) if not p.exists()]  # the deepest first
    probe = folder / f".tessera-write-probe-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        from tessera.checkpointing.storage import in_the_way

        raise ConfigError(f"the HLO dump folder {folder} cannot be written ({in_the_way(folder) or e.strerror}); set "
                          "dump_hlo_local_dir to a writable folder") from None
    finally:
        for p in made:
            with contextlib.suppress(OSError):
                p.rmdir()


def apply_hlo_dump(cfg: Config, environ: MutableMapping[str, str] | None = None) -> Path | None:
    """Add the dump flags to XLA_FLAGS (nothing without dump_hlo, but for turning the cache off when
    XLA_FLAGS has a dump folder of its own, as the A3 recipes do); the dump folder, created, or None.
    ConfigError when XLA_FLAGS already names a dump folder (two dumps cannot both be asked for)."""
    environ = os.environ if environ is None else environ
    current = environ.get("XLA_FLAGS", "").split()
    theirs = [f for f in current if f.startswith(DUMP_FLAG + "=")]
    if not cfg.profiler.dump_hlo:
        if theirs:  # a dump of XLA_FLAGS' own (the A3 recipes'): cached programs were not dumped, silently
            _cache_off_for_the_dump(cfg, environ, f"XLA_FLAGS has {theirs[-1]}")
        return None
    flags = dump_flags(cfg)
    ours = [f for f in flags if f.startswith(DUMP_FLAG + "=")]
    if ours and theirs:
        raise ConfigError(f"XLA_FLAGS already has {theirs[0]}, and dump_hlo=true adds {ours[0]}; drop "
                          f"{DUMP_FLAG} from XLA_FLAGS, or set dump_hlo=false to keep XLA_FLAGS' dump")
    check_backends_not_started("apply_hlo_dump sets XLA_FLAGS")
    folder = Path(ours[0].partition("=")[2]) if ours else None
    if folder is not None:
        _probe(folder)
    environ["XLA_FLAGS"] = " ".join([*current, *flags])
    _cache_off_for_the_dump(cfg, environ, "HLO dump")
    if folder is None and not theirs:  # XLA then prints every dumped file to stdout, megabytes of it
        log.warning("HLO dump: dump_hlo_xla_flags=%r has no %s=<folder>, so XLA prints the dump to stdout; add "
                    "%s=<folder> to it", cfg.profiler.dump_hlo_xla_flags, DUMP_FLAG, DUMP_FLAG)
    name = cfg.profiler.dump_hlo_module_name  # not used with dump_hlo_xla_flags
    what = ("the programs dump_hlo_xla_flags selects" if cfg.profiler.dump_hlo_xla_flags else
            f"programs matching {name!r}" if name else "every program")
    where = folder or (theirs[0].partition("=")[2] if theirs else "stdout")
    log.info("HLO dump: %s to %s (XLA_FLAGS: %s)", what, where, " ".join(flags))
    return folder
