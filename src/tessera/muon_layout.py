"""Muon's Newton-Schulz iterations on whole matrices, each device orthogonalizing its own share.

Left to GSPMD, the iterations on FSDP-split matrices are split only partly: compiled for v5p-128,
the Llama 2 7B update took 3.2e13 FLOPs per chip (three times the iterations' products spread
evenly over the 64 chips), 66 all-reduces and 9.4 GiB of temporaries. Here the Muon leaves are
regrouped before optax's `scale_by_muon` runs: the matrices of leaves with the same batch shape and
the same [rows <= columns] shape (a matrix with more rows than columns is transposed first, as
optax's iteration does anyway) are stacked into one [count, rows, columns] array whose first axis
is split over every device of the mesh, padded with zero matrices (which the iteration keeps at
zero) to a multiple of the device count; afterwards each leaf takes its matrices back. The state
stays optax's, in the parameters' layout, so checkpoints are unchanged. A group with fewer matrices
than devices is split over only some mesh axes, each matrix then computed by the devices of the
others, as long as that is at most MAX_COPIES devices; else, and for matrices split along two of
their axes (rows over fsdp, columns over tensor), GSPMD splits the iterations as it can.
Measured by AOT compiles (README, "The optimizer"): Llama 2 7B on v5p-128 1.29e13 FLOPs per chip
(1.07e13 for a perfect split), 1.3 GiB of temporaries and 12 all-to-alls; the v6e Mixtral 8x7B
recipe fits (23.8 GiB per chip; 37.6 before, over its 30.4 budget).

The batch axes a leaf is already split over (experts over `expert`, layers over `stage`) go first in
the stacked axis, and their mesh axes first in its split, so that the regrouping moves each
matrix within the devices that already hold it.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec
from optax.contrib import MuonDimensionNumbers, scale_by_muon

from tessera.mesh import logical_spec

# A group of fewer matrices than devices is split over some mesh axes and computed on each device of
# the others: stacked while at most this many devices compute each matrix, else left to GSPMD
MAX_COPIES = 4


def scale_by_muon_whole_matrices(beta: float, eps: float, masked_dims: Any, logical_axes: Any, mu_dtype=None
                                 ) -> optax.GradientTransformation:
    """optax's scale_by_muon (Nesterov momentum `beta`, kept in `mu_dtype` (None: the parameters'),
    Newton-Schulz iterations) for the leaves whose dimension numbers `masked_dims` gives (MaskedNode
    for the others), run on regrouped matrices under a mesh of more than one device (module docstring)."""
    base = scale_by_muon(beta=beta, eps=eps, mu_dtype=mu_dtype, weight_dimension_numbers=lambda _: masked_dims)

    def update(updates, state, params=None):
        del params
        groups = MatrixGroups(updates, masked_dims, logical_axes)
        if not groups.stacked:
            return base.update(updates, state)
        inner = scale_by_muon(beta=beta, eps=eps, mu_dtype=mu_dtype, weight_dimension_numbers=groups.dims)
        new_updates, new_state = inner.update(groups.stack(updates), state._replace(mu=groups.stack(state.mu)))
        return groups.unstack(new_updates), new_state._replace(mu=groups.unstack(new_state.mu))

    return optax.GradientTransformation(base.init, update)


class _Leaf:
    """One Muon leaf's layout: batch axes (split ones first), input and output axes, orientation."""

    def __init__(self, shape: tuple, d: MuonDimensionNumbers, spec: PartitionSpec):
        matrix = (*d.reduction_axis, *d.output_axis)
        batch = [i for i in range(len(shape)) if i not in matrix]
        self.batch = sorted(batch, key=lambda i: spec[i] is None)  # split batch axes first (a stable sort)
        self.order = (*self.batch, *matrix)
        self.shape = shape
        self.fan_in = math.prod(shape[i] for i in d.reduction_axis)
        self.fan_out = math.prod(shape[i] for i in d.output_axis)
        self.transposed = self.fan_in > self.fan_out
        self.split = tuple(a for i in self.batch for a in _axes(spec[i]))  # mesh axes over the batch axes
        # matrices split along one of their axes move to the stacked layout by all-to-alls; split along
        # two (rows over fsdp, columns over tensor), GSPMD gathered whole stacks on the way: those stay
        self.movable = sum(spec[i] is not None for i in matrix) <= 1

    @property
    def count(self) -> int:
        return math.prod(self.shape[i] for i in self.batch)

    def key(self, dtype) -> tuple:
        """Leaves with equal keys stack: the same batch shape and split, matrix shape and dtype."""
        return (tuple(self.shape[i] for i in self.batch), self.split, *self.matrix, jnp.dtype(dtype).name)

    @property
    def matrix(self) -> tuple:
        return min(self.fan_in, self.fan_out), max(self.fan_in, self.fan_out)

    def as_matrices(self, x):
        """[*batch, rows, columns], rows <= columns."""
        m = x.transpose(self.order).reshape(*(self.shape[i] for i in self.batch), self.fan_in, self.fan_out)
        return m.swapaxes(-1, -2) if self.transposed else m

    def from_matrices(self, m):
        """The leaf from its matrices ([count, rows, columns] or [*batch, rows, columns])."""
        m = m.swapaxes(-1, -2) if self.transposed else m
        return m.reshape([self.shape[i] for i in self.order]).transpose([self.order.index(i) for i in
                                                                          range(len(self.shape))])


def _axes(entry) -> tuple:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


class MatrixGroups:
    """The Muon leaves of one pytree as {name: array} for optax: each stacked group as group<k>
    ([count, rows, columns], split over the mesh axes `split` names), every other Muon leaf as leaf<i>."""

    def __init__(self, tree: Any, masked_dims: Any, logical_axes: Any):
        is_masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
        self.leaves, self.treedef = jax.tree.flatten(tree, is_leaf=is_masked)
        leaf_dims = jax.tree.leaves(masked_dims, is_leaf=lambda x: is_masked(x) or isinstance(x, MuonDimensionNumbers))
        names = self.treedef.flatten_up_to(logical_axes)
        mesh = jax.sharding.get_abstract_mesh()
        sizes = {} if mesh.empty else dict(mesh.shape)
        self.mesh_axes = tuple(a for a, n in sizes.items() if n > 1)
        self.sizes = sizes
        self.devices = math.prod(sizes[a] for a in self.mesh_axes)
        self.layouts: dict[int, _Leaf] = {}
        by_key: dict[tuple, list[int]] = {}
        for i, (x, d) in enumerate(zip(self.leaves, leaf_dims)):
            if isinstance(d, MuonDimensionNumbers):
                self.layouts[i] = _Leaf(x.shape, d, logical_spec(names[i], x.shape, sizes))
                if self.layouts[i].movable:
                    by_key.setdefault(self.layouts[i].key(x.dtype), []).append(i)
        self.stacked: dict[tuple, list[int]] = {}  # key: members
        self.split: dict[tuple, tuple] = {}  # key: the mesh axes its stacked axis is split over
        for key, members in by_key.items() if self.devices > 1 else ():
            split = self._split(self.layouts[members[0]].split, len(members) * self.layouts[members[0]].count, sizes)
            if self.devices <= MAX_COPIES * math.prod(sizes[a] for a in split):
                self.stacked[key], self.split[key] = members, split
        grouped = {i for members in self.stacked.values() for i in members}
        self.dims = {f"leaf{i}": leaf_dims[i] for i in self.layouts if i not in grouped}
        self.dims.update({f"group{k}": MuonDimensionNumbers((1,), (2,)) for k in range(len(self.stacked))})

    def _split(self, first: tuple, count: int, sizes: dict) -> tuple:
        """The mesh axes a group of `count` matrices is split over: those its leaves' batch axes are
        split over first, then the others in mesh order, while one matrix per device is left at least."""
        split: tuple = ()
        for axis in (*first, *(a for a in self.mesh_axes if a not in first)):
            if math.prod(sizes[a] for a in split) * sizes[axis] <= count:
                split += (axis,)
        return split

    def stack(self, tree: Any) -> dict:
        leaves = self.treedef.flatten_up_to(tree)
        out = {name: leaves[int(name[4:])] for name in self.dims if name.startswith("leaf")}
        for k, (key, members) in enumerate(self.stacked.items()):
            m = jnp.concatenate([self.layouts[i].as_matrices(leaves[i]).reshape(-1, *self.layouts[i].matrix)
                                 for i in members])
            ways = math.prod(self.sizes[a] for a in self.split[key])
            m = jnp.pad(m, [(0, -m.shape[0] % ways), (0, 0), (0, 0)])
            out[f"group{k}"] = jax.lax.with_sharding_constraint(m, PartitionSpec(self.split[key] or None))
        return out

    def unstack(self, stacked: dict) -> Any:
        leaves = list(self.leaves)
        for name, x in stacked.items():
            if name.startswith("leaf"):
                leaves[int(name[4:])] = x
        for k, (key, members) in enumerate(self.stacked.items()):
            count = self.layouts[members[0]].count
            group = jax.lax.with_sharding_constraint(stacked[f"group{k}"], PartitionSpec(self.split[key] or None))
            for j, i in enumerate(members):
                m = group[j * count:(j + 1) * count]
                leaves[i] = self.layouts[i].from_matrices(m)
        return jax.tree.unflatten(self.treedef, leaves)
