"""`dataset_type=grain` (ArrayRecord or Parquet files) and `dataset_type=tfds` (a TFDS dataset)
through Grain, deterministic and resumable.

Records are read by index (`grain.MapDataset`), so the order is a pure function of the files and
`data_shuffle_seed`: process p of n takes records p, p+n, p+2n, ... of the (shuffled) list, so
a file count that does not divide across processes loses nothing (p and n count shares of the batch,
`tessera.data.process_shares`: processes whose devices hold the same rows read the same records). The
training stream repeats (reshuffled each epoch); the eval stream is read in file order and ends. Tokenizing runs in
`grain_worker_count` worker processes (0: in this process). The iterator state is Grain's own
iterator state plus the tokens already used of the current document (JSON, saved in checkpoints).

ArrayRecord records hold a document as UTF-8 text, or as a JSON object whose
`train_data_columns` hold the text. Parquet files are read a row group at a time.

TFDS datasets are opened with `tfds.data_source` (`dataset_name`, `dataset_path`, the split
from `train_split`/`eval_split`): random access needs the dataset prepared in ArrayRecord
format, which TFDS reads without TensorFlow. Nothing is ever downloaded.
The sources that read records by index are in `grain_sources.py`.
"""

from __future__ import annotations

import logging

import numpy as np

from tessera.config import ConfigError, DataConfig
from tessera.data import rows_per_process
from tessera.data.documents import column_values, document_ids
from tessera.data.errors import DataError, no_records
from tessera.data.grain_sources import open_source, tfds_source
from tessera.data.hf import expand_files, files_with_sizes
from tessera.data.packing import DocumentCursor, next_batch
from tessera.data.tokenizers import check_tokenizer, load_tokenizer

log = logging.getLogger("tessera")


class _Checked:
    """A source's records as checked `column_values` (see tessera.data.documents); errors name the
    record's file and place (the source's `where`, when it has one)."""

    def __init__(self, source, columns: list[str], described: str, vocab_size: int):
        self.source, self.columns, self.described, self.vocab_size = source, columns, described, vocab_size
        self.tokenized = True  # whether text can be tokenized (False: every record must hold token ids)

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> list:
        return self.values(index, self.tokenized)

    def values(self, index: int, tokenized: bool) -> list:
        example = self.source[index]
        try:
            return column_values(example, self.columns, self.described, self.vocab_size, tokenized)
        except DataError:  # again, naming the record
            where = self.source.where(index) if hasattr(self.source, "where") else f"{self.described}, record {index}"
            return column_values(example, self.columns, where, self.vocab_size, tokenized)


class _Tokenize:
    """Checked column values -> token ids; a small picklable object, as Grain's worker processes need."""

    def __init__(self, tokenizer, add_bos: bool, add_eos: bool):
        self.tokenizer = tokenizer
        self.bos = [tokenizer.bos_id] if tokenizer and add_bos else []
        self.eos = [tokenizer.eos_id] if tokenizer and add_eos else []

    def __call__(self, values: list) -> list[int]:
        return document_ids(values, self.tokenizer, self.bos, self.eos)


class GrainData:
    """This process's rows of the global batch from Grain files or a TFDS dataset (see module doc)."""

    process_local = True

    def __init__(self, cfg: DataConfig, vocab_size: int, global_batch: int, split: str = "train",
                 shares: list[tuple[int, int]] | None = None):
        import grain
        import jax

        self.shares = shares or [(p, jax.process_count()) for p in range(jax.process_count())]  # process_shares
        index, processes = self.shares[jax.process_index()]  # processes holding the same rows read the same share
        self.cfg, self.rows = cfg, rows_per_process(global_batch, split, processes)
        self.length = cfg.max_target_length + 1
        if cfg.dataset_type == "tfds":
            described = f"dataset_name={cfg.dataset_name!r}"
            source = tfds_source(cfg, split)
            if len(source) == 0:
                raise ConfigError(f"dataset_name={cfg.dataset_name!r}: split "
                                  f"{cfg.train_split if split == 'train' else cfg.eval_split!r} holds no records")
        else:
            files_key = "grain_train_files" if split == "train" else "grain_eval_files"
            described = f"{files_key}={getattr(cfg, files_key)!r}"
            source = open_source(cfg, files_key, cfg.grain_train_files if split == "train" else cfg.grain_eval_files)
            if len(source) == 0:
                raise no_records(files_key, expand_files(getattr(cfg, files_key), files_key))
        # what the processes of a job compare (make_input): each reads every n-th of the records they count
        self.seen = {"records": len(source), "files": [] if cfg.dataset_type == "tfds" else
                     files_with_sizes(expand_files(getattr(cfg, files_key), files_key))}
        described += f", train_data_columns={list(cfg.train_data_columns)}"
        checked = _Checked(source, list(cfg.train_data_columns), described, vocab_size)
        self.tokenizer = None  # records of token ids need none (as with dataset_type=hf)
        first = checked.values(0, tokenized=True)  # a missing column or a bad value stops the run before compiling
        if cfg.tokenizer_path or not all(isinstance(v, list) for v in first):
            self.tokenizer = load_tokenizer(cfg.tokenizer_path, cfg.tokenizer_type)
            check_tokenizer(self.tokenizer, cfg.tokenizer_path, vocab_size, cfg.add_bos, cfg.add_eos)
        checked.tokenized = self.tokenizer is not None
        if split == "train" and len(source) < processes:  # every process knows it: all stop alike
            raise DataError(f"{described}: {len(source)} record(s) for {processes} processes, each of which "
                            "trains on its own records: add records (or split the documents into more records)")
        ds = grain.MapDataset.source(checked)
        if split == "train":
            ds = ds.shuffle(seed=cfg.data_shuffle_seed)
        ds = ds[index::processes]
        # a run of this many documents holds a whole (reshuffled) pass: all empty, the data holds no tokens
        whole_pass = 2 * len(ds) - 1
        if split == "train":
            ds = ds.repeat()
        tokenize = _Tokenize(self.tokenizer, cfg.add_bos, cfg.add_eos)
        ds = ds.map(tokenize)
        iter_ds = ds.to_iter_dataset()
        if cfg.grain_worker_count > 0:
            from absl import flags

            if not flags.FLAGS.is_parsed():  # Grain's workers read absl flags; the trainer does not parse them
                flags.FLAGS.mark_as_parsed()
            iter_ds = iter_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg.grain_worker_count))
        self._it = iter(iter_ds)
        # the eval stream ends at every evaluation that reads it whole: its workers are kept for the next one
        self._workers_kept = cfg.grain_worker_count if split == "train" else 0
        self.cursor = DocumentCursor(lambda: next(self._it), self._it.get_state, described,
                                     whole_pass if split == "train" else 0, len(tokenize.bos) + len(tokenize.eos))

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        try:
            return next_batch(self.cursor, self.rows, self.length, self.cfg.packing)
        finally:
            if self._workers_kept < self.cfg.grain_worker_count:  # the workers' iterators start with the first reads
                self._workers_kept = _keep_workers_at_end(self._it)

    def get_state(self) -> dict:
        return {"type": self.cfg.dataset_type, **self.cursor.get_state()}

    def set_state(self, state: dict) -> None:
        if set(state) == {"step"}:  # a full-state load from another run: start at the first record, as hf says
            log.warning("%s data starts from its first record (the loaded state holds no %s data position)",
                        self.cfg.dataset_type, self.cfg.dataset_type)
            return
        if state.get("type") != self.cfg.dataset_type:
            raise ConfigError(f"the checkpoint's data state is for dataset_type={state.get('type')!r}, not "
                              f"{self.cfg.dataset_type}; resume with the dataset_type the run started with")
        self._it.set_state(_for_workers(state["source"], self._it.get_state(), self.cfg.grain_worker_count))
        self.cursor.resume(int(state["offset"]))

    def stop_workers(self) -> None:
        """Stop the worker processes (grain_worker_count): left to the interpreter's exit, a resumed
        iterator's clean-up printed tracebacks after the run had ended. (Not `close`: `yield from`
        calls a `close` when the generator around it is left, as each evaluation leaves its batches.)"""
        for ended in _ended_iterators(self._it):  # kept by _keep_workers_at_end: Grain's close leaves them running
            ended.close()
        self._it.close()


def _iterator_tree(it) -> list:
    """`it` and the Grain iterators it reads from (an interleave's current and ended shard iterators included)."""
    found, todo = [], [it]
    while todo:
        node = todo.pop()
        found.append(node)
        todo += getattr(node, "_parents", [])
        todo += [n for n in getattr(node, "_iterators_in_use", []) if n is not None]
        todo += _ended_iterators(node)
    return found


def _ended_iterators(node) -> list:
    """An interleave's shard iterators that reached their end and were kept for a `set_state` back."""
    return [kept[1] for kept in getattr(node, "_exhausted_iterators", []) if kept is not None]


def _keep_workers_at_end(it) -> int:
    """Keep the worker processes (grain_worker_count) of the iterator `it` running when the eval
    stream ends: Grain stops a worker at the end of its shard, and the next evaluation's
    `set_state` back to the start started every worker again (as Grain's `repeat` does, the
    interleave keeps its ended shards for a set_state back, and each shard its process). Returns
    the number of worker iterators found so far (they are made as the first records are read)."""
    workers = 0
    for node in _iterator_tree(it):
        if hasattr(node, "set_keep_iterators_after_stop_iteration"):
            node.set_keep_iterators_after_stop_iteration(True)
        if hasattr(node, "set_keep_workers_after_stop_iteration"):
            node.set_keep_workers_after_stop_iteration(True)
            workers += 1
    return workers


def _workers_in(state: dict) -> int | None:
    """The worker count a Grain iterator state was saved with: 0 for a plain iterator
    ({"next_index": n}), W for W worker processes (Grain's interleave of W plain states); None
    for a state of another shape."""
    if set(state) == {"next_index"}:
        return 0
    workers = state.get("iterators_in_use_states")
    if isinstance(workers, list) and workers and all(isinstance(w, dict) and set(w) == {"next_index"}
                                                       for w in workers):
        return len(workers)
    return None


def _for_workers(saved: dict, own: dict, worker_count: int) -> dict:
    """A saved Grain position in the shape of this iterator's state `own`. The records come in the same
    order with any worker count (worker w of W reads records w, w+W, ..., taken in turn), so a position
    saved with another grain_worker_count is the same number of records read: n = the sum of the
    workers' positions."""
    then, now = _workers_in(saved), _workers_in(own)
    if then == now or then is None or now is None:
        if then != now:
            raise ConfigError(f"the checkpoint's grain data position ({sorted(saved)}) does not fit this iterator "
                              f"(grain_worker_count={worker_count}); resume with the grain_worker_count it was saved "
                              "with")
        return saved
    read = saved["next_index"] if then == 0 else sum(w["next_index"] for w in saved["iterators_in_use_states"])
    log.info("the data position was saved with grain_worker_count=%d, resumed with %d: %d records read, as before",
             then, worker_count, read)
    if now == 0:
        return {"next_index": read}
    return {**own, "next_index_in_cycle": read % now, "next_index_in_datasets": now,
            "iterators_in_use_indices": list(range(now)),
            "iterators_in_use_states": [{"next_index": read // now + (w < read % now)} for w in range(now)],
            "exhausted": [0] * now, "future_states": {}}
