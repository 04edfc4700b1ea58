"""The record sources `dataset_type=grain` and `tfds` read by index (`grain.MapDataset.source`):
Parquet files a row group at a time (`ParquetSource`), ArrayRecord files (`ArrayRecordSource`),
and a prepared TFDS dataset through `tfds.data_source` (`TfdsSource`), with `open_source`
choosing the file reader from `grain_file_type`. Each names the file and the record when one
cannot be read. The pipeline around them is `grain_pipeline.py`.
"""

from __future__ import annotations

import bisect
import json
import logging

import numpy as np

from tessera.config import ConfigError, DataConfig
from tessera.data.errors import DataError, brief, check_reachable, damaged_file
from tessera.data.hf import expand_files

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


def tfds_source(cfg: DataConfig, split: str):
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


def open_source(cfg: DataConfig, files_key: str, files_value: str):
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
