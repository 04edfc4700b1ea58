"""Quantized checkpoints for decoding (`save_quantized_params_path`, read back with
`checkpoint_is_quantized=true`): the parameters quantized as `quantization` computes them, with the
config of the checkpoint they came from, so that a decode with other model keys is warned."""

from __future__ import annotations

import json
import logging
import os
import re

from tessera.config import Config, ConfigError

log = logging.getLogger("tessera")


def check_new_folder(path: str, key: str) -> None:
    """ConfigError unless `path` does not exist yet and can be created (`check_writable`, which
    leaves nothing behind)."""
    from etils import epath

    from tessera.checkpointing import check_writable

    target = epath.Path(path)
    if target.exists():
        raise ConfigError(f"{key}={path} exists already; choose a new folder (nothing was written)")
    if target.name.isdigit() and (target.parent.name == "checkpoints" or _beside_training_steps(target)):
        raise ConfigError(f"{key}={path} would be taken for step {target.name} of the run whose checkpoints are in "
                          f"{target.parent}; choose a folder outside it (e.g. {target.parent.parent / 'quantized'}) "
                          "(nothing was written)")
    check_writable(path, key)


def _beside_training_steps(target) -> bool:
    """Whether the folder of `target` holds a training step (a folder named by its number, with a state item)."""
    parent = target.parent
    return parent.is_dir() and any(p.name.isdigit() and (p / "state").is_dir() for p in parent.iterdir())


def source_config(cfg: Config) -> dict:
    """The flat config a quantized checkpoint keeps: that of the training checkpoint its weights were
    loaded from (its model keys are what they were trained with), else this decode's."""
    from tessera.checkpointing import saved_config
    from tessera.config.loader import flat_dict

    return saved_config(cfg.checkpoint.load_parameters_path) or json.loads(json.dumps(flat_dict(cfg)))


def save_quantized(params, logical_axes, mode: str, path: str, checksums: bool = True,
                   config: dict | None = None) -> None:
    """Write `params` quantized (`tessera.models.quantization.quantize_params`) as an Orbax
    checkpoint holding {"params": ...}: what load_parameters_path with checkpoint_is_quantized=true reads;
    with `checksums`, its files' checksums too (`checkpoint_checksums`), which every load verifies.
    `config` (a flat config): kept as a training step keeps its own (config/<CONFIG_FILE>), so that a
    decode with other model keys is warned as from the float checkpoint (`warn_model_changes`)."""
    import jax
    import orbax.checkpoint as ocp
    from etils import epath

    from tessera.checkpointing import record_checksums
    from tessera.checkpointing.storage import CONFIG_FILE
    from tessera.models.quantization import quantize_params

    target = epath.Path(path)
    if target.exists():
        raise ConfigError(f"save_quantized_params_path={path} exists already; choose a new folder (nothing was "
                          "written)")
    tree = {"params": jax.jit(lambda p: quantize_params(p, mode, logical_axes))(params)}
    try:
        ocp.PyTreeCheckpointer().save(target, tree)
        if config is not None and jax.process_index() == 0:
            (target / "config").mkdir()
            (target / "config" / CONFIG_FILE).write_text(json.dumps(config))
        if checksums:
            record_checksums(path)
    except BaseException as e:  # a full disk, Ctrl-C: a folder without its config or checksums would read as whole
        _remove_partial(target)
        code = re.search(r"os_error_code='(\d+)'", str(e)) if isinstance(e, ValueError) else None
        if isinstance(e, OSError) or code:  # a folder that could not be made (/proc), a full disk (TensorStore's
            # failed write is a ValueError naming its OSError's code)
            why = os.strerror(int(code[1])) if code else e.strerror or e
            raise ConfigError(f"save_quantized_params_path={path} could not be written ({why}); choose "
                              "another path (the partial folder was removed)") from None
        raise
    log.info("wrote the parameters quantized (%s) to %s", mode, path)


def _remove_partial(target) -> None:
    """Remove what a save interrupted at `target` left: the folder, or Orbax's temporary one beside it."""
    import jax

    if jax.process_index() != 0:
        return
    for folder in [target, *target.parent.glob(f"{target.name}.orbax-checkpoint-tmp-*")]:
        if folder.exists():
            folder.rmtree(missing_ok=True)
