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
  `ulimit -v` less what the process has mapped already.
A device or host that reports none of these (macOS) is not checked. A step that still runs out
(memory taken by another program meanwhile) is reported the same way by `out_of_memory`.
"""

from __future__ import annotations

import dataclasses
import math
import resource
from collections.abc import Callable
from pathlib import Path

import jax

EXIT_OUT_OF_MEMORY = 7

SIZING = "`python3 -m tessera.tools.estimate` and `python3 -m tessera.tools.plan` size a run beforehand"


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


def format_bytes(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@dataclasses.dataclass(frozen=True)
class Room:
    """Bytes the local devices can still allocate. `shared`: one pool for all of them (host
    memory behind CPU devices), else `free_bytes` is each device's (the least of them)."""

    free_bytes: int
    shared: bool
    devices: int
    platform: str
    source: str  # what bounds it, for messages

    def need(self, per_device: int) -> int:
        return per_device * self.devices if self.shared else per_device

    def verdict(self, per_device: int) -> str:
        """'this host's 8 cpu devices need 42.2 GiB in all and have 6.2 GiB left (ulimit -v ...)'."""
        left = f"{format_bytes(self.free_bytes)} left ({self.source})"
        if not self.shared:
            return f"each {self.platform} device has {left}"
        if self.devices == 1:
            return f"this host has {left}"
        return (f"this host's {self.devices} {self.platform} devices need {format_bytes(self.need(per_device))} in all "
                f"and have {left}")


def local_devices(mesh) -> list:
    return [d for d in mesh.devices.flat if d.process_index == jax.process_index()]


def room(devices: list) -> Room | None:
    """What `devices` (all of one process) can still allocate; None when nothing reports it."""
    platform = devices[0].platform
    stats = [_memory_stats(d) for d in devices]
    if all(s and "bytes_limit" in s for s in stats):
        free = min(s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats)
        limit = min(s["bytes_limit"] for s in stats)
        return Room(free, False, len(devices), platform, f"memory limit {format_bytes(limit)} per device")
    if platform != "cpu":
        return None
    host = host_room()
    return None if host is None else Room(host[0], True, len(devices), platform, host[1])


def _memory_stats(device) -> dict | None:
    try:
        return device.memory_stats()
    except Exception:  # noqa: BLE001 - a platform without memory statistics is simply not checked
        return None


def host_room() -> tuple[int, str] | None:
    """(bytes this process can still take from the host, what bounds it), or None off Linux."""
    bounds = [b for b in (_meminfo_room(), *_cgroup_rooms(), _address_space_room()) if b is not None]
    return min(bounds) if bounds else None


def _meminfo_room() -> tuple[int, str] | None:
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        kib = {k: int(v.split()[0]) for k, v in fields.items() if k in ("MemAvailable", "SwapFree")}
    except (OSError, ValueError):
        return None
    if "MemAvailable" not in kib:
        return None
    swap = kib.get("SwapFree", 0) * 1024
    text = f"available host memory{f' and {format_bytes(swap)} of free swap' if swap else ''}"
    return kib["MemAvailable"] * 1024 + swap, text


PROC_SELF_CGROUP = Path("/proc/self/cgroup")
# (mount point, limit file, usage file, reclaimable file-cache key of memory.stat) per cgroup version
_CGROUP_FILES = {2: ("/sys/fs/cgroup", "memory.max", "memory.current", "inactive_file"),
                 1: ("/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")}


def _cgroup_rooms() -> list[tuple[int, str]]:
    """limit - usage + reclaimable cache of each memory cgroup around this process that has a limit."""
    try:
        lines = PROC_SELF_CGROUP.read_text().splitlines()
    except OSError:
        return []
    rooms = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        version = 2 if controllers == "" else 1 if "memory" in controllers.split(",") else None
        if version is None:
            continue
        mount, limit_name, usage_name, cache_key = _CGROUP_FILES[version]
        base = Path(mount)
        folder = base / path.strip("/")
        if not folder.is_dir():  # inside a container, the cgroup's path is the namespace's root
            folder = base
        while True:
            bound = _cgroup_room(folder, limit_name, usage_name, cache_key)
            if bound:
                rooms.append(bound)
            if folder == base or folder == folder.parent:
                break
            folder = folder.parent
    return rooms


def _cgroup_room(folder: Path, limit_name: str, usage_name: str, cache_key: str) -> tuple[int, str] | None:
    try:
        limit_text = (folder / limit_name).read_text().strip()
        if limit_text == "max" or int(limit_text) >= 2**60:  # no limit
            return None
        limit, usage = int(limit_text), int((folder / usage_name).read_text())
        stat = dict(line.split() for line in (folder / "memory.stat").read_text().splitlines() if " " in line)
    except (OSError, ValueError):
        return None
    cache = int(stat.get(cache_key, 0))
    return max(0, limit - usage + cache), f"memory cgroup limit {format_bytes(limit)} of {folder}"


def _address_space_room() -> tuple[int, str] | None:
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit == resource.RLIM_INFINITY:
        return None
    try:
        status = Path("/proc/self/status").read_text()
        mapped = int(status.split("VmSize:")[1].split()[0]) * 1024
    except (OSError, IndexError, ValueError):
        return None
    return max(0, limit - mapped), (f"ulimit -v {format_bytes(limit)}, of which this process has mapped "
                                    f"{format_bytes(mapped)}; raise it with `ulimit -v`")


# --------------------------------------------------------------------------- the checks


def bytes_per_device(shapes, shardings) -> int:
    """Bytes one device holds of a tree of arrays (shapes and dtypes) laid out by `shardings`."""
    each = jax.tree.map(lambda s, sh: math.prod(sh.shard_shape(s.shape)) * s.dtype.itemsize, shapes, shardings)
    return int(sum(jax.tree.leaves(each)))


def state_bytes(trainer) -> dict[str, int]:
    """Bytes of the parameters and of the optimizer state on one device, from their shardings."""
    shapes = jax.eval_shape(lambda p: {"params": p, "opt_state": trainer.optimizer.init(p)},
                            trainer.model.param_shapes())
    return {part: bytes_per_device(tree, trainer.state_shardings[part]) for part, tree in shapes.items()}


def check_state_fits(trainer) -> None:
    """OutOfMemory before the train state is created, loaded or restored, if it cannot fit."""
    sizes = state_bytes(trainer)
    check_fits(local_devices(trainer.mesh), sum(sizes.values()), "the train state", (
        f"parameters {format_bytes(sizes['params'])}, optimizer state {format_bytes(sizes['opt_state'])}, "
        f"over a mesh of {trainer.mesh.size} device(s)"))


def check_fits(devices: list, per_device: int, what: str, parts: str,
               advice: Callable[[bool], str] = state_advice) -> None:
    """OutOfMemory if `what` (arrays of `per_device` bytes on each of `devices`, made of `parts`)
    cannot be allocated in what the devices have left. `advice(shared)` says what to change."""
    free = room(devices)
    if free is None or free.need(per_device) <= free.free_bytes:
        return
    raise OutOfMemory(
        f"not enough memory for {what}: {format_bytes(per_device)} per device ({parts}); "
        f"{free.verdict(per_device)}. Nothing was allocated; {advice(free.shared)}")


def check_step_fits(compiled, trainer) -> None:
    """OutOfMemory before the first step, if the compiled step's temporaries and outputs (the
    state it holds is already allocated; donated outputs reuse its buffers) cannot fit."""
    free = room(local_devices(trainer.mesh))
    if free is None:
        return
    mem = compiled.memory_analysis()
    if mem is None:
        return
    per_device = mem.temp_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
    if free.need(per_device) <= free.free_bytes:
        return
    policy = trainer.model.cfg.remat_policy
    raise OutOfMemory(
        f"not enough memory for the train step: its activations, gradients and other temporaries need "
        f"{format_bytes(per_device)} per device (a global batch of {trainer.plan.global_batch} sequences of "
        f"{trainer.plan.max_target_length} tokens over {trainer.mesh.size} device(s), remat_policy={policy}) on top "
        f"of the train state; {free.verdict(per_device)}. Nothing was run; {step_advice(policy, free.shared)}")


def out_of_memory(error: BaseException, during: str, advice: str = "") -> OutOfMemory | None:
    """The OutOfMemory to raise for an XLA allocation failure (RESOURCE_EXHAUSTED), else None."""
    text = str(error)
    if "RESOURCE_EXHAUSTED" not in text:
        return None
    said = " ".join(text.strip().splitlines()[0].split())[:300]
    return OutOfMemory(f"out of device memory {during} (XLA said: {said}); {advice or step_advice()}")
