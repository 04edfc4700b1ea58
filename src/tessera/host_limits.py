"""What bounds the host memory this process can still take, read from Linux: MemAvailable plus free
swap (/proc/meminfo), each enclosing memory cgroup's limit less its usage (containers, Kubernetes,
Slurm; reclaimable file cache counts as free), and `ulimit -v` less what the process has mapped.
`tessera.memory_fit` takes the smallest as a CPU host's room; each reader returns None (or no
bounds) where its file or limit does not exist.
"""

from __future__ import annotations

import resource
from pathlib import Path


def format_bytes(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def meminfo_room() -> tuple[int, str] | None:
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
# (mount point, limit file, usage file, memory.stat keys of the file cache, of its dirty part) per
# cgroup version. The usage counts the page cache; its clean pages, active or not, are what the
# kernel drops before the limit is hit (a checkpoint read twice, checksums then restore, sits on
# the active list: counting only the inactive one refused a resume that ran in that limit)
_CGROUP_FILES = {
    2: ("/sys/fs/cgroup", "memory.max", "memory.current", ("active_file", "inactive_file"),
        ("file_dirty", "file_writeback")),
    1: ("/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes",
        ("total_active_file", "total_inactive_file"), ("total_dirty", "total_writeback")),
}


def cgroup_rooms() -> list[tuple[int, str]]:
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
        mount, limit_name, usage_name, cache_keys, dirty_keys = _CGROUP_FILES[version]
        base = Path(mount)
        folder = base / path.strip("/")
        if not folder.is_dir():  # inside a container, the cgroup's path is the namespace's root
            folder = base
        while True:
            bound = _cgroup_room(folder, limit_name, usage_name, cache_keys, dirty_keys)
            if bound:
                rooms.append(bound)
            if folder == base or folder == folder.parent:
                break
            folder = folder.parent
    return rooms


def _cgroup_room(folder: Path, limit_name: str, usage_name: str, cache_keys: tuple[str, ...],
                 dirty_keys: tuple[str, ...]) -> tuple[int, str] | None:
    try:
        limit_text = (folder / limit_name).read_text().strip()
        if limit_text == "max" or int(limit_text) >= 2**60:  # no limit
            return None
        limit, usage = int(limit_text), int((folder / usage_name).read_text())
        stat = dict(line.split() for line in (folder / "memory.stat").read_text().splitlines() if " " in line)
    except (OSError, ValueError):
        return None
    clean_cache = sum(int(stat.get(k, 0)) for k in cache_keys) - sum(int(stat.get(k, 0)) for k in dirty_keys)
    return max(0, limit - usage + max(0, clean_cache)), f"memory cgroup limit {format_bytes(limit)} of {folder}"


def address_space_room() -> tuple[int, str] | None:
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
