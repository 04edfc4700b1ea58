"""Documents (token lists) into fixed-length rows with segment ids and positions.

A row has `length` = T+1 tokens. With packing, documents follow each other in a row, each with
its own segment id (1, 2, ...) and positions restarting at 0, so attention and the loss stay
inside a document; the last document of a row is cut and continues, as a new segment, in the
next row. Without packing, a row holds one piece of one document and the rest is padding
(segment id 0, masked out of the loss); a document longer than a row continues in the next row.

The whole position of the stream is (state of the document source before the current document,
tokens of it already used), so a resumed stream re-reads one document and skips into it.
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np

from tessera.data.errors import no_tokens

log = logging.getLogger("tessera")
# After this many documents, a source whose documents nearly all hold no text (at most a begin and an
# end token: an empty or wrong text column) is reported once; training on it would learn nothing.
EMPTY_CHECK_DOCUMENTS = 100
EMPTY_SHARE = 0.9


class DocumentCursor:
    """Hands out pieces of documents from `fetch()` (which raises StopIteration at the end).

    `source_state()` must return the source's position *before* the next `fetch()`. `source` names
    the data in the warning about documents without text (e.g. "hf_train_files='...'"). When
    `whole_pass` (> 0) empty documents come in a row, they hold a whole pass over a source that
    repeats for ever: a DataError says the data holds no tokens, instead of fetching on and on. A
    document of one token counts as empty here: it has no next token to predict, so data of such
    documents would train with a loss of 0 on nothing. `framing`: the begin/end tokens the pipeline
    adds to a text document (add_bos, add_eos); a document of no more tokens holds no text."""

    def __init__(self, fetch: Callable[[], list[int]], source_state: Callable[[], dict], source: str = "",
                 whole_pass: int = 0, framing: int = 2):
        self._fetch, self._source_state, self._source, self._whole_pass = fetch, source_state, source, whole_pass
        self._framing = framing
        self.doc: list[int] = []
        self.offset = 0
        self.doc_state: dict | None = None  # source state before `doc` was fetched
        self._seen = self._textless = self._empty_run = 0

    def take(self, n: int) -> list[int]:
        """Up to n tokens of the current document (fetching the next one when it is used up)."""
        while self.offset >= len(self.doc):
            self.doc_state = self._source_state()
            self.doc, self.offset = self._fetch(), 0
            self._count(self.doc)
            self._empty_run = 0 if len(self.doc) > 1 else self._empty_run + 1
            if self._whole_pass and self._empty_run >= self._whole_pass:
                raise no_tokens(self._source or "the training data")
        piece = self.doc[self.offset:self.offset + n]
        self.offset += len(piece)
        return piece

    def _count(self, doc: list[int]) -> None:
        if self._seen >= EMPTY_CHECK_DOCUMENTS:
            return
        self._seen += 1
        self._textless += len(doc) <= self._framing
        if self._seen == EMPTY_CHECK_DOCUMENTS and self._textless >= EMPTY_SHARE * self._seen:
            log.warning("%s: %d of the first %d documents hold no text (at most a begin and an end token); "
                        "the model learns nothing from them: check train_data_columns and the files",
                        self._source or "the data", self._textless, self._seen)

    def get_state(self) -> dict:
        if self.doc_state is None or self.offset >= len(self.doc):  # nothing half-used: start at the next document
            return {"source": self._source_state(), "offset": 0}
        return {"source": self.doc_state, "offset": self.offset}

    def resume(self, offset: int) -> None:
        """After the source was put back to `state["source"]`: re-read that document, skip `offset` tokens."""
        self.doc, self.offset, self.doc_state = [], 0, None
        if offset:
            self.doc_state = self._source_state()
            self.doc, self.offset = self._fetch(), offset


def fill_row(cursor: DocumentCursor, length: int, packing: bool) -> dict[str, np.ndarray] | None:
    """One row of `length` tokens, or None when the source has ended before any token was placed."""
    tokens = np.zeros(length, np.int32)
    segments = np.zeros(length, np.int32)
    positions = np.zeros(length, np.int32)
    filled, segment = 0, 0
    while filled < length:
        try:
            piece = cursor.take(length - filled)
        except StopIteration:
            break
        segment += 1
        end = filled + len(piece)
        tokens[filled:end], segments[filled:end] = piece, segment
        positions[filled:end] = np.arange(len(piece))
        filled = end
        if not packing:
            break
    if filled == 0:
        return None
    return {"tokens": tokens, "segment_ids": segments, "positions": positions}


def stack_rows(rows: list[dict[str, np.ndarray]], batch: int, length: int) -> dict[str, np.ndarray]:
    """Rows into a [batch, length] batch; missing rows (end of an eval set) are all padding."""
    out = {k: np.zeros((batch, length), np.int32) for k in ("tokens", "segment_ids", "positions")}
    for i, row in enumerate(rows):
        for k in out:
            out[k][i] = row[k]
    return out


def next_batch(cursor: DocumentCursor, rows: int, length: int, packing: bool) -> dict[str, np.ndarray]:
    """The next [rows, length] batch; StopIteration when the source ended before the first row."""
    filled = []
    while len(filled) < rows:
        row = fill_row(cursor, length, packing)
        if row is None:
            break
        filled.append(row)
    if not filled:
        raise StopIteration
    return stack_rows(filled, rows, length)
