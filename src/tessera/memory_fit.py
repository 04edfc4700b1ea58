"""Will the run fit in memory? Checked before the train state is allocated and after the step compiles.

Running out of memory is the failure that costs most and says least. On CPU the kernel's OOM
killer ends the process with no message (exit 137; 37 s into a llama2-7b start on a 24 GiB
host); under `ulimit -v` XLA's CPU client waits forever for a buffer it could not allocate; a
GPU fails at the first step with a long RESOURCE_EXHAUSTED traceback. The trainer knows both sizes before it allocates: the
train state's, from its shapes and shardings, and the compiled step's temporaries, which XLA's
buffer assignment fixes at compile time (on CPU the peak resident memory of a step matched it
within 2%). So it compares them with what the devices have left and stops with one line and
exit code 7 (`EXIT_OUT_OF_MEMORY`) instead.

What the devices have left (`room`):
- accelerators: each local device's `bytes_limit - bytes_in_use` (`Device.memory_stats()`);
- CPU: what this process can still take from the host, shared by all its CPU devices: the
  smallest of MemAvailable plus free swap (/proc/meminfo), each enclosing memory cgroup's limit
  less its usage (containers, Kubernetes, Slurm; reclaimable file cache counts as free), and
  `ulimit -v` less what the process has mapped already (read by `tessera.host_limits`).
A device or host that reports none of these (macOS) is not checked. A step that still runs out
(memory taken by another program meanwhile) is reported the same way by `out_of_memory`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable

import jax

from tessera.host_limits import address_space_room, cgroup_rooms, format_bytes, meminfo_room

EXIT_OUT_OF_MEMORY = 7

SIZING = "`.venv/bin/python -m tessera.tools.estimate` and `.venv/bin/python -m tessera.tools.plan` size a run beforehand"


def _either(ways: list[str]) -> str:
    return ", ".join(ways[:-1]) + f" or {ways[-1]}" if len(ways) > 1 else ways[0]


def state_advice(shared: bool = False) -> str:
    """What shrinks the state per device. Sharding does not help CPU devices: they share one host."""
    ways = ([] if shared else ["shard it over more devices (ici_fsdp_parallelism)"]) + [
        "use a smaller model or weight_dtype=bfloat16", "free memory"]
    return f"{_either(ways)}; {SIZING}"


def step_advice(remat_policy: str | None = None, shared: bool = False) -> str:
    """What shrinks a step's temporaries, each piece of advice only where it applies."""
    ways = ["lower per_device_batch_size or max_target_length",
            "run the batch in micro-batches (gradient_accumulation_steps)"]
    if remat_policy != "full":
        ways.append("recompute more in the backward pass (remat_policy=full"
                    + (f"; now {remat_policy})" if remat_policy else ")"))
    if not shared:
        ways.append("shard over more devices")
    return f"{_either(ways)}; {SIZING}"


class OutOfMemory(Exception):
    """The run does not fit in the memory its devices have left (exit code 7)."""


@dataclasses.dataclass(frozen=True)
class Room:
    """Bytes the local devices can still allocate. `shared`: one pool for all of them (host
    memory behind CPU devices), else `free_bytes` is each device's (the least of them)."""

    free_bytes: int
    shared: bool
    devices: int
    platform: str
    source: str  # what bounds it, for messages

    def need(self, per_device: int, host: int = 0) -> int:
        """Bytes to find in `free_bytes`: `per_device` on each device, and `host` bytes of the host's
        own (read buffers), which only count where the devices share the host's memory."""
        return per_device * self.devices + host if self.shared else per_device

    def verdict(self, per_device: int, host: int = 0) -> str:
        """'this host's 8 cpu devices need 42.2 GiB in all and have 6.2 GiB left (ulimit -v ...)'."""
        left = f"{format_bytes(self.free_bytes)} left ({self.source})"
        if not self.shared:
            return f"each {self.platform} device has {left}"
        if self.devices == 1 and not host:
            return f"this host has {left}"
        if self.devices == 1:
            return f"this host needs {format_bytes(self.need(per_device, host))} in all and has {left}"
        return (f"this host's {self.devices} {self.platform} devices need {format_bytes(self.need(per_device, host))} "
                f"in all and have {left}")


def local_devices(mesh) -> list:
    return [d for d in mesh.devices.flat if d.process_index == jax.process_index()]


def room(devices: list) -> Room | None:
    """What `devices` (all of one process) can still allocate; None when nothing reports it."""
    platform = devices[0].platform
    stats = [_memory_stats(d) for d in devices]
    if all(s and "bytes_limit" in s for s in stats):
        free = min(s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats)
        limit = min(s["bytes_limit"] for s in stats)
        return Room(free, False, len(devices), platform, f"memory limit {format_bytes(limit)} per device"
                    + (_gpu_share() if platform == "gpu" else ""))
    if platform != "cpu":
        return None
    host = host_room()
    return None if host is None else Room(host[0], True, len(devices), platform, host[1])


def _gpu_share() -> str:
    """What bounds a GPU's limit: the share of its memory JAX took at start-up, which a larger
    xla_python_client_mem_fraction raises (JAX's default, 0.75, left a quarter of it unused)."""
    from tessera.config.schema import GpuConfig
    from tessera.gpu_tuning import gpu_memory_fraction

    fraction, source = gpu_memory_fraction(GpuConfig(), os.environ)  # train.py has set the variable from the key
    return f": {fraction:g} of the GPU's memory, {source}"


def _memory_stats(device) -> dict | None:
    try:
        return device.memory_stats()
    except Exception:  # noqa: BLE001 - a platform without memory statistics is simply not checked
        return None


def host_room() -> tuple[int, str] | None:
    """(bytes this process can still take from the host, what bounds it), or None off Linux."""
    bounds = host_bounds()
    return min(b[:2] for b in bounds) if bounds else None


def host_bounds() -> list[tuple[int, str, bool]]:
    """Each bound on what this process can still take from the host: (bytes, what it is, whether it
    bounds address space (`ulimit -v`) rather than resident memory)."""
    resident = [(*b, False) for b in (meminfo_room(), *cgroup_rooms()) if b is not None]
    space = address_space_room()
    return resident + ([(*space, True)] if space else [])


# --------------------------------------------------------------------------- the checks


def bytes_per_device(shapes, shardings) -> int:
    """Bytes one device holds of a tree of arrays (shapes and dtypes) laid out by `shardings`."""
    each = jax.tree.map(lambda s, sh: math.prod(sh.shard_shape(s.shape)) * s.dtype.itemsize, shapes, shardings)
    return int(sum(jax.tree.leaves(each)))


def state_shapes(trainer) -> dict:
    """{"params": ..., "opt_state": ...}: the train state's arrays as shapes and dtypes."""
    return jax.eval_shape(lambda p: {"params": p, "opt_state": trainer.optimizer.init(p)},
                          trainer.model.param_shapes())


def state_bytes(trainer) -> dict[str, int]:
    """Bytes of the parameters and of the optimizer state on one device, from their shardings."""
    return {part: bytes_per_device(tree, trainer.state_shardings[part]) for part, tree in state_shapes(trainer).items()}


def offloaded_to_host(trainer) -> bool:
    """Whether optimizer_memory_host_offload keeps the optimizer state in memory that is not the
    devices' own (accelerators; a CPU device's memory is the host's)."""
    return getattr(trainer, "offload", None) is not None and trainer.mesh.devices.flat[0].platform != "cpu"


def device_state_bytes(trainer) -> int:
    """Bytes of the train state in one device's own memory: all of it but the optimizer state when
    optimizer_memory_host_offload keeps that in an accelerator's host memory."""
    sizes = state_bytes(trainer)
    if offloaded_to_host(trainer):
        sizes.pop("opt_state")
    return sum(sizes.values())


def check_host_holds_offloaded_state(trainer) -> None:
    """OutOfMemory when the moments optimizer_memory_host_offload pins in this host's memory, for
    each of its devices, exceed what the host has left (resident-memory bounds: available memory,
    the memory cgroup)."""
    if not offloaded_to_host(trainer):
        return
    per_device, devices = state_bytes(trainer)["opt_state"], len(local_devices(trainer.mesh))
    need = per_device * devices
    for available, source, address_space in host_bounds():
        if not address_space and need > available:
            raise OutOfMemory(
                f"not enough host memory for the offloaded optimizer state: optimizer_memory_host_offload=true keeps "
                f"{format_bytes(need)} of AdamW's moments in this host's memory ({format_bytes(per_device)} for each "
                f"of its {devices} device(s)), and it has {format_bytes(available)} left ({source}). Nothing was "
                "allocated; set optimizer_memory_host_offload=false, or spread the state over more chips (a larger "
                "slice, or more slices with dcn_fsdp_parallelism)")


@dataclasses.dataclass(frozen=True)
class HostBuffers:
    """Host memory that checkpoint reads and saves hold beside the arrays: `resident` bytes of
    memory and `mapped` bytes of address space (what `ulimit -v` bounds). They count where the
    devices share the host's memory (CPU): on accelerators they are not the devices' memory."""

    resident: int = 0
    mapped: int = 0
    what: str = ""  # for messages: "...; and up to 2.0 GiB on the host {what}"


def read_buffers(shapes) -> HostBuffers:
    """What reading a checkpoint of `shapes` (a tree of arrays) holds beyond the arrays it fills.
    TensorStore reads each stored chunk (at most a whole array) into a buffer of its own before it
    is copied into place, on up to max(4, cores) threads at once (its file I/O concurrency): at
    most that many of the largest arrays resident, while it maps address space for every array
    read. Measured, restoring a 2.05 GiB state on 2 cores: 0.21-0.38 GiB resident above the state
    (this bound: 0.50) and 2.09 GiB of address space. Left out of the check, a restore that just
    fitted died in TensorStore (SIGABRT under `ulimit -v`, SIGKILL under a memory cgroup)."""
    sizes = sorted((leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(shapes)), reverse=True)
    return HostBuffers(sum(sizes[:max(4, os.cpu_count() or 1)]), sum(sizes), "while the checkpoint is read")


def save_buffers(state_shapes_tree, state_on_devices: int, beside_steps: bool) -> HostBuffers:
    """What saving the train state (`state_shapes_tree`, whose shards take `state_on_devices` bytes
    on this process's devices) holds on the host: a copy of its arrays to write from (measured: 1.94
    GiB for a 2.05 GiB state on CPU), and with `beside_steps` (an asynchronous save while training
    goes on) the state again, since a step that runs while the save still reads the state cannot
    write its new state over it: the state is not donated, and the step allocates another
    (measured on one run: 7.0 GiB resident at the peak, against 5.1 GiB with async_checkpointing=false)."""
    # the arrays once, or this process's part of them in a multi-process job
    copy = min(state_on_devices, sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(state_shapes_tree)))
    total = copy + (state_on_devices if beside_steps else 0)
    what = "for checkpoint saves (a copy of the state to write from" + (
        ", and a second state for the step that runs beside an asynchronous save)" if beside_steps else ")")
    return HostBuffers(total, total, what)


def check_state_fits(trainer, read: str = "", init_program=None) -> None:
    """OutOfMemory before the train state is created, loaded or restored, if it cannot fit. `read`:
    the part read from a checkpoint ("params", or "state" for all of it), whose read buffers
    count too where the devices share the host's memory. `init_program`: the compiled program
    that creates a fresh state (`step.init_program`), whose temporaries count too (the random draws
    of the initializers: 0.72 GiB per device beside a 2.05 GiB state on CPU; left out, fresh runs
    in memory cgroups 0.4 GiB too small were killed while the state was created)."""
    sizes, shapes = state_bytes(trainer), state_shapes(trainer)
    buffers = read_buffers(shapes if read == "state" else shapes["params"]) if read else HostBuffers()
    mem = init_program.memory_analysis() if init_program is not None else None
    temporaries = mem.temp_size_in_bytes if mem is not None else 0
    parts = (f"parameters {format_bytes(sizes['params'])}, optimizer state {format_bytes(sizes['opt_state'])}"
             + (f", and {format_bytes(temporaries)} of temporaries while it is initialized" if temporaries else "")
             + f", over a mesh of {trainer.mesh.size} device(s)")
    on_devices = sum(sizes.values())
    if offloaded_to_host(trainer):
        on_devices -= sizes["opt_state"]
        parts += " (the optimizer state in host memory: optimizer_memory_host_offload)"
        check_host_holds_offloaded_state(trainer)
    check_fits(local_devices(trainer.mesh), on_devices + temporaries, "the train state", parts,
               host_buffers=buffers)


def _short_of(free: Room, per_device: int, buffers: HostBuffers) -> tuple[Room, int] | None:
    """(the bound that `per_device` on each device and `buffers` on the host exceed, the host bytes
    counted against it), or None when they fit. Host buffers are weighed against each host bound
    in its own terms: resident bytes against memory, mapped bytes against `ulimit -v`."""
    if not free.shared or not (buffers.resident or buffers.mapped):
        return None if free.need(per_device) <= free.free_bytes else (free, 0)
    shortfalls = []
    for available, source, address_space in host_bounds():
        host = buffers.mapped if address_space else buffers.resident
        if free.need(per_device, host) > available:
            shortfalls.append((available - free.need(per_device, host), available, source, host))
    if not shortfalls:
        return None
    _, available, source, host = min(shortfalls)  # the bound it misses by most
    return dataclasses.replace(free, free_bytes=available, source=source), host


def check_fits(devices: list, per_device: int, what: str, parts: str,
               advice: Callable[[bool], str] = state_advice, host_buffers: HostBuffers = HostBuffers()) -> None:
    """OutOfMemory if `what` (arrays of `per_device` bytes on each of `devices`, made of `parts`)
    cannot be allocated in what the devices have left. `advice(shared)` says what to change.
    `host_buffers`: what checkpoint I/O holds on the host meanwhile (`read_buffers`)."""
    free = room(devices)
    short = None if free is None else _short_of(free, per_device, host_buffers)
    if short is None:
        return
    bound, host = short
    if host:
        parts += f"; and up to {format_bytes(host)} on the host {host_buffers.what}"
    raise OutOfMemory(
        f"not enough memory for {what}: {format_bytes(per_device)} per device ({parts}); "
        f"{bound.verdict(per_device, host)}. Nothing was allocated; {advice(bound.shared)}")


def check_step_fits(compiled, trainer, saves: HostBuffers = HostBuffers()) -> None:
    """OutOfMemory before the first step, if the compiled step's temporaries and outputs (the
    state it holds is already allocated; donated outputs reuse its buffers) cannot fit, with what
    checkpoint saves hold on the host (`save_buffers`) where the devices share its memory."""
    found = _beside_state(compiled, trainer, saves)
    if found is None:
        return
    per_device, (bound, host) = found
    policy = trainer.model.cfg.remat_policy
    saving = f", and up to {format_bytes(host)} on the host {saves.what}" if host else ""
    advice = step_advice(policy, bound.shared)
    if host and "asynchronous" in saves.what:
        advice = f"set async_checkpointing=false (a save then holds up the steps instead of a second state), or {advice}"
    raise OutOfMemory(
        f"not enough memory for the train step: its activations, gradients and other temporaries need "
        f"{format_bytes(per_device)} per device (a global batch of {trainer.plan.global_batch} sequences of "
        f"{trainer.plan.max_target_length} tokens over {trainer.mesh.size} device(s), remat_policy={policy}) on top "
        f"of the train state{saving}; {bound.verdict(per_device, host)}. Nothing was run; {advice}")


def check_eval_fits(compiled, trainer, saves: HostBuffers = HostBuffers()) -> None:
    """OutOfMemory before the first step, if the compiled eval step's temporaries and outputs cannot
    fit beside the train state (an evaluation runs between two steps, the state allocated) and
    what an asynchronous save may still hold on the host meanwhile (`saves`: the copy it writes
    from), where the devices share the host's memory."""
    found = _beside_state(compiled, trainer, saves)
    if found is None:
        return
    per_device, (bound, host) = found
    ways = ["lower eval_per_device_batch_size"]
    if trainer.model.cfg.num_vocab_tiling == 1:
        ways.append("compute the logits in pieces (num_vocab_tiling)")
    if host:
        ways.insert(0, "set async_checkpointing=false (no save is then being written while an evaluation runs)")
    saving = f", and up to {format_bytes(host)} on the host {saves.what}" if host else ""
    raise OutOfMemory(
        f"not enough memory for the eval step: its activations and logits need {format_bytes(per_device)} per device "
        f"(an eval batch of {trainer.plan.eval_batch} sequences of {trainer.plan.max_target_length} tokens over "
        f"{trainer.mesh.size} device(s)) on top of the train state{saving}; {bound.verdict(per_device, host)}. "
        f"Nothing was run; {_either(ways)}; {SIZING}")


def _beside_state(compiled, trainer, saves: HostBuffers) -> tuple[int, tuple[Room, int]] | None:
    """(per-device bytes, (the bound, host bytes)) when a compiled program's temporaries and new
    outputs, beside the train state, exceed what the devices have left (`_short_of`); else None,
    also when nothing reports the room or the program's memory."""
    free = room(local_devices(trainer.mesh))
    mem = None if free is None else compiled.memory_analysis()
    if mem is None:
        return None
    per_device = mem.temp_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
    short = _short_of(free, per_device, saves)
    return None if short is None else (per_device, short)


def out_of_memory(error: BaseException, during: str, advice: str = "") -> OutOfMemory | None:
    """The OutOfMemory to raise for an XLA allocation failure (RESOURCE_EXHAUSTED), else None."""
    text = str(error)
    if "RESOURCE_EXHAUSTED" not in text:
        return None
    said = " ".join(text.strip().splitlines()[0].split())[:300]
    return OutOfMemory(f"out of device memory {during} (XLA said: {said}); {advice or step_advice()}")
