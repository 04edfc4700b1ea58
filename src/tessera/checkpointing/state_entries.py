"""Train-state entries a checkpoint holds in another form than the config expects, read as saved and
put in the expected form after the restore (`tessera.checkpointing.trees.restacked` chains them): the
optimizer state saved with gradient clipping turned on or off, skip_step_on_spikes' window saved or not
(or of another size), and moments saved in another floating dtype (mu_dtype changed). Each takes the
saved tree's arrays by path (`have`) and the expected tree, and returns (the tree to read, finish)."""

from __future__ import annotations

import logging
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from tessera.checkpointing.trees import _flat, _path_key, _weights
from tessera.spikes import WINDOW, new_window

log = logging.getLogger(__name__)


def clip_slot(have: dict[str, Any], expected):
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


def spike_window(have: dict[str, Any], expected):
    """(expected, finish) for a train state saved without skip_step_on_spikes' window where `expected` has one,
    with one where it has none, or with a window of another skip_step_interval: the state reads without the saved
    window (or with it, to be dropped), and `finish` adds a new, empty window in `expected`'s sharding. So a run
    may turn the spike check on or off at a resume, or change its interval."""
    unchanged = (expected, lambda restored: restored)
    if not isinstance(expected, dict) or "opt_state" not in expected:
        return unchanged
    saved = {k.split("/", 1)[1]: a for k, a in have.items() if k.split("/", 1)[0] == WINDOW}
    want = expected.get(WINDOW)
    if want is None and not saved:
        return unchanged
    if want is not None and saved and all(k in saved and tuple(saved[k].shape) == tuple(w.shape)
                                          for k, w in want.items()):
        return unchanged
    rest = {k: v for k, v in expected.items() if k != WINDOW}
    if want is None:  # the check is off now: read the saved window as saved, then drop it
        log.info("checkpoint: saved with skip_step_on_spikes' window of recent losses, restored without the check")
        replicated = NamedSharding(jax.tree.leaves(expected["opt_state"])[0].sharding.mesh, PartitionSpec())
        target = {**rest, WINDOW: {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated)
                                   for k, a in saved.items()}}
        return target, lambda restored: {k: v for k, v in restored.items() if k != WINDOW}
    interval = want["losses"].shape[0]
    log.info("checkpoint: saved %s, restored with skip_step_on_spikes' window of %d steps: it starts empty, and no "
             "step is skipped before it holds max(2, %d // 2) values",
             f"with a window of {saved['losses'].shape[0]} steps" if saved else "without the spike check's window",
             interval, interval)
    if saved:  # read the old window, to be replaced
        target = {**rest, WINDOW: {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=want[k].sharding)
                                   for k, a in saved.items()}}
    else:
        target = rest

    def finish(restored):
        window = new_window(interval)
        return {**{k: v for k, v in restored.items() if k != WINDOW},
                WINDOW: {k: jax.device_put(window[k], want[k].sharding) for k in window}}

    return target, finish


def recast_moments(have: dict[str, Any], expected):
    """(expected, finish) for an optimizer state whose moments were saved in another floating dtype (mu_dtype
    changed at a resume: float32 first moments read into bfloat16 ones, or back): they are read as saved and
    `finish` casts them to `expected`'s dtype. Parameters are not cast here (weight_dtype stays a mismatch)."""
    if not isinstance(expected, dict) or "opt_state" not in expected:
        return expected, lambda restored: restored
    want = expected["opt_state"]

    def as_saved(path, leaf):  # the leaf to read: in the saved dtype where only a floating dtype differs
        h = have.get("opt_state/" + _path_key(path))
        if h is None or getattr(h, "dtype", None) is None or tuple(h.shape) != tuple(leaf.shape):
            return leaf
        was, now = np.dtype(h.dtype), np.dtype(leaf.dtype)
        if was == now or not (_weights(was) and _weights(now)):
            return leaf
        return jax.ShapeDtypeStruct(leaf.shape, was, sharding=leaf.sharding)

    read = jax.tree_util.tree_map_with_path(as_saved, want)
    changed = [(r.dtype, w.dtype) for r, w in zip(jax.tree.leaves(read), jax.tree.leaves(want)) if r.dtype != w.dtype]
    if not changed:
        return expected, lambda restored: restored
    log.info("checkpoint: %d optimizer-state arrays saved in %s, restored as %s (mu_dtype)", len(changed),
             *changed[0])

    def finish(restored):
        cast = jax.tree.map(lambda x, w: x if x.dtype == w.dtype else x.astype(w.dtype), restored["opt_state"], want)
        return {**restored, "opt_state": cast}

    return {**expected, "opt_state": read}, finish
