"""Synthetic data: deterministic per step, learnable structure, reuse_example_batch."""

import numpy as np

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
