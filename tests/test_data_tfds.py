"""dataset_type=tfds: a TFDS dataset prepared (in ArrayRecord format) on the fly, read without
TensorFlow: every document once per epoch, determinism, resume, processes' shares, the trainer
with evaluation, and clear errors."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
import tensorflow_datasets as tfds

from conftest import tiny_config
from tessera.config import ConfigError
from tessera.data import DataError, make_input
from tessera.data.tokenizers import load_tokenizer
from tessera.train import run
from test_data_hf import make_docs, sp_model  # noqa: F401 - sp_model is a fixture

TRAIN_DOCS, EVAL_DOCS = make_docs(24, seed=11), [f"the cat sat {i} times" for i in range(5)]


class TesseraTestText(tfds.core.GeneratorBasedBuilder):
    """A two-split text dataset, written the way TFDS writes real ones."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
            {"text": tfds.features.Text(), "id": tfds.features.Scalar(np.int64)}))

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(TRAIN_DOCS), "validation": self._generate_examples(EVAL_DOCS)}

    def _generate_examples(self, docs):
        for i, text in enumerate(docs):
            yield i, {"text": text, "id": i}


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("tfds")
    TesseraTestText(data_dir=str(data_dir), file_format="array_record").download_and_prepare()
    return str(data_dir)


def tfds_config(data_dir, tok, **overrides):
    values = dict(dataset_type="tfds", dataset_name="tessera_test_text:1.0.0", dataset_path=data_dir,
                  tokenizer_path=tok)
    return tiny_config(**{**values, **overrides})


def _documents(data, tok):
    """Every document piece of a finite stream, as token tuples (BOS/EOS off, no packing)."""
    out = []
    for batch in data:
        out += [tuple(t[s > 0]) for t, s in zip(batch["tokens"], batch["segment_ids"]) if s.any()]
    return sorted(out)


def test_eval_split_holds_every_document_once_across_processes(tfds_dir, sp_model, monkeypatch):  # noqa: F811
    cfg = tfds_config(tfds_dir, sp_model, add_bos=False, add_eos=False, packing=False, max_target_length=40)
    tok = load_tokenizer(sp_model)
    want = sorted(tuple(tok.encode(d)) for d in EVAL_DOCS)
    assert _documents(make_input(cfg.data, 96, 4, split="eval"), tok) == want
    monkeypatch.setattr(jax, "process_count", lambda: 2)  # 5 records over 2 processes: none dropped
    shares = []
    for rank in (0, 1):
        monkeypatch.setattr(jax, "process_index", lambda r=rank: r)
        shares.append(_documents(make_input(cfg.data, 96, 4, split="eval"), tok))
    assert sorted(shares[0] + shares[1]) == want and len(shares[0]) == 3 and len(shares[1]) == 2


def test_training_stream_is_deterministic_seeded_and_resumes_exactly(tfds_dir, sp_model):  # noqa: F811
    cfg = tfds_config(tfds_dir, sp_model)
    data = make_input(cfg.data, 96, 4)
    states, seen = [], []
    for _ in range(8):  # more than one epoch of the 24 documents
        states.append(json.loads(json.dumps(data.get_state())))
        seen.append(next(data)["tokens"])
    again = make_input(cfg.data, 96, 4)
    np.testing.assert_array_equal(np.stack([next(again)["tokens"] for _ in range(8)]), np.stack(seen))
    other = make_input(tfds_config(tfds_dir, sp_model, data_shuffle_seed=5).data, 96, 4)
    assert not np.array_equal(next(other)["tokens"], seen[0])
    for k in (1, 5):
        resumed = make_input(cfg.data, 96, 4)
        resumed.set_state(states[k])
        for want in seen[k:k + 2]:
            np.testing.assert_array_equal(next(resumed)["tokens"], want)
    assert states[3]["type"] == "tfds"
    grain_state = dict(states[3], type="grain")
    with pytest.raises(ConfigError, match="data state is for dataset_type='grain', not tfds"):
        make_input(cfg.data, 96, 4).set_state(grain_state)


def test_trainer_runs_tfds_with_eval_on_eight_devices(tfds_dir, sp_model, tmp_path):  # noqa: F811
    assert jax.device_count() == 8
    cfg = tfds_config(tfds_dir, sp_model, steps=3, eval_interval=2, eval_steps=-1, base_output_directory=str(tmp_path),
                      run_name="tfds", ici_fsdp_parallelism=4, ici_data_parallelism=2)
    report = run(cfg)
    assert report["steps"] == 3 and np.isfinite(report["final_loss"]) and np.isfinite(report["final_eval_loss"])
    evals = [json.loads(line) for line in (tmp_path / "tfds" / "metrics.jsonl").read_text().splitlines()
             if "eval_loss" in line]
    assert [e["step"] for e in evals] == [2, 3]


def test_bad_tfds_inputs_say_what_to_fix(tfds_dir, sp_model, tmp_path):  # noqa: F811
    cases = [(dict(dataset_name=""), "dataset_type=tfds needs dataset_name"),
             (dict(dataset_name="no_such_text:1.0.0"), r"dataset_name='no_such_text:1.0.0': not found in dataset_path"),
             (dict(dataset_path=str(tmp_path)), r"dataset_name='tessera_test_text:1.0.0': not found in dataset_path"),
             (dict(train_split="test"), r"split 'test'.*Unknown split 'test'")]
    for overrides, message in cases:
        cfg = tfds_config(tfds_dir, sp_model, **overrides)
        with pytest.raises(ConfigError, match=message):
            make_input(cfg.data, 96, 4)
    cfg = tfds_config(tfds_dir, sp_model, eval_dataset_name="missing_eval:1.0.0")
    with pytest.raises(ConfigError, match="eval_dataset_name='missing_eval:1.0.0': not found"):
        make_input(cfg.data, 96, 4, split="eval")


def test_a_cut_short_shard_is_named_not_read_as_empty_documents(tfds_dir, sp_model, tmp_path):  # noqa: F811
    """ArrayRecord reads every record of a shard cut short (an interrupted copy) as b"", which TFDS
    decodes as {"text": None}: the run trained on empty documents with a warning at most."""
    import shutil

    copy = tmp_path / "tfds"
    shutil.copytree(tfds_dir, copy)
    (shard,) = copy.glob("tessera_test_text/1.0.0/*-train.array_record-*")
    shard.write_bytes(shard.read_bytes()[:shard.stat().st_size // 2])
    with pytest.raises(DataError) as e:
        make_input(tfds_config(str(copy), sp_model).data, 96, 4)
    assert str(e.value).startswith(f"dataset_name='tessera_test_text:1.0.0': file {str(shard)!r} is damaged: record ")
    assert str(e.value).endswith("reads as empty bytes, as every record of a shard cut short does (an interrupted "
                                 "copy, a full disk); copy or prepare the dataset again")
    # the intact dataset reads as before
    assert next(make_input(tfds_config(tfds_dir, sp_model).data, 96, 4))["segment_ids"].any()


def test_a_bad_column_names_the_shard_file_and_record(tfds_dir, sp_model):  # noqa: F811
    cfg = tfds_config(tfds_dir, sp_model, train_split="train[5:10]", train_data_columns="id")
    with pytest.raises(DataError) as e:
        make_input(cfg.data, 96, 4)
    (shard,) = Path(tfds_dir).glob("tessera_test_text/1.0.0/*-train.array_record-*")
    assert str(e.value).startswith(f"dataset_name='tessera_test_text:1.0.0': file {str(shard)!r}, record 5 (counting "
                                   "from 0): column 'id' holds a value of type "), str(e.value)
