"""Parameters chosen by regular expressions searched in their paths (layers/attention/wq_dnh,
token_embedder/table_vd): adamw_mask's, which AdamW does not decay, and trainable_parameters_mask's, the only
ones that train. A pattern found in no path is a config error naming the model's parameters (MaxText's
names are not Tessera's, and a pattern that finds nothing would change nothing without a word)."""

from __future__ import annotations

import logging
import re
from typing import Any, Callable

import jax

from tessera.config import ConfigError, OptimConfig

log = logging.getLogger("tessera")


def param_path(path) -> str:
    """A parameter's path as the patterns read it: its keys joined by "/" (layers/attention/wq_dnh)."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def matcher(patterns) -> Callable[[Any], bool]:
    """path -> whether one of the regular expressions `patterns` is found in it (`param_path`)."""
    compiled = [re.compile(str(p)) for p in patterns]
    return lambda path: any(p.search(param_path(path)) for p in compiled)


def frozen_mask(params, patterns) -> Any:
    """True for the parameters trainable_parameters_mask leaves frozen: those none of `patterns` is found in."""
    matches = matcher(patterns)
    return jax.tree_util.tree_map_with_path(lambda path, _: not matches(path), params)


def found(params, key: str, patterns) -> list[str]:
    """The parameter paths `patterns` (the value of `key`) are found in; ConfigError for a pattern found in none,
    listing the model's parameters."""
    paths = [param_path(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    for p in patterns:
        if not any(re.search(str(p), x) for x in paths):
            raise ConfigError(f"{key}: {p!r} is found in no parameter's path; this model's parameters are "
                              f"{', '.join(sorted(set(paths)))}")
    matches = matcher(patterns)
    return sorted({param_path(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0] if matches(path)})


def check_adamw_mask(optim: OptimConfig, params) -> None:
    """`found`'s check of adamw_mask over `params` (shapes will do), and a line naming what it keeps from decaying."""
    if optim.adamw_mask and optim.opt_type != "sgd":
        masked = found(params, "adamw_mask", optim.adamw_mask)
        log.info("adamw_mask: AdamW does not decay %s (nor the norm scales)", ", ".join(masked))


def frozen_params(optim: OptimConfig, params) -> Any:
    """trainable_parameters_mask's tree of frozen parameters (None without the key), after `found`'s check, and a
    line naming what trains."""
    if not optim.trainable_parameters_mask:
        return None
    trained = found(params, "trainable_parameters_mask", optim.trainable_parameters_mask)
    log.info("trainable_parameters_mask: only %s train; the other parameters keep their values", ", ".join(trained))
    return frozen_mask(params, optim.trainable_parameters_mask)
