"""`jax_cache_dir` (MaxText's key): JAX's persistent compilation cache.

XLA's compile of a large model's train step takes minutes on a TPU host. With a cache folder
(local, or gs:// shared by the hosts of a slice) JAX writes every compiled program there, keyed
by the program, the devices, the compiler flags and the JAX and XLA versions; a later run that
compiles the same program loads it instead: a job restarted after a preemption, or a second run
of the same recipe, skips the compile. train.py and decode.py use it; `train_compile` does not
(JAX writes a program compiled for a topology without devices, but cannot load it back).

JAX leaves out programs that compiled in under `jax_persistent_cache_min_compile_time_secs`
(1 s by default; its environment variable JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS changes
it). The folder is never pruned: delete it to start over. JAX never replaces an entry either, so
one it cannot read (cut short by a kill while written) is compiled at every run: a warning names
the files to delete. An empty key leaves JAX's own setting
(JAX_COMPILATION_CACHE_DIR) as it is.

`cache_hits()` counts the programs loaded from the cache in this process, so the trainer can say
that a compile was a load.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings

log = logging.getLogger("tessera")

_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_counted = {"hits": 0, "listening": False}
_before: dict[str, str | None] = {}  # JAX's cache folder before use_compilation_cache set ours


def use_compilation_cache(path: str) -> None:
    """Compile through the persistent cache in `path` (already absolute or a URL; '' leaves JAX's
    setting alone), and count its hits from now on. Starts no JAX backend, so it runs before a
    multi-process job is joined; `check_cache_folder` runs once it is."""
    import jax

    if not _counted["listening"]:
        jax.monitoring.register_event_listener(_count)
        warnings.showwarning = _explaining_unreadable_entries(warnings.showwarning)
        _counted["listening"] = True
    if path:
        _before.setdefault("dir", jax.config.jax_compilation_cache_dir)
        jax.config.update("jax_compilation_cache_dir", path)


def check_cache_folder(path: str) -> None:
    """ConfigError when the cache folder `path` cannot be written: JAX itself only warns, once, at its
    first compile, and compiles every program again at each start (minutes on a TPU host, where the
    cache matters). Called after the job is joined (the probe asks for the process index, which starts
    JAX's backends) and before the first compile, so JAX's warning never comes first. A refused folder
    is then no longer JAX's setting (the one before `use_compilation_cache` is again), so a caller that
    goes on in this process, such as a notebook calling `decode.main`, compiles without it."""
    if path:
        import jax

        from tessera.checkpointing.storage import check_writable

        try:
            check_writable(path, "jax_cache_dir")
        except Exception:
            jax.config.update("jax_compilation_cache_dir", _before.pop("dir", None))
            raise
        log.info("compilation cache: %s", path)


@contextlib.contextmanager
def unloadable_programs_unsaved(mesh):
    """Compiles for `mesh` write nothing to the persistent cache when its devices are not this host's
    (a TPU topology compiled for ahead of time): JAX writes such a program but cannot load it back,
    and warned "Error reading persistent compilation cache entry ... PjRtCompiler must be constructed
    with a Client" at the next compile of it (JAX_COMPILATION_CACHE_DIR set, as on many TPU hosts)."""
    import jax

    if mesh.devices.flat[0] in jax.devices():
        yield
        return
    before = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))  # JAX writes no faster compile
    try:
        yield
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before)


def _explaining_unreadable_entries(show):
    """`warnings.showwarning` that replaces JAX's "Error reading persistent compilation cache entry"
    with a line that says what to do: JAX compiles the program again but never replaces an entry
    (one cut short by a process killed while writing it, or a corrupt file), so without it every
    later run compiled that program again, and only this warning said why."""
    def showwarning(message, category, filename, lineno, file=None, line=None):
        m = re.match(r"Error reading persistent compilation cache entry for '([^']+)': (.*)", str(message), re.S)
        if not m:
            return show(message, category, filename, lineno, file, line)
        import jax

        folder = jax.config.jax_compilation_cache_dir or "the compilation cache folder"
        log.warning("compilation cache: the entry of %s in %s cannot be read (%s); it is compiled instead, and JAX "
                    "never replaces an entry, so every run would compile it again: delete %s/%s-*-cache (or the "
                    "folder, to start over)", m[1], folder, " ".join(m[2].split())[:200], folder, m[1])
    return showwarning


def cache_hits() -> int:
    """Programs loaded from the persistent cache in this process so far."""
    return _counted["hits"]


def loaded_note(hits_before: int) -> str:
    """' (loaded from the compilation cache)' when a program came from the cache since `cache_hits()`
    returned `hits_before`; '' otherwise (for a compile's log line)."""
    return " (loaded from the compilation cache)" if cache_hits() > hits_before else ""


def _count(event: str, **_) -> None:
    if event == _HIT_EVENT:
        _counted["hits"] += 1
