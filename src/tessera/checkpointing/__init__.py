"""Checkpoints through Orbax: periodic (async) saves, resume, parameter-only and full-state loads.

A checkpoint is one folder per step under `checkpoint_dir`, with three items:
`state` (step, params, opt_state: sharded arrays), `data` (the input pipeline's position, JSON)
and `config` (the final flat config, JSON). Orbax writes a step into a temporary folder and
renames it (or, on GCS, writes `commit_success.txt`) only when every file is complete, so a
save cut short by SIGKILL leaves a `*.orbax-checkpoint-tmp*` folder that is never listed as
a step. At start-up `Checkpointer` moves such folders to `<checkpoint_dir>_incomplete/` and
says so in the log: they are never loaded and never deleted. A save that fails (disk full)
raises CheckpointSaveError at that save, or for an async save at the next save, check, wait or
close; its partial folder is set aside the same way and earlier steps stay loadable.

A step whose files are damaged (`state/_METADATA` missing, an array file truncated) is reported
as damaged, naming the earlier step the run resumes from once it is moved away. Orbax's event
loops are made to cancel and await their pending reads and writes before closing, so a failed
read or write is one error, not a page of abandoned-task tracebacks.

Every save also records the size and CRC32C of each file it wrote, and every read compares the
files with that list first (`checkpoint_checksums`; see `checksums.py`): a file
changed in place after the save is reported as damaged instead of being trained on.

Before restoring, the checkpoint's own metadata is compared with the state the current config
expects; any difference (missing or extra arrays, shapes, dtypes) is reported by path and
nothing is loaded or overwritten. A path to load from that does not exist, or holds no
checkpoint (e.g. a run folder instead of a step folder), is reported as such, with a step folder
to use when there is one nearby. Paths arrive absolute: the config layer resolves them, and
Orbax refuses relative ones.

The package: `manager.py` (Checkpointer), `loading.py` (load paths), `checksums.py`,
`trees.py` (saved against expected trees), `storage.py` (Orbax's loops and logs, buckets,
writable folders, errors), `quantized.py` (decode.py's quantized checkpoints).
"""

from tessera.checkpointing.loading import (load_full_state, load_parameters, mismatch_explained, quantized_explained,
                                          record_checksums, saved_config, saved_tree, verify_item, warn_model_changes)
from tessera.checkpointing.manager import (Checkpointer, CheckpointSaveError, save_allowance_seconds,
                                          set_aside_incomplete)
from tessera.checkpointing.storage import (INCOMPLETE_MARKER, PYTREE_METADATA_FILE, CheckpointError, check_writable,
                                           read_error, remote_exists, unwritable)
from tessera.checkpointing.trees import CheckpointMismatch, describe_mismatch, raise_on_mismatch

__all__ = [
    "INCOMPLETE_MARKER", "PYTREE_METADATA_FILE", "CheckpointError", "CheckpointMismatch", "CheckpointSaveError",
    "Checkpointer", "check_writable", "describe_mismatch", "load_full_state", "load_parameters", "mismatch_explained",
    "quantized_explained", "raise_on_mismatch", "read_error", "record_checksums", "remote_exists", "save_allowance_seconds", "saved_config",
    "saved_tree", "set_aside_incomplete", "unwritable", "verify_item", "warn_model_changes",
]
