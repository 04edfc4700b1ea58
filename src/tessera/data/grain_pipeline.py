"""`dataset_type=grain` (ArrayRecord or Parquet files) and `dataset_type=tfds` (a TFDS dataset)
through Grain, deterministic and resumable.

Records are read by index (`grain.MapDataset`), so the order is a pure function of the files and
`data_shuffle_seed`: process p of n takes records p, p+n, p+2n, ... of the (shuffled) list, so
a file count that does not divide across processes loses nothing. The training stream repeats
(reshuffled each epoch); the eval stream is read in file order and ends. Tokenizing runs in
`grain_worker_count` worker processes (0: in this process). The iterator state is Grain's own
iterator state plus the tokens already used of the current document (JSON, saved in checkpoints).

ArrayRecord records hold a document as UTF-8 text, or as a JSON object whose
`train_data_columns` hold the text. Parquet files are read a row group at a time.

TFDS datasets are opened with `tfds.data_source` (`dataset_name`, `dataset_path`, the split
from `train_split`/`eval_split`): random access needs the dataset prepared in ArrayRecord
format, which TFDS reads without TensorFlow. Nothing is ever downloaded.
"""

from __future__ import annotations

import bisect
import json
import logging

import numpy as np

from tessera.config import ConfigError, DataConfig
from tessera.data import rows_per_process
from tessera.data.documents import column_values, document_ids
from tessera.data.errors import DataError, brief, check_reachable, damaged_file, no_records
from tessera.data.hf import expand_files
from tessera.data.packing import DocumentCursor, next_batch
from tessera.data.tokenizers import check_tokenizer, load_tokenizer

log = logging.getLogger("tessera")


# Parquet reads whole row groups: in a shuffled order, one for each record. Past this size (uncompressed)
# that costs milliseconds per document (measured on a 2-core host: a row group of 10,000 documents of
# about 2 KB, 27 ms per document; of 100,000, 165 ms), and training waits for its input.
LARGE_ROW_GROUP_BYTES = 4 << 20


class ParquetSource:
    """Random access to the rows of several Parquet files (`grain` data source protocol)."""

    def __init__(self, files: list[str], columns: list[str], key: str):
        import pyarrow.parquet as pq

        self.files, self.columns, self.key, self._cache = files, columns, key, (None, None)
        self.starts = [0]
        self.groups: list[tuple[int, int]] = []  # global row group -> (file, row group in that file)
        self.largest = (0, 0, "")  # the largest row group: (uncompressed bytes, rows, file)
        for file, f in enumerate(files):
            try:
                meta = pq.ParquetFile(f)
            except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ...
                raise ConfigError(f"{key}: file {f!r} cannot be read as parquet ({e}); fix or remove it") from e
            missing = [c for c in columns if c not in meta.schema_arrow.names]
            if missing:
                raise ConfigError(f"train_data_columns={columns}: column(s) {missing} not in {f!r} (columns: "
                                  f"{meta.schema_arrow.names}); set train_data_columns to one of them")
            groups = [meta.metadata.row_group(i).num_rows for i in range(meta.num_row_groups)]
            for i in range(meta.num_row_groups):
                self.largest = max(self.largest, (meta.metadata.row_group(i).total_byte_size, groups[i], f))
            self.starts += list(np.cumsum(groups) + self.starts[-1])
            self.groups += [(file, i) for i in range(meta.num_row_groups)]

    def __len__(self) -> int:
        return self.starts[-1]

    def warn_if_slow(self) -> None:
        """Say once, at start-up, when shuffled reading will re-read large row groups for every record."""
        size, rows, file = self.largest
        if size > LARGE_ROW_GROUP_BYTES:
            log.warning("%s: row groups of up to %.0f MiB (%d rows, in %r): the training records are read in a "
                        "shuffled order, a whole row group for each, so every document costs reading one; write the "
                        "files with row groups of about 1 MiB (pyarrow: row_group_size), or convert them to "
                        "ArrayRecord", self.key, size / 2**20, rows, file)

    def __getitem__(self, index: int) -> dict:
        import pyarrow.parquet as pq

        group = bisect.bisect_right(self.starts, index) - 1
        if self._cache[0] != group:
            file, local = self.groups[group]
            try:
                table = pq.ParquetFile(self.files[file]).read_row_group(local, columns=self.columns)
            except Exception as e:  # noqa: BLE001 - pyarrow raises OSError, ArrowInvalid, ...
                raise damaged_file(self.key, self.files[file],
                                   f"row group {local} (counting from 0) cannot be read ({brief(e)})") from None
            self._cache = (group, table.to_pylist())
        return self._cache[1][index - self.starts[group]]

    def where(self, index: int) -> str:
        """The file and row of record `index`, for messages."""
        file = self.groups[bisect.bisect_right(self.starts, index) - 1][0]
        first_group = next(g for g, (f, _) in enumerate(self.groups) if f == file)
        return f"{self.key}: file {self.files[file]!r}, row {index - self.starts[first_group]} (counting from 0)"


class ArrayRecordSource:
    """The records of ArrayRecord files as examples: a record is UTF-8 text, or a JSON object
    holding the columns when it parses as one (any other text, `{` or not, is text)."""

    def __init__(self, files: list[str], columns: list[str], key: str):
        import grain

        self.files, self.column, self.key = files, columns[0], key
        self.source = grain.sources.ArrayRecordDataSource(files)

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> dict:
        try:
            record = self.source[index]
        except Exception as e:  # noqa: BLE001 - Riegeli raises RuntimeError on a damaged block
            path, local = self._locate(index)
            raise damaged_file(self.key, str(path), f"record {local} (counting from 0) cannot be read "
                               f"({brief(e)})") from None
        try:
            text = record.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{self.where(index)} is not UTF-8 text (byte {e.start}: {e.reason}); re-create the "
                            f"file, or leave it out of {self.key}") from None
        if text.startswith("{"):
            try:
                example = json.loads(text)
            except ValueError:
                example = None
            if isinstance(example, dict):
                return example
        return {self.column: text}

    def where(self, index: int) -> str:
        """The file and record of record `index`, for messages."""
        path, local = self._locate(index)
        return f"{self.key}: file {path!r}, record {local} (counting from 0)" if path else f"{self.key}: record {local}"

    def _locate(self, index: int) -> tuple[str | None, int]:
        """(file, record in that file) of record `index` (opens each file to count its records)."""
        import grain

        for path in self.files:
            count = len(grain.sources.ArrayRecordDataSource([path]))
            if index < count:
                return path, index
            index -= count
        return None, index


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


def _tfds_source(cfg: DataConfig, split: str):
    """The `split` ('train' or 'eval') of a prepared TFDS dataset, as a random-access source."""
    import tensorflow_datasets as tfds
    from tensorflow_datasets.core import read_only_builder

    key = "dataset_name" if split == "train" or not cfg.eval_dataset_name else "eval_dataset_name"
    name = getattr(cfg, key)
    split_name = cfg.train_split if split == "train" else cfg.eval_split
    where = f"dataset_path={cfg.dataset_path!r}" if cfg.dataset_path else "TFDS's default data directory"
    if not name:
        raise ConfigError("dataset_type=tfds needs dataset_name (e.g. dataset_name=c4/en:3.1.0 "
                          "dataset_path=gs://my-bucket/tensorflow_datasets)")
    if cfg.dataset_path:
        check_reachable(cfg.dataset_path, f"dataset_path={cfg.dataset_path!r}")
    try:  # from the prepared files alone: no builder code, no download
        builder = read_only_builder.builder_from_files(name, **({"data_dir": cfg.dataset_path} if cfg.dataset_path
                                                                else {}))
    except tfds.core.registered.DatasetNotFoundError:
        raise ConfigError(f"{key}={name!r}: not found in {where} (expected <dataset_path>/<name>/<config>/"
                          "<version> with dataset_info.json, as TFDS writes it); check the name, version and "
                          "dataset_path") from None
    if builder.info.file_format != tfds.core.FileFormat.ARRAY_RECORD:
        raise ConfigError(f"{key}={name!r} in {where} is stored as {builder.info.file_format.value}; reading it "
                          "by index needs ArrayRecord: prepare it with `tfds build --file_format=array_record` or "
                          "convert it with `tfds convert_format --out_file_format=array_record`")
    try:
        return TfdsSource(builder.as_data_source(split=split_name), f"{key}={name!r}")
    except Exception as e:  # noqa: BLE001 - an unknown split, unreadable shards, ...
        detail = str(e).splitlines()[0] if str(e) else ""
        raise ConfigError(f"{key}={name!r} (split {split_name!r}, {where}) cannot be read: "
                          f"{type(e).__name__}: {detail}") from None


class TfdsSource:
    """The examples of a TFDS ArrayRecord data source (`as_data_source`), with damaged shards named.
    ArrayRecord reads every record of a shard cut short (an interrupted copy: its footer is lost) as
    empty bytes, without an error, and TFDS decodes those as an example of None values: training went
    on with empty documents. A TFDS record is never empty (it holds its features' names), so an empty
    one is a DataError naming the shard."""

    def __init__(self, source, setting: str):
        from tensorflow_datasets.core.data_sources.base import file_instructions

        self.source, self.setting = source, setting
        self.shards = [(f.filename, f.skip, f.take) for f in file_instructions(source.dataset_info, source.split)]
        self.starts = list(np.cumsum([0] + [take for _, _, take in self.shards]))

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> dict:
        try:
            record = self.source.data_source[index]
        except Exception as e:  # noqa: BLE001 - Riegeli raises RuntimeError on a damaged block
            raise self._damaged(index, f"cannot be read ({brief(e)})") from None
        if not record:
            raise self._damaged(index, "reads as empty bytes, as every record of a shard cut short does (an "
                                       "interrupted copy, a full disk)")
        return self.source._deserialize(record)  # what the source's own __getitem__ returns

    def where(self, index: int) -> str:
        """The shard file and record of record `index`, for messages."""
        return f"{self.setting}: file {self._locate(index)[0]!r}, record {self._locate(index)[1]} (counting from 0)"

    def _locate(self, index: int) -> tuple[str, int]:
        shard = bisect.bisect_right(self.starts, index) - 1
        path, skip, _ = self.shards[shard]
        return path, int(index - self.starts[shard] + skip)

    def _damaged(self, index: int, what: str) -> DataError:
        path, record = self._locate(index)
        return DataError(f"{self.setting}: file {path!r} is damaged: record {record} (counting from 0) {what}; copy "
                         "or prepare the dataset again")


def _open_source(cfg: DataConfig, files_key: str, files_value: str):
    if not files_value:
        raise ConfigError(f"dataset_type=grain needs {files_key} (comma-separated globs of .array_record or "
                          ".parquet files)")
    files = expand_files(files_value, files_key)
    if cfg.grain_file_type == "parquet":
        source = ParquetSource(files, list(cfg.train_data_columns), files_key)
        if files_key == "grain_train_files":  # the eval stream reads in file order: a row group at a time
            source.warn_if_slow()
        return source
    try:
        return ArrayRecordSource(files, list(cfg.train_data_columns), files_key)
    except Exception as e:  # array_record raises RuntimeError/ValueError on a bad file
        path, why = _unreadable_array_record(files, e)
        which = f"file {path!r}" if path else repr(files_value)
        raise ConfigError(f"{files_key}: {which} cannot be read as ArrayRecord ({why}); re-create it, leave it out "
                          f"of {files_key}, or set grain_file_type=parquet for Parquet files") from None


def _unreadable_array_record(files: list[str], error: Exception) -> tuple[str | None, str]:
    """(the first of `files` that ArrayRecord cannot open, why), after opening them all failed with
    `error`, which names no file (and a file cut short raises a RuntimeError without a message)."""
    import grain

    for path in files:
        try:
            grain.sources.ArrayRecordDataSource([path])
        except Exception as e:  # noqa: BLE001 - RuntimeError, ValueError, ...
            return path, brief(e) if str(e) else (f"{type(e).__name__}: its footer cannot be read: the file is cut "
                                                  "short, or not ArrayRecord")
    return None, brief(error)


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

    def __init__(self, cfg: DataConfig, vocab_size: int, global_batch: int, split: str = "train"):
        import grain
        import jax

        self.cfg, self.rows, self.length = cfg, rows_per_process(global_batch, split), cfg.max_target_length + 1
        if cfg.dataset_type == "tfds":
            described = f"dataset_name={cfg.dataset_name!r}"
            source = _tfds_source(cfg, split)
            if len(source) == 0:
                raise ConfigError(f"dataset_name={cfg.dataset_name!r}: split "
                                  f"{cfg.train_split if split == 'train' else cfg.eval_split!r} holds no records")
        else:
            files_key = "grain_train_files" if split == "train" else "grain_eval_files"
            described = f"{files_key}={getattr(cfg, files_key)!r}"
            source = _open_source(cfg, files_key, cfg.grain_train_files if split == "train" else cfg.grain_eval_files)
            if len(source) == 0:
                raise no_records(files_key, expand_files(getattr(cfg, files_key), files_key))
        described += f", train_data_columns={list(cfg.train_data_columns)}"
        checked = _Checked(source, list(cfg.train_data_columns), described, vocab_size)
        self.tokenizer = None  # records of token ids need none (as with dataset_type=hf)
        first = checked.values(0, tokenized=True)  # a missing column or a bad value stops the run before compiling
        if cfg.tokenizer_path or not all(isinstance(v, list) for v in first):
            self.tokenizer = load_tokenizer(cfg.tokenizer_path, cfg.tokenizer_type)
            check_tokenizer(self.tokenizer, cfg.tokenizer_path, vocab_size, cfg.add_bos, cfg.add_eos)
        checked.tokenized = self.tokenizer is not None
        processes = jax.process_count()
        if split == "train" and len(source) < processes:  # every process knows it: all stop alike
            raise DataError(f"{described}: {len(source)} record(s) for {processes} processes, each of which "
                            "trains on its own records: add records (or split the documents into more records)")
        ds = grain.MapDataset.source(checked)
        if split == "train":
            ds = ds.shuffle(seed=cfg.data_shuffle_seed)
        ds = ds[jax.process_index()::processes]
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
        if set(state) == {"step"}:  # a full-state load from another run: start at the first record
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
