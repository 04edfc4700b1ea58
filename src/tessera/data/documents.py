"""A record's `train_data_columns` -> one document's token ids, shared by the hf and grain pipelines.

Each column's value is text (`str`, or UTF-8 `bytes` as TFDS `Text` features arrive), a list of
token ids (a list or integer array, used as it is: no tokenizer, no begin/end tokens), or null
(an empty document). Text columns are joined by a newline and tokenized, with the begin/end
tokens `add_bos`/`add_eos` ask for. Any other value (a number, a list of strings, a dict) is a
`DataError` naming the column, the value's type and where the record came from, as are token
ids outside 0..vocab_size-1 and text bytes that are not UTF-8.
"""

from __future__ import annotations

import numpy as np

from tessera.data.errors import DataError


def column_values(example: dict, columns: list[str], where: str, vocab_size: int, tokenized: bool) -> list:
    """The record's columns, each as str, list[int] or None, checked (see module doc): `where`
    names the record in errors (e.g. "grain_train_files: file 'a.array_record', record 3"),
    `tokenized` says whether a tokenizer is at hand for text."""
    missing = [c for c in columns if c not in example]
    if missing:
        raise DataError(f"{where}: train_data_columns={columns}: column(s) {missing} not in the record (keys: "
                        f"{sorted(example)}); set train_data_columns to the record's text columns")
    values = [_value(example[c], c, where) for c in columns]
    ids_columns = [c for c, v in zip(columns, values) if isinstance(v, list)]
    text_columns = [c for c, v in zip(columns, values) if isinstance(v, str)]
    if ids_columns and text_columns:
        raise DataError(f"{where}: column(s) {ids_columns} hold token ids and {text_columns} text; one document "
                        "is either, so set train_data_columns to columns of one kind")
    if text_columns and not tokenized:
        raise DataError(f"{where}: column(s) {text_columns} hold text, and no tokenizer_path is set (the first "
                        "record held token ids); set tokenizer_path, or give every record token ids")
    ids = [t for v in values if isinstance(v, list) for t in v]
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = min(ids) if min(ids) < 0 else max(ids)
        fix = "token ids cannot be negative: re-tokenize the data" if bad < 0 else "raise vocab_size"
        raise DataError(f"{where}: column(s) {ids_columns} hold token id {bad}, outside 0..{vocab_size - 1} "
                        f"(vocab_size={vocab_size}); {fix}")
    return values


def document_ids(values: list, tokenizer, bos: list[int], eos: list[int]) -> list[int]:
    """One document's token ids from checked `column_values`: token-id columns as they are, text
    columns joined by a newline and tokenized between `bos` and `eos` (lists of 0 or 1 id)."""
    if any(isinstance(v, list) for v in values):
        return [t for v in values if v for t in v]
    if tokenizer is None:  # every column null: an empty document
        return []
    return bos + tokenizer.encode_document("\n".join(v or "" for v in values)) + eos


def _value(value, column: str, where: str):
    """One column's value as str, list[int] or None."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{where}: column {column!r} is not UTF-8 text (byte {e.start}: {e.reason}); "
                            "re-encode the data as UTF-8, or leave the record out") from None
    if isinstance(value, np.ndarray) and value.dtype.kind in "iu":
        return value.tolist()
    if isinstance(value, (list, tuple, np.ndarray)) and all(_is_int(t) for t in value):
        return [int(t) for t in value]
    raise DataError(f"{where}: column {column!r} holds {_kind(value)}, neither text nor a list of token ids; "
                    "set train_data_columns to text columns or to columns of token-id lists")


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _kind(value) -> str:
    """"a list of str (e.g. 'a')" / "a value of type int ('0')": what a column holds, for messages."""
    if isinstance(value, (list, tuple, np.ndarray)):
        other = next(t for t in value if not _is_int(t))
        return f"a list of {type(other).__name__} (e.g. {str(other)[:40]!r})"
    return f"a value of type {type(value).__name__} ({str(value)[:40]!r})"
