"""dataset_type=grain: ArrayRecord and Parquet records, determinism, sharding, resume through a checkpoint."""

import json

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from array_record.python.array_record_module import ArrayRecordWriter

from conftest import tiny_config
from tessera.config import ConfigError
from tessera.data import DataError, make_input
from tessera.train import run
from test_data_hf import damage_row_group, make_docs, sp_model  # noqa: F401 - sp_model is a fixture


def write_records(folder, docs, files=2, as_json=False, fmt="arrayrecord"):
    folder.mkdir(parents=True, exist_ok=True)
    for i, idx in enumerate(np.array_split(np.arange(len(docs)), files)):
        texts = [docs[j] for j in idx]
        if fmt == "parquet":
            pq.write_table(pa.table({"text": texts}), folder / f"part{i}.parquet", row_group_size=3)
            continue
        writer = ArrayRecordWriter(str(folder / f"part{i}.array_record"), "group_size:1")
        for t in texts:
            writer.write((json.dumps({"text": t, "id": int(i)}) if as_json else t).encode())
        writer.close()
    return str(folder / ("part*.parquet" if fmt == "parquet" else "part*.array_record"))


def grain_config(files, tok, **overrides):
    return tiny_config(dataset_type="grain", grain_train_files=files, tokenizer_path=tok, **overrides)


def batches(cfg, n, rows=4):
    data = make_input(cfg.data, 96, rows)
    return [next(data)["tokens"] for _ in range(n)]


def test_text_json_and_parquet_records_give_the_same_deterministic_batches(tmp_path, sp_model):  # noqa: F811
    docs = make_docs(30)
    text = batches(grain_config(write_records(tmp_path / "t", docs), sp_model), 3)
    as_json = batches(grain_config(write_records(tmp_path / "j", docs, as_json=True), sp_model), 3)
    parquet = batches(grain_config(write_records(tmp_path / "p", docs, fmt="parquet"), sp_model,
                                   grain_file_type="parquet"), 3)
    np.testing.assert_array_equal(np.stack(text), np.stack(as_json))
    np.testing.assert_array_equal(np.stack(text), np.stack(parquet))
    other_seed = batches(grain_config(write_records(tmp_path / "t", docs), sp_model, data_shuffle_seed=1), 3)
    assert not np.array_equal(np.stack(text), np.stack(other_seed))


def test_resume_from_any_batch_continues_exactly(tmp_path, sp_model):  # noqa: F811
    cfg = grain_config(write_records(tmp_path, make_docs(5, seed=3)), sp_model)
    data = make_input(cfg.data, 96, 4)
    states, seen = [], []
    for _ in range(10):
        states.append(json.loads(json.dumps(data.get_state())))
        seen.append(next(data)["tokens"])
    for k in (0, 4, 8):
        resumed = make_input(cfg.data, 96, 4)
        resumed.set_state(states[k])
        for want in seen[k:k + 2]:
            np.testing.assert_array_equal(next(resumed)["tokens"], want)


def test_a_full_state_load_says_the_data_starts_from_its_first_record(tmp_path, sp_model, caplog):  # noqa: F811
    # load_full_state_path hands the pipeline {"step": n}: hf said it starts from its first document, grain and tfds
    # started from their first record without a word
    cfg = grain_config(write_records(tmp_path, make_docs(5, seed=3)), sp_model)
    first = batches(cfg, 1)[0]
    data = make_input(cfg.data, 96, 4)
    with caplog.at_level("WARNING", logger="tessera"):
        data.set_state({"step": 7})
    assert "grain data starts from its first record (the loaded state holds no grain data position)" in caplog.text
    np.testing.assert_array_equal(next(data)["tokens"], first)


def test_eval_stream_ends_and_processes_split_records(tmp_path, sp_model, monkeypatch):  # noqa: F811
    docs = [f"the cat {i}" for i in range(7)]
    files = write_records(tmp_path, docs, files=3)
    cfg = grain_config("", sp_model, grain_eval_files=files, add_bos=False, add_eos=False, packing=False,
                       max_target_length=30)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    tokens = []
    for rank in (0, 1):
        monkeypatch.setattr(jax, "process_index", lambda r=rank: r)
        for batch in make_input(cfg.data, 96, 8, split="eval"):
            tokens += [tuple(t[s > 0]) for t, s in zip(batch["tokens"], batch["segment_ids"]) if s.any()]
    from tessera.data.tokenizers import load_tokenizer

    tok = load_tokenizer(sp_model)
    assert sorted(tokens) == sorted(tuple(tok.encode(d)) for d in docs)


def test_worker_processes_give_the_same_batches(tmp_path, sp_model):  # noqa: F811
    files = write_records(tmp_path, make_docs(20))
    want = batches(grain_config(files, sp_model), 2)
    got = batches(grain_config(files, sp_model, grain_worker_count=1), 2)
    np.testing.assert_array_equal(np.stack(got), np.stack(want))


def test_evaluations_reading_the_eval_stream_whole_keep_its_workers(tmp_path, sp_model, monkeypatch):  # noqa: F811
    """Each evaluation sets the eval stream back to its start; one that read it to its end (eval_steps=-1, or fewer
    batches than eval_steps) stopped Grain's workers there, so that every evaluation started them again (2 more
    worker processes per evaluation, seconds each). They now start once, give the same batches as reading in this
    process, and stop with stop_workers."""
    import multiprocessing

    import grain._src.python.dataset.transformations.process_prefetch as prefetch

    starts = []
    start_prefetch = prefetch.ProcessPrefetchDatasetIterator.start_prefetch

    def counted(it):
        starts.append(it._prefetch_process is None)
        start_prefetch(it)

    monkeypatch.setattr(prefetch.ProcessPrefetchDatasetIterator, "start_prefetch", counted)
    earlier = set(multiprocessing.active_children())  # an earlier test's streams may still hold theirs
    files = write_records(tmp_path, make_docs(12))
    plain = make_input(grain_config("", sp_model, grain_eval_files=files).data, 96, 4, split="eval")
    want = [b["tokens"] for b in plain]
    data = make_input(grain_config("", sp_model, grain_eval_files=files, grain_worker_count=2).data, 96, 4,
                      split="eval")
    start = data.get_state()
    for _ in range(3):  # as Evaluator.run: back to the start, then every batch
        data.set_state(start)
        np.testing.assert_array_equal(np.stack([b["tokens"] for b in data]), np.stack(want))
    assert sum(starts) == 2  # once per worker
    ours = [p for p in multiprocessing.active_children() if p not in earlier]
    assert len(ours) == 2, ours
    data.stop_workers()
    for p in ours:
        p.join(timeout=30)
    assert not [p for p in ours if p.is_alive()]


def test_a_resume_may_change_grain_worker_count(tmp_path, sp_model):  # noqa: F811
    """The position saved with one grain_worker_count (here past an epoch: 5 records, 10 batches of 4
    rows) continues exactly with another, both ways (it raised a KeyError)."""
    files = write_records(tmp_path, make_docs(5, seed=3))
    plain = make_input(grain_config(files, sp_model).data, 96, 4)
    for _ in range(10):
        next(plain)
    state = json.loads(json.dumps(plain.get_state()))
    after = [next(plain)["tokens"] for _ in range(3)]
    two = make_input(grain_config(files, sp_model, grain_worker_count=2).data, 96, 4)
    two.set_state(state)
    np.testing.assert_array_equal(np.stack([next(two)["tokens"] for _ in range(2)]), np.stack(after[:2]))
    back = make_input(grain_config(files, sp_model).data, 96, 4)
    back.set_state(json.loads(json.dumps(two.get_state())))
    two.stop_workers()
    np.testing.assert_array_equal(next(back)["tokens"], after[2])


def test_bad_grain_inputs(tmp_path, sp_model):  # noqa: F811
    (tmp_path / "bad.array_record").write_bytes(b"not an array record")
    cases = [("", "dataset_type=grain needs grain_train_files"),
             (str(tmp_path / "none*"), r"grain_train_files=.*none\*.* matches no files"),
             (str(tmp_path / "bad.array_record"), "cannot be read as ArrayRecord")]
    for files, message in cases:
        with pytest.raises(ConfigError, match=message):
            make_input(grain_config(files, sp_model).data, 96, 4)


def test_an_array_record_file_cut_short_is_named_among_the_files(tmp_path, sp_model):  # noqa: F811
    """Opening the files together failed naming none of them, and a file cut short said only "()"."""
    files = write_records(tmp_path, make_docs(30), files=3)
    cut = tmp_path / "part1.array_record"
    cut.write_bytes(cut.read_bytes()[:cut.stat().st_size // 2])
    with pytest.raises(ConfigError) as e:
        make_input(grain_config(files, sp_model).data, 96, 4)
    assert str(e.value) == (f"grain_train_files: file {str(cut)!r} cannot be read as ArrayRecord (RuntimeError: its "
                            "footer cannot be read: the file is cut short, or not ArrayRecord); re-create it, leave it "
                            "out of grain_train_files, or set grain_file_type=parquet for Parquet files")


def test_damaged_or_empty_parquet_is_named(tmp_path, sp_model):  # noqa: F811
    files = write_records(tmp_path, make_docs(30), fmt="parquet")  # row groups of 3 documents
    damage_row_group(tmp_path / "part1.parquet", 2)
    data = make_input(grain_config(files, sp_model, grain_file_type="parquet", data_shuffle_seed=0).data, 96, 4)
    with pytest.raises(DataError, match=r"grain_train_files: file .*part1\.parquet' is damaged: row group 2 "
                                        r"\(counting from 0\) cannot be read .*leave it out of grain_train_files"):
        for _ in range(100):  # the damaged row group comes up within the first epoch
            next(data)
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    with pytest.raises(DataError, match=r"grain_train_files: file .*empty\.parquet' holds no records"):
        make_input(grain_config(str(tmp_path / "empty.parquet"), sp_model, grain_file_type="parquet").data, 96, 4)


def test_large_parquet_row_groups_are_said_to_slow_shuffled_reading(tmp_path, sp_model, caplog,  # noqa: F811
                                                                     monkeypatch):
    """Records are read in a shuffled order, a whole row group for each: a Parquet file written with
    pyarrow's default row groups (a million rows) costs a row group's read per document (165 ms for
    one of 100,000 documents), silently."""
    import logging

    from tessera.data import grain_sources

    docs = make_docs(30)
    pq.write_table(pa.table({"text": docs}), tmp_path / "one_group.parquet")  # one row group of 30 documents
    size = pq.ParquetFile(tmp_path / "one_group.parquet").metadata.row_group(0).total_byte_size
    files = write_records(tmp_path / "small", docs, fmt="parquet")  # row groups of 3 documents
    small = max(pq.ParquetFile(f).metadata.row_group(i).total_byte_size for f in (tmp_path / "small").glob("*")
                for i in range(pq.ParquetFile(f).num_row_groups))
    assert small < size
    monkeypatch.setattr(grain_sources, "LARGE_ROW_GROUP_BYTES", small)  # the limit between the two files' groups
    large = str(tmp_path / "one_group.parquet")
    with caplog.at_level(logging.WARNING, "tessera"):
        make_input(grain_config(files, sp_model, grain_file_type="parquet").data, 96, 4)
        assert not caplog.records
        eval_only = grain_config(files, sp_model, grain_file_type="parquet", grain_eval_files=large, eval_interval=1)
        make_input(eval_only.data, 96, 4, split="eval")  # read in file order: a row group at a time
        assert not caplog.records
        make_input(grain_config(large, sp_model, grain_file_type="parquet").data, 96, 4)
    assert [r.getMessage() for r in caplog.records] == [
        f"grain_train_files: row groups of up to {size / 2**20:.0f} MiB (30 rows, in {large!r}): the training "
        "records are read in a shuffled order, a whole row group for each, so every document costs reading one; "
        "write the files with row groups of about 1 MiB (pyarrow: row_group_size), or convert them to ArrayRecord"]


def test_trainer_checkpoint_resumes_grain_at_the_next_unseen_batch(tmp_path, sp_model):  # noqa: F811
    files = write_records(tmp_path / "data", make_docs(30, seed=5), files=3)
    cfg = grain_config(files, sp_model, steps=2, base_output_directory=str(tmp_path), run_name="test",
                       enable_checkpointing=True, async_checkpointing=False)
    report = run(cfg)
    assert report["steps"] == 2 and np.isfinite(report["final_loss"])
    saved = json.loads(next((tmp_path / "test" / "checkpoints" / "2" / "data").glob("metadata")).read_text())
    uninterrupted = make_input(cfg.data, 96, 8)
    expected = [next(uninterrupted)["tokens"] for _ in range(4)][2:]
    resumed = make_input(cfg.data, 96, 8)
    resumed.set_state(saved)
    for want in expected:
        np.testing.assert_array_equal(next(resumed)["tokens"], want)


def test_processes_holding_the_same_rows_read_the_same_records(tmp_path, sp_model, monkeypatch):  # noqa: F811
    """Two processes whose devices hold every row of the batch (sequence ways across them) each took every
    other record and half of the rows, and the first step failed (make_array_from_process_local_data). Both
    now read all the records, every row, as one process does; split over the processes, each its half."""
    from test_data_hf import _Sharding

    cfg = grain_config(write_records(tmp_path, make_docs(12)), sp_model)
    single = batches(cfg, 2, rows=8)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    for rank in (0, 1):
        monkeypatch.setattr(jax, "process_index", lambda r=rank: r)
        data = make_input(cfg.data, 96, 8, sharding=_Sharding([None] * 4))
        assert data.rows == 8 and data.seen["records"] == 12
        np.testing.assert_array_equal(np.stack([next(data)["tokens"] for _ in range(2)]), np.stack(single))
        assert make_input(cfg.data, 96, 8, sharding=_Sharding([(0, 2), (2, 4), (4, 6), (6, 8)])).rows == 4
