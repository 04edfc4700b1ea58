"""Where a run's train state comes from at its start: this run's newest checkpoint (a resume),
else `load_full_state_path`, else `load_parameters_path` (a fresh optimizer state around them),
else fresh weights from `init_weights_seed`. `tessera.train` asks `state_source` first (to size
the read before it happens, `memory_fit.check_state_fits`), then `initial_state`.

A resume compares the config saved with the checkpoint with this one: it names the settings that
changed, and warns when that moves the training data under the saved data position, the
learning rate of the next step or the global batch (another device count), or changes a model key
the saved parameters fit but were not trained with. A checkpoint that does not fit the model names the model keys its
saved config differs in (`checkpointing.mismatch_explained`)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from typing import Any, Mapping

import jax
import optax

from tessera.checkpointing import (Checkpointer, load_full_state, load_parameters, mismatch_explained,
                                   quantized_explained, saved_config, warn_model_changes)
from tessera.checkpointing.storage import CONFIG_FILE
from tessera.config import CheckpointConfig, Config, ConfigError, ModelConfig, OptimConfig, flat_dict
from tessera.data import restore_state
from tessera.optim import learning_rate_schedule, schedule_step
from tessera.step import Trainer, abstract_state, create_state, state_from_params

log = logging.getLogger("tessera")


def state_source(ckpt: Checkpointer | None, cfg: CheckpointConfig) -> str:
    """What `initial_state` reads from a checkpoint: "state" (resume, load_full_state_path),
    "params" (load_parameters_path) or "" (nothing: a fresh init). ConfigError when a start without
    a checkpoint of its own is given both load paths."""
    if ckpt and ckpt.latest_step() is not None:
        return "state"  # a load path is not read (named at the resume)
    if cfg.load_full_state_path and cfg.load_parameters_path:  # the full state would win without a word
        raise ConfigError(f"load_parameters_path={cfg.load_parameters_path} and load_full_state_path="
                          f"{cfg.load_full_state_path} are both set, but a run starts from one of them; keep "
                          "load_full_state_path to continue that state (parameters, optimizer state and step), or "
                          "load_parameters_path for its parameters with a fresh optimizer state at step 0")
    if cfg.load_full_state_path:
        return "state"
    return "params" if cfg.load_parameters_path else ""


def initial_state(trainer: Trainer, ckpt: Checkpointer | None, data, config: Config, program=None) -> dict:
    """Resume from this run's newest checkpoint, else load_full_state_path, load_parameters_path or
    init from init_weights_seed, with `program` (`step.init_program`) when given."""
    cfg = config.checkpoint
    latest = ckpt.latest_step() if ckpt else None
    model_keys = {f.name: getattr(config.model, f.name) for f in dataclasses.fields(ModelConfig)}
    if latest is not None:
        folder = str(ckpt.step_path(latest))
        with mismatch_explained(folder, model_keys, config.optim.opt_type, config.optim.trainable_parameters_mask):
            state, data_state = ckpt.restore(latest, abstract_state(trainer))
        if data_state:
            restore_state(data, data_state)
        log.info("resuming from step %d: %s", latest, folder)
        saved = saved_config(folder)
        if saved:
            log_changes_since_save(saved, config, trainer.schedule, latest, folder, applied_updates(state))
            _warn_global_batch_change(saved, config, trainer.plan.global_batch, trainer.plan.num_devices, latest)
        else:  # its config item deleted or damaged (with checkpoint_checksums=false; else the checksums refuse it)
            log.warning("checkpoint %s keeps no readable config (config/%s): the settings step %d was saved with are "
                        "not compared with this run's (a changed learning-rate schedule, training data or global "
                        "batch is not named)", folder, CONFIG_FILE, latest)
        warn_model_changes(folder, model_keys)  # e.g. another rope base: the shapes fit, the model is another
        return state
    if cfg.load_full_state_path:
        with mismatch_explained(cfg.load_full_state_path, model_keys, config.optim.opt_type,
                                config.optim.trainable_parameters_mask):
            state = load_full_state(cfg.load_full_state_path, abstract_state(trainer), key="load_full_state_path",
                                    verify=cfg.checkpoint_checksums)
        step = int(jax.device_get(state["step"]))
        data.set_state({"step": step})
        log.info("loaded full state at step %d from %s", step, cfg.load_full_state_path)
        saved = saved_config(cfg.load_full_state_path)
        if saved:
            _warn_learning_rate_jump(saved, config, trainer.schedule, step, "after this full-state load",
                                     applied_updates(state))
            _warn_global_batch_change(saved, config, trainer.plan.global_batch, trainer.plan.num_devices, step,
                                      "after this full-state load")
        warn_model_changes(cfg.load_full_state_path, model_keys)
        return state
    if cfg.load_parameters_path:
        if cfg.checkpoint_is_quantized:
            raise ConfigError("checkpoint_is_quantized=true is for decode.py (quantized weights are dequantized for "
                              "decoding); train from the float checkpoint the quantized one was written from")
        with quantized_explained(cfg.load_parameters_path, "load_parameters_path", "train from the float checkpoint "
                                 "they were written from"), mismatch_explained(cfg.load_parameters_path, model_keys):
            params = load_parameters(cfg.load_parameters_path, abstract_state(trainer)["params"],
                                     key="load_parameters_path", verify=cfg.checkpoint_checksums)
        log.info("loaded parameters from %s (fresh optimizer state, step 0)", cfg.load_parameters_path)
        warn_model_changes(cfg.load_parameters_path, model_keys)
        return state_from_params(trainer, params)
    return create_state(trainer, config.run.init_weights_seed, program)


def changes_since_save(saved: Mapping[str, Any], config: Config) -> dict[str, tuple[Any, Any]]:
    """{key: (value saved with the checkpoint, value now)} for the keys whose value differs (keys
    only one of the two configs knows, e.g. from another version of Tessera, are left out)."""
    now = json.loads(json.dumps(flat_dict(config)))  # as the checkpoint stored it: lists, not tuples
    return {k: (saved[k], v) for k, v in now.items() if k in saved and saved[k] != v}


def unread_load_paths(changes: Mapping[str, tuple[Any, Any]]) -> list[tuple[str, str]]:
    """(key, path) of the load paths given or changed since the run's checkpoint was saved (`changes`,
    from changes_since_save): read at a run's first start only, so not read now."""
    return [(key, changes[key][1]) for key in ("load_parameters_path", "load_full_state_path")
            if key in changes and changes[key][1]]


def saved_schedule(saved: Mapping[str, Any], config: Config) -> tuple[optax.Schedule, int] | None:
    """The learning-rate schedule of the run that saved `saved` (its config) and its length in
    steps; None when that config lacks or garbles the keys it needs."""
    try:
        # a checkpoint from before lr_schedule_type was saved by a cosine schedule: the new keys' defaults, not
        # this run's values, are what it trained with
        older = {name: OPTIM_DEFAULTS[name] for name in SCHEDULE_KEYS_SINCE_WSD}
        optim = dataclasses.replace(config.optim, **{**older, **{f.name: saved[f.name]
                                                                 for f in dataclasses.fields(OptimConfig)
                                                                 if f.name in saved}})
        length = int(saved["steps"]) if optim.learning_rate_schedule_steps == -1 else optim.learning_rate_schedule_steps
        schedule = learning_rate_schedule(optim, length)
        float(schedule(0))
        return schedule, length
    except (KeyError, TypeError, ValueError):
        return None


def applied_updates(state: dict) -> int:
    """The updates the train state applied (its schedule's count): its step less the skipped ones."""
    return int(jax.device_get(schedule_step(state["opt_state"])))


def warn_if_no_step_learns(config: Config, schedule: optax.Schedule, state: dict, start_step: int) -> None:
    """Warn when every step this run trains applies learning rate 0, so no weight moves (AdamW's decay
    is scaled by the rate too): one step at the start of a warm-up (which starts from 0), or steps past
    the schedule's end with cosine_learning_rate_final_fraction=0, or learning_rate=0."""
    steps = config.run.steps - start_step
    if steps < 1:
        return
    at = applied_updates(state)
    if float(jax.numpy.max(jax.numpy.abs(schedule(jax.numpy.arange(at, at + steps))))) > 0.0:
        return
    o, length = config.optim, config.total_steps_in_schedule
    if o.learning_rate == 0:
        why = "learning_rate=0. Set it above 0"
    elif at >= length:
        why = (f"the schedule's {length} steps are over and cosine_learning_rate_final_fraction="
               f"{o.cosine_learning_rate_final_fraction:g}. Raise learning_rate_schedule_steps, or that fraction")
    else:
        why = (f"the warm-up (warmup_steps_fraction={o.warmup_steps_fraction:g}) starts from 0. Train more steps, or "
               "lower warmup_steps_fraction")
    log.warning("every step this run trains (%s) applies learning rate 0, so the weights do not change: %s",
                f"step {start_step + 1}" if steps == 1 else f"steps {start_step + 1}-{config.run.steps}", why)


def log_changes_since_save(saved: Mapping[str, Any], config: Config, schedule: optax.Schedule, step: int,
                           step_folder: str, applied: int | None = None) -> None:
    """Log the settings that differ from those `step` (saved in `step_folder`) was saved with, and
    warn when the training data changed under the saved data position or the learning rate jumps."""
    changes = changes_since_save(saved, config)
    if not changes:
        return
    listed = [f"{k} {show_setting(then)} -> {show_setting(now)}" for k, (then, now) in changes.items()]
    more = f", and {len(listed) - MAX_LISTED} more" if len(listed) > MAX_LISTED else ""
    log.info("settings changed since step %d was saved: %s%s", step, ", ".join(listed[:MAX_LISTED]), more)
    for key, path in unread_load_paths(changes):
        log.warning("%s=%s is not read: the run resumes from its own checkpoint of step %d (a load path is "
                    "read only when the run has no checkpoint). To start from %s, train in a new run_name",
                    key, path, step, path)
    data = [k for k in changes if k in DATA_SOURCE_KEYS]
    if data:
        log.warning("the training data changed since step %d was saved (%s): the data position saved with it "
                    "(which record comes next, and the tokens already used of it) is applied to the new data as it "
                    "stands. That continues where the run stopped when files were only added after the old ones; "
                    "otherwise it starts at an arbitrary point of the new data. To read the new data from its start, "
                    "train in a new run_name with load_full_state_path=%s", step, ", ".join(data), step_folder)
    _warn_learning_rate_jump(saved, config, schedule, step, applied=applied)


def _warn_learning_rate_jump(saved: Mapping[str, Any], config: Config, schedule: optax.Schedule, step: int,
                             where: str = "at this resume", applied: int | None = None) -> None:
    """Warn when the next step's learning rate differs from the one the saved schedule gives it.
    The usual cause: `steps` raised to train a finished run further stretches the cosine schedule
    (as long as `steps` by default), and the rate climbs from its end value back up the curve.
    `applied`: the updates the state applied (`applied_updates`), where both schedules are read: steps
    skipped for a non-finite loss (on_nonfinite_loss=skip_step) did not advance them."""
    before = saved_schedule(saved, config)
    if before is None:
        return
    at = step if applied is None else applied
    then, now = float(before[0](at)), float(schedule(at))
    if math.isclose(then, now, rel_tol=1e-3, abs_tol=1e-12):
        return
    length = config.total_steps_in_schedule
    # step n trains at schedule(n - 1): the schedule's final rate is that of the steps after its last one
    keep = (f" To continue the schedule it was saved with, add learning_rate_schedule_steps={before[1]} (its last "
            f"step is {before[1]}; the steps after it train at its final rate, {float(before[0](before[1])):.3g})."
            if before[1] != length else "")
    skips = f" (its {step - at} skipped step(s) did not advance the schedule)" if at != step else ""
    log.warning("the learning rate jumps %s: step %d trains at %.3g, where the schedule step %d was saved with (%d "
                "steps long; %d now) gives %.3g%s.%s", where, step + 1, now, step, before[1], length, then, skips, keep)


def saved_config_entries(config: Config, global_batch: int) -> dict[str, Any]:
    """What a checkpoint keeps of the run that saved it: the flat config and, beside its keys, the
    global batch (SAVED_GLOBAL_BATCH), which depends on the device count no key names."""
    return {**flat_dict(config), SAVED_GLOBAL_BATCH: global_batch}


def _warn_global_batch_change(saved: Mapping[str, Any], config: Config, global_batch: int, devices: int, step: int,
                              where: str = "at this resume") -> None:
    """Warn when the global batch differs from the one `step` was trained with. per_device_batch_size
    counts per device, so a resume on another number of devices (a smaller slice, another XLA_FLAGS
    device count) changes it with no key changed. A per_device_batch_size changed on purpose is named
    among the changed settings already."""
    then = saved.get(SAVED_GLOBAL_BATCH)
    if not isinstance(then, int) or then == global_batch or \
            saved.get("per_device_batch_size") != config.data.per_device_batch_size:
        return
    log.warning("the global batch changes %s: %d sequence%s per step now (per_device_batch_size=%g x %d device%s), "
                "%d when step %d was saved; the learning rate and the other optimizer settings were chosen for "
                "that batch. To train on with it, set per_device_batch_size=%g", where, global_batch,
                "" if global_batch == 1 else "s", config.data.per_device_batch_size, devices,
                "" if devices == 1 else "s", then, step, then / devices)


SCHEDULE_KEYS_SINCE_WSD = ("lr_schedule_type", "wsd_decay_steps_fraction", "wsd_decay_style")
OPTIM_DEFAULTS = {f.name: f.default for f in dataclasses.fields(OptimConfig)}
SAVED_GLOBAL_BATCH = "global_batch"  # not a config key: the sequences per step of the run that saved a checkpoint
MAX_LISTED = 12  # changed settings named in the resume's line
# The keys that say which records the training data holds, and in which order: the saved data
# position means something else once one of them changes
DATA_SOURCE_KEYS = ("hf_path", "hf_train_files", "train_split", "dataset_name", "dataset_path", "train_data_columns",
                    "grain_train_files", "grain_file_type", "data_shuffle_seed", "tokenizer_path",
                    "hf_streaming",  # hf: files streamed are other shards than a converted dataset's slices
                    # other tokens per document: the saved offset into the current document points elsewhere
                    "tokenizer_type", "add_bos", "add_eos")


def show_setting(value: Any) -> str:
    """A setting's value as a log line shows it: an empty string as "", a list as JSON."""
    return json.dumps(value) if isinstance(value, (list, dict)) or value == "" else str(value)
