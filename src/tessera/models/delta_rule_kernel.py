"""The gated delta rule's sequential part as a Pallas TPU kernel, forward and backward.

`gated_deltanet.chunked_delta_rule` turns a sequence into chunks whose own products are parallel
(the WY solve, the in-chunk scores); what remains sequential is one recurrence over the chunks of
each (row, value head), carrying the memory S [dk, dv]. Per chunk, from S at its start:

    V = U - W S                      the chunk's values corrected by what the memory already answers
    O = Q S + A V                    its outputs: the memory's reading plus the in-chunk part
    S' = c S + K^T V                 the memory after it (c: the decay, 0 where a segment ends)

As XLA ops this is a `while` loop whose every step reads and writes S and the chunk's tensors from
HBM as several small fusions. The kernel runs the loop over the chunks as its innermost grid
axis with S held in VMEM across steps, one (row, head) pair per outer grid step (both parallel,
for the cores), and its backward pass is a second kernel running the chunks in reverse with the
memory's gradient in VMEM:

    dV = A^T dO + K dS'      dA = dO V^T      dQ = dO S^T      dK = V dS'^T
    dU = dV                  dW = -dV S^T     dc = sum(S * dS')
    dS = Q^T dO + c dS' - W^T dV

The backward pass needs S at each chunk's start ([N, dk, dv] per pair: as many bytes as the
chunks' own inputs). The forward pass does not keep it ("delta_rule_chunks" writes only the
outputs and the final memory); the backward pass first walks the chunks forward again writing it
("delta_rule_chunks_states", which forms no outputs), then walks them in reverse. The recurrence's
products are a small part of the layer's, and this way no layer holds its chunks' memories from
its forward pass to its backward pass (XLA's loop keeps them, as the residuals of its `while`),
and under a remat policy, whose forward pass the backward pass repeats anyway, they are written
once instead of twice. Every product is float32 at the highest precision.
`interpret=True` runs the kernels in Pallas' interpreter (the tests, on a CPU).

Under a mesh the kernels run inside `shard_map`: rows and heads split as the activations' logical
`batch` and `act_heads` axes are (data, fsdp, expert; tensor); a sequence split is gathered first (the recurrence needs the whole sequence).
"""

from __future__ import annotations

import functools
import logging
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

from tessera.mesh import logical_spec, traced_platform

log = logging.getLogger(__name__)
HIGHEST = jax.lax.Precision.HIGHEST
_FELL_BACK: set[str] = set()  # platforms whose fallback from gdn_kernel=pallas was logged (once per process)


def select_delta_rule_kernel(choice: str) -> str:
    """The recurrence's kernel for `gdn_kernel`=`choice` on the platform being traced: "pallas" on TPUs
    (unless xla was asked for), else "xla", with one logged line when pallas was asked for."""
    platform = traced_platform()
    if platform == "tpu" and choice != "xla":
        return "pallas"
    if choice == "pallas" and platform not in _FELL_BACK:
        _FELL_BACK.add(platform)
        log.info("gdn_kernel=pallas: the Pallas kernel of the gated delta rule is compiled for TPUs only; on %s the "
                 "recurrence runs as an XLA loop (the same results)", platform)
    return "xla"


def _mm(a, b, contract_a: int = 1, contract_b: int = 0):
    """a @ b contracting a's axis `contract_a` with b's `contract_b` (2-D, float32, highest precision)."""
    return jax.lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())), precision=HIGHEST,
                               preferred_element_type=jnp.float32)


def _start(s0_ref, s_vmem):
    """The memory before the first chunk, into VMEM at a pair's first step."""
    @pl.when(pl.program_id(2) == 0)
    def _():
        s_vmem[...] = s0_ref[...]


def _forward_kernel(u_ref, w_ref, a_ref, q_ref, k_ref, c_ref, s0_ref, out_ref, final_ref, s_vmem):
    _start(s0_ref, s_vmem)
    s = s_vmem[...]
    v = u_ref[...] - _mm(w_ref[...], s)
    out_ref[...] = _mm(q_ref[...], s) + _mm(a_ref[...], v)
    s_vmem[...] = final_ref[...] = s * c_ref[...] + _mm(k_ref[...], v, 0, 0)


def _states_kernel(u_ref, w_ref, k_ref, c_ref, s0_ref, states_ref, final_ref, s_vmem):
    _start(s0_ref, s_vmem)
    s = states_ref[...] = s_vmem[...]
    s_vmem[...] = final_ref[...] = s * c_ref[...] + _mm(k_ref[...], u_ref[...] - _mm(w_ref[...], s), 0, 0)


def _backward_kernel(u_ref, w_ref, a_ref, q_ref, k_ref, c_ref, states_ref, do_ref, dfinal_ref,
                     du_ref, dw_ref, da_ref, dq_ref, dk_ref, dc_ref, ds0_ref, ds_vmem):
    @pl.when(pl.program_id(2) == 0)
    def _():
        ds_vmem[...] = dfinal_ref[...]

    ds_after, s, w, do = ds_vmem[...], states_ref[...], w_ref[...], do_ref[...]
    v = u_ref[...] - _mm(w, s)
    dv = _mm(a_ref[...], do, 0, 0) + _mm(k_ref[...], ds_after)
    du_ref[...] = dv
    dw_ref[...] = -_mm(dv, s, 1, 1)
    da_ref[...] = _mm(do, v, 1, 1)
    dq_ref[...] = _mm(do, s, 1, 1)
    dk_ref[...] = _mm(v, ds_after, 1, 1)
    dc_ref[...] = jnp.sum(s * ds_after, axis=0, keepdims=True)
    ds = _mm(q_ref[...], do, 0, 0) + c_ref[...] * ds_after - _mm(w, dv, 0, 0)
    ds_vmem[...] = ds
    ds0_ref[...] = ds


def _run(kernel, name: str, reverse: bool, ins: str, outs: str, *args, interpret: bool):
    """pallas_call of `kernel` over the grid (row, head, step) on `args`; `ins` and `outs` name each operand's
    tile, one letter each: a chunk's [C, dv] (v), [C, dk] (k), [C, C] (a), [1, dv] (c) or [dk, dv] (s) tile of
    an [N, B, H, ...] array, the step taking chunk n (N - 1 - n in `reverse`), or a pair's [dk, dv] tile of a
    [B, H, dk, dv] array (p). Every output is float32."""
    n, b, h, chunk, dv = args[0].shape
    dk = args[1].shape[-1]
    at = (lambda i: n - 1 - i) if reverse else (lambda i: i)
    sq = pl.Squeezed()
    tiles = {"v": (chunk, dv), "k": (chunk, dk), "a": (chunk, chunk), "c": (1, dv), "s": (dk, dv)}
    spec = {x: pl.BlockSpec((sq, sq, sq, *tile), lambda b_, h_, i: (at(i), b_, h_, 0, 0)) for x, tile in tiles.items()}
    spec["p"] = pl.BlockSpec((sq, sq, dk, dv), lambda b_, h_, i: (b_, h_, 0, 0))
    shape = {x: (n, b, h, *tile) for x, tile in tiles.items()} | {"p": (b, h, dk, dv)}
    return pl.pallas_call(
        kernel, grid=(b, h, n), in_specs=[spec[x] for x in ins], out_specs=[spec[x] for x in outs],
        out_shape=[jax.ShapeDtypeStruct(shape[x], jnp.float32) for x in outs],
        scratch_shapes=[pltpu.VMEM((dk, dv), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret, name=name,
    )(*args)


def _forward(u, w, a, q, k, c, s0, interpret: bool):
    """(outputs, the final memory)."""
    return _run(_forward_kernel, "delta_rule_chunks", False, "vkakkcp", "vp", u, w, a, q, k, c, s0,
                interpret=interpret)


def _states(u, w, k, c, s0, interpret: bool):
    """The memory at each chunk's start (for the backward pass; no outputs formed)."""
    return _run(_states_kernel, "delta_rule_chunks_states", False, "vkkcp", "sp", u, w, k, c, s0,
                interpret=interpret)[0]  # (a second output, the final memory, keeps the kernel's name plain in HLO)


def _backward(u, w, a, q, k, c, states, d_out, d_final, interpret: bool):
    """The gradients of u, w, a, q, k, c and the starting memory."""
    return _run(_backward_kernel, "delta_rule_chunks_bwd", True, "vkakkcsvp", "vkakkcp", u, w, a, q, k, c, states,
                d_out, d_final, interpret=interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _recurrence(u, w, a, q, k, c, s0, interpret):
    return tuple(_forward(u, w, a, q, k, c, s0, interpret))


def _recurrence_fwd(u, w, a, q, k, c, s0, interpret):
    return _recurrence(u, w, a, q, k, c, s0, interpret), (u, w, a, q, k, c, s0)


def _recurrence_bwd(interpret, residuals, cotangents):
    """The memory at each chunk's start, recomputed here rather than kept from the forward pass, then the
    reverse walk."""
    u, w, a, q, k, c, s0 = residuals
    states = _states(u, w, k, c, s0, interpret)
    return _backward(u, w, a, q, k, c, states, *cotangents, interpret)


_recurrence.defvjp(_recurrence_fwd, _recurrence_bwd)


def chunk_recurrence(u, w, a, q, k, carried, state, *, interpret: bool = False):
    """(outputs [N, B, H, C, dv], final memory [B, H, dk, dv]) of the recurrence in the module
    docstring, from the chunks' corrected values U [N, B, H, C, dv], state reach W [N, B, H, C, dk],
    in-chunk scores A [N, B, H, C, C], query reads Q and key writes K [N, B, H, C, dk], decays c
    [N, B, H] and the memory before the first chunk [B, H, dk, dv]; all float32."""
    n, b, h, _, dv = u.shape
    c = jnp.broadcast_to(carried[..., None, None], (n, b, h, 1, dv))
    args = (u, w, a, q, k, c, state)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or math.prod(mesh.shape.values()) == 1:
        return _recurrence(*args, interpret)
    rows, heads = logical_spec(("batch", "act_heads"), (b, h), dict(mesh.shape))  # as the activations split
    chunked, pair = P(None, rows, heads, None, None), P(rows, heads, None, None)
    return jax.shard_map(lambda *xs: _recurrence(*xs, interpret), in_specs=(chunked,) * 6 + (pair,),
                         out_specs=(chunked, pair), check_vma=False)(*args)
