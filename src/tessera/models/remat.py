"""`remat_policy`: which activations a block keeps for the backward pass, which it recomputes and
which it moves to host memory, as `jax.checkpoint` policies (`REMAT_POLICIES`; remat_policy=custom
builds one from the per-tensor keys, `custom_policy`). The decoder wraps each block in `remat`;
a block's input is named decoder_layer_input, its projections by the names below.
"""

from __future__ import annotations

import jax

from tessera.config import ModelConfig
from tessera.config.fields import REMAT_TENSORS

_cp = jax.checkpoint_policies
_OFFLOADABLE = ["query_proj", "key_proj", "value_proj", "context", "out_proj", "mlpwi", "mlpwo"]
_ATTENTION_DOTS = ("query_proj", "key_proj", "value_proj", "context", "out_proj")


def _offload(names_saved, names_offloaded):
    return _cp.save_and_offload_only_these_names(
        names_which_can_be_saved=names_saved, names_which_can_be_offloaded=names_offloaded,
        offload_src="device", offload_dst="pinned_host")


# remat_policy -> jax.checkpoint policy; "none" means no checkpointing (keep every activation)
# and "full" means keep nothing but the block's input; "custom" is built by `custom_policy`.
REMAT_POLICIES = {
    "none": None,
    "full": _cp.nothing_saveable,
    "minimal": _cp.checkpoint_dots_with_no_batch_dims,
    "save_dot_except_mlp": _cp.save_only_these_names(*_ATTENTION_DOTS),
    "save_dot_except_mlpwi": _cp.save_only_these_names(*_ATTENTION_DOTS, "mlpwo"),
    "save_qkv_proj": _cp.save_only_these_names("query_proj", "key_proj", "value_proj"),
    "save_out_proj": _cp.save_only_these_names("out_proj"),
    "qkv_proj_offloaded": _offload([], ["query_proj", "key_proj", "value_proj"]),
    "minimal_offloaded": _offload([], _OFFLOADABLE),
    "offload": _offload([], _OFFLOADABLE),
    "custom": None,
}
OFFLOADING_POLICIES = ("qkv_proj_offloaded", "minimal_offloaded", "offload")


def custom_choices(cfg: ModelConfig) -> dict[str, str]:
    """remat_policy=custom: {activation name: remat | device | offload} from the per-tensor keys."""
    return {name: getattr(cfg, name) for name in REMAT_TENSORS}


def offloads_to_host(cfg: ModelConfig) -> bool:
    """Whether the remat policy moves activations to pinned host memory."""
    return cfg.remat_policy in OFFLOADING_POLICIES or (
        cfg.remat_policy == "custom" and "offload" in custom_choices(cfg).values())


def custom_policy(cfg: ModelConfig):
    """The jax.checkpoint policy of remat_policy=custom: names set to `device` are kept, those set
    to `offload` are moved to host memory, the others are recomputed in the backward pass."""
    choices = custom_choices(cfg)
    keep = [n for n, c in choices.items() if c == "device"]
    offload = [n for n, c in choices.items() if c == "offload"]
    return _offload(keep, offload) if offload else _cp.save_only_these_names(*keep)


def remat(fn, cfg: ModelConfig, in_scan: bool):
    """`fn` checkpointed with the policy of cfg.remat_policy (unchanged for `none`)."""
    if cfg.remat_policy == "none":
        return fn
    policy = custom_policy(cfg) if cfg.remat_policy == "custom" else REMAT_POLICIES[cfg.remat_policy]
    return jax.checkpoint(fn, policy=policy, prevent_cse=not in_scan)
