"""Synthetic data: deterministic per step, learnable structure, reuse_example_batch (every pipeline)."""

import json
from dataclasses import replace

import numpy as np
import pytest

from conftest import tiny_config
from tessera.data import make_input
from tessera.data.synthetic import BRANCHING


def test_batches_are_a_pure_function_of_seed_and_step():
    cfg = tiny_config().data
    a, b = make_input(cfg, 96, 4), make_input(cfg, 96, 4)
    first, second = next(a), next(a)
    np.testing.assert_array_equal(first["tokens"], next(b)["tokens"])
    assert not np.array_equal(first["tokens"], second["tokens"])
    assert first["tokens"].shape == (4, cfg.max_target_length + 1) and first["tokens"].max() < 96


def test_every_transition_follows_the_successor_graph():
    data = make_input(tiny_config().data, 96, 4)
    tokens = next(data)["tokens"]
    for row in tokens:
        for prev, nxt in zip(row[:-1], row[1:]):
            assert nxt in data.successors[prev]
    assert data.successors.shape == (96, BRANCHING)


def test_reuse_example_batch_repeats_the_first_batch():
    data = make_input(tiny_config(reuse_example_batch=True).data, 96, 4)
    np.testing.assert_array_equal(next(data)["tokens"], next(data)["tokens"])


def test_synthetic_data_refuses_a_vocabulary_its_graph_cannot_hold():
    """vocab_size=2**31 (allowed: token ids fit int32) ended in numpy's MemoryError traceback building the
    32 GiB successor table, before the memory checks of the model could say anything."""
    from tessera.data import DataError

    with pytest.raises(DataError) as e:
        make_input(tiny_config().data, 2**31, 4)
    assert str(e.value) == ("dataset_type=synthetic with vocab_size=2,147,483,648: its graph holds 4 successors per "
                            "token, 32 GiB of host memory; synthetic data takes vocab_size up to 67,108,864 (1 GiB). "
                            "Lower vocab_size, or train on a dataset (dataset_type, Data.md)")


def test_reuse_example_batch_leaves_the_synthetic_eval_batches_as_they_are():
    """reuse_example_batch repeats the first training batch, as with file data, whose eval stream it
    leaves alone: the synthetic eval stream repeated its first batch too, so eval_steps=4 scored one
    batch four times (and a loss other than the run without the key)."""
    cfg = tiny_config(reuse_example_batch=True, eval_interval=1, eval_steps=4).data
    plain = make_input(replace(cfg, reuse_example_batch=False), 96, 4, split="eval")
    reused = make_input(cfg, 96, 4, split="eval")
    for _ in range(3):
        np.testing.assert_array_equal(next(reused)["tokens"], next(plain)["tokens"])


def test_synthetic_data_refuses_the_position_of_file_data():
    """A run on file data resumed with dataset_type=synthetic stopped with a KeyError traceback;
    now with the config error the file pipelines give the other way round. A full-state load's
    {"step": n} still places the stream."""
    from tessera.config import ConfigError

    data = make_input(tiny_config().data, 96, 4)
    with pytest.raises(ConfigError, match="data state is for dataset_type='hf', not synthetic; resume with the "
                                          "dataset_type the run started with"):
        data.set_state({"type": "hf", "source": {"epoch": 0, "stream": None}, "offset": 0})
    data.set_state({"step": 5})
    assert data.get_state() == {"type": "synthetic", "step": 5}


@pytest.mark.parametrize("dataset_type", ["hf", "grain"])
def test_reuse_example_batch_repeats_the_first_batch_of_file_data_too(tmp_path, dataset_type):
    """reuse_example_batch=true was read by the synthetic stream alone: with data files it did
    nothing, and a speed test meant to leave the input pipeline out measured it."""
    if dataset_type == "hf":
        path = tmp_path / "ids.jsonl"
        path.write_text("".join(json.dumps({"text": list(range(i, i + 20))}) + "\n" for i in range(30)))
        files = dict(hf_path="json", hf_train_files=str(path))
    else:
        from array_record.python.array_record_module import ArrayRecordWriter

        writer = ArrayRecordWriter(str(tmp_path / "ids.array_record"), "group_size:1")
        for i in range(30):
            writer.write(json.dumps({"text": list(range(i, i + 20))}).encode())
        writer.close()
        files = dict(grain_train_files=str(tmp_path / "ids.array_record"))
    cfg = tiny_config(dataset_type=dataset_type, **files).data
    moving, first = make_input(cfg, 96, 4), make_input(replace(cfg, reuse_example_batch=True), 96, 4)
    batches = [next(first)["tokens"] for _ in range(3)]
    expected = next(moving)["tokens"]
    assert not np.array_equal(expected, next(moving)["tokens"])  # without the key the batches move on
    for batch in batches:
        np.testing.assert_array_equal(batch, expected)
    # a resumed run feeds that first batch too
    resumed = make_input(replace(cfg, reuse_example_batch=True), 96, 4)
    resumed.set_state(first.get_state())
    np.testing.assert_array_equal(next(resumed)["tokens"], expected)
