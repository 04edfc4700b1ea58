"""`matmul_precision` (MaxText's key): the precision JAX gives the model's products, and the Pallas kernels kept
out of it.

The model's methods (`ModelDef`) and the train step's gradient are traced in `matmul_precision(cfg)`, JAX's
default matmul precision for that while: the forward products and those JAX derives for the backward pass (it
derives them after the forward pass is traced, so the gradient must be taken inside as well). Pallas kernels (splash
attention, megablox) run as written: Mosaic compiles a bfloat16 product asked for at HIGHEST not at all ("Bad lhs
type", splash's forward on v5p), and MaxText's key reaches its dense layers and reference attention only.
"""

from __future__ import annotations

import contextlib

import jax


def matmul_precision(cfg):
    """A context in which JAX traces products at `cfg.matmul_precision` (a ModelConfig's; "default": JAX's own,
    which JAX_DEFAULT_MATMUL_PRECISION sets)."""
    precision = cfg.matmul_precision
    return contextlib.nullcontext() if precision == "default" else jax.default_matmul_precision(precision)


def at_default_precision(fn, *arrays):
    """fn(*arrays) with its forward and backward passes traced at JAX's own precision, whatever precision the caller
    is traced in (a Pallas kernel's products keep their own); fn itself when no precision is set."""
    if jax.config.jax_default_matmul_precision is None:
        return fn(*arrays)

    def unset():
        return jax.default_matmul_precision(None)

    @jax.custom_vjp
    def call(*xs):
        with unset():
            return fn(*xs)

    def forward(*xs):
        with unset():
            return jax.vjp(fn, *xs)

    def backward(vjp, g):
        with unset():
            return vjp(g)

    call.defvjp(forward, backward)
    return call(*arrays)
