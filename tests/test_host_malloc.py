"""The host allocator of CPU runs: when mimalloc is preloaded, the restart itself, and what it is for
(a step's freed temporary buffer is reused without page faults)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from tessera import host_malloc
from tessera.host_malloc import HostMallocError, plan

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="the allocator is preloaded on Linux only")


def test_the_plan_keeps_the_system_allocator_where_mimalloc_is_not_for_this_run():
    cpu = {"JAX_PLATFORMS": "cpu"}
    assert plan({**cpu, "TESSERA_HOST_MALLOC": "system"}, "linux") == (None, "TESSERA_HOST_MALLOC=system")
    assert plan(cpu, "darwin")[0] is None
    assert "accelerator" in plan({}, "linux")[1]  # JAX picks its platform: an accelerator host
    assert "accelerator" in plan({"JAX_PLATFORMS": "tpu"}, "linux")[1]
    # asked for by the user, it is named: "runs on an accelerator here" was untrue on a host without one
    assert plan({"JAX_PLATFORMS": "cuda"}, "linux")[1].startswith("JAX_PLATFORMS=cuda, not the CPU")
    assert plan({**cpu, "_TESSERA_HOST_MALLOC_PRELOADED": "/x/libmimalloc.so.3"}, "linux") == (
        None, "mimalloc was preloaded")


def test_an_unknown_allocator_name_is_refused_with_the_choices():
    with pytest.raises(HostMallocError, match="'jemalloc' is not one of mimalloc, system"):
        plan({"JAX_PLATFORMS": "cpu", "TESSERA_HOST_MALLOC": "jemalloc"}, "linux")


@linux_only
def test_the_plan_preloads_mimalloc_before_the_users_preload_and_keeps_the_users_settings():
    lib = host_malloc.library()
    assert lib is not None and lib.is_file(), "setup.sh installs cmeel-mimalloc on Linux (locks/cpu.txt)"
    env, why = plan({"JAX_PLATFORMS": "cpu", "LD_PRELOAD": "/opt/mine.so", "MIMALLOC_PURGE_DELAY": "250"}, "linux")
    assert env["LD_PRELOAD"] == f"{lib}:/opt/mine.so" and why == f"preloading {lib}"
    assert env["MIMALLOC_PURGE_DELAY"] == "250" and env["MIMALLOC_ALLOW_THP"] == "0"
    assert plan({"JAX_PLATFORMS": "cpu"}, "linux")[0]["MIMALLOC_PURGE_DELAY"] == "-1"


# Restarts itself as train.py does, then runs a jitted function whose temporary buffer (64 MiB,
# between two matmuls) is allocated and freed on every call, and counts the page faults per call.
# mimalloc keeps a freed buffer with the thread that allocated it, so each of XLA's threads that
# runs the function faults its own buffer in once: under load more threads take turns and more of
# the first calls fault (CI once saw 3 of 4). The median of 12 calls is the steady state.
PROBE = """
import json, os, resource, sys
sys.path.insert(0, {src!r})
pid = os.getpid()
from tessera import host_malloc
host_malloc.reexec()
import jax, jax.numpy as jnp
a, b, c = jnp.ones((8192, 64)), jnp.ones((64, 2048)), jnp.ones((2048, 8))
f = jax.jit(lambda a, b, c: (a @ b) @ c)
f(a, b, c).block_until_ready()
faults = []
for _ in range(12):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(a, b, c).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(dict(pid=pid, pid_after=os.getpid(), in_use=host_malloc.in_use(),
                      ld_preload=os.environ.get("LD_PRELOAD"), faults=sorted(faults)[6])))
"""


def _probe(tmp_path, **env):
    script = tmp_path / "probe.py"
    script.write_text(PROBE.format(src=str(REPO / "src")))
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("TESSERA_HOST_MALLOC", "LD_PRELOAD"))}
    proc = subprocess.run([sys.executable, "-u", str(script)], capture_output=True, text=True, timeout=300,
                          env={**environ, "JAX_PLATFORMS": "cpu", **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@linux_only
def test_a_cpu_process_restarts_with_mimalloc_and_reuses_a_freed_step_buffer_without_page_faults(tmp_path):
    mi = _probe(tmp_path)
    system = _probe(tmp_path, TESSERA_HOST_MALLOC="system")
    # the same process (exec keeps the pid and the arguments), mimalloc really mapped, and programs
    # it starts get the user's LD_PRELOAD back (here none)
    assert mi["pid"] == mi["pid_after"] and mi["in_use"] == "mimalloc" and mi["ld_preload"] is None
    assert system["in_use"] == "system"
    # glibc maps the 64 MiB afresh on every call (16,384 pages of 4 KiB); mimalloc reuses them
    assert system["faults"] > 8000, system
    assert mi["faults"] < system["faults"] / 20, (mi, system)


# Restarts itself with mimalloc, frees 512 MiB of touched memory inside and outside
# `returning_freed_memory`, and reports the resident memory it kept each time (MiB).
KEEP_PROBE = """
import ctypes, json, sys
sys.path.insert(0, {src!r})
from tessera import host_malloc
host_malloc.reexec()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def resident():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
def kept_after_free():
    start = resident()
    blocks = [libc.malloc(64 << 20) for _ in range(8)]
    for b in blocks:
        ctypes.memset(b, 1, 64 << 20)
    for b in blocks:
        libc.free(b)
    return resident() - start
with host_malloc.returning_freed_memory():
    inside = kept_after_free()
outside = kept_after_free()
print(json.dumps(dict(in_use=host_malloc.in_use(), inside=inside, outside=outside)))
"""


@linux_only
def test_one_off_work_gives_its_memory_back_while_the_steps_keep_theirs(tmp_path):
    """Inside `returning_freed_memory` (checkpoint reads, compilation) freed memory goes back to the
    OS; after it mimalloc keeps freed memory again for the next step's reuse."""
    script = tmp_path / "keep.py"
    script.write_text(KEEP_PROBE.format(src=str(REPO / "src")))
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("TESSERA_HOST_MALLOC", "LD_PRELOAD",
                                                                         "MIMALLOC_"))}
    proc = subprocess.run([sys.executable, "-u", str(script)], capture_output=True, text=True, timeout=300,
                          env={**environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["in_use"] == "mimalloc"
    assert got["inside"] < 64 and got["outside"] > 448, got  # of the 512 MiB freed


def test_a_bad_allocator_name_stops_train_py_with_one_line_and_exit_code_2(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), str(REPO / "configs" / "base.yml")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", "TESSERA_HOST_MALLOC": "tcmalloc"})
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("config error: TESSERA_HOST_MALLOC='tcmalloc' is not one of mimalloc, system "
                                   "(unset it for mimalloc, the default on CPU runs)")
    assert not list(tmp_path.iterdir())


def test_python_m_tessera_train_goes_through_the_same_restart(tmp_path):
    """`.venv/bin/python -m tessera.train` restarts itself as train.py does (a bad allocator name proves it reached
    the restart: one line, exit code 2, before any config is read)."""
    proc = subprocess.run([sys.executable, "-m", "tessera.train", str(REPO / "configs" / "base.yml")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", "TESSERA_HOST_MALLOC": "tcmalloc",
                               "PYTHONPATH": str(REPO / "src")})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("config error: TESSERA_HOST_MALLOC='tcmalloc'")


@linux_only
def test_the_log_line_says_why_a_process_runs_on_the_system_allocator(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.delenv("TESSERA_HOST_MALLOC", raising=False)
    monkeypatch.delenv("_TESSERA_HOST_MALLOC_PRELOADED", raising=False)
    monkeypatch.setattr(host_malloc, "in_use", lambda: "system")  # as if the library were not mapped
    monkeypatch.setattr(host_malloc, "_reexec_called", False)
    assert host_malloc.describe() == ("system; this process did not restart itself with it "
                                      "(train.py and .venv/bin/python -m tessera.train do)")
    monkeypatch.setattr(host_malloc, "_reexec_called", True)  # restarted, yet not mapped: the loader refused it
    assert host_malloc.describe() == (f"system; {host_malloc.library()} was not loaded; "
                                      "see the loader's message at start-up")
    monkeypatch.setenv("TESSERA_HOST_MALLOC", "system")
    assert host_malloc.describe() == "system; TESSERA_HOST_MALLOC=system"


def test_a_library_path_with_a_space_is_preloaded_through_a_link(tmp_path, monkeypatch):
    """A clone under a path with a space made LD_PRELOAD split the library's path: the loader printed
    three errors at every start and the run used the system allocator."""
    lib = tmp_path / "My Projects" / "libmimalloc.so.2.1"
    lib.parent.mkdir()
    lib.write_bytes(b"")
    monkeypatch.setattr(host_malloc, "library", lambda: lib)
    env, why = plan({"JAX_PLATFORMS": "cpu", "LD_PRELOAD": "/opt/mine.so"}, "linux")
    link = env["LD_PRELOAD"].split(":")[0]
    assert " " not in link and Path(link).resolve() == lib.resolve() and why == f"preloading {link}"
    assert env["LD_PRELOAD"] == f"{link}:/opt/mine.so"
    assert plan({"JAX_PLATFORMS": "cpu"}, "linux")[0]["LD_PRELOAD"] == link  # the same link again
