"""Unusual training data for the hf and grain pipelines: no tokens at all, less than a batch,
columns that are not text, records that are not JSON or not UTF-8, eval files never read."""

import contextlib
import json
import logging
import re
import signal

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from array_record.python.array_record_module import ArrayRecordWriter

from conftest import tiny_config
from tessera.config import ConfigError
from tessera.data import DataError, make_input, restore_state
from tessera.data.tokenizers import load_tokenizer
from test_data_hf import hf_config, make_docs, sp_model, take, write_corpus  # noqa: F401 - sp_model is a fixture


@contextlib.contextmanager
def within(seconds):
    """Fail instead of hanging when the block runs longer than `seconds`."""
    def stop(*_):
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return "json", str(path)


def write_array_record(path, records: list[bytes]):
    writer = ArrayRecordWriter(str(path), "group_size:1")
    for r in records:
        writer.write(r)
    writer.close()
    return str(path)


def grain_data(files, tok, **overrides):
    cfg = tiny_config(dataset_type="grain", grain_train_files=files, tokenizer_path=tok, **overrides)
    return make_input(cfg.data, 96, 4)


def row_tokens(batch):
    return [t for tokens, segments in zip(batch["tokens"], batch["segment_ids"]) for t in tokens[segments > 0]]


# ---------------------------------------------------------------- no tokens at all, or fewer than a batch


def test_data_whose_documents_are_all_empty_stops_with_one_message(tmp_path, sp_model):
    no_ends = dict(add_bos=False, add_eos=False)
    hf = make_input(hf_config(write_jsonl(tmp_path / "e.jsonl", [{"text": ""}] * 3), sp_model, **no_ends).data, 96, 4)
    grain = grain_data(write_array_record(tmp_path / "e.array_record", [b""] * 3), sp_model, **no_ends)
    for data, named in ((hf, "hf_train_files="), (grain, "grain_train_files=")):
        with within(20), pytest.raises(DataError, match=f"{named}.*: a whole pass over the training data holds no "
                                                        "tokens .*check that train_data_columns names the column"):
            next(data)


def test_data_whose_documents_are_single_tokens_stops_too(tmp_path, sp_model):
    """Empty text with add_bos alone (or one token id per record): every document is one token, with
    no next token to predict; training ran at loss 0.0000 on nothing, exit code 0."""
    bos_only = dict(add_bos=True, add_eos=False)
    hf = make_input(hf_config(write_jsonl(tmp_path / "e.jsonl", [{"text": ""}] * 3), sp_model, **bos_only).data, 96, 4)
    grain = grain_data(write_array_record(tmp_path / "e.array_record", [b""] * 3), sp_model, **bos_only)
    ids = make_input(hf_config(write_jsonl(tmp_path / "i.jsonl", [{"ids": [5]}, {"ids": [7]}]), None,
                               train_data_columns="ids").data, 96, 4)
    for data, named in ((hf, "hf_train_files="), (grain, "grain_train_files="), (ids, "hf_train_files=")):
        with within(20), pytest.raises(DataError, match=f"{named}.*: a whole pass over the training data holds no "
                                                        "tokens to predict .*a single token"):
            next(data)
    # one document of two tokens among them is enough
    mixed = make_input(hf_config(write_jsonl(tmp_path / "m.jsonl", [{"ids": [5]}, {"ids": [7, 8]}]), None,
                                 train_data_columns="ids").data, 96, 4)
    assert row_tokens(next(mixed))[:6] == [5, 7, 8, 5, 7, 8]


def test_data_smaller_than_a_batch_is_said_once_not_per_epoch(tmp_path, sp_model, caplog):
    tiny = write_jsonl(tmp_path / "one.jsonl", [{"text": "hi"}])
    with caplog.at_level(logging.INFO, logger="tessera"):
        take(make_input(hf_config(tiny, sp_model).data, 96, 4), 3)
    lines = [r.getMessage() for r in caplog.records if "epoch" in r.getMessage() or "one batch" in r.getMessage()]
    tokens = len(load_tokenizer(sp_model).encode("hi")) + 2
    assert lines == [f"hf training data: one pass over hf_train_files={tiny[1]!r} fills {tokens} tokens, less than "
                     "one batch of 4 x 13 = 52 tokens; the data is repeated within each batch (no line per epoch "
                     "from here on)"]
    # data larger than a batch keeps its line per epoch
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tessera"):
        data = make_input(hf_config(write_corpus(tmp_path / "c", make_docs(6, seed=3), "json"), sp_model).data, 96, 4)
        take(data, 12)
    epochs = [r.getMessage() for r in caplog.records if "epoch" in r.getMessage()]
    assert data.epoch >= 2 and epochs == [f"hf training data: epoch {e} finished, starting again from the first file"
                                          for e in range(1, data.epoch + 1)]


# ---------------------------------------------------------------- columns that are not text


def test_a_token_id_column_is_used_as_it_is_even_with_a_tokenizer(tmp_path, sp_model):
    ids = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17]]
    pq.write_table(pa.table({"ids": ids}), tmp_path / "ids.parquet")
    hf = make_input(hf_config(("parquet", str(tmp_path / "ids.parquet")), sp_model,
                              train_data_columns="ids").data, 96, 4)
    grain = grain_data(str(tmp_path / "ids.parquet"), sp_model, grain_file_type="parquet", train_data_columns="ids",
                       data_shuffle_seed=0)
    assert row_tokens(next(hf))[:13] == (ids[0] + ids[1])[:13]
    assert set(row_tokens(next(grain))) <= set(ids[0] + ids[1])


def test_null_text_is_an_empty_document(tmp_path, sp_model):
    data = make_input(hf_config(write_jsonl(tmp_path / "n.jsonl", [{"text": None}, {"text": "the cat"}]), sp_model,
                                packing=False).data, 96, 4)
    tok = load_tokenizer(sp_model)
    assert row_tokens(next(data))[:2 + len(tok.encode("the cat")) + 2] == [1, 2, 1, *tok.encode("the cat"), 2]


@pytest.mark.parametrize("value,kind", [(0, "a value of type int ('0')"), (["a", "b"], "a list of str (e.g. 'a')"),
                                        ([1.5, 2.0], "a list of float (e.g. '1.5')")])
def test_a_column_neither_text_nor_token_ids_is_refused(tmp_path, sp_model, value, kind):
    fmt, path = write_jsonl(tmp_path / "x.jsonl", [{"text": "the cat", "other": value}])
    with within(20), pytest.raises(DataError) as e:  # the first record: found at start-up, before any compile
        make_input(hf_config((fmt, path), sp_model, train_data_columns="other").data, 96, 4)
    assert str(e.value) == (f"hf_train_files={path!r}: column 'other' holds {kind}, neither text nor a list of "
                            "token ids; set train_data_columns to text columns or to columns of token-id lists")
    (tmp_path / "g").mkdir()
    records = write_array_record(tmp_path / "g" / "x.array_record", [b"the cat", json.dumps({"text": value}).encode()])
    with within(20), pytest.raises(DataError, match=r"grain_train_files: file '.*x\.array_record', record 1 "
                                                    r"\(counting from 0\): column 'text' holds " + re.escape(kind)):
        next(grain_data(records, sp_model))


def test_the_first_record_is_checked_at_start_up_even_with_a_tokenizer(tmp_path, sp_model):
    """With tokenizer_path set, grain and tfds read their first record only for the first batch: a
    column that does not exist (or a bad value in it) stopped the run after the step had compiled,
    where the docs promise "before anything is compiled"."""
    missing = write_array_record(tmp_path / "body.array_record", [json.dumps({"body": "the cat"}).encode()] * 3)
    with pytest.raises(DataError, match=r"column\(s\) \['text'\] not in the record \(keys: \['body'\]\)"):
        grain_data(missing, sp_model)
    (tmp_path / "big").mkdir()
    big = write_array_record(tmp_path / "big" / "big.array_record", [json.dumps({"text": [1, 96]}).encode()] * 3)
    with pytest.raises(DataError, match=r"hold token id 96, outside 0\.\.95"):
        grain_data(big, sp_model)
    ids = str(tmp_path / "ids.parquet")
    pq.write_table(pa.table({"text": [[1, 2]] * 3}), ids)
    cfg = tiny_config(dataset_type="grain", grain_file_type="parquet", grain_train_files=ids, tokenizer_path=sp_model)
    with pytest.raises(DataError, match=r"file '.*ids\.parquet', row 0 \(counting from 0\): column\(s\) \['text'\] "
                                        r"hold token id 2, outside 0\.\.1"):
        make_input(cfg.data, 2, 4)


def test_no_train_data_columns_is_refused_for_every_file_pipeline(tmp_path, sp_model):
    """train_data_columns=[] made every hf document empty (a warning after 100 of them, then training on
    begin/end tokens alone) and failed grain as "cannot be read as ArrayRecord (list index out of range)"."""
    fmt, path = write_jsonl(tmp_path / "x.jsonl", [{"text": "the cat"}] * 3)
    records = write_array_record(tmp_path / "x.array_record", [b"the cat"] * 3)
    for cfg in (hf_config((fmt, path), sp_model, train_data_columns=[]),
                tiny_config(dataset_type="grain", grain_train_files=records, tokenizer_path=sp_model,
                            train_data_columns=[])):
        with pytest.raises(ConfigError) as e:
            make_input(cfg.data, 96, 4)
        assert str(e.value) == (f"train_data_columns=[] names no column for dataset_type={cfg.data.dataset_type}; "
                                "set it to the records' text or token-id column(s), e.g. train_data_columns=[text]")


def test_a_column_named_twice_in_train_data_columns_is_refused(tmp_path, sp_model):
    """train_data_columns=[text, text] joined each document's text with itself, without a word."""
    fmt, path = write_jsonl(tmp_path / "x.jsonl", [{"text": "the cat", "title": "a"}] * 3)
    with pytest.raises(ConfigError) as e:
        make_input(hf_config((fmt, path), sp_model, train_data_columns=["text", "title", "text"]).data, 96, 4)
    assert str(e.value) == ("train_data_columns=['text', 'title', 'text'] names ['text'] more than once, which would "
                            "put that column's text in every document again; name each column once, e.g. "
                            "train_data_columns=['text', 'title']")


def test_grain_token_id_records_need_no_tokenizer_as_with_hf(tmp_path):
    """dataset_type=grain asked for tokenizer_path even when every record held token ids (the
    message said "unless the text columns are already token ids"); hf read them without one."""
    ids = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17]]
    files = write_array_record(tmp_path / "ids.array_record", [json.dumps({"text": i}).encode() for i in ids])
    data = grain_data(files, "", packing=False, max_target_length=6)
    assert sorted(row_tokens(next(data))) == sorted((ids[0] + ids[1]) * 2)  # 4 rows: each document twice
    # a text record after token-id ones, with no tokenizer: that record is named
    mixed = write_array_record(tmp_path / "mixed.array_record", [json.dumps({"text": ids[0]}).encode(), b"the cat"])
    with within(20), pytest.raises(DataError, match=r"file '.*mixed\.array_record', record 1 \(counting from 0\): "
                                                    r"column\(s\) \['text'\] hold text, and no tokenizer_path is set"):
        for _ in range(4):
            next(grain_data(mixed, "", data_shuffle_seed=0))
    # text first and no tokenizer: refused before training, as for hf
    with pytest.raises(ConfigError, match="reading text needs tokenizer_path"):
        grain_data(write_array_record(tmp_path / "text.array_record", [b"the cat"]), "")


def test_grain_training_refuses_fewer_records_than_processes(tmp_path, monkeypatch):
    """A process whose share of the records was empty raised StopIteration out of the training loop;
    every process can count the records, so every one stops with the same data error."""
    files = write_array_record(tmp_path / "one.array_record", [json.dumps({"text": [1, 2, 3]}).encode()])
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    for rank in (0, 1):
        monkeypatch.setattr(jax, "process_index", lambda r=rank: r)
        with pytest.raises(DataError) as e:
            grain_data(files, "")
        assert str(e.value) == (f"grain_train_files={files!r}, train_data_columns=['text']: 1 record(s) for 2 "
                                "processes, each of which trains on its own records: add records (or split the "
                                "documents into more records)")
    # evaluation reads the shares as they are (an empty one pads, see tessera.evaluation)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    eval_cfg = tiny_config(dataset_type="grain", grain_train_files=files, grain_eval_files=files)
    assert list(make_input(eval_cfg.data, 96, 4, split="eval")) == []


def test_each_process_resumes_at_its_own_saved_data_position(tmp_path, monkeypatch, caplog):
    """`restore_state` gives each process its own entry of the saved positions; with another process
    count (other shares), or a checkpoint holding one process's position, every share starts over,
    with a warning. (The two-process resume itself: test_distributed.)"""
    rng = np.random.default_rng(0)
    files = write_array_record(tmp_path / "ids.array_record",
                               [json.dumps({"text": rng.integers(1, 96, n).tolist()}).encode()
                                for n in rng.integers(3, 30, 24)])
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    first, second, saved = {}, {}, []
    for rank in (0, 1):
        monkeypatch.setattr(jax, "process_index", lambda r=rank: r)
        data = grain_data(files, "")
        first[rank] = row_tokens(next(data))
        saved.append(json.loads(json.dumps(data.get_state())))
        second[rank] = row_tokens(next(data))
    assert saved[0] != saved[1]
    for rank in (0, 1):
        monkeypatch.setattr(jax, "process_index", lambda r=rank: r)
        data = grain_data(files, "")
        restore_state(data, {"processes": saved})
        assert row_tokens(next(data)) == second[rank]
    for state, why in (({"processes": saved + [saved[0]]}, "the checkpoint's data positions are those of 3 processes"),
                       (saved[1], "the checkpoint holds the data position of one process")):
        data = grain_data(files, "")
        with caplog.at_level(logging.WARNING, logger="tessera"):
            restore_state(data, state)
        assert why in caplog.text and "reads its share of the files from the start" in caplog.text
        assert row_tokens(next(data)) == first[1]
        caplog.clear()


def test_negative_token_ids_are_refused_like_ids_past_the_vocabulary(tmp_path):
    pq.write_table(pa.table({"text": [[1, 2, 3, 4, -7] * 10] * 20}), tmp_path / "neg.parquet")
    pq.write_table(pa.table({"text": [[1, 2, 3, 4, 96] * 10] * 20}), tmp_path / "big.parquet")
    for name, bad, fix in (("neg", -7, "token ids cannot be negative"), ("big", 96, "raise vocab_size")):
        path = str(tmp_path / f"{name}.parquet")
        with pytest.raises(DataError) as e:  # in the first record: at start-up
            make_input(tiny_config(dataset_type="hf", hf_path="parquet", hf_train_files=path).data, 96, 4)
        assert str(e.value) == (f"hf_train_files={path!r}: column(s) ['text'] hold token id {bad}, outside 0..95 "
                                f"(vocab_size=96); {fix}" + (": re-tokenize the data" if bad < 0 else ""))


# ---------------------------------------------------------------- ArrayRecord records


def test_array_record_text_that_is_not_a_json_object_is_text(tmp_path, sp_model):
    text = "{x: 1} is a dict literal"
    files = write_array_record(tmp_path / "t.array_record", [text.encode()] * 4)
    batch = next(grain_data(files, sp_model, packing=False))
    assert row_tokens(batch)[:12] == [1, *load_tokenizer(sp_model).encode(text), 2][:12]


def test_array_record_bytes_that_are_not_utf8_name_the_file_and_record(tmp_path, sp_model):
    files = write_array_record(tmp_path / "u.array_record", [b"the cat", b"\xff\xfe\x00bad", b"the dog"])
    data = grain_data(files, sp_model, data_shuffle_seed=0)
    with within(20), pytest.raises(DataError, match=r"grain_train_files: file '.*u\.array_record', record 1 "
                                                    r"\(counting from 0\) is not UTF-8 text \(byte 0: invalid start "
                                                    "byte\\); re-create the file, or leave it out of grain_train_files"):
        take(data, 3)



def test_a_damaged_array_record_block_names_the_file_and_record(tmp_path, sp_model):
    """A record whose stored bytes are damaged (the file still opens) raised Riegeli's RuntimeError
    out of the training loop: a traceback hours into a run, where the docs promise one data error."""
    texts = [f"the cat sat on the mat {i} " * 3 for i in range(20)]
    writer = ArrayRecordWriter(str(tmp_path / "d.array_record"), "group_size:1,uncompressed")
    for t in texts:
        writer.write(t.encode())
    writer.close()
    files = str(tmp_path / "d.array_record")
    raw = bytearray((tmp_path / "d.array_record").read_bytes())
    at = raw.index(texts[9].encode())  # the stored bytes of record 9 (records are stored as they are)
    raw[at:at + 10] = b"X" * 10
    (tmp_path / "d.array_record").write_bytes(bytes(raw))
    data = grain_data(files, sp_model)
    with within(30), pytest.raises(DataError) as e:
        take(data, 20)  # an epoch and more
    assert re.fullmatch(r"grain_train_files: file '.*d\.array_record' is damaged: record 9 \(counting from 0\) cannot "
                        r"be read \(RuntimeError: Corrupted Riegeli/records file: .*\)\. Re-create the file, or "
                        r"leave it out of grain_train_files", str(e.value))


# ---------------------------------------------------------------- eval files without evaluation


def test_eval_files_without_eval_interval_are_said_to_be_unread(tmp_path, sp_model, caplog):
    corpus = write_corpus(tmp_path, make_docs(10), "json")
    missing = str(tmp_path / "nope_missing.jsonl")
    with caplog.at_level(logging.WARNING, logger="tessera"):
        make_input(hf_config(corpus, sp_model, hf_eval_files=missing).data, 96, 4)
        make_input(hf_config(corpus, sp_model, hf_eval_files=missing, eval_interval=2).data, 96, 4)
    assert [r.getMessage() for r in caplog.records] == [
        f"hf_eval_files={missing!r}: not read, because eval_interval=0 never evaluates; set eval_interval=N to "
        "evaluate every N steps"]


def test_a_tokenizer_path_that_is_a_url_says_the_tokenizer_is_read_from_a_local_file():
    """tokenizer_path=gs://b/t.model said "does not exist" (pathlib read it as the local gs:/b/t.model), though the
    file may well be in the bucket: the tokenizer is read from a local path only."""
    with pytest.raises(ConfigError) as e:
        load_tokenizer("gs://b/t.model")
    assert str(e.value) == ("tokenizer_path='gs://b/t.model' is a URL: the tokenizer is read from a local file or "
                            "folder; copy it to this machine (gcloud storage cp) and give that path")
