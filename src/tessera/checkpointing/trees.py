"""A saved tree against the one a config expects: differences by path; stacked layers saved in
another pipeline layout, reshaped on restore; an optimizer state saved with gradient clipping
turned on or off, read as saved."""

from __future__ import annotations

import logging
import math
import re
from typing import Any

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec

from tessera.checkpointing.storage import CheckpointError

log = logging.getLogger(__name__)


def _path_key(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _flat(tree) -> dict[str, Any]:
    """{"params/layers/mlp/wi_0": leaf, ...} for arrays, ShapeDtypeStructs or Orbax metadata."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]
    return {_path_key(path): leaf for path, leaf in leaves if leaf is not None}


def restacked(saved, expected):
    """(target, finish) for restoring `saved` into `expected` when they differ only in how the
    decoder's stacked blocks are laid out: [L, ...] (plain or GPipe) against [R, L/R, ...]
    (circular pipelining, `tessera.models.pipeline`), the same layers in the same order. Such
    arrays are read in their saved shape (split as `expected` splits the other axes) and
    `finish` reshapes them into `expected`'s shape and sharding; everything else is unchanged.
    An optimizer state saved with clipping on or off is read as saved (`_clip_slot`)."""
    have = _flat(saved)
    expected, reslot = _clip_slot(have, expected)
    target, finish = _restacked(have, expected)
    return target, lambda restored: reslot(finish(restored))


def _clip_slot(have: dict[str, Any], expected):
    """(expected, finish) for a train state whose optimizer state has gradient clipping's slot
    where the saved one has none, or the other way round: `tessera.optim` chains the clip in front
    when gradient_clipping_threshold > 0, and its state (optax's EmptyState) holds nothing, so the
    state reads as saved and `finish` adds or drops the slot. Turning clipping on after a
    non-finite stop, as the trainer's advice says, resumed into a mismatch before."""
    unchanged = (expected, lambda restored: restored)
    if not isinstance(expected, dict) or "opt_state" not in expected:
        return unchanged
    opt = expected["opt_state"]
    if _flat(expected).keys() == have.keys():
        return unchanged
    options = [({**expected, "opt_state": (optax.EmptyState(), opt)},
                lambda r: {**r, "opt_state": r["opt_state"][1]}, "on", "off")]
    if isinstance(opt, tuple) and len(opt) == 2 and isinstance(opt[0], optax.EmptyState):
        options.append(({**expected, "opt_state": opt[1]},
                        lambda r: {**r, "opt_state": (optax.EmptyState(), r["opt_state"])}, "off", "on"))
    for target, finish, then, now in options:
        if _flat(target).keys() == have.keys():
            log.info("checkpoint: saved with gradient clipping %s, restored with it %s (the clip keeps no state)",
                     then, now)
            return target, finish
    return unchanged


def _restacked(have: dict[str, Any], expected):
    moved = []

    def adapt(path, want):
        key = _path_key(path)
        h = have.get(key)
        if h is None or not hasattr(want, "sharding") or "layers" not in key.split("/"):
            return want
        hs, ws = tuple(h.shape), tuple(want.shape)
        for a, b in ((1, 2), (2, 1)):  # leading axes [L] saved, [R, L/R] wanted, or the other way round
            if hs != ws and len(hs) - a == len(ws) - b and hs[a:] == ws[b:] and math.prod(hs[:a]) == math.prod(ws[:b]):
                spec = tuple(want.sharding.spec) + (None,) * (len(ws) - len(want.sharding.spec))
                moved.append(f"{key} {hs} -> {ws}")
                return jax.ShapeDtypeStruct(hs, want.dtype, sharding=NamedSharding(
                    want.sharding.mesh, PartitionSpec(*([None] * a), *spec[b:])))
        return want

    target = jax.tree_util.tree_map_with_path(adapt, expected)
    if moved:
        log.info("checkpoint: %d stacked-layer array(s) saved with another pipeline layout are reshaped on restore "
                 "(e.g. %s)", len(moved), moved[0])

    def finish(restored):
        def fit(x, want):
            if not hasattr(want, "sharding") or tuple(x.shape) == tuple(want.shape):
                return x
            return jax.jit(lambda a: a.reshape(want.shape), out_shardings=want.sharding)(x)

        return runtime_owned(jax.tree.map(fit, restored, expected))

    return target, finish


def runtime_owned(tree):
    """`tree` with each array on CPU devices copied into a buffer XLA allocated, the restored one
    released as soon as it is copied (one array at a time). On CPU a restored array keeps the host
    buffer it was read into, which the jitted train step does not reuse for its output even when
    it is donated: the first step after a resume allocated a second train state (measured: with a
    2.05 GiB state, 5.2 GiB resident after that step against 3.2 GiB after a fresh start's).
    Arrays on accelerators arrive through the runtime's own transfers and are left as they are."""
    def own(x):
        if not isinstance(x, jax.Array) or any(d.platform != "cpu" for d in x.sharding.device_set):
            return x
        copy = jax.numpy.copy(x)
        copy.block_until_ready()
        x.delete()
        return copy

    return jax.tree.map(own, tree)


def describe_mismatch(saved, expected, only_prefix: str = "", cast_floats: bool = False) -> list[str]:
    """Human-readable differences between saved metadata and the expected abstract tree
    (`cast_floats`: a floating dtype that differs from the expected floating dtype is not one)."""
    have, want = _flat(saved), _flat(expected)
    have = {k: v for k, v in have.items() if k.startswith(only_prefix)}
    problems = [f"missing in checkpoint: {k} {tuple(want[k].shape)}" for k in sorted(set(want) - set(have))]
    problems += [f"not expected by this config: {k} {tuple(have[k].shape)}" for k in sorted(set(have) - set(want))]
    for k in sorted(set(have) & set(want)):
        h, w = have[k], want[k]
        if tuple(h.shape) != tuple(w.shape):
            problems.append(f"{k}: checkpoint has shape {tuple(h.shape)}, this config expects {tuple(w.shape)}")
        elif h.dtype is not None and jax.numpy.dtype(h.dtype) != jax.numpy.dtype(w.dtype) and not (
                cast_floats and _floating(h.dtype) and _floating(w.dtype)):
            problems.append(f"{k}: checkpoint has dtype {h.dtype}, this config expects {w.dtype}")
    return problems


def _floating(dtype) -> bool:
    return jax.numpy.issubdtype(jax.numpy.dtype(dtype), jax.numpy.floating)


def cast_summary(saved, expected) -> str:
    """'float32 -> bfloat16' (pairs joined by ', ') for the dtypes that differ between the saved
    metadata and the expected tree, which a params-only load casts; '' when none differ."""
    have, want = _flat(saved), _flat(expected)
    pairs = {(str(jax.numpy.dtype(have[k].dtype)), str(jax.numpy.dtype(want[k].dtype))) for k in set(have) & set(want)
             if have[k].dtype is not None and jax.numpy.dtype(have[k].dtype) != jax.numpy.dtype(want[k].dtype)}
    return ", ".join(f"{a} -> {b}" for a, b in sorted(pairs))


class CheckpointMismatch(CheckpointError):
    """A checkpoint whose arrays differ from those the config expects (names, shapes, dtypes)."""


def raise_on_mismatch(path, saved, expected, only_prefix: str = "", cast_floats: bool = False) -> None:
    problems = describe_mismatch(saved, expected, only_prefix, cast_floats)
    if problems:
        shown = "\n  ".join(problems[:20]) + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        raise CheckpointMismatch(
            f"checkpoint {path} does not match this config ({len(problems)} difference(s)):\n  {shown}\n"
            f"{_layer_layout_hint(_flat(saved), _flat(expected))}"
            "Use the model settings the checkpoint was made with (a training run keeps its config with each "
            "checkpoint; `tessera.tools.convert` printed the keys of the ones it writes), or, for a training "
            "run, start a new run_name. Nothing was loaded or overwritten."
        )


_ONE_LAYER = re.compile(r"(^|/)layers_\d+/")
_STACKED = re.compile(r"(^|/)layers/")


def _layer_layout_hint(have: dict, want: dict) -> str:
    """A line naming scan_layers when the checkpoint holds the decoder's layers stacked ([layers, ...]
    arrays under `layers`) and the config expects one entry per layer (`layers_0`, ...), or the reverse."""
    def layout(keys):
        return (any(_STACKED.search(k) for k in keys), any(_ONE_LAYER.search(k) for k in keys))

    (saved_stacked, saved_single), (want_stacked, want_single) = layout(have), layout(want)
    if saved_stacked and want_single and not saved_single and not want_stacked:
        return "The checkpoint holds its layers stacked (saved with scan_layers=true): set scan_layers=true.\n"
    if saved_single and want_stacked and not saved_stacked and not want_single:
        return "The checkpoint holds one entry per layer (saved with scan_layers=false): set scan_layers=false.\n"
    return ""
