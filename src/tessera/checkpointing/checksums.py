"""Checksums of checkpoint files: recorded when a checkpoint is saved, verified before it is read.

Orbax and TensorStore check a checkpoint's structure (its metadata, each file's length), not
its bytes: a data file overwritten in place with the same number of bytes (a failing disk, a
bad copy, a stray `dd`) restores without complaint and the run trains on the damage. So each
save also writes `tessera_checksums.json`, the size and CRC32C of every file it wrote, and every
read of that checkpoint first compares the files with it.

- A training step folder: the files of its items (`state/`, `data/`, `config/`). Orbax still
  rewrites the step's own top-level metadata after the items are complete, so those few small
  files are left out. With async saves the list is written on Orbax's background thread before
  the step folder is committed, so a committed step always carries it.
- A single-item checkpoint (a converted or quantized parameters folder): every file in it.
- Only local (and mounted network) folders are covered. Bucket URLs are not: reading a large
  checkpoint back from a bucket would cost as much as writing it, and Cloud Storage checks each
  object's CRC32C itself on upload and download.
- A checkpoint without the list (saved before Tessera wrote one, with checkpoint_checksums=false,
  or to a bucket) is read unverified, with one log line saying so: a warning when the config saved
  with a step says its run recorded a list.

In a multi-process job each process lists the files it wrote itself (Orbax's OCDBT format puts
them under `ocdbt.process_<i>/`), once they are complete and before the save's processes meet
(`record_share`, a partial list in the step folder); process 0 merges those lists and adds the
rest (the metadata, the data-loader and config items), so no process reads back more than its
own share of the checkpoint. Each process checks its share of the files when a checkpoint is
read, and the first problem any of them finds is reported by all. CRC32C runs at several GB/s
with the CPU's instruction (google-crc32c), so a share is read at about the speed the disk
delivers it (mostly from the page cache, right after the write); recording that takes longer
than a few seconds is logged.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import google_crc32c

log = logging.getLogger(__name__)

MANIFEST = "tessera_checksums.json"
SHARE = ".tessera_checksums.process_{}.json"  # one process's part of a step's list, until process 0 merges it
_OWN = ".tessera_checksums"  # how the partial lists and the list's temporary file start: never listed themselves
PROCESS_FILES = "ocdbt.process_{}"  # where Orbax's OCDBT format puts the array files process i writes
_FORMAT = 1
_CHUNK = 8 << 20
SLOW_SECONDS = 5.0  # recording that takes longer is logged at INFO


def is_local(folder) -> bool:
    return "://" not in str(folder)


def crc32c(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = google_crc32c.extend(crc, chunk)
    return crc


def _files(folder: Path, items_only: bool) -> list[str]:
    """Relative paths of the files under `folder` (without the list itself), sorted; with
    `items_only`, only those inside its subfolders."""
    out = []
    for root, dirs, names in os.walk(folder):
        dirs.sort()
        rel = Path(root).relative_to(folder)
        if items_only and rel == Path("."):
            continue
        out += [str(rel / n) if rel != Path(".") else n for n in names
                if n != MANIFEST and not n.startswith(_OWN)]
    return sorted(out)


def _entry(path: Path) -> dict[str, int]:
    """A file's entry in a checksum list."""
    return {"size": path.stat().st_size, "crc32c": crc32c(path)}


def _write_list(path: Path, files: dict[str, dict]) -> None:
    """`files` (name -> size and CRC32C) as a checksum list at `path`, atomically (a temporary file renamed)."""
    tmp = path.with_name(f".{path.name}.tmp")
    lines = ",\n".join(f"  {json.dumps(name)}: {json.dumps(entry)}" for name, entry in files.items())
    tmp.write_text(f'{{"format": {_FORMAT}, "algorithm": "crc32c", "files": {{\n{lines}\n}}}}\n')
    os.replace(tmp, path)


def _log_cost(what: str, files: dict[str, dict], folder, took: float, more: str = "") -> None:
    """Log what a list cost at INFO when slow (a slow disk or a very large checkpoint; it runs on
    Orbax's background thread), else at DEBUG."""
    size = sum(f["size"] for f in files.values())
    log.log(logging.INFO if took > SLOW_SECONDS else logging.DEBUG, "%s %d files (%.1f GiB) under %s in %.1f s%s "
            "(checkpoint_checksums=false skips them)", what, len(files), size / 2**30, folder, took, more)


def record_share(item, name: str, process: int) -> None:
    """This process's part of a step's list: the size and CRC32C of the files it wrote into the
    checkpoint item folder `item` (`ocdbt.process_<process>/`; Orbax renames the folder to the
    item's `name` when it commits), written to the step folder as a partial list that `record`
    merges. Called once the process's writes are complete."""
    if not is_local(item):
        return
    item, start = Path(item), time.perf_counter()
    own = item / PROCESS_FILES.format(process)
    files = {}
    for rel in _files(own, items_only=False) if own.is_dir() else []:
        path = own / rel
        files[f"{name}/{own.name}/{rel}"] = _entry(path)
    _write_list(item.parent / SHARE.format(process), files)
    _log_cost(f"process {process} recorded checksums of the", files, own, time.perf_counter() - start)


def record(folder, items_only: bool) -> None:
    """Write the size and CRC32C of the files under `folder` into `folder/MANIFEST`. `items_only`:
    a step folder, whose top-level files Orbax may still rewrite; the partial lists the processes
    wrote there (`record_share`) are taken for the files they cover whose size is unchanged, and
    removed. Nothing is written for a bucket URL."""
    if not is_local(folder):
        return
    folder = Path(folder)
    start, files, shared = time.perf_counter(), {}, {}
    shares = sorted(folder.glob(SHARE.format("*"))) if items_only else []
    for share in shares:
        try:
            shared.update({k: {"size": int(v["size"]), "crc32c": int(v["crc32c"])}
                           for k, v in json.loads(share.read_text())["files"].items()})
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # its files are read here instead
            log.warning("%s cannot be read (%s); its files' checksums are recorded from the files", share,
                        type(e).__name__)
    for name in _files(folder, items_only):
        path = folder / name
        size = path.stat().st_size
        entry = shared.get(name)
        files[name] = entry if entry is not None and entry["size"] == size else _entry(path)
    _write_list(folder / MANIFEST, files)
    for share in shares:
        share.unlink()
    listed = sum(1 for name, entry in files.items() if shared.get(name) is entry)
    _log_cost("recorded checksums of", files, folder, time.perf_counter() - start,
              f", {listed} of them listed by the processes that wrote them" if shares else "")


def check(target) -> str | None:
    """What is wrong with checkpoint folder or item `target` against the list that covers it (its
    own, or its step folder's), or None when its files match. Without a list (or for a bucket URL)
    it is read unverified, with a log line. Collective in a multi-process job (`problem`)."""
    found = _find(target)
    if found is None:
        if is_local(target) and _saved_with_list(Path(target)):
            log.warning("%s has no checksum list (%s): read without verifying its files, though the run that saved "
                        "it recorded one (checkpoint_checksums=true); the list was removed, or the process ended "
                        "between a synchronous save and its list", target, MANIFEST)
        elif is_local(target):
            log.info("%s has no checksum list (%s): read without verifying its files", target, MANIFEST)
        return None
    return problem(*found)


def _saved_with_list(target: Path) -> bool:
    """Whether the training run that saved step folder (or its item) `target` recorded checksums, as the
    config saved with it says: checkpoint_checksums on, its checkpoints in a local folder."""
    from tessera.checkpointing.storage import CONFIG_FILE

    folder = target.parent if target.name == "state" else target
    try:
        saved = json.loads((folder / "config" / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(saved, dict) or saved.get("checkpoint_checksums") is not True:
        return False
    return is_local(saved.get("checkpoint_dir") or saved.get("base_output_directory") or "")


def _find(item) -> tuple[Path, str] | None:
    """(the folder whose list covers `item`, `item`'s prefix in that list) for a checkpoint item
    folder or a single-item checkpoint; None when no list was recorded (or for a bucket URL)."""
    if not is_local(item):
        return None
    item = Path(item)
    if (item / MANIFEST).exists():
        return item, ""
    if (item.parent / MANIFEST).exists():
        return item.parent, item.name + "/"
    return None


def problem(folder, prefix: str = "") -> str | None:
    """What is wrong with the files of `folder` whose paths start with `prefix`, against its list
    ('its file state/d/ab12 ...'), or None when they all match (or there is no list). Collective in
    a multi-process job: every process must call it, each checks its share of the files."""
    import jax

    folder = Path(folder)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        entries = {k: (int(v["size"]), int(v["crc32c"])) for k, v in manifest["files"].items() if k.startswith(prefix)}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return (f"its checksum list {MANIFEST} cannot be read ({type(e).__name__}: {str(e)[:200]}); if the list alone "
                f"is damaged, deleting it ({folder / MANIFEST}) reads the files without verifying them")
    names = sorted(entries)
    n, i = jax.process_count(), jax.process_index()
    start = time.perf_counter()
    mine = next(((k, why) for k in names[i::n] if (why := _mismatch(folder, k, *entries[k]))), None)
    if n > 1:  # the first mismatch any process found; its reason is worked out again where another found it
        from jax.experimental import multihost_utils
        import numpy as np

        index = names.index(mine[0]) if mine is not None else len(names)
        found = int(np.min(multihost_utils.process_allgather(np.int32(index))))
        if found == len(names):
            mine = None
        elif mine is None or mine[0] != names[found]:
            mine = names[found], _mismatch(folder, names[found], *entries[names[found]])
    if mine is not None:
        return mine[1]
    size = sum(s for s, _ in entries.values())
    log.info("checksums of %d files (%.1f MiB) under %s match (%.2f s)", len(names), size / 2**20,
             folder / prefix, time.perf_counter() - start)
    return None


def _mismatch(folder: Path, name: str, size: int, crc: int) -> str | None:
    path = folder / name
    try:
        actual = path.stat().st_size
        if actual != size:
            return f"its file {name} has {actual} bytes, {size} when it was saved"
        if crc32c(path) != crc:
            return f"its file {name} has changed since it was saved (its CRC32C differs)"
    except FileNotFoundError:
        return f"its file {name} is missing"
    except OSError as e:
        return f"its file {name} cannot be read ({e.strerror or e})"
    return None

