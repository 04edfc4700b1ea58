"""Input pipelines. `make_input(cfg, vocab_size, global_batch)` returns an iterator of host
batches: dicts of numpy arrays with keys `tokens` [B, T+1] (inputs and shifted targets come
from it), `segment_ids` [B, T+1] (0 marks padding) and `positions` [B, T+1]. B is the global
batch, or this process's share of it when the iterator has `process_local = True` (file-backed
pipelines read only their share: the rows its devices hold, `process_shares`); `place_batch` puts
either kind on the mesh. Each iterator has
`get_state()` (JSON-able, saved in checkpoints) and `set_state(state)`, so a resumed run
continues with the next unseen batch. `split="eval"` gives the evaluation stream, which ends.
Data that cannot be used (a damaged file, no records), found when opening or in the middle of
a run, raises `DataError` (a `ConfigError`: exit code 2) naming the file and what to do."""

from __future__ import annotations

import json
import logging

import jax
import numpy as np

from tessera.config import ConfigError, DataConfig
from tessera.data.errors import DataError
from tessera.data.synthetic import SyntheticData

__all__ = ["DataError", "SyntheticData", "close_input", "make_input", "place_batch"]


log = logging.getLogger("tessera")


def make_input(cfg: DataConfig, vocab_size: int, global_batch: int, split: str = "train", sharding=None):
    """The input pipeline of `split`; `sharding` (the batch's, as `place_batch` gets it) decides which rows each
    process reads where each reads its own (`process_shares`; without it, process p reads share p of n)."""
    if split == "train":
        _warn_unread_eval_files(cfg)
    if cfg.dataset_type == "synthetic":
        return SyntheticData(cfg, vocab_size, global_batch, split)  # reuse_example_batch: regenerates step 0
    if not cfg.train_data_columns:  # every document would be empty
        raise ConfigError(f"train_data_columns=[] names no column for dataset_type={cfg.dataset_type}; set it to the "
                          "records' text or token-id column(s), e.g. train_data_columns=[text]")
    columns = list(cfg.train_data_columns)
    twice = sorted({c for c in columns if columns.count(c) > 1})
    if twice:  # its text would be in every document twice
        raise ConfigError(f"train_data_columns={columns} names {twice} more than once, which would put that column's "
                          f"text in every document again; name each column once, e.g. "
                          f"train_data_columns={list(dict.fromkeys(columns))}")
    if cfg.dataset_type == "hf":
        from tessera.data.hf import HfData  # imports `datasets` only when used

        data = HfData(cfg, vocab_size, global_batch, split, process_shares(sharding, global_batch))
    elif cfg.dataset_type in ("grain", "tfds"):
        from tessera.data.grain_pipeline import GrainData

        data = GrainData(cfg, vocab_size, global_batch, split, process_shares(sharding, global_batch))
    else:
        raise ConfigError(f"dataset_type={cfg.dataset_type!r} is not available; use synthetic, hf, tfds or grain")
    _check_same_data(data, cfg, split)
    return FirstBatchAgain(data) if cfg.reuse_example_batch and split == "train" else data


class FirstBatchAgain:
    """reuse_example_batch for the file pipelines: the first batch of `data`, read at start-up, at
    every step (speed tests without the input pipeline). Its position never moves, so a resumed
    run feeds the same batch."""

    def __init__(self, data):
        self.data, self.process_local = data, getattr(data, "process_local", False)
        self.shares = getattr(data, "shares", None)
        self.start = data.get_state()
        self.batch = next(data)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return self.batch

    def get_state(self) -> dict:
        return self.start

    def set_state(self, state: dict) -> None:
        self.data.set_state(state)  # checks the saved state's dataset_type; the batch stays the first one

    def stop_workers(self) -> None:
        close_input(self.data)


def _check_same_data(data, cfg: DataConfig, split: str) -> None:
    """DataError when another process of the job sees other files for `split` (a file missing on one host, or
    still being copied there: another size), or another number of records: each process reads its share of
    what it sees, so the shares overlapped and left records out, without a word. Compared with process 0."""
    if jax.process_count() == 1:
        return
    from tessera.job_sync import compared_values

    mine, me = json.loads(json.dumps(data.seen)), jax.process_index()
    setting = {"hf": "hf_train_files" if split == "train" else "hf_eval_files", "tfds": "dataset_name",
               "grain": "grain_train_files" if split == "train" else "grain_eval_files"}[cfg.dataset_type]
    for other, theirs in compared_values(f"{split} data", mine, 0, "open it"):
        if theirs == mine:
            continue
        files, their_files = (dict(map(tuple, x.get("files", []))) for x in (mine, theirs))
        differ = [f"{f} ({_size(files.get(f))} here, {_size(their_files.get(f))} on process {other})"
                  for f in sorted(set(files) | set(their_files)) if files.get(f) != their_files.get(f)]
        if not differ:
            differ = [f"{mine.get('records')} records here, {theirs.get('records')} on process {other}"]
        raise DataError(f"{setting}={getattr(cfg, setting)!r}: process {me} sees other data than process {other}: "
                        f"{'; '.join(differ[:3])}{f'; and {len(differ) - 3} more' if len(differ) > 3 else ''}. "
                        "Each process reads its share of the records it sees, so the shares would overlap and leave "
                        "records out: give every process the same files (a copy finished on every host, or a shared "
                        "file system)")


def _size(size) -> str:
    return "missing" if size is None else f"{size:,} bytes"


def close_input(data) -> None:
    """Stop the worker processes of an input pipeline (grain_worker_count), if it has any, before
    the interpreter's exit would (whose clean-up printed tracebacks after a resumed run)."""
    stop = getattr(data, "stop_workers", None)
    if stop:
        stop()


def _warn_unread_eval_files(cfg: DataConfig) -> None:
    """Eval files set while eval_interval=0 are never opened: say so once, at start-up."""
    settings = [f"{key}={getattr(cfg, key)!r}" for key in ("hf_eval_files", "grain_eval_files", "eval_dataset_name")
                if getattr(cfg, key)]
    if settings and not cfg.eval_interval:
        log.warning("%s: not read, because eval_interval=0 never evaluates; set eval_interval=N to evaluate every N "
                    "steps", ", ".join(settings))


def state_to_save(data, step: int, timeout: float) -> dict:
    """The data position saved with checkpoint `step`. Where each process reads its own share of
    the files (`process_local`), each has its own position, and process 0 (the one that writes
    it) saves them all: {"processes": [process 0's state, process 1's, ...]}. Otherwise (one
    process, or identical global batches everywhere) the one state. Collective: every process
    calls it at the same step; `timeout` seconds for the slowest."""
    state = data.get_state()
    if not getattr(data, "process_local", False) or jax.process_count() == 1:
        return state
    from tessera.job_sync import gather_json

    states = gather_json(f"data_state/{step}", state, timeout)
    if states is None:
        return {}  # only process 0's is written
    shares = _shares_of(data, len(states))
    return {"processes": states} if shares == _each_its_own(len(states)) else {"processes": states, "shares": shares}


def _each_its_own(processes: int) -> list[list[int]]:
    """The shares when every process reads one of its own (process p, share p of n): saved without "shares"."""
    return [[p, processes] for p in range(processes)]


def _shares_of(data, processes: int) -> list[list[int]]:
    """[share, shares] of every process, as `data` reads them (`process_shares`)."""
    return [list(s) for s in getattr(data, "shares", None) or _each_its_own(processes)]


def restore_state(data, saved: dict) -> None:
    """Put `data` at a checkpoint's saved position (`state_to_save`). Per-process positions need
    as many processes as saved them, reading the same shares of the batch (`process_shares`, saved
    as "shares" unless each process read its own): otherwise each process's share of the files is a
    different one, so it starts at its beginning (a warning says so)."""
    if "processes" in saved:
        states, count = saved["processes"], jax.process_count()
        shares = _shares_of(data, count)
        if saved.get("shares", _each_its_own(len(states))) == shares:
            data.set_state(states[jax.process_index()])
            return
        if len(states) == count:  # another mesh: the processes hold other rows of the batch than when saved
            log.warning("the checkpoint's data positions are those of processes reading the shares %s of the batch; "
                        "with this mesh they read %s, each a different part of the files, so every process reads "
                        "its share from the start (documents already trained on come again)",
                        saved.get("shares", "one each"), "one each" if shares == _each_its_own(count) else shares)
            return
        log.warning("the checkpoint's data positions are those of %d processes, each in its own share of the "
                    "files; with %d process(es) the shares differ, so every process reads its share of the files from "
                    "the start (documents already trained on come again)", len(states), count)
        return
    if getattr(data, "process_local", False) and jax.process_count() > 1 and saved.get("type"):
        log.warning("the checkpoint holds the data position of one process (saved by one process, or by a "
                    "version of Tessera that kept only process 0's); every process reads its share of the "
                    "files from the start (documents already trained on come again)")
        return
    data.set_state(saved)


def process_shares(sharding, global_batch: int) -> list[tuple[int, int]]:
    """(share, shares) for every process, in process order: which share of the global batch's rows each
    process reads (pipelines that read only their own rows), of how many. A process's share is the rows
    its devices hold under the batch `sharding`: where the batch is split fewer ways across the processes
    than there are processes (pipeline stages, or sequence or tensor ways, across them), several processes
    hold the same rows and read the same share, since each gives all of them to
    `make_array_from_process_local_data` (each read half of them: a ValueError at the first step). Shares
    are numbered in the order of their first process: with the batch split over every process, process p
    reads share p of n, as without `sharding`."""
    n = jax.process_count()
    if sharding is None or n == 1:
        return [(p, n) for p in range(n)]
    held: dict[int, set] = {}
    for device, index in sharding.devices_indices_map((global_batch, 1)).items():
        held.setdefault(device.process_index, set()).add(index[0].indices(global_batch)[:2])
    rows = [tuple(sorted(held[p])) for p in range(n)]
    distinct = list(dict.fromkeys(rows))
    return [(distinct.index(r), len(distinct)) for r in rows]


def rows_per_process(global_batch: int, split: str = "train", shares: int | None = None) -> int:
    """The rows of a global batch each process reads (pipelines that read only their own rows), from
    `shares` of it (default: one per process); ConfigError when the processes do not divide the batch."""
    processes = jax.process_count() if shares is None else shares
    if global_batch % processes:
        what, key = ("evaluation batch", "eval_per_device_batch_size") if split == "eval" else \
            ("global batch", "per_device_batch_size")
        raise ConfigError(f"the {what} of {global_batch} sequences does not divide across {processes} processes; "
                          f"change {key}")
    return global_batch // processes


def place_batch(data, host_batch: dict[str, np.ndarray], sharding, global_batch: int) -> dict[str, jax.Array]:
    """Host batch -> global arrays on the mesh; each device receives only its own rows."""
    if getattr(data, "process_local", False):
        return {k: jax.make_array_from_process_local_data(sharding, v, (global_batch, *v.shape[1:]))
                for k, v in host_batch.items()}
    return {k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx]) for k, v in host_batch.items()}
