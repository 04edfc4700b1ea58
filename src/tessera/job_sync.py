"""What the processes of a formed job agree on, through the coordinator of JAX's distributed
runtime (every function is a no-op, or answers at once, in a single process): meeting points
(`wait_for_all`), values gathered on process 0 (`gather_json`) or compared between all
(`compared_values`, `check_same_config`), and the step after which all stop (a signal that
reached some) or end an evaluation. Start-up is `tessera.distributed`."""

from __future__ import annotations

import json
from typing import Any, Mapping

import jax

from tessera.distributed import DistributedError

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
