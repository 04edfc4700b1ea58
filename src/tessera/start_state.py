"""Where a run's train state comes from at its start: this run's newest checkpoint (a resume),
else `load_full_state_path`, else `load_parameters_path` (a fresh optimizer state around them),
else fresh weights from `init_weights_seed`. `tessera.train` asks `state_source` first (to size
the read before it happens, `memory_fit.check_state_fits`), then `initial_state`."""

from __future__ import annotations

import logging

import jax

from tessera.checkpointing import Checkpointer, load_full_state, load_parameters
from tessera.config import CheckpointConfig, ConfigError
from tessera.step import Trainer, abstract_state, create_state, state_from_params

log = logging.getLogger("tessera")


def state_source(ckpt: Checkpointer | None, cfg: CheckpointConfig) -> str:
    """What `initial_state` reads from a checkpoint: "state" (resume, load_full_state_path),
    "params" (load_parameters_path) or "" (nothing: a fresh init)."""
    if (ckpt and ckpt.latest_step() is not None) or cfg.load_full_state_path:
        return "state"
    return "params" if cfg.load_parameters_path else ""


def initial_state(trainer: Trainer, ckpt: Checkpointer | None, data, cfg: CheckpointConfig, seed: int,
                  program=None) -> dict:
    """Resume from this run's newest checkpoint, else load_full_state_path, load_parameters_path or
    init from `seed` (init_weights_seed), with `program` (`step.init_program`) when given."""
    latest = ckpt.latest_step() if ckpt else None
    if latest is not None:
        state, data_state = ckpt.restore(latest, abstract_state(trainer))
        if data_state:
            data.set_state(data_state)
        log.info("resuming from step %d: %s", latest, ckpt.step_path(latest))
        return state
    if cfg.load_full_state_path:
        state = load_full_state(cfg.load_full_state_path, abstract_state(trainer), key="load_full_state_path",
                                verify=cfg.checkpoint_checksums)
        step = int(jax.device_get(state["step"]))
        data.set_state({"step": step})
        log.info("loaded full state at step %d from %s", step, cfg.load_full_state_path)
        return state
    if cfg.load_parameters_path:
        if cfg.checkpoint_is_quantized:
            raise ConfigError("checkpoint_is_quantized=true is for decode.py (quantized weights are dequantized for "
                              "decoding); train from the float checkpoint the quantized one was written from")
        params = load_parameters(cfg.load_parameters_path, abstract_state(trainer)["params"],
                                 key="load_parameters_path", verify=cfg.checkpoint_checksums)
        log.info("loaded parameters from %s (fresh optimizer state, step 0)", cfg.load_parameters_path)
        return state_from_params(trainer, params)
    return create_state(trainer, seed, program)
