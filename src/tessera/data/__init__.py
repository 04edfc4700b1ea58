"""Input pipelines. `make_input(cfg, vocab_size, global_batch)` returns an iterator of host
batches: dicts of numpy arrays of the *global* batch shape with keys
`tokens` [B, T+1] (inputs and shifted targets come from it), `segment_ids` [B, T+1]
(0 marks padding) and `positions` [B, T+1]. Each iterator has `get_state()` (JSON-able, saved
in checkpoints) and `set_state(state)`, so a resumed run continues with the next unseen batch."""

from __future__ import annotations

from tessera.config import ConfigError, DataConfig
from tessera.data.synthetic import SyntheticData

__all__ = ["SyntheticData", "make_input"]


def make_input(cfg: DataConfig, vocab_size: int, global_batch: int):
    if cfg.dataset_type == "synthetic":
        return SyntheticData(cfg, vocab_size, global_batch)
    raise ConfigError(f"dataset_type={cfg.dataset_type!r} is not available; use synthetic")
