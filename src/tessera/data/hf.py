"""`dataset_type=hf`: text from local (or Hub) files through the Hugging Face `datasets` library.

`hf_path` is a file format (`parquet`, `json`, `arrow`, `text`, `csv`) read from the globs in
`hf_train_files` / `hf_eval_files`, a local dataset folder (`load_dataset` layout or one written
by `save_to_disk`), or a Hub dataset name. Every source becomes an `IterableDataset` (streamed
with `hf_streaming=true`, else converted to an Arrow cache first), split across processes with
`split_dataset_by_node`: whole files per share when the file count divides evenly, else every
process reads all files and keeps every n-th document, so no document is dropped or read twice.

Each process builds only its rows of the global batch: those its devices hold, `global_batch / n`
of them for n shares (`tessera.data.process_shares`: one per process unless several processes hold
the same rows, which then read the same share), placed on the mesh by `tessera.data.place_batch`.
The training stream restarts at its end (a new epoch); the eval stream ends. The iterator state
(epoch, the `datasets` stream state and the token offset in the current document) is JSON and
resumes exactly.
"""

from __future__ import annotations

import codecs
import contextlib
import glob
import logging
import os
from pathlib import Path

import numpy as np

from tessera.config import ConfigError, DataConfig
from tessera.config.fields import HF_FILE_FORMATS as FILE_FORMATS
from tessera.data import rows_per_process
from tessera.data.documents import column_values, document_ids
from tessera.data.errors import (REMOTE_PREFIXES, DataError, check_reachable, no_records, no_tokens, open_local,
                                  read_failure, unresolvable_host)
from tessera.data.packing import DocumentCursor, next_batch
from tessera.data.tokenizers import check_tokenizer, load_tokenizer

log = logging.getLogger("tessera")


SUFFIX_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".txt": "text",
                  ".csv": "csv"}


def _format_hint(files_value: str) -> str:
    """For files of a known suffix given with an hf_path that is no format (hf_path=jsonl for .jsonl
    files went to the Hugging Face Hub and failed there): the format to name instead."""
    suffixes = {Path(p.strip()).suffix for p in files_value.split(",") if p.strip()}
    formats = {SUFFIX_FORMATS.get(s) for s in suffixes}
    if len(formats) != 1 or None in formats:
        return ""
    fmt, = formats
    return (f". For local files hf_path names their format ({', '.join(FILE_FORMATS)}): for "
            f"{'/'.join(sorted(suffixes))} files, hf_path={fmt}")


def expand_files(pattern_list: str, key: str) -> list[str]:
    """Comma-separated globs -> sorted files; an empty match is an error naming the key and the glob,
    as is a file that two globs match (it would be read twice in every pass)."""
    files, matched_by = [], {}
    for pattern in [p.strip() for p in pattern_list.split(",") if p.strip()]:
        if pattern.startswith(REMOTE_PREFIXES):
            check_reachable(pattern, f"{key}={pattern!r}")
            _once(pattern, pattern, pattern, matched_by, key)
            files.append(pattern)
            continue
        matched = sorted(glob.glob(os.path.expanduser(pattern)))
        if not matched:
            raise ConfigError(f"{key}={pattern!r} matches no files; check the path (globs like /data/c4/000*.parquet "
                              "are allowed)")
        found = [f for f in matched if os.path.isfile(f)]
        if not found and not all(map(os.path.isdir, matched)):  # /dev/null, a pipe (<(zcat ...)), a socket
            other = next(f for f in matched if not os.path.isdir(f))
            raise ConfigError(f"{key}={pattern!r} matches {other!r}, which is no regular file (a device, a pipe or a "
                              "socket; the readers need a file they can open again and seek in); write the data to a "
                              "file and name that")
        if not found:  # only folders: a folder is not read as its files
            folders = f"folder {matched[0]!r}" if len(matched) == 1 else f"{len(matched)} folders"
            raise ConfigError(f"{key}={pattern!r} matches {folders} and no file; name the files in it, e.g. "
                              f"{key}={os.path.join(matched[0], '*')!r}")
        for f in found:
            _once(f, os.path.realpath(f), pattern, matched_by, key)
        files += found
    return files


def files_with_sizes(files: list[str]) -> list[list]:
    """[file, bytes] of each of `files` (bytes None for a URL), as the processes of a job compare them."""
    return [[f, None if f.startswith(REMOTE_PREFIXES) else os.path.getsize(f)] for f in files]


def _once(file: str, same: str, pattern: str, matched_by: dict, key: str) -> None:
    """Note that glob `pattern` matched `file` (`same`: what is equal for one file, e.g. its real
    path); ConfigError when an earlier glob matched it too."""
    if same in matched_by:
        earlier = matched_by[same]
        by = f"both {earlier!r} and {pattern!r}" if earlier != pattern else f"{pattern!r} twice"
        raise ConfigError(f"{key}: file {file!r} is matched by {by}, so it would be read twice; give each file "
                          "once")
    matched_by[same] = pattern


def _check_readable(files: list[str], fmt: str, key: str) -> None:
    """Fail early, naming the file, instead of deep inside a streaming read."""
    for f in files:
        if f.startswith(REMOTE_PREFIXES):
            continue
        try:
            if fmt == "parquet":
                import pyarrow.parquet as pq

                pq.read_metadata(f)
            else:
                with open_local(f) as fh:
                    head = fh.read(1 << 16)
                if fmt in ("json", "text", "csv"):  # a character cut at the end of the sample is fine
                    codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
        except (OSError, EOFError, UnicodeDecodeError, ValueError) as e:
            raise ConfigError(f"{key}: file {f!r} cannot be read as {fmt} ({type(e).__name__}: {e}); "
                              "fix or remove it, or change hf_path") from e


def files_setting(cfg: DataConfig, split: str) -> tuple[str, str]:
    """(key, value) of the file globs of `split`: hf_train_files or hf_eval_files."""
    return ("hf_train_files", cfg.hf_train_files) if split == "train" else ("hf_eval_files", cfg.hf_eval_files)


LIBRARY_LOGGERS = ("datasets", "huggingface_hub")  # each adds a stderr handler of its own when imported


def _log_through_the_run() -> None:
    """`datasets` and `huggingface_hub` print their records with a stderr handler of their own and also
    pass them on to the root logger: under train.py's and decode.py's root handler each of their
    warnings was printed twice (a Hub retry as a bare line, then again timestamped). With a root
    handler, their stream handlers are removed, so each line comes once, in the run's format."""
    if not logging.getLogger().handlers:
        return
    for name in LIBRARY_LOGGERS:
        library = logging.getLogger(name)
        if library.propagate:
            for handler in [h for h in library.handlers if type(h) is logging.StreamHandler]:
                library.removeHandler(handler)


@contextlib.contextmanager
def _offline_when_the_hub_is_unreachable(path: str):
    """For a Hub dataset name `path`: when the Hub's host name does not resolve (no network; see
    `errors.unresolvable_host`), `datasets` and `huggingface_hub` run in their offline mode for the
    load. A dataset in this host's cache then loads at once, as with HF_HUB_OFFLINE=1 (the Hub client
    used to retry the name five times first, about 25 s, logging each retry, before `datasets` fell
    back to that cache or gave up); one that is not there is a ConfigError naming the cache."""
    import datasets.config
    import huggingface_hub.constants

    unreachable = "" if Path(path).expanduser().exists() else unresolvable_host(f"hf://datasets/{path}") or ""
    if not unreachable:
        yield
        return
    switch = not datasets.config.HF_HUB_OFFLINE
    if switch:
        log.info("the Hugging Face Hub cannot be reached (%s): hf_path=%r from this host's cache only",
                 unreachable, path)
        saved = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
        datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    except ConnectionError as e:  # OfflineModeIsEnabled: not in this host's cache
        raise ConfigError(
            f"hf_path={path!r} is not in this host's Hugging Face cache ({datasets.config.HF_DATASETS_CACHE}) and the "
            f"Hub cannot be reached ({unreachable}); check the network, or load it once on a host that reaches the Hub "
            "and copy it here (save_to_disk, then hf_path=<that folder>)") from e
    finally:
        if switch:
            datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = saved


def load_stream(cfg: DataConfig, split: str, share: tuple[int, int] | None = None):
    """The `datasets.IterableDataset` for `split` ('train' or 'eval'): its `share` (index, count; default:
    this process's of one per process)."""
    import datasets
    import jax
    from datasets.distributed import split_dataset_by_node

    _log_through_the_run()

    files_key, files_value = files_setting(cfg, split)
    split_name = cfg.train_split if split == "train" else cfg.eval_split
    path, files = cfg.hf_path, []
    try:
        if path in FILE_FORMATS:
            if not files_value:
                raise ConfigError(f"hf_path={path} reads files: set {files_key} (e.g. {files_key}=/data/*.{path})")
            files = expand_files(files_value, files_key)
            _check_readable(files, path, files_key)
            # the json and parquet readers log their own error before raising; the DataError below says it once
            for reader in ("json.json", "parquet.parquet"):
                logging.getLogger(f"datasets.packaged_modules.{reader}").setLevel(logging.CRITICAL)
            ds = datasets.load_dataset(path, data_files=files, split="train", streaming=cfg.hf_streaming)
        elif Path(path).expanduser().is_dir() and (Path(path).expanduser() / "dataset_dict.json").is_file():
            ds = datasets.load_from_disk(str(Path(path).expanduser()))[split_name]
        elif Path(path).expanduser().is_dir() and (Path(path).expanduser() / "state.json").is_file():
            ds = datasets.load_from_disk(str(Path(path).expanduser()))
        elif path:
            data_files = expand_files(files_value, files_key) if files_value else None
            with _offline_when_the_hub_is_unreachable(path):
                ds = datasets.load_dataset(path, data_files=data_files, split=split_name, streaming=cfg.hf_streaming)
        else:
            raise ConfigError("dataset_type=hf needs hf_path: a file format (parquet, json, arrow, text, csv) with "
                              "hf_train_files, or a dataset folder")
    except ConfigError:
        raise
    except Exception as e:  # datasets raises FileNotFoundError, ValueError, DatasetNotFoundError, ...
        if files:  # the files were found and opened: reading them failed (hf_streaming=false reads them all)
            raise read_failure(e, files, path, f"{files_key}={files_value!r}") from None
        raise ConfigError(f"hf_path={path!r} ({files_key}={files_value!r}, split {split_name!r}) could not be "
                          f"loaded: {type(e).__name__}: {e}{_format_hint(files_value)}") from e
    if isinstance(ds, datasets.Dataset):
        ds = ds.to_iterable_dataset(num_shards=max(1, min(len(ds), 64)))
    index, count = share or (jax.process_index(), jax.process_count())
    if count > 1:
        ds = split_dataset_by_node(ds, index, count)
    return ds


class HfData:
    """Rows of this process's share of the global batch, from a `datasets` stream (see module doc)."""

    process_local = True  # batches hold this process's rows only

    def __init__(self, cfg: DataConfig, vocab_size: int, global_batch: int, split: str = "train",
                 shares: list[tuple[int, int]] | None = None):
        import jax

        self.cfg, self.split, self.length = cfg, split, cfg.max_target_length + 1
        self.shares = shares or [(p, jax.process_count()) for p in range(jax.process_count())]  # process_shares
        self.share = self.shares[jax.process_index()]
        self.rows = rows_per_process(global_batch, split, self.share[1])
        self.tokenizer = None
        if cfg.tokenizer_path:  # first: a missing tokenizer is named at once, not after a Hub dataset's retries
            self.tokenizer = self._load_tokenizer(vocab_size)
        self.ds = load_stream(cfg, split, self.share)
        self._pass_start = self.ds.state_dict()  # the start of a pass: epoch 0, the first file (see _restart)
        self.files_key, files_value = files_setting(cfg, split)
        self.files = expand_files(files_value, self.files_key) if cfg.hf_path in FILE_FORMATS else []
        self.setting = f"{self.files_key}={files_value!r}" if self.files else f"hf_path={cfg.hf_path!r}"
        self.seen = {"files": files_with_sizes(self.files)}  # what the processes of a job compare (make_input)
        self.columns = list(cfg.train_data_columns)
        try:
            first = self._next_record(iter(self.ds))
        except StopIteration:
            raise self._no_records() from None
        self._check_columns(first)
        # the first record's values, checked before anything is compiled (text columns may need a tokenizer)
        first_values = column_values(first, self.columns, self.setting, vocab_size, tokenized=True)
        if self.tokenizer is None and not all(isinstance(v, list) for v in first_values):
            self.tokenizer = self._load_tokenizer(vocab_size)  # text without tokenizer_path: its error says so
        self.vocab_size = vocab_size
        self.bos = [self.tokenizer.bos_id] if self.tokenizer and cfg.add_bos else []
        self.eos = [self.tokenizer.eos_id] if self.tokenizer and cfg.add_eos else []
        self.epoch = 0
        # tokens and rows of the pass over the files so far (None: it began mid-pass, at a resumed position);
        # `_predicts`: whether a document of the pass had 2 tokens or more (a token to predict);
        # `_small` once a pass is known to fill less than one batch
        self._pass_tokens, self._pass_rows, self._predicts, self._small = 0, 0, False, False
        self._restart(None)
        self.cursor = DocumentCursor(self._next_document, self._source_state,
                                     f"{self.setting}, train_data_columns={self.columns}",
                                     framing=len(self.bos) + len(self.eos))

    def _load_tokenizer(self, vocab_size: int):
        """tokenizer_path's tokenizer, checked against the model's vocabulary and add_bos / add_eos."""
        tok = load_tokenizer(self.cfg.tokenizer_path, self.cfg.tokenizer_type)
        check_tokenizer(tok, self.cfg.tokenizer_path, vocab_size, self.cfg.add_bos, self.cfg.add_eos)
        return tok

    def _check_columns(self, first: dict) -> None:
        names = self.ds.column_names
        if names is None:  # some streamed formats only know their columns after the first record
            names = list(first)
        missing = [c for c in self.columns if c not in names]
        if missing:
            raise ConfigError(f"train_data_columns={self.columns}: column(s) {missing} not in hf_path="
                              f"{self.cfg.hf_path!r} (columns: {names}); set train_data_columns to one of them")

    def _no_records(self) -> DataError:
        import jax

        share, (index, n) = "", self.share
        if n > 1:
            who = (f"process {jax.process_index()} of {n}" if n == jax.process_count() else
                   f"process {jax.process_index()} of {jax.process_count()} (share {index} of {n})")
            if self.files:  # the files together may hold records: this process's share holds none
                return DataError(f"{self.setting}: {who} gets no records from these files (each process reads its "
                                 f"own share: whole files when {n} divides their count, else every {n}th document); "
                                 "add documents, or run fewer processes")
            share = f" (the share of {who})"
        if self.files:
            one_per_line = " (hf_path=text: one document per line)" if self.cfg.hf_path == "text" else ""
            return no_records(self.setting, self.files, one_per_line)
        return DataError(f"{self.setting} holds no records{share} in split "
                         f"{self.cfg.train_split if self.split == 'train' else self.cfg.eval_split!r}; check hf_path "
                         "and the split")

    def _next_record(self, it) -> dict:
        """next(it); a failing read (e.g. a damaged file) becomes one DataError naming the file."""
        try:
            return next(it)
        except StopIteration:
            raise
        except Exception as e:  # noqa: BLE001 - pyarrow, datasets and fsspec raise many kinds
            raise read_failure(e, self.files, self.cfg.hf_path, self.setting) from None

    # ---- the document source
    def _source_state(self) -> dict:
        # Until the first record of a fresh iterator arrives, the `datasets` state still describes
        # the previous iterator, so the position is the one this iterator started from.
        stream = self._start_stream if self._fresh else self.ds.state_dict()
        return {"epoch": self.epoch, "stream": stream}

    def _restart(self, stream: dict | None) -> None:
        """Iterate from `stream` (a saved `datasets` state), or from the start of a pass (None). Every pass is
        `datasets`' epoch 0: for any other epoch it reorders the files (5.x), unshuffled data too, where the files
        are read in order. A loaded state stays with the dataset and is loaded again by every iterator of its
        epoch, so a new pass loads the start."""
        self.ds.set_epoch(int(stream.get("epoch", 0)) if stream else 0)  # a position saved in a reordered pass
        self.ds.load_state_dict(stream if stream is not None else self._pass_start)  # (before 2026-12-01) ends it
        self._it, self._start_stream, self._fresh = iter(self.ds), stream, True

    def _next_document(self) -> list[int]:
        try:
            example = self._next_record(self._it)
        except StopIteration:
            if self.split != "train":
                raise
            self._end_pass()
            self._restart(None)
            try:
                example = self._next_record(self._it)
            except StopIteration:
                raise self._no_records() from None
        self._fresh = False
        ids = self._tokens(example)
        self._predicts = self._predicts or len(ids) > 1
        if self._pass_tokens is not None:
            self._pass_tokens += len(ids)
            self._pass_rows += -(-len(ids) // self.length)
        return ids

    def _end_pass(self) -> None:
        """At the end of a training pass over the files: stop when it held no token to predict (no
        document of 2 tokens or more: it would be read again and again for ever, or train on nothing);
        say once when it fills less than a batch, else log the epoch."""
        tokens, rows = self._pass_tokens, self._pass_rows
        if tokens is not None and not self._predicts:
            raise no_tokens(f"{self.setting}, train_data_columns={self.columns}")
        self.epoch += 1
        self._pass_tokens, self._pass_rows, self._predicts = 0, 0, False
        if tokens is not None and not self._small and (
                rows < self.rows if not self.cfg.packing else tokens < self.rows * self.length):
            self._small = True
            batch = (f"{self.rows} rows" if not self.cfg.packing else
                     f"{self.rows} x {self.length} = {self.rows * self.length} tokens")
            held = f"{rows} row(s) (packing=false)" if not self.cfg.packing else f"{tokens} tokens"
            log.warning("hf training data: one pass over %s fills %s, less than one batch of %s; the data is "
                        "repeated within each batch (no line per epoch from here on)", self.setting, held, batch)
        elif not self._small:
            log.info("hf training data: epoch %d finished, starting again from the first file", self.epoch)

    def _tokens(self, example: dict) -> list[int]:
        values = column_values(example, self.columns, self.setting, self.vocab_size, self.tokenizer is not None)
        return document_ids(values, self.tokenizer, self.bos, self.eos)

    # ---- the iterator contract
    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return next_batch(self.cursor, self.rows, self.length, self.cfg.packing)

    def get_state(self) -> dict:
        return {"type": "hf", **self.cursor.get_state()}

    def set_state(self, state: dict) -> None:
        if set(state) == {"step"}:  # a full-state load from another run: only its step count is known
            log.warning("hf data starts from its first document (the loaded state holds no hf data position)")
            return
        if state.get("type") != "hf":
            raise ConfigError(f"the checkpoint's data state is for dataset_type={state.get('type')!r}, not hf; "
                              "resume with the dataset_type the run started with")
        source = state["source"]
        self.epoch = int(source["epoch"])
        self._pass_tokens = self._pass_rows = None if source["stream"] is not None else 0  # None: mid-pass
        self._predicts = False
        self._restart(source["stream"])
        self.cursor.resume(int(state["offset"]))
