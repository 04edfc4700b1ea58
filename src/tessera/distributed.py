"""Multi-process start-up on JAX's distributed runtime (what the processes of a formed job then agree on
is tessera.job_sync; the hang watchdog that ends a stuck process is tessera.hang_watchdog).

Which processes form one job is read from the environment, first match wins:

1. `JAX_COORDINATOR_IP` [+ `JAX_COORDINATOR_PORT`, default 8476], `NNODES`, `NODE_RANK`
   (GPU clusters, the validation suite, CPU tests on localhost);
2. Slurm under `srun` (`SLURM_NTASKS` > 1): JAX's own Slurm detection;
3. a multi-host TPU slice (`TPU_WORKER_HOSTNAMES` lists several hosts, as on TPU VMs and GKE; newer GKE
   gives them as `TPU_PROCESS_ADDRESSES` or a file named by `TPU_PROCESS_ADDRESSES_PATH`, read first), or
   several slices (`MEGASCALE_NUM_SLICES` > 1 beside `TPU_WORKER_HOSTNAMES`, as xpk sets them):
   JAX's own TPU detection, which counts hosts per slice x slices.

Anything else is a single process, which never initializes and never waits (`NNODES` > 1 without
`JAX_COORDINATOR_IP` is refused). Timeouts come
from `JAX_DISTRIBUTED_INITIALIZATION_TIMEOUT_SECONDS` (default 300) and
`JAX_DISTRIBUTED_HEARTBEAT_TIMEOUT_SECONDS` (default 100). A coordinator that cannot be
reached, or a peer that never arrives, ends start-up with `DistributedError` (exit code 4)
naming the coordinator, the processes expected and how long this one waited.
"""

from __future__ import annotations

import dataclasses
import errno
import ipaddress
import logging
import os
import re
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Mapping

import jax

log = logging.getLogger(__name__)

DEFAULT_PORT = 8476
EXIT_DISTRIBUTED = 4  # start-up failed: coordinator unreachable or a peer never arrived


class DistributedError(Exception):
    """Start-up of a multi-process job failed; the message says who was expected and for how long."""


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """How this process joins its job. `mode` is single, env, slurm or tpu."""

    mode: str
    coordinator: str | None = None
    num_processes: int = 1
    process_id: int = 0
    init_timeout: int = 300
    heartbeat_timeout: int = 100


def _int_env(env: Mapping[str, str], name: str, default: int) -> int:
    value = env.get(name, "")
    if value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise DistributedError(f"{name}={value!r} must be a whole number") from None


# what a timeout below 1 s did: the heartbeat's made JAX's runtime call every process dead ("stopped sending
# heartbeats") and abort the job in C++ seconds after it formed (SIGABRT, 134); start-up's gave up before joining
# and blamed the coordinator
TIMEOUTS = {"JAX_DISTRIBUTED_INITIALIZATION_TIMEOUT_SECONDS": ("how long a process waits for the job to form", 300),
            "JAX_DISTRIBUTED_HEARTBEAT_TIMEOUT_SECONDS": ("how long a silent process is waited for before JAX's "
                                                          "runtime ends the job", 100)}


def job_from_env(env: Mapping[str, str] | None = None) -> JobSpec:
    """Read the job layout from environment variables (see the module docstring)."""
    env = os.environ if env is None else env
    spec = _job_layout(env)
    if spec.mode != "single":  # a single process never joins: its timeouts are not read
        for name, seconds in zip(TIMEOUTS, (spec.init_timeout, spec.heartbeat_timeout)):
            if seconds < 1:
                what, default = TIMEOUTS[name]
                raise DistributedError(f"{name}={seconds} is {what}, in seconds: give 1 or more (default {default}), "
                                       "or unset it")
    return spec


def _job_layout(env: Mapping[str, str]) -> JobSpec:
    init, heartbeat = (_int_env(env, name, default) for name, (_, default) in TIMEOUTS.items())
    timeouts = dict(init_timeout=init, heartbeat_timeout=heartbeat)
    if env.get("JAX_COORDINATOR_IP"):
        ip = env["JAX_COORDINATOR_IP"].strip()
        if re.fullmatch(r"[^:\[\]]+:\d+|\[[^\]]+\]:\d+", ip):  # host:port or [v6]:port (an IPv6 address has more colons)
            host, port = ip.rsplit(":", 1)
            raise DistributedError(f"JAX_COORDINATOR_IP={env['JAX_COORDINATOR_IP']} holds a port: give the address "
                                   f"alone, JAX_COORDINATOR_IP={host}, and the port as JAX_COORDINATOR_PORT={port}")
        nodes, rank = _int_env(env, "NNODES", 1), _int_env(env, "NODE_RANK", 0)
        if not env.get("NNODES") and env.get("NODE_RANK"):  # NODE_RANK=0 trained alone, NODE_RANK=1 was "out of range"
            raise DistributedError(f"JAX_COORDINATOR_IP and NODE_RANK={rank} are set but NNODES is not: set NNODES to "
                                   "the number of processes of the job, the same on every process (NNODES=1: one)")
        if nodes < 1:  # "NODE_RANK=0 must be in [0, NNODES=0)" named the wrong variable
            raise DistributedError(f"NNODES={nodes} is the number of processes of the job: give 1 or more, the same on "
                                   "every process")
        if not 0 <= rank < nodes:
            raise DistributedError(f"NODE_RANK={rank} must be in [0, NNODES={nodes})")
        if nodes == 1:
            return JobSpec("single", **timeouts)
        _check_address(ip, env["JAX_COORDINATOR_IP"])  # one process never reads it (a validation JSON's <changeme>)
        port = _int_env(env, "JAX_COORDINATOR_PORT", DEFAULT_PORT)
        if not 0 < port < 65536:  # waited the whole start-up timeout, then called the port reachable
            raise DistributedError(f"JAX_COORDINATOR_PORT={port} is not a TCP port: give one from 1 to 65535 "
                                   f"(default {DEFAULT_PORT}), the same on every process")
        # an IPv6 address goes in brackets: "fd00::1:8476" made gRPC look for another host, and the job never formed
        address = f"[{ip}]:{port}" if ":" in ip and not ip.startswith("[") else f"{ip}:{port}"
        return JobSpec("env", address, nodes, rank, **timeouts)
    if _int_env(env, "SLURM_NTASKS", 1) > 1 and "SLURM_PROCID" in env:
        return JobSpec("slurm", None, _int_env(env, "SLURM_NTASKS", 1), _int_env(env, "SLURM_PROCID", 0), **timeouts)
    hosts = [h for h in _tpu_hosts(env).split(",") if h.strip()]
    # slices of a multi-slice job (xpk, queued resources): JAX counts hosts per slice x slices. One-host slices
    # (2 x v5e-8) were a single process each, never joined: every slice trained alone, silently
    slices = _int_env(env, "MEGASCALE_NUM_SLICES", 1) if hosts else 1
    if len(hosts) > 1 or slices > 1:
        worker = _int_env(env, "TPU_WORKER_ID", 0) + _int_env(env, "MEGASCALE_SLICE_ID", 0) * len(hosts)
        return JobSpec("tpu", None, len(hosts) * slices, worker, **timeouts)
    nodes = _int_env(env, "NNODES", 1)
    if nodes > 1:  # each process trained alone, silently: NNODES=4 made four single-process runs of one name
        seen = " (JAX_COORDINATOR_ADDRESS, JAX's own name for it, is set but not read)" \
            if env.get("JAX_COORDINATOR_ADDRESS") else ""
        raise DistributedError(f"NNODES={nodes} asks for a {nodes}-process job, but JAX_COORDINATOR_IP is not set{seen}; "
                               "set JAX_COORDINATOR_IP to the address of the host of NODE_RANK=0 (its port as "
                               "JAX_COORDINATOR_PORT), or unset NNODES for a single process")
    rank = _int_env(env, "NODE_RANK", 0)
    if rank != 0:  # process 1 of a job whose NNODES and coordinator were left out trained alone, silently
        nnodes = f"NNODES={nodes}" if env.get("NNODES") else "NNODES"
        raise DistributedError(f"NODE_RANK={rank} names process {rank} of a job, but {nnodes} and JAX_COORDINATOR_IP "
                               "do not: it would train alone. Set NNODES to the number of processes and "
                               "JAX_COORDINATOR_IP to the address of the host of NODE_RANK=0, or unset NODE_RANK for a "
                               "single process")
    return JobSpec("single", **timeouts)


HOST_NAME = re.compile(r"[A-Za-z0-9_]([-A-Za-z0-9_]*[A-Za-z0-9_])?(\.[A-Za-z0-9_]([-A-Za-z0-9_]*[A-Za-z0-9_])?)*\.?")


def _check_address(ip: str, given: str) -> None:
    """DistributedError unless JAX_COORDINATOR_IP (`given`; `ip` stripped) is a host name or an IP address (IPv6 in
    brackets or not). Anything else (empty, a URL, a list, a network) could never be joined: each process
    waited out the start-up timeout (300 s) and then named the address as unreachable."""
    bare = ip[1:-1] if ip.startswith("[") and ip.endswith("]") else ip
    try:
        ipaddress.ip_address(bare.split("%", 1)[0])  # an IPv6 address may carry its zone (fe80::1%eth0)
        return
    except ValueError:
        if bare == ip and HOST_NAME.fullmatch(ip):
            return
    raise DistributedError(f"JAX_COORDINATOR_IP={given!r} is not a host name or an IP address: give the address of the "
                           "host of NODE_RANK=0 alone, e.g. JAX_COORDINATOR_IP=10.0.0.2 or a host name (the port as "
                           "JAX_COORDINATOR_PORT)")


def _tpu_hosts(env: Mapping[str, str]) -> str:
    """The hosts of this TPU slice, comma-separated, from where JAX's TPU detection reads them, first found:
    the file named by TPU_PROCESS_ADDRESSES_PATH, TPU_PROCESS_ADDRESSES, TPU_WORKER_HOSTNAMES (newer GKE sets
    the first two alone: read the last only, a multi-host slice was taken for a single process)."""
    path = env.get("TPU_PROCESS_ADDRESSES_PATH")
    if path:
        try:
            return Path(path).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            why = getattr(e, "strerror", None) or e
            raise DistributedError(f"TPU_PROCESS_ADDRESSES_PATH={path} cannot be read ({why}): it names the file of "
                                   "this slice's host addresses, which JAX reads too; fix the path or unset it") from None
    return env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES", "")


def initialize(spec: JobSpec | None = None) -> JobSpec:
    """Join the job described by `spec` (default: from the environment); a no-op for one process."""
    from_env = spec is None
    spec = job_from_env() if from_env else spec
    if spec.mode == "single":
        if from_env and os.environ.get("JAX_COORDINATOR_IP") and os.environ.get("NNODES", "").strip() == "1":
            # NNODES=1 here and 2 on the other hosts: this process trained alone, and the others waited out their
            # start-up timeout for it with no word here
            log.info("NNODES=1: this process trains alone and joins no job (JAX_COORDINATOR_IP=%s is not used); for "
                     "a job of several processes set NNODES to their count on every one",
                     os.environ["JAX_COORDINATOR_IP"])
        return spec
    log.info("joining a %d-process job (%s) as process %d, coordinator %s; waiting up to %d s",
             spec.num_processes, spec.mode, spec.process_id, spec.coordinator or "auto-detected", spec.init_timeout)
    # JAX aborts the whole process (no Python exception) when start-up fails, so our own timer
    # fires first, explains, and exits with EXIT_DISTRIBUTED; JAX gets a longer deadline.
    timer = threading.Timer(spec.init_timeout, _startup_timed_out, args=(spec, time.monotonic()))
    timer.daemon = True
    kwargs = dict(initialization_timeout=spec.init_timeout + 60, heartbeat_timeout_seconds=spec.heartbeat_timeout)
    if spec.mode == "env":
        kwargs.update(coordinator_address=spec.coordinator, num_processes=spec.num_processes,
                      process_id=spec.process_id)
        if spec.process_id == 0:
            _check_port_free(spec.coordinator)
        _warn_if_unresolved(spec.coordinator, spec.init_timeout)
    timer.start()
    # JAX's preemption service would take SIGTERM over (a "SIGTERM caught" log line, and training went
    # on to the end, exit 0); stop_signals already stops every process after the same step
    jax.config.update("jax_enable_preemption_service", False)
    try:
        jax.distributed.initialize(**kwargs)
    except Exception as e:  # noqa: BLE001 - every start-up failure gets the same explanation
        raise DistributedError(_startup_message(spec, f"JAX said: {' '.join(str(e).split())[:600]}")) from None
    finally:
        timer.cancel()
    log.info("joined: process %d of %d, %d local / %d global devices", jax.process_index(), jax.process_count(),
             jax.local_device_count(), jax.device_count())
    return spec


def _warn_if_unresolved(address: str, timeout: int) -> None:
    """A warning at once when the coordinator's host name does not resolve here: a misspelled one was said only
    after the whole start-up timeout. It is waited for all the same (a Kubernetes service's name can appear
    after the pods start)."""
    host = address.rpartition(":")[0].strip("[]")
    try:
        socket.getaddrinfo(host, None)
    except OSError as e:
        log.warning("the coordinator's host %s does not resolve here (%s): waiting up to %d s for it, as a Kubernetes "
                    "service's name can appear late; if JAX_COORDINATOR_IP is misspelled, stop and fix it", host,
                    e.strerror or e, timeout)


def _check_port_free(address: str) -> None:
    """Process 0 hosts the coordinator on the port of `address`, on every interface of this host. When
    another program listens there, JAX's coordination service crashed the process in C++ (a segmentation
    fault, exit 139, after one gRPC log line) and the other processes waited out their start-up timeout."""
    port = int(address.rpartition(":")[2])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC: a closed job's TIME_WAIT is no conflict
        try:
            s.bind(("0.0.0.0", port))
        except OSError as e:
            why = (": another program listens on it, perhaps an earlier job still running or a second process "
                   "started with NODE_RANK=0. Stop it, or" if e.errno == errno.EADDRINUSE else ";")
            raise DistributedError(
                f"JAX_COORDINATOR_PORT={port} cannot be used on this host, where process 0 runs the job's coordinator "
                f"({e.strerror or e}){why} start every process with another JAX_COORDINATOR_PORT") from None


def _coordinator_reachable(address: str | None) -> str:
    if not address:
        return "unknown (auto-detected coordinator)"
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
            return "yes"
    except OSError as e:
        return f"no ({e.strerror or e})"


def _startup_message(spec: JobSpec, detail: str) -> str:
    return (
        f"process {spec.process_id} of {spec.num_processes} could not join the job at coordinator "
        f"{spec.coordinator or '(auto-detected)'} within {spec.init_timeout} s "
        f"(JAX_DISTRIBUTED_INITIALIZATION_TIMEOUT_SECONDS). Expected processes 0..{spec.num_processes - 1} "
        f"({spec.mode} launch); coordinator port reachable from here: {_coordinator_reachable(spec.coordinator)}. "
        "Check that every node started the same command with the same NNODES (a process given NNODES=1 trains "
        "alone and never joins), that NODE_RANKs are distinct, and that process 0 "
        f"runs on the coordinator host. {detail}"
    )


def _startup_timed_out(spec: JobSpec, started: float) -> None:
    waited = time.monotonic() - started
    message = _startup_message(spec, f"Waited {waited:.0f} s; not every process arrived.")
    print(f"distributed start-up error: {message}", file=sys.stderr, flush=True)
    os._exit(EXIT_DISTRIBUTED)
