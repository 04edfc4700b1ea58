"""Loads from a path the user gives (`load_parameters_path`, `load_full_state_path`, decode,
convert): a step folder or a single-item checkpoint, found, verified and checked against the
config before anything is read."""

from __future__ import annotations

import contextlib
import json
import logging
from typing import Any, Iterator, Mapping

import jax
import orbax.checkpoint as ocp
from etils import epath

from tessera.checkpointing import checksums
from tessera.checkpointing.storage import (CONFIG_FILE, INCOMPLETE_MARKER, PYTREE_METADATA_FILE, SOURCE_CONFIG,
                                           CheckpointError, read_error, remote_exists, use_tidy_event_loops)
from tessera.checkpointing.trees import CheckpointMismatch, cast_summary, raise_on_mismatch, restacked

log = logging.getLogger("tessera")


def _state_item(path: str, key: str | None = None) -> epath.Path:
    """The `state` item of a step folder, or `path` itself when it is an item (a converted
    checkpoint). CheckpointError naming `key=path` when nothing loadable is there."""
    p = epath.Path(path)
    label = _label(key, p)
    if "://" in path:
        remote_exists(path, key or "checkpoint", CheckpointError)
    if not p.exists():
        raise CheckpointError(f"{label} does not exist; {_step_folder_hint(p)}")
    if INCOMPLETE_MARKER in p.name:
        raise CheckpointError(f"{label} is an incomplete (interrupted) save; use a complete step folder")
    if p.is_file():  # e.g. a file inside a step folder, or the run's config.yml
        raise CheckpointError(f"{label} is a file, not a checkpoint folder; {_enclosing_step_hint(p)}")
    if not (p / "state").exists() and (p / "data").is_dir() and (p / "config").is_dir():  # a training step's items
        raise CheckpointError(f"{label} is damaged: its state item (state/, the parameters and optimizer state) is "
                              f"missing; {_step_folder_hint(p)}")
    item = p / "state" if (p / "state").exists() else p
    if item != p and not (item / PYTREE_METADATA_FILE).exists():
        raise CheckpointError(f"{label} is damaged: its file state/{PYTREE_METADATA_FILE} is missing; "
                              f"{_step_folder_hint(p)}")
    if not (item / PYTREE_METADATA_FILE).exists() and (p / "config.json").is_file() and \
            any(c.name.endswith(".safetensors") for c in p.iterdir()):
        raise CheckpointError(f"{label} is a Hugging Face checkpoint (config.json and safetensors); convert it first: "
                              f".venv/bin/python -m tessera.tools.convert hf-to-tessera {p} <out_dir> "
                              "model_name=<name>, then give <out_dir> (getting_started/Models.md)")
    if not (item / PYTREE_METADATA_FILE).exists():
        raise CheckpointError(f"{label} holds no checkpoint (no state item, no Orbax metadata); "
                              f"{_enclosing_step_hint(p)}")
    return item


def _label(key: str | None, path: epath.Path) -> str:
    """How errors name a path: `load_parameters_path=/abs/path`, or `checkpoint /abs/path` without a key."""
    return f"{key}={path}" if key else f"checkpoint {path}"


def _enclosing_step_hint(p: epath.Path) -> str:
    """'point it at the step folder ...' holding `p` (another item, a file or folder inside one), else
    `_step_folder_hint`."""
    inside = next((a for a in p.parents if a.name.isdigit() and (a / "state" / PYTREE_METADATA_FILE).exists()), None)
    return f"point it at the step folder {inside}" if inside is not None else _step_folder_hint(p)


def _step_folder_hint(p: epath.Path) -> str:
    """'point it at a step folder such as ...', naming a real step folder near `p` when there is one."""
    for folder in (p, p / "checkpoints", p.parent, p.parent / "checkpoints"):
        if not folder.is_dir():
            continue
        steps = sorted(int(c.name) for c in folder.iterdir() if c.name.isdigit() and c != p)
        if steps:
            return f"point it at a step folder such as {folder / str(steps[-1])}"
    return "point it at a step folder such as outputs/<run_name>/checkpoints/<step>"


def saved_tree(path: str, key: str | None = None, verify: bool = True) -> tuple[epath.Path, Any]:
    """(the item folder, the metadata tree of the arrays saved in it) for a step folder or a
    {"params": ...} checkpoint; CheckpointError naming `key=path` when there is nothing to read, or
    (`verify`) when its files differ from the checksums recorded at its save."""
    item = _state_item(path, key)
    if verify:
        verify_item(item, key, epath.Path(path))
    use_tidy_event_loops()
    try:  # the handler, not a Checkpointer: that would look for (and warn about) step metadata an item lacks
        saved = ocp.PyTreeCheckpointHandler().metadata(item)
    except Exception as e:  # noqa: BLE001
        raise read_error(e, f"{_label(key, item)} is not a readable Orbax checkpoint") from None
    return item, getattr(saved, "tree", saved)


def verify_item(item: epath.Path, key: str | None, path: epath.Path) -> None:
    """CheckpointError naming `key=path` when a file of checkpoint item `item` differs from the
    checksums recorded at its save (collective in a multi-process job); a log line when none were."""
    why = checksums.check(item)
    if why:
        hint = _step_folder_hint(path) if item.name == "state" else "copy or write it again from its source"
        raise CheckpointError(f"{_label(key, path)} is damaged: {why}. Nothing was loaded; {hint}")


def record_checksums(folder) -> None:
    """After a single-item checkpoint (converted or quantized parameters) is written to `folder`:
    record its files' checksums, which every later load verifies."""
    if jax.process_index() == 0:
        checksums.record(folder, items_only=False)


def _restore_tree(path: str, key: str | None, target, partial: bool, verify: bool = True):
    item, tree = saved_tree(path, key, verify)
    label = _label(key, item)
    if partial and "params" not in tree:
        raise CheckpointError(f"{label} holds no parameters (its tree has {', '.join(map(str, tree))}); "
                              "point it at a training step folder or a converted checkpoint")
    if not partial and "params" in tree and "opt_state" in target and "opt_state" not in tree:
        if _holds_quantized(tree):  # load_parameters_path refuses it too: no use pointing there
            raise CheckpointError(f"{label} holds quantized parameters (written by decode.py "
                                  "save_quantized_params_path), which only decode.py reads (checkpoint_is_quantized="
                                  "true); train from the float checkpoint they were written from")
        raise CheckpointError(f"{label} holds parameters only (a converted or quantized checkpoint: no optimizer "
                              f"state, no step); start from it with load_parameters_path={path} instead")
    target, finish = restacked(tree, target)
    # parameters alone may be read into another floating dtype (weight_dtype): Orbax casts them as it reads
    raise_on_mismatch(item, tree, target, only_prefix="params/" if partial else "", cast_floats=partial)
    if partial and (casts := cast_summary({"params": tree["params"]}, target)):
        log.info("%s: parameters are read in the config's weight_dtype (%s)", label, casts)
    restore_args = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding, dtype=s.dtype), target)
    try:
        return finish(ocp.PyTreeCheckpointer().restore(item, args=ocp.args.PyTreeRestore(
            item=target, restore_args=restore_args, partial_restore=partial)))
    except Exception as e:  # noqa: BLE001
        raise read_error(e, f"{label} could not be restored: files may be missing or corrupt") from None


def load_parameters(path: str, abstract_params, key: str | None = "load_parameters_path", verify: bool = True) -> Any:
    """Parameters only, from a Tessera checkpoint step or a checkpoint holding {"params": ...}.
    `key` names the path in errors (None: "checkpoint <path>"). `verify`: check the files against
    their recorded checksums first (the whole state item: Orbax mixes arrays within files)."""
    return _restore_tree(path, key, {"params": abstract_params}, partial=True, verify=verify)["params"]


def load_full_state(path: str, abstract_state, key: str | None = "load_full_state_path", verify: bool = True) -> Any:
    """Parameters, optimizer state and step from a Tessera checkpoint step folder."""
    return _restore_tree(path, key, abstract_state, partial=False, verify=verify)


def saved_config(path: str) -> dict:
    """The flat config saved with the training checkpoint at `path` (a step folder or its `state`
    item), or with a quantized one (decode.py keeps its source's); {} for a checkpoint saved without one
    (converted parameters, quantized ones written before 2026-11-30) or unreadable."""
    p = epath.Path(path)
    folder = p.parent if p.name == "state" else p
    try:
        saved = json.loads((folder / "config" / CONFIG_FILE).read_text())
    except Exception:  # noqa: BLE001 - only a hint for an error being reported: a bucket's own errors included
        return {}
    return saved if isinstance(saved, dict) else {}


# the model keys that set the parameters' sizes (check_same_model's); with global_parameter_scale they are multiplied
_SIZE_KEYS = ("base_emb_dim", "base_num_query_heads", "base_num_kv_heads", "base_mlp_dim", "base_num_decoder_layers")


def converted_model_keys(path: str, model_keys: Mapping[str, Any]) -> dict:
    """For parameters hf-to-tessera wrote (no config item; the config.json they came from beside them,
    SOURCE_CONFIG): the model keys that config.json describes, as the converter built and checked them
    (`config_from_hf`), as a saved config holds them; {} for other checkpoints or an unreadable file. The
    sizes are left out when `model_keys` scale them (global_parameter_scale): the shapes tell those apart."""
    from tessera.config import build_config
    from tessera.tools.hf_configs import config_from_hf

    p = epath.Path(path)
    try:
        keys = config_from_hf(json.loads((p / SOURCE_CONFIG).read_text()))
        model = build_config(keys).model
    except Exception:  # noqa: BLE001 - only a hint: a file written by hand, or one this version reads otherwise
        return {}
    skip = {"global_parameter_scale", *(_SIZE_KEYS if model_keys.get("global_parameter_scale", 1) != 1 else ())}
    return json.loads(json.dumps({k: getattr(model, k) for k in keys if k not in skip}))


def _described(path: str, model_keys: Mapping[str, Any]) -> tuple[dict, str]:
    """(the model keys the checkpoint at `path` was made with, what says so): the config saved with a
    training checkpoint, else the config.json a converted one came from; ({}, "") for neither."""
    saved = saved_config(path)
    if saved:
        return saved, "the config saved with it"
    converted = converted_model_keys(path, model_keys)
    return converted, f"the config.json it was converted from ({SOURCE_CONFIG})" if converted else ""


# Model keys that change how the projections or the KV cache compute, never the parameters saved: a mismatch is
# not theirs to explain (a quantized training run's float checkpoint has the same arrays as any other)
QUANTIZATION_KEYS = frozenset({"quantization", "quantize_kvcache", "kv_quant_axis", "kv_quant_dtype"})


@contextlib.contextmanager
def mismatch_explained(path: str, model_keys: Mapping[str, Any], opt_type: str = "",
                       trainable: list | None = None) -> Iterator[None]:
    """Around a load from `path`: a CheckpointMismatch gets a last line naming the `model_keys`
    (this config's model keys and values) whose saved values differ, when the checkpoint kept its config,
    and, for a load of the whole state (`opt_type` given), the optimizer it was saved by if that differs, or the
    trainable_parameters_mask (`trainable`, this run's) that shaped its state."""
    try:
        yield
    except CheckpointMismatch as e:
        saved = saved_config(path)
        described, source = _described(path, model_keys)
        now = json.loads(json.dumps(dict(model_keys)))  # as saved: lists, not tuples
        differ = [f"{k}={json.dumps(described[k])} (here {json.dumps(v)})" for k, v in now.items()
                  if k in described and described[k] != v and k not in QUANTIZATION_KEYS]
        lines = [f"{source[0].upper()}{source[1:]} differs in its model keys: {', '.join(differ)}"] if differ else []
        saved_opt = saved.get("opt_type", "adamw")  # checkpoints from before opt_type were AdamW's
        if opt_type and saved and saved_opt != opt_type:
            switch = (f"checkpoint {path} was saved by opt_type={saved_opt} (here {opt_type}), whose state this "
                      f"optimizer cannot read; to switch optimizers, start a new run_name with load_parameters_path="
                      f"{path} (its parameters, with a fresh optimizer state). Nothing was loaded or overwritten.")
            if not differ:  # the optimizer alone: its state's paths would only bury the reason
                raise CheckpointMismatch(switch) from None
            lines.append(switch)
        elif opt_type and saved and list(saved.get("trainable_parameters_mask", [])) != list(trainable or []):
            mask = (f"checkpoint {path} was saved with trainable_parameters_mask="
                    f"{json.dumps(saved.get('trainable_parameters_mask', []))} (here {json.dumps(list(trainable or []))}),"
                    " which shapes the optimizer state (moments for the trained parameters only); to train other "
                    f"parameters, start a new run_name with load_parameters_path={path} (its parameters, with a fresh "
                    "optimizer state). Nothing was loaded or overwritten.")
            if not differ:
                raise CheckpointMismatch(mask) from None
            lines.append(mask)
        elif opt_type and saved.get("weight_dtype", now["weight_dtype"]) != now["weight_dtype"]:
            lines.append(f"The whole state (parameters and optimizer state) is read as saved; to train on in "
                         f"weight_dtype={now['weight_dtype']}, start a new run_name with load_parameters_path={path} "
                         "(its parameters, read into weight_dtype, with a fresh optimizer state).")
        if not lines:
            raise
        raise CheckpointMismatch("\n".join([str(e), *lines])) from None


def _holds_quantized(tree) -> bool:
    """Whether a checkpoint's metadata tree holds quantized parameters ({qvalue, scale} leaves)."""
    leaves = jax.tree_util.tree_leaves_with_path(tree.get("params", {}))
    return any(getattr(keys[-1], "key", None) == "qvalue" for keys, _ in leaves)


@contextlib.contextmanager
def quantized_explained(path: str, key: str | None, fix: str) -> Iterator[None]:
    """Around a load of float parameters (training, tessera-to-hf) from `path`: a checkpoint of quantized
    parameters (decode.py save_quantized_params_path) listed every matrix as missing and unexpected, without
    the reason; a last line gives it, and `fix`."""
    try:
        yield
    except CheckpointMismatch as e:
        _, tree = saved_tree(path, verify=False)
        if not _holds_quantized(tree):
            raise
        raise CheckpointMismatch(f"{e}\n{_label(key, epath.Path(path))} holds quantized parameters (written by "
                                 "decode.py save_quantized_params_path), which only decode.py reads "
                                 f"(checkpoint_is_quantized=true); {fix}") from None


# Model keys that say how the model is computed, stored or trained, not what it computes: a load
# with other values of them is the same model. A difference in any other model key, where the
# parameters' shapes still fit (a rotary base, a window, a soft cap), loads silently as another model.
IMPLEMENTATION_KEYS = frozenset({
    "model_name", "global_parameter_scale", "dtype", "weight_dtype", "num_vocab_tiling", "logits_dot_in_fp32",
    "use_iota_embed", "quantization", "quantize_kvcache", "kv_quant_axis", "kv_quant_dtype", "scan_layers",
    "remat_policy", "decoder_layer_input", "query_proj", "key_proj", "value_proj", "context", "out_proj", "mlpwi",
    "mlpwi_0", "mlpwi_1", "mlpwo", "attention", "sa_block_q", "sa_block_kv", "sa_block_kv_compute", "sa_block_q_dkv",
    "sa_block_kv_dkv", "sa_block_kv_dkv_compute", "sa_block_q_dq", "sa_block_kv_dq", "sa_use_fused_bwd_kernel",
    "sa_q_layout", "sa_k_layout", "sa_v_layout", "context_parallel_load_balance", "enable_dropout", "dropout_rate",
    "capacity_factor", "sparse_matmul", "megablox", "tile_batch_seq", "tile_activation_dim", "tile_weight_dim",
    "ragged_buffer_factor", "load_balance_loss_weight", "routed_bias_update_rate", "mtp_loss_scaling_factor",
    "mtp_eval_target_module",
})


def warn_model_changes(path: str, model_keys: Mapping[str, Any]) -> None:
    """After parameters were loaded from `path`: warn when the config saved with them (or, for converted
    parameters, the config.json they came from) differs in a model key that changes what the model
    computes (not in IMPLEMENTATION_KEYS). A converted Llama 3.1 read with model_name=llama3-8b (the same
    shapes, no rope scaling) or another rope_max_timescale was loaded without a word."""
    saved, source = _described(path, model_keys)
    now = json.loads(json.dumps(dict(model_keys)))  # as saved: lists, not tuples
    differ = [f"{k}={json.dumps(saved[k])} (here {json.dumps(v)})" for k, v in now.items()
              if k in saved and saved[k] != v and k not in IMPLEMENTATION_KEYS]
    if differ:
        made = "trained with" if source.startswith("the config saved") else "converted from a config.json with"
        log.warning("the parameters of %s were %s other model keys: %s. They fit, so they were loaded, "
                    "but the model computes something else than it was trained to; give the %s values unless "
                    "the change is meant", path, made, ", ".join(differ),
                    "saved" if made == "trained with" else "converted")
