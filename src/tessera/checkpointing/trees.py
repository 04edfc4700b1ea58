"""A saved tree against the one a config expects: differences by path; stacked layers saved in
another pipeline layout or with the other scan_layers, reshaped on restore (the train state's other
entries read in another form: `tessera.checkpointing.state_entries`)."""

from __future__ import annotations

import logging
import math
import re
from typing import Any

import jax
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
    (circular pipelining, `tessera.models.pipeline`), or [R, L/R] against [R', L/R'], the same
    layers in the same order. Such
    arrays are read in their saved shape (split as `expected` splits the other axes) and
    `finish` reshapes them into `expected`'s shape and sharding; everything else is unchanged.
    An optimizer state saved with clipping on or off is read as saved, as are a spike window saved or not
    and moments in another dtype (`tessera.checkpointing.state_entries`), and one saved with the other
    scan_layers in its layout (`_rescanned`)."""
    # imported here: that module reads trees with this one's path helpers
    from tessera.checkpointing.state_entries import clip_slot, recast_moments, spike_window

    have = _flat(saved)
    windowed, rewindow = spike_window(have, expected)
    scanned, rescan = _rescanned(have, windowed)
    clipped, reslot = clip_slot(have, scanned)
    restacked_target, finish = _restacked(have, clipped)
    target, recast = recast_moments(have, restacked_target)
    return target, lambda restored: rewindow(rescan(reslot(finish(recast(restored)))))


_LAYER_KEY = re.compile(r"^(layers|dense_layers)_(\d+)$")  # the decoder's blocks with scan_layers=false


def _rescanned(have: dict[str, Any], expected):
    """(expected, finish) for a checkpoint saved with the other scan_layers: the decoder's blocks
    stacked on a leading axis (`layers`, `dense_layers`) where `expected` has one entry per block
    (`layers_0`, ...), or the reverse. Such arrays are read in their saved layout (split as
    `expected` splits the block's own axes) and `finish` splits or stacks them into `expected`'s,
    so a run, a parameter load or decode.py may change scan_layers."""
    unchanged = (expected, lambda restored: restored)
    want = _flat(expected)
    stacked = lambda keys: any(_STACKED.search(k) for k in keys)  # noqa: E731
    single = lambda keys: any(_ONE_LAYER.search(k) for k in keys)  # noqa: E731
    if stacked(have) and not single(have) and single(want) and not stacked(want):
        to_saved, saved_stacked = _stack_blocks, True
    elif single(have) and not stacked(have) and stacked(want) and not single(want):
        counts = {}
        for k in have:
            for m in re.finditer(r"(?:^|/)(layers|dense_layers)_(\d+)/", k):
                counts[m[1]] = max(counts.get(m[1], 0), int(m[2]) + 1)
        to_saved, saved_stacked = (lambda d: _unstack_blocks(d, counts)), False
    else:
        return unchanged
    try:
        target = _map_dicts(expected, to_saved)
    except ValueError:  # block counts that do not match: the mismatch report says what differs
        return unchanged
    if {k for k in _flat(target)} - set(have):
        return unchanged
    if _block_count(have) == _block_count(want):  # another depth is refused (the mismatch, in the saved layout)
        log.info("checkpoint: saved %s, restored %s: the blocks' arrays are %s",
                 _stacking(saved_stacked, _pipelined(have)), _stacking(not saved_stacked, _pipelined(want)),
                 "split per block" if saved_stacked else "stacked")

    def finish(restored):
        return _from_saved(expected, restored, saved_stacked)

    return target, finish


def _stacking(stacked: bool, pipelined: bool) -> str:
    """How a layout of the decoder's blocks came about, for the log: a pipeline stacks them whatever
    scan_layers says (a pipelined run saved with scan_layers=false was logged as scan_layers=true)."""
    if stacked and pipelined:
        return "pipelined (the blocks stacked over the stages, whatever scan_layers)"
    return f"with scan_layers={str(stacked).lower()}"


def _pipelined(flat: dict[str, Any]) -> bool:
    """Whether the decoder's stacked blocks of `flat` (arrays, ShapeDtypeStructs or Orbax metadata)
    are split over a pipeline's stages: a `stage` mesh axis of more than one device in their sharding."""
    for key, leaf in flat.items():
        sharding = getattr(leaf, "sharding", None)
        if sharding is None or not {"layers", "dense_layers"} & set(key.split("/")):
            continue
        if isinstance(sharding, NamedSharding):
            names, sizes, spec = sharding.mesh.axis_names, tuple(sharding.mesh.devices.shape), sharding.spec
        elif hasattr(sharding, "axis_names") and hasattr(sharding, "partition_spec"):  # Orbax's saved metadata
            names, sizes, spec = sharding.axis_names, tuple(sharding.shape), sharding.partition_spec
        else:
            continue
        used = {a for entry in spec for a in (entry if isinstance(entry, (tuple, list)) else (entry,))}
        if "stage" in used and "stage" in names and sizes[list(names).index("stage")] > 1:
            return True
    return False


def _map_dicts(node, fn):
    """`node` with `fn` applied to every dict in it, innermost first (tuples and NamedTuples kept)."""
    if isinstance(node, dict):
        return fn({k: _map_dicts(v, fn) for k, v in node.items()})
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        return type(node)(*(_map_dicts(v, fn) for v in node))
    if isinstance(node, (tuple, list)):
        return type(node)(_map_dicts(v, fn) for v in node)
    return node


def _block_spec(s, lead: int) -> tuple:
    spec = tuple(s.sharding.spec) + (None,) * (len(s.shape) - len(s.sharding.spec))
    return spec[lead:]


def _stack_blocks(d: dict) -> dict:
    """A dict's `layers_0 .. layers_{n-1}` (and `dense_layers_i`) as one `layers` entry of [n, ...] arrays."""
    out = dict(d)
    for base in ("layers", "dense_layers"):
        found = sorted(int(m[2]) for k in d if (m := _LAYER_KEY.match(str(k))) and m[1] == base)
        if not found:
            continue
        if found != list(range(len(found))) or base in d:
            raise ValueError(f"{base}: blocks {found}")
        blocks = [out.pop(f"{base}_{i}") for i in found]
        out[base] = jax.tree.map(lambda *xs: jax.ShapeDtypeStruct((len(xs), *xs[0].shape), xs[0].dtype, sharding=(
            NamedSharding(xs[0].sharding.mesh, PartitionSpec(None, *_block_spec(xs[0], 0)))
            if isinstance(xs[0].sharding, NamedSharding) else xs[0].sharding)), *blocks)
    return out


def _unstack_blocks(d: dict, counts: dict[str, int]) -> dict:
    """A dict's stacked `layers` (and `dense_layers`) entry as `layers_0 .. layers_{n-1}`."""
    out = dict(d)
    for base, n in counts.items():
        if base not in d:
            continue
        leaves = jax.tree.leaves(d[base])
        if any(len(x.shape) == 0 or x.shape[0] != n for x in leaves):
            raise ValueError(f"{base}: {n} blocks saved")
        blocks = out.pop(base)
        for i in range(n):
            out[f"{base}_{i}"] = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=(
                NamedSharding(x.sharding.mesh, PartitionSpec(*_block_spec(x, 1)))
                if isinstance(x.sharding, NamedSharding) else x.sharding)), blocks)
    return out


def _from_saved(want, got, saved_stacked: bool):
    """`got` (restored in the saved layout) in `want`'s layout and shardings (see _rescanned)."""
    if isinstance(want, dict):
        split = {}  # base: its blocks, each split from the stacked arrays once
        for base in {m[1] for k in want if (m := _LAYER_KEY.match(str(k))) and saved_stacked and k not in got
                     and m[1] in got}:
            n = sum(1 for k in want if (m := _LAYER_KEY.match(str(k))) and m[1] == base)
            split[base] = _split_blocks(got[base], [want[f"{base}_{i}"] for i in range(n)])
        out = {}
        for k, w in want.items():
            m = _LAYER_KEY.match(str(k))
            if m and m[1] in split:
                out[k] = split[m[1]][int(m[2])]
            elif not saved_stacked and k in ("layers", "dense_layers") and k not in got:
                n = sum(1 for g in got if _LAYER_KEY.match(str(g)) and str(g).startswith(f"{k}_"))
                out[k] = jax.tree.map(lambda s, *xs: jax.jit(lambda *a: jax.numpy.stack(a),
                                                             out_shardings=s.sharding)(*xs),
                                      w, *[got[f"{k}_{i}"] for i in range(n)])
            else:
                out[k] = _from_saved(w, got[k], saved_stacked)
        return out
    if isinstance(want, tuple) and hasattr(want, "_fields"):
        return type(want)(*(_from_saved(w, g, saved_stacked) for w, g in zip(want, got)))
    if isinstance(want, (tuple, list)):
        return type(want)(_from_saved(w, g, saved_stacked) for w, g in zip(want, got))
    return got


def _split_blocks(stacked, wants: list) -> list:
    """The blocks of a stacked subtree, each in the layout and shardings of its entry in `wants`."""
    leaves, treedef = jax.tree.flatten(stacked)
    want_leaves = [treedef.flatten_up_to(w) for w in wants]
    pieces = []
    for j, x in enumerate(leaves):
        shardings = tuple(w[j].sharding for w in want_leaves)
        pieces.append(jax.jit(lambda a: tuple(jax.lax.index_in_dim(a, i, keepdims=False) for i in range(len(wants))),
                              out_shardings=shardings)(x))
    return [jax.tree.unflatten(treedef, [p[i] for p in pieces]) for i in range(len(wants))]


def _circular_lead(flat: dict[str, Any]) -> tuple[int, ...] | None:
    """(R, L/R) when every stacked-layer array of `flat` starts with the same two axes (a circular
    pipeline's layout; plain [L, ...] arrays differ in their second), else None."""
    leads = {tuple(a.shape[:2]) for k, a in flat.items() if "layers" in k.split("/") and len(a.shape) >= 2}
    return leads.pop() if len(leads) == 1 else None


def _restacked(have: dict[str, Any], expected):
    moved = []
    # [R, L/R] saved, [R', L/R'] wanted: another repeat count (or stage count), the same blocks in the same order
    saved_lead, wanted_lead = _circular_lead(have), _circular_lead(_flat(expected))
    both_circular = None not in (saved_lead, wanted_lead) and math.prod(saved_lead) == math.prod(wanted_lead)

    def adapt(path, want):
        key = _path_key(path)
        h = have.get(key)
        if h is None or not hasattr(want, "sharding") or "layers" not in key.split("/"):
            return want
        hs, ws = tuple(h.shape), tuple(want.shape)
        # leading axes [L] saved, [R, L/R] wanted, or the other way round; or [R, L/R] both, with other R
        for a, b in ((1, 2), (2, 1)) + (((2, 2),) if both_circular else ()):
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
    """Human-readable differences between saved metadata and the expected abstract tree, the
    parameters' first (the optimizer state's paths repeat them, two or three times over:
    listed first, they filled the 20 lines shown). `cast_floats`: a floating dtype that differs from
    the expected floating dtype is not a difference."""
    have, want = _flat(saved), _flat(expected)
    have = {k: v for k, v in have.items() if k.startswith(only_prefix)}
    order = lambda keys: sorted(keys, key=lambda k: (not k.startswith("params/"), k))  # noqa: E731
    problems = [f"missing in checkpoint: {k} {tuple(want[k].shape)}" for k in order(set(want) - set(have))]
    problems += [f"not expected by this config: {k} {tuple(have[k].shape)}" for k in order(set(have) - set(want))]
    for k in order(set(have) & set(want)):
        h, w = have[k], want[k]
        if tuple(h.shape) != tuple(w.shape):
            problems.append(f"{k}: checkpoint has shape {tuple(h.shape)}, this config expects {tuple(w.shape)}")
        elif h.dtype is not None and jax.numpy.dtype(h.dtype) != jax.numpy.dtype(w.dtype) and not (
                cast_floats and _weights(h.dtype) and _weights(w.dtype)):
            problems.append(f"{k}: checkpoint has dtype {h.dtype}, this config expects {w.dtype}")
    return problems


def _weights(dtype) -> bool:
    """A floating dtype of 16 bits or more, which a parameters-only load may cast to another. Float8
    holds quantized values: cast to another float8 format (quantization=fp8's e4m3fn read as nanoo_fp8's
    e4m3fnuz) every value above 240 became NaN, and decoding gave token 0 without a word."""
    dtype = jax.numpy.dtype(dtype)
    return jax.numpy.issubdtype(dtype, jax.numpy.floating) and dtype.itemsize >= 2


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
            "checkpoint; a converted one needs the model_name and keys given to `tessera.tools.convert`), or, "
            "for a training run, start a new run_name. Nothing was loaded or overwritten."
        )


_ONE_LAYER = re.compile(r"(^|/)layers_\d+/")
_STACKED = re.compile(r"(^|/)layers/")


def _block_count(flat: dict[str, Any]) -> int | None:
    """The decoder blocks (`layers`) whose parameters `flat` holds: the leading axis of the stacked arrays
    (both leading axes of a circular pipeline's [R, L/R]), or the number of `layers_i` entries."""
    params = {k: v for k, v in flat.items() if k.startswith("params/")} or flat
    single = {int(m[1]) for k in params if (m := re.search(r"(?:^|/)layers_(\d+)/", k))}
    if single:
        return max(single) + 1
    lead = _circular_lead(params)
    stacked = [a.shape[0] for k, a in params.items() if _STACKED.search(k) and len(a.shape)]
    return math.prod(lead) if lead is not None else (stacked[0] if stacked else None)


def _layer_layout_hint(have: dict, want: dict) -> str:
    """A line for a checkpoint that holds the decoder's blocks in the other layout (stacked [layers, ...]
    arrays under `layers`, or one entry per block, `layers_0`, ...): with another number of them it names
    both counts (scan_layers may change at a load, `_rescanned`, the depth may not; the line said to set
    scan_layers, which then mismatched again), else it names the scan_layers that reads it as it is."""
    def layout(keys):
        return (any(_STACKED.search(k) for k in keys), any(_ONE_LAYER.search(k) for k in keys))

    def described(stacked: bool, count: int | None) -> str:
        return f"{count}, " + ("stacked (scan_layers=true or a pipeline)" if stacked else
                               "one entry per block (scan_layers=false)")

    (saved_stacked, saved_single), (want_stacked, want_single) = layout(have), layout(want)
    saved, wanted = _block_count(have), _block_count(want)
    if saved_stacked != want_stacked and saved_single != want_single and saved != wanted:
        return (f"The checkpoint holds decoder blocks {described(saved_stacked, saved)}; this config has "
                f"{described(want_stacked, wanted)}: scan_layers may change at a load, the number of layers may not.\n")
    if saved_stacked and want_single and not saved_single and not want_stacked:
        return "The checkpoint holds its layers stacked (saved with scan_layers=true): set scan_layers=true.\n"
    if saved_single and want_stacked and not saved_stacked and not want_single:
        return "The checkpoint holds one entry per layer (saved with scan_layers=false): set scan_layers=false.\n"
    return ""
