"""Multi-process start-up on JAX's distributed runtime, and the stop and evaluation agreements of a job's processes
(the hang watchdog that ends a stuck process is tessera.hang_watchdog).

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
import json
import logging
import os
import re
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Mapping

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
    spec = job_from_env() if spec is None else spec
    if spec.mode == "single":
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
        "Check that every node started the same command, that NODE_RANKs are distinct, and that process 0 "
        f"runs on the coordinator host. {detail}"
    )


def _startup_timed_out(spec: JobSpec, started: float) -> None:
    waited = time.monotonic() - started
    message = _startup_message(spec, f"Waited {waited:.0f} s; not every process arrived.")
    print(f"distributed start-up error: {message}", file=sys.stderr, flush=True)
    os._exit(EXIT_DISTRIBUTED)


# A stop (SIGTERM, Ctrl-C) that reaches some processes of a job must stop all of them after the
# same step, because saving is collective. The first signalled process publishes "stop after
# step S+2" (S: the step it checks after) in the coordinator's key-value store; later writers keep
# the first value; every process reads the key after each step (one RPC, ~0.3 ms on localhost).
# Two steps of slack, because the loop checks after step T having read only step T-1's stats
# (step_stats.METRICS_LAG = 1: step T may still run): a process that has read step S+1's stats
# knows that every process started step S+1 (its collectives), and the publisher published before
# starting it, so every process sees the key by its check after step S+2 at the latest. With one
# step of slack a publisher whose host stalled between starting step S and publishing (metrics
# writes, a busy host) let another process pass step S+1 unaware: it ran step S+2 alone and waited
# in its collectives while the publisher saved step S+1, until the hang watchdog ended both.
STOP_KEY = "tessera/stop_after_step"
STOP_SLACK_STEPS = 2


def _kv_client():
    from jax._src.distributed import global_state  # the runtime's client; None in a single process

    return global_state.client


def wait_for_all(name: str, timeout: float, what: str) -> None:
    """Block until every process of the job reaches the point `name` (a no-op for one process).

    JAX's CPU collectives (gloo) set up their connections at the first collective and give up
    after a fixed 30 s when a process arrives later than that (a slow start on a loaded host);
    on accelerators a late process is simply waited for. Meeting first at the coordinator's
    barrier, which waits `timeout` seconds (0: an hour), makes every process enter the next
    collective together, and a process that never comes is named in one clear error."""
    from jax._src.distributed import global_state  # not jax.process_index(): it would wait for every backend

    client = global_state.client
    if client is None:
        return
    seconds = timeout if timeout > 0 else 3600.0
    try:
        client.wait_at_barrier(f"tessera/{name}", int(seconds * 1000))
    except Exception as e:  # noqa: BLE001 - DEADLINE_EXCEEDED and the like from the coordinator
        raise DistributedError(
            f"process {global_state.process_id} of {global_state.num_processes} waited {seconds:.0f} s for the "
            f"other processes to reach {what}, and not all did (step_timeout_seconds). Look at the other "
            f"processes' logs for an error or a stall before that point. JAX said: {' '.join(str(e).split())[:400]}") from None


def gather_json(name: str, value: Any, timeout: float) -> list[Any] | None:
    """Process 0: the JSON-able `value` of every process, in process order (through the
    coordinator's key-value store, keys under tessera/<name>/, deleted once read); every other
    process: None, once its value is published. A single process gets [value]. `timeout`
    seconds (0: an hour) for the slowest process, then a DistributedError."""
    client = _kv_client()
    if client is None:
        return [value]
    from jax._src.distributed import global_state

    me, count = global_state.process_id, global_state.num_processes
    client.key_value_set(f"tessera/{name}/{me}", json.dumps(value))
    if me != 0:
        return None
    wait_ms = int((timeout if timeout > 0 else 3600.0) * 1000)
    values = [value]
    for other in range(1, count):
        key = f"tessera/{name}/{other}"
        try:
            values.append(json.loads(client.blocking_key_value_get(key, wait_ms)))
        except Exception as e:  # noqa: BLE001 - DEADLINE_EXCEEDED: that process did not get this far
            raise DistributedError(f"process 0 waited {wait_ms / 1000:.0f} s for process {other}'s {name}, which "
                                   f"never came (look at its log). JAX said: {' '.join(str(e).split())[:300]}"
                                   ) from None
    for other in range(count):
        try:
            client.key_value_delete(f"tessera/{name}/{other}")
        except Exception:  # noqa: BLE001 - only tidiness is lost
            pass
    return values


def compared_values(name: str, value: Any, timeout: float, point: str):
    """Publish this process's JSON-able `value` (under tessera/<name>/<process>), then yield (process, value)
    for each process it is compared with: every other one on process 0, process 0 on the others, so that
    each process that differs from process 0 finds it, and process 0 too. Nothing in a single process.
    DistributedError when one has not published within `timeout` seconds (0: an hour), having not reached
    `point` (the place of the comparison in the run)."""
    from jax._src.distributed import global_state

    client = global_state.client
    if client is None:
        return
    me, count = global_state.process_id, global_state.num_processes
    wait_ms = int((timeout if timeout > 0 else 3600.0) * 1000)
    client.key_value_set(f"tessera/{name}/{me}", json.dumps(value, sort_keys=True))
    for other in range(1, count) if me == 0 else [0]:
        try:
            theirs = json.loads(client.blocking_key_value_get(f"tessera/{name}/{other}", wait_ms))
        except Exception as e:  # noqa: BLE001 - DEADLINE_EXCEEDED: that process never got this far
            raise DistributedError(f"process {me} waited for the {name} of process {other}, which did not {point} "
                                   f"(look at its log). JAX said: {' '.join(str(e).split())[:300]}") from None
        yield other, theirs


LOCAL_DEVICES = "devices of the process"  # compared with the config: every process of a job has as many


def check_same_config(config: Mapping[str, Any], timeout: float) -> None:
    """DistributedError when the processes of the job were started with different configs (a no-op for
    one process): each publishes its flat config; process 0 compares every other's with its own, and
    every other process its own with process 0's, so each stops with the keys that differ. Started with
    different batches, the first collective aborted in C++ ("Received data size doesn't match") and the
    other processes blamed a lost network."""
    from jax._src.distributed import global_state

    if global_state.client is None:
        return
    me, count = global_state.process_id, global_state.num_processes
    # with the process count each was started with: the coordinator's is the job's, so a process given another
    # NNODES joined a job of another size than it was told, and trained on; and with the devices each sees
    # (a GPU missing on one VM, another CUDA_VISIBLE_DEVICES), which failed with a traceback in Orbax's first save
    mine = json.loads(json.dumps({**config, "NNODES": count, LOCAL_DEVICES: jax.local_device_count()}, default=str))
    for other, theirs in compared_values("config", mine, timeout, "start training"):
        differ = [k for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]
        if differ:
            shown = ", ".join(f"{k}={json.dumps(mine.get(k))} (process {other}: {json.dumps(theirs.get(k))})"
                              for k in differ[:5]) + (f", and {len(differ) - 5} more" if len(differ) > 5 else "")
            devices = (" Every process must see as many devices: compare `.venv/bin/python -m tessera.doctor` on "
                       "their hosts (CUDA_VISIBLE_DEVICES, XLA_FLAGS, a device missing)." if LOCAL_DEVICES in differ else "")
            raise DistributedError(f"process {me} was started with another config than process {other}: {shown}. "
                                   "Start every process of a job with the same command and config (set run_name: "
                                   f"a name each process makes up from its clock can differ).{devices}")


def request_stop(step: int, signum: int, slack: int = STOP_SLACK_STEPS) -> tuple[int, int]:
    """Ask every process to stop after `step + slack` (see STOP_SLACK_STEPS); returns the agreed
    (step, signal), which is an earlier request's when another process published first. A slack of
    0 is for a point every process is known not to have passed (an evaluation of `step`, which all
    run together)."""
    client = _kv_client()
    try:
        client.key_value_set(STOP_KEY, f"{step + slack}:{signum}")
    except Exception:  # noqa: BLE001 - ALREADY_EXISTS: another process asked first and its step wins
        pass
    return _parse_stop(client.blocking_key_value_get(STOP_KEY, 60_000))


# An evaluation that a stop interrupts: its batches end in cross-process sums, so every process
# must leave it after the same batch. The signalled process publishes "after batch B+1" (B: its last
# finished batch) under the step's key before it starts batch B+1; the others read the key after each
# batch. As with steps, one batch of slack is enough.
def _eval_stop_key(step: int) -> str:
    return f"tessera/stop_evaluation_of_step/{step}"


def request_eval_stop(step: int, batches: int) -> int:
    """Ask every process to leave the evaluation of `step` after batch `batches + 1`; returns the
    agreed batch (an earlier request's when another process published first)."""
    client = _kv_client()
    try:
        client.key_value_set(_eval_stop_key(step), str(batches + 1))
    except Exception:  # noqa: BLE001 - ALREADY_EXISTS: the first request wins
        pass
    return int(client.blocking_key_value_get(_eval_stop_key(step), 60_000))


def eval_stop_requested(step: int) -> int | None:
    """The batch after which every process leaves the evaluation of `step`, or None (never waits)."""
    try:
        return int(_kv_client().key_value_try_get(_eval_stop_key(step)))
    except Exception:  # noqa: BLE001 - NOT_FOUND: nobody asked
        return None


def stop_requested() -> tuple[int, int] | None:
    """(step, signal) when some process asked the job to stop, else None (never waits)."""
    client = _kv_client()
    if client is None:
        return None
    try:
        return _parse_stop(client.key_value_try_get(STOP_KEY))
    except Exception:  # noqa: BLE001 - NOT_FOUND: nobody asked
        return None


def _parse_stop(value: str) -> tuple[int, int]:
    step, signum = value.split(":")
    return int(step), int(signum)
