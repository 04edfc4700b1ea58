"""Synthetic token streams that a model can learn, so a run shows its loss falling.

Every sequence is a walk on a fixed random graph over the vocabulary: each token has
`BRANCHING` possible successors, chosen uniformly. A model that learns the graph reaches a
loss of ln(BRANCHING) (about 1.39 nats) from ln(vocab_size) at the start. The walk for step s
is a pure function of (data_shuffle_seed, s), so any step's batch can be regenerated
(resume) and every host computes the same global batch.
"""

from __future__ import annotations

import numpy as np

from tessera.config import ConfigError, DataConfig
from tessera.data.errors import DataError

BRANCHING = 4
MAX_VOCAB = 2**26  # the successor table then takes 1 GiB of host memory (vocab_size x BRANCHING int32)


class SyntheticData:
    def __init__(self, cfg: DataConfig, vocab_size: int, global_batch: int, split: str = "train"):
        self.cfg, self.vocab_size, self.global_batch = cfg, vocab_size, global_batch
        self.stream = 1 if split == "train" else 2  # eval walks are drawn apart from training walks
        if vocab_size > MAX_VOCAB:  # numpy's MemoryError traceback, or the host's memory taken by the table
            raise DataError(f"dataset_type=synthetic with vocab_size={vocab_size:,}: its graph holds {BRANCHING} "
                            f"successors per token, {vocab_size * BRANCHING * 4 / 2**30:,.0f} GiB of host memory; "
                            f"synthetic data takes vocab_size up to {MAX_VOCAB:,} (1 GiB). Lower vocab_size, or "
                            "train on a dataset (dataset_type, Data.md)")
        # reuse_example_batch repeats the first training batch; an evaluation still reads its eval_steps batches
        self.reuse = cfg.reuse_example_batch and split == "train"
        graph_rng = np.random.default_rng([cfg.data_shuffle_seed, 0])
        self.successors = graph_rng.integers(0, vocab_size, size=(vocab_size, BRANCHING), dtype=np.int32)
        self.step = 0  # batches handed out so far: the whole iterator state

    def batch_for_step(self, step: int) -> dict[str, np.ndarray]:
        length = self.cfg.max_target_length + 1
        rng = np.random.default_rng([self.cfg.data_shuffle_seed, self.stream, step])
        choices = rng.integers(0, BRANCHING, size=(self.global_batch, length), dtype=np.int32)
        tokens = np.empty((self.global_batch, length), np.int32)
        tokens[:, 0] = rng.integers(0, self.vocab_size, size=self.global_batch)
        for t in range(1, length):
            tokens[:, t] = self.successors[tokens[:, t - 1], choices[:, t]]
        return {
            "tokens": tokens,
            "segment_ids": np.ones_like(tokens),
            "positions": np.broadcast_to(np.arange(length, dtype=np.int32), tokens.shape).copy(),
        }

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = self.batch_for_step(0 if self.reuse else self.step)
        self.step += 1
        return batch

    def get_state(self) -> dict:
        """The position in the stream, saved in checkpoints (JSON)."""
        return {"type": "synthetic", "step": self.step}

    def set_state(self, state: dict) -> None:
        if state.get("type", "synthetic") != "synthetic":  # {"step": n} alone: a full-state load
            raise ConfigError(f"the checkpoint's data state is for dataset_type={state['type']!r}, not synthetic; "
                              "resume with the dataset_type the run started with")
        self.step = int(state["step"])
