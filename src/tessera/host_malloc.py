"""The host memory allocator of CPU runs: mimalloc, preloaded by starting the interpreter again.

Why. XLA:CPU allocates each step's temporary buffer with `malloc` and frees it when the step
ends (about 2 GB per step on `benchmarks/cpu_llama.py`'s workload). glibc serves a block that
large with `mmap` and returns it with `munmap`, so every step the kernel maps and zeroes the same
memory again: measured on that workload, 509,000 page faults and 0.8-0.9 s of system time per
step, the step 3.2 s with glibc and 2.7 s with mimalloc told to keep freed memory (0 faults once
warm). Accelerators' own allocators (XLA's BFC pools) already keep their memory between steps;
this gives CPU runs the same.

What it does. `reexec()` runs before JAX is imported, in `train.py` and in the CPU benchmark. When
JAX will run on the CPU (JAX_PLATFORMS=cpu, which `platforms.use_cpu_on_hosts_without_accelerators`
sets on hosts without accelerators), on Linux, with the `cmeel-mimalloc` wheel installed (setup.sh
installs it), it starts the same command again with mimalloc in LD_PRELOAD (`os.execve`: same
process id, same arguments, same interpreter options). The settings below become mimalloc's
defaults; any MIMALLOC_* variable already set wins:

    MIMALLOC_PURGE_DELAY=-1   keep freed memory mapped for the next step (the point of all this);
                              the process's resident memory stays at its high-water mark
    MIMALLOC_ALLOW_THP=0      no transparent huge pages: on the reference machine (a VM) first
                              touches of huge pages stalled steps for seconds

The restarted process restores LD_PRELOAD to what it was, so programs it starts (data workers,
tools) get the system allocator.

    TESSERA_HOST_MALLOC=mimalloc   the default
    TESSERA_HOST_MALLOC=system     glibc's malloc (for comparisons, or to rule the allocator out)

`in_use()` reads /proc/self/maps, so what the run log says is what the process really runs.

One-off work. Memory kept for the next step is memory the next step reuses; buffers of one-off
work are not, and kept, they stay resident for the whole run. Reading a checkpoint is such work:
TensorStore reads every array into buffers of its own, and with the purge delay at -1 a resume of
a 2.05 GiB train state left the process 4.1 GiB larger instead of 2.05 (measured on 2 cores).
`returning_freed_memory()` sets mimalloc's purge delay to 0 for such a block (freed memory goes
back to the OS at once), then back to the process's setting; `start_state.initial_state` and
`decode.load_model` read checkpoints inside it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
from pathlib import Path

CHOICE_VAR = "TESSERA_HOST_MALLOC"
CHOICES = ("mimalloc", "system")
DEFAULTS = {"MIMALLOC_PURGE_DELAY": "-1", "MIMALLOC_ALLOW_THP": "0"}
# Set by the process that restarts itself, read (and removed) by the restarted one.
_PRELOADED_VAR = "_TESSERA_HOST_MALLOC_PRELOADED"
_PREVIOUS_PRELOAD_VAR = "_TESSERA_HOST_MALLOC_PREVIOUS_LD_PRELOAD"
_reexec_called = False  # whether this process went through `reexec` (describe says so when it did not)


class HostMallocError(ValueError):
    """TESSERA_HOST_MALLOC names no known allocator."""


def library() -> Path | None:
    """libmimalloc's path from the installed `cmeel-mimalloc` wheel, or None."""
    from importlib import metadata

    try:
        files = metadata.files("cmeel-mimalloc") or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name.startswith("libmimalloc.so."):
            path = Path(f.locate())
            if path.is_file():
                return path
    return None


def plan(environ: dict[str, str], platform: str = sys.platform) -> tuple[dict[str, str] | None, str]:
    """(the environment to restart with, or None to stay; why), decided from `environ` alone."""
    choice = environ.get(CHOICE_VAR, "mimalloc")
    if choice not in CHOICES:
        raise HostMallocError(f"{CHOICE_VAR}={choice!r} is not one of {', '.join(CHOICES)} "
                              f"(unset it for mimalloc, the default on CPU runs)")
    if choice == "system":
        return None, f"{CHOICE_VAR}=system"
    if platform != "linux":
        return None, f"preloading an allocator is done on Linux only (this is {platform})"
    if environ.get("JAX_PLATFORMS") != "cpu":  # set to cpu on hosts without accelerators; otherwise asked for
        return None, (f"JAX_PLATFORMS={environ['JAX_PLATFORMS']}, not the CPU: an accelerator's allocator keeps "
                      "its memory between steps" if environ.get("JAX_PLATFORMS") else
                      "JAX runs on an accelerator here, whose allocator keeps its memory between steps")
    if _PRELOADED_VAR in environ:
        return None, "mimalloc was preloaded"
    lib = library()
    if lib is None:
        return None, "the cmeel-mimalloc package is not installed (bash setup.sh installs it)"
    if not _preloadable(lib):
        lib = _link_for_preload(lib)
        if lib is None:
            return None, "the path of the mimalloc library holds a space or a colon, which LD_PRELOAD cannot carry"
    env = dict(environ)
    previous = environ.get("LD_PRELOAD", "")
    env["LD_PRELOAD"] = f"{lib}:{previous}" if previous else str(lib)
    env[_PRELOADED_VAR] = str(lib)
    env[_PREVIOUS_PRELOAD_VAR] = previous
    for key, value in DEFAULTS.items():
        env.setdefault(key, value)
    return env, f"preloading {lib}"


def _preloadable(path: Path) -> bool:
    """LD_PRELOAD splits its list at spaces and colons: a path holding one cannot be in it."""
    return not any(c in str(path) for c in " :\t")


def _link_for_preload(lib: Path) -> Path | None:
    """A symbolic link to `lib` in the temporary folder, for a repository cloned under a path with a
    space (~/My Projects/tessera): the loader maps the library it points to. None when that folder's
    path cannot be preloaded either, or the link cannot be made."""
    import tempfile

    link = Path(tempfile.gettempdir()) / f"tessera-{os.getuid()}-{lib.name}"
    if not _preloadable(link):
        return None
    try:
        if not (link.is_symlink() and link.resolve() == lib.resolve()):
            new = link.with_name(f"{link.name}.{os.getpid()}")
            new.unlink(missing_ok=True)
            new.symlink_to(lib)
            new.replace(link)  # atomic: processes starting together never see half a link
    except OSError:
        return None
    return link


def reexec() -> None:
    """Start this command again with mimalloc preloaded when `plan` says so (see the module
    docstring); in the restarted process, put LD_PRELOAD back. Call it before importing JAX. A bad
    TESSERA_HOST_MALLOC ends the process with exit code 2 and one line."""
    global _reexec_called
    _reexec_called = True
    if _PRELOADED_VAR in os.environ:
        previous = os.environ.pop(_PREVIOUS_PRELOAD_VAR, "")
        if previous:
            os.environ["LD_PRELOAD"] = previous
        else:
            os.environ.pop("LD_PRELOAD", None)
        os.environ.pop(_PRELOADED_VAR)
        return
    try:
        env, _ = plan(dict(os.environ))
    except HostMallocError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)  # train.py's exit code for a bad input
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError as e:  # the same interpreter cannot be started again: run on with the system allocator
        print(f"host malloc: could not restart with mimalloc ({e}); using the system allocator", file=sys.stderr)


_PURGE_DELAY_OPTION = 15  # mi_option_purge_delay's place in mimalloc 2's and 3's mi_option_e (mimalloc.h)


def _loaded_mimalloc() -> ctypes.CDLL | None:
    """The libmimalloc mapped into this process (preloaded), or None."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = {line.split()[-1] for line in maps.splitlines() if "libmimalloc" in line and "/" in line}
    if not paths:
        return None
    lib = ctypes.CDLL(sorted(paths)[0])  # already loaded: this only returns its handle
    lib.mi_option_get.restype, lib.mi_option_get.argtypes = ctypes.c_long, [ctypes.c_int]
    lib.mi_option_set.restype, lib.mi_option_set.argtypes = None, [ctypes.c_int, ctypes.c_long]
    return lib


@contextlib.contextmanager
def returning_freed_memory():
    """Inside the block, mimalloc gives memory back to the OS as soon as it is freed (purge delay
    0); afterwards the process's setting applies again. Nothing changes under another allocator,
    or when the option does not read back as MIMALLOC_PURGE_DELAY says (another mimalloc layout)."""
    lib = _loaded_mimalloc()
    previous = lib.mi_option_get(_PURGE_DELAY_OPTION) if lib else None
    if previous is None or str(previous) != os.environ.get("MIMALLOC_PURGE_DELAY", DEFAULTS["MIMALLOC_PURGE_DELAY"]):
        if lib:
            logging.getLogger("tessera").debug("mimalloc's purge delay reads %s: left as it is", previous)
        yield
        return
    lib.mi_option_set(_PURGE_DELAY_OPTION, 0)
    try:
        yield
    finally:
        lib.mi_option_set(_PURGE_DELAY_OPTION, previous)


def in_use() -> str:
    """'mimalloc' when libmimalloc is mapped into this process, else 'system'."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "system"
    return "mimalloc" if "libmimalloc" in maps else "system"


def describe() -> str:
    """One line for the run log: the allocator in use and, when it is the system's, why."""
    if in_use() == "mimalloc":
        return "mimalloc (freed memory stays mapped for the next step; TESSERA_HOST_MALLOC=system for glibc's)"
    try:
        env, why = plan(dict(os.environ))
    except HostMallocError as e:
        env, why = None, str(e)
    if env is not None and not _reexec_called:  # started some other way than through train.py
        why = "this process did not restart itself with it (train.py and .venv/bin/python -m tessera.train do)"
    elif env is not None:  # it would be preloaded, yet is not mapped: the dynamic loader refused it
        why = f"{env[_PRELOADED_VAR]} was not loaded; see the loader's message at start-up"
    return f"system; {why}"
