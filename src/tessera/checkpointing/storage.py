"""The checkpoint folder's storage: Orbax's event loops and error logs made quiet, bucket probes,
the check that an output folder can be written, and TensorStore's errors in one line."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import re
import shutil

import jax
from etils import epath

from tessera.config import ConfigError
from tessera.data.errors import brief, unresolvable_host
from tessera.memory_fit import format_bytes

log = logging.getLogger(__name__)

INCOMPLETE_MARKER = ".orbax-checkpoint-tmp"


PYTREE_METADATA_FILE = "_METADATA"  # what Orbax writes in every complete PyTree item (the tree and its arrays)
CONFIG_FILE = "metadata"  # the file of a step's `config` item (the run's flat config, JSON)
# beside the parameters hf-to-tessera writes: the config.json they were converted from (tessera-to-hf reads its
# max_position_embeddings back, the loads compare the model keys it describes; the checksum list covers it)
SOURCE_CONFIG = "hf_source_config.json"


class CheckpointError(Exception):
    """A checkpoint that cannot be used: the message names the path and what is wrong."""


class _TidyEventLoop(asyncio.SelectorEventLoop):
    """An event loop that, when closed, first cancels the tasks still pending and lets them end.

    Orbax runs each read or write in a fresh loop and closes it as soon as the first array
    fails (a truncated file, a full disk), while the other arrays' tasks are still pending.
    Python then reports every abandoned task at garbage collection ("Task was destroyed",
    "_GatheringFuture exception was never retrieved", "Exception ignored in: <coroutine ...>").
    Cancelling and awaiting them before the close ends them quietly, and the one error that
    caused it reaches us alone."""

    def call_soon_threadsafe(self, callback, *args, context=None):
        """A TensorStore thread may complete a read after Orbax closed this loop (a race seen
        when a damaged checkpoint fails one array while others are still in flight): nobody
        awaits that result any more, so it is dropped instead of printing a traceback."""
        try:
            return super().call_soon_threadsafe(callback, *args, context=context)
        except RuntimeError:
            if self.is_closed():
                return None
            raise

    def call_exception_handler(self, context) -> None:
        """When the disk fills up, every array's write fails: Orbax raises the first failure (which
        the trainer reports) and the others end as finished tasks nobody asks for. Python would print
        each at garbage collection ("Task exception was never retrieved") with its traceback; those
        echoes of the reported storage error are dropped. Anything else is reported as usual."""
        exc = context.get("exception")
        if "never retrieved" in str(context.get("message", "")) and _is_storage_error(exc):
            log.debug("dropped a repeated storage error of an abandoned Orbax task: %s", exc)
            return
        super().call_exception_handler(context)

    def close(self) -> None:
        if not self.is_closed() and not self.is_running():
            pending = [t for t in asyncio.all_tasks(self) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                self.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        super().close()


def _is_storage_error(exc) -> bool:
    """A failed TensorStore read or write (full disk, missing or truncated file)."""
    text = str(exc)
    return isinstance(exc, OSError) or (isinstance(exc, ValueError) and any(
        s in text for s in ("RESOURCE_EXHAUSTED", "Error writing", "Error reading", "No space left")))


class _TidyEventLoopPolicy(asyncio.DefaultEventLoopPolicy):
    _loop_factory = _TidyEventLoop


def use_tidy_event_loops() -> None:
    """Make new event loops `_TidyEventLoop`s (called before every Orbax read and write)."""
    if not isinstance(asyncio.get_event_loop_policy(), _TidyEventLoopPolicy):
        asyncio.set_event_loop_policy(_TidyEventLoopPolicy())


def skip_tensorstore_byte_counts() -> None:
    """Stop Orbax asking TensorStore for the bytes it wrote or read before and after every array save
    and restore (`get_tensorstore_raw_bytes`, for a throughput line Orbax logs at INFO). Each answer,
    from TensorStore's `experimental_collect_matching_metrics`, is never freed (about 3 KB a call
    with tensorstore 0.1.86): a long run kept 18 KB of host memory per checkpoint saved for good.
    Orbax skips the count when the first one is None."""
    from orbax.checkpoint._src.serialization import tensorstore_utils

    if hasattr(tensorstore_utils, "get_tensorstore_raw_bytes"):
        tensorstore_utils.get_tensorstore_raw_bytes = _no_byte_count


def _no_byte_count(*_args, **_kwargs) -> None:
    return None


def read_error(e: Exception, message: str) -> CheckpointError:
    """`message (<the array, when known>: <what TensorStore said>)`, without the page-long spec."""
    arrays = re.findall(r"'path': '([^'/]+)/'", str(e))  # the innermost path of the spec is the array
    cause = e.__cause__ if e.__cause__ is not None and arrays else e
    detail = str(cause).split(" See full TensorStore details")[0]
    detail = " ".join(re.sub(r"\s*\[tensorstore_spec='.*?'\]", "", detail).split())[:400]
    where = f"array {arrays[-1]}: " if arrays else ""
    return CheckpointError(f"{message} ({where}{type(cause).__name__}: {detail})")


def free_space(directory: epath.Path) -> str:
    """'1.2 GiB of 50.0 GiB' for the nearest existing folder at or above `directory`."""
    path = directory
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        usage = shutil.disk_usage(str(path))
    except (OSError, TypeError, ValueError):  # a bucket has no disk usage
        return "unknown"
    return f"{format_bytes(usage.free)} of {format_bytes(usage.total)}"


class _OrbaxLogsWeReport(logging.Filter):
    """Drops Orbax's own log records of what Checkpointer reports once itself: the ERROR records
    (each with a traceback) about a failed save or read, which also reach it as exceptions, and
    the warning that a save waited for the previous one, which its save line states. A warning
    Orbax repeats for the same step (a step folder without its _CHECKPOINT_METADATA, read once for
    the step list and once for the restore) passes once."""

    def __init__(self):
        super().__init__()
        self.said: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if f"{os.sep}orbax{os.sep}" not in record.pathname:
            return True
        waited = str(record.msg).startswith("Waiting for previous save to complete took")
        if record.levelno >= logging.ERROR or waited:
            return False
        if record.levelno == logging.WARNING:
            text = record.getMessage()
            if text in self.said:
                return False
            self.said.add(text)
        return True


def quiet_orbax_logs() -> None:
    absl_logger = logging.getLogger("absl")
    if not any(isinstance(f, _OrbaxLogsWeReport) for f in absl_logger.filters):
        absl_logger.addFilter(_OrbaxLogsWeReport())


# loggers of the bucket clients, which log each failed retry with its traceback before raising
_STORAGE_LOGGERS = ("gcsfs", "fsspec", "google", "google.auth", "urllib3", "aiohttp")


def remote_exists(path: str, key: str, error=ConfigError, subject: str | None = None) -> bool:
    """Whether a bucket URL exists, or `error` (one line naming `key=path`, or `subject`) when the bucket
    cannot be reached: no network, no credentials, no permission. The clients' own retry logs are held back."""
    advice = "check the network, the bucket name and the credentials (gcloud auth application-default login)"
    why = unresolvable_host(path)
    if why:
        raise error(f"{subject or f'{key}={path}'} cannot be reached ({why}); {advice}")
    loggers = [logging.getLogger(name) for name in _STORAGE_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL + 1)
    try:
        return epath.Path(path).exists()
    except Exception as e:  # noqa: BLE001 - DNS, auth and permission errors come in many types
        raise error(f"{subject or f'{key}={path}'} cannot be reached ({brief(e)}); {advice}") from None
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def in_the_way(folder) -> str:
    """What keeps local folder `folder` (a Path or epath.Path) from being made: "<p> is a file, not a folder",
    "<p> is a symbolic link to <q>, which does not exist" for it or a parent; "" for neither."""
    blocker = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        return f"{blocker} is a file, not a folder"
    dangling = next((p for p in (folder, *folder.parents) if os.path.islink(p) and not p.exists()), None)
    return f"{dangling} is a symbolic link to {os.readlink(dangling)}, which does not exist" if dangling else ""


def unwritable(subject: str, key: str, folder: epath.Path, e: OSError) -> ConfigError:
    """'<subject> cannot be written: <why>; <what to do> (free space there: ...)' for output folder `folder`."""
    blocker = in_the_way(folder)
    why = blocker or f"{e.strerror or e}"
    fix = (f"free some space there or choose another {key}" if e.errno == errno.ENOSPC and not blocker else
           f"choose another {key} or fix the folder's permissions")
    return ConfigError(f"{subject} cannot be written: {why}; {fix} (free space there: {free_space(folder)})")


def check_writable(path: str, key: str, folder_name: str | None = None) -> None:
    """ConfigError naming `key=path` unless a file can be created in folder `path`; for a folder derived
    from `key` (`folder_name`, e.g. "the checkpoint folder") the error names that folder, then the key. The probe
    (and every folder it had to create) is removed again, so nothing is left behind either way.
    A bucket URL is only checked to be reachable (`remote_exists`): its write permission shows at
    the first save. In a multi-process
    job only process 0 probes: processes creating and removing the same folders at once would
    trip over each other (the others write into the same folders at the first save)."""
    if jax.process_index() != 0:
        return
    subject = f"{folder_name} {path} (from {key})" if folder_name else f"{key}={path}"
    if "://" in path:
        remote_exists(path, key, subject=subject)  # reachable; write permission shows at the first save
        return
    folder, created = epath.Path(path), []
    probe = folder / f".tessera-write-probe-{os.getpid()}"
    try:
        for p in reversed([p for p in (folder, *folder.parents) if not p.exists()]):
            try:
                p.mkdir()
            except FileExistsError:  # made meanwhile by someone else: theirs to keep
                continue
            created.append(p)
        probe.write_text("probe")  # not empty: an empty file fits on a full disk, and the run then failed later
    except OSError as e:
        raise unwritable(subject, key, folder, e) from None
    finally:
        with contextlib.suppress(OSError):
            probe.unlink(missing_ok=True)
            for p in reversed(created):
                p.rmdir()
