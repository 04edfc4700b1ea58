"""TPU flash attention: Pallas splash attention from `jax.experimental.pallas.ops.tpu`.

Why this kernel: it ships with the pinned jax (no extra dependency whose releases could drift
from jax's), it is the kernel MaxText's TPU figures are measured with, and its block-sparse
masks skip the masked half of causal attention and everything outside a sliding window
without computing it. It supports everything Tessera's attention does: causal masks, sliding
windows (a `LocalMask`), Llama 4's attention within chunks (a `ChunkedCausalMask`), packed documents (segment ids), grouped-query heads (the "MQA"
variant, vmapped over kv heads), score soft-capping (`attn_logits_soft_cap`), sink logits
(`attention_sink`, an input of the kernel with its own gradient), and any score scale (the
queries are multiplied by it first, in float32 and rounded once, as the kernel does not scale).

Layout: queries [B, T, N, H] become [B, K, G, T, H] (K kv heads, G = N/K queries per kv head);
the kernel runs on one batch row and one kv head at a time (vmapped). Under a mesh it runs
inside `shard_map`: batch split over data/fsdp/expert, heads over tensor (kv heads too when
tensor divides them, else they are repeated to the query heads first). A sequence axis splits
the queries (context parallelism): each device gathers the keys, values and their segment ids
of the whole sequence over that axis and attends with its own part of the queries, the kernel's
mask tables split the same way (its `q_seq_shards`), so the global causal and window masks
hold. The backward pass reduce-scatters the key and value gradients back over the axis. Under a
causal mask contiguous parts are uneven work (the last part visits every key block, the first
only its own), so with `context_parallel_load_balance` the sequence is cut into 2 x S parts and
device j attends with parts j and 2S-1-j: two collective permutes bring its queries (and send
the outputs back), and the kernel's mask rows carry those queries' global positions.
The mask tables the kernel is built with are computed on the host; the masks here (`_Causal`,
`_Local`, `_Chunked`) answer the blocks a diagonal or window edge does not cross from their bounds, which
keeps that minutes rather than hours at a million tokens.
Tests run the same code with `interpret=True` (Pallas' interpreter on CPU).

Block sizes are the `sa_block_*` keys (MaxText's names); 0 picks the largest of 512, 256 and
128 that divides the sequence length (for the query blocks: one device's part of it).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu import splash_attention as sa
from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_mask import ChunkedCausalMask
from jax.sharding import PartitionSpec as P

from tessera.config import ConfigError, ModelConfig
from tessera.models.precision import at_default_precision

BLOCK_KEYS = ("sa_block_q", "sa_block_kv", "sa_block_kv_compute", "sa_block_q_dkv", "sa_block_kv_dkv",
              "sa_block_kv_dkv_compute", "sa_block_q_dq", "sa_block_kv_dq")
Q_BLOCK_KEYS = ("sa_block_q", "sa_block_q_dkv", "sa_block_q_dq")  # tiles of one device's queries
# the kernels walk each key/value block in steps of its compute block, which must divide it
COMPUTE_BLOCK_OF = {"sa_block_kv_compute": "sa_block_kv", "sa_block_kv_dkv_compute": "sa_block_kv_dkv"}
LANE = 128  # the kernel tiles the sequence in multiples of this


def unsupported(m: ModelConfig, length: int, mesh_shape: dict[str, int] | None) -> str | None:
    """Why splash attention cannot serve this model and sequence length, or None if it can."""
    if not length:
        return "the sequence length is not known here; splash attention is chosen only with one"
    if m.dtype == "float16":  # Mosaic: "failed to legalize operation 'tpu.load'" of f16 tiles (jax 0.12, v6e)
        return ("splash attention takes bfloat16 or float32 on TPU: Mosaic cannot compile its float16 loads "
                "(dtype=float16); dtype=bfloat16 keeps the kernel")
    shards = (mesh_shape or {}).get("sequence", 1)
    if shards > 1 and length % (LANE * shards):
        return (f"splash attention splits the queries over the sequence axis ({shards} ways) in tiles of {LANE}: "
                f"it needs a sequence length that is a multiple of {LANE * shards}, not {length}")
    if length % LANE:
        return f"splash attention needs a sequence length that is a multiple of {LANE}, not {length}"
    return None


def load_balanced(m: ModelConfig, length: int, shards: int) -> bool:
    """Whether a sequence split `shards` ways gives each device an early and a late part
    (context_parallel_load_balance, and a length cut into 2 x shards parts of whole tiles)."""
    return bool(m.context_parallel_load_balance) and shards > 1 and length % (2 * shards * LANE) == 0


def balanced_order(length: int, shards: int) -> np.ndarray:
    """The position in the sequence of each query row of the load-balanced layout: device j holds
    part j, then part 2*shards-1-j, of 2*shards equal parts."""
    size = length // (2 * shards)
    parts = [p for j in range(shards) for p in (j, 2 * shards - 1 - j)]
    return np.concatenate([np.arange(p * size, (p + 1) * size) for p in parts]).astype(np.int32)


def sequence_shards() -> int:
    """How many ways the ambient mesh's sequence axis splits the queries (1 without a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else dict(mesh.shape).get("sequence", 1)


def block_sizes(m: ModelConfig, length: int, q_shards: int = 1) -> sa.BlockSizes:
    """The kernel's tiles from the sa_block_* keys; ConfigError for any that does not divide `length`
    (the query blocks: `length / q_shards`, one device's queries when the sequence axis splits them),
    and for a compute block that does not divide its key/value block (0 takes that whole block)."""
    if length % LANE or (length // q_shards) % LANE:
        raise ConfigError(unsupported(m, length, {"sequence": q_shards}))
    balanced = load_balanced(m, length, q_shards)
    local = length // q_shards // (2 if balanced else 1)  # the queries a tile must divide: one part
    auto_kv = next(b for b in (512, 256, LANE) if length % b == 0)
    auto_q = next(b for b in (512, 256, LANE) if local % b == 0)
    chosen, bad, bad_q = {}, [], []
    for name in BLOCK_KEYS:
        queries = name in Q_BLOCK_KEYS
        span, auto = (local, auto_q) if queries else (length, chosen.get(COMPUTE_BLOCK_OF.get(name), auto_kv))
        value = min(getattr(m, name) or auto, span)
        inherited = name in COMPUTE_BLOCK_OF and not getattr(m, name)  # (its key/value block is named if bad)
        if (span % value or value % LANE) and not inherited:
            (bad_q if queries and q_shards > 1 else bad).append(f"{name}={getattr(m, name)}")
        chosen[name] = value
    if bad:
        raise ConfigError(f"{', '.join(bad)}: splash attention block sizes must be multiples of {LANE} that divide "
                          f"the sequence length {length} (0 picks one); e.g. {auto_kv}")
    if bad_q:
        parts = f" in two parts of {local} (context_parallel_load_balance)" if balanced else ""
        whole = length // q_shards  # one contiguous share, without the load balance
        unbalanced = all(whole % min(getattr(m, n) or auto_q, whole) == 0 for n in Q_BLOCK_KEYS)
        alternative = (f", or set context_parallel_load_balance=false (shares of {whole})"
                       if balanced and unbalanced else "")
        raise ConfigError(f"{', '.join(bad_q)}: with the sequence axis splitting the queries {q_shards} ways each "
                          f"device holds {whole} of them{parts}, and splash attention query blocks must "
                          f"be multiples of {LANE} that divide {local} (0 picks one); e.g. {auto_q}{alternative}")
    for name, block in COMPUTE_BLOCK_OF.items():
        if chosen[block] % chosen[name]:
            raise ConfigError(f"{name}={getattr(m, name)}: splash attention computes each key/value block of "
                              f"{block}={chosen[block]} in steps of it, so it must divide {chosen[block]} (0 takes "
                              f"the whole block); e.g. {chosen[block]}")
    fused = m.sa_use_fused_bwd_kernel
    layout = {name: getattr(sa.QKVLayout, getattr(m, f"sa_{name}_layout").upper())
              for name in ("q", "k", "v")}
    return sa.BlockSizes(
        block_q=chosen["sa_block_q"], block_kv=chosen["sa_block_kv"], block_kv_compute=chosen["sa_block_kv_compute"],
        block_q_dkv=chosen["sa_block_q_dkv"], block_kv_dkv=chosen["sa_block_kv_dkv"],
        block_kv_dkv_compute=chosen["sa_block_kv_dkv_compute"],
        block_q_dq=None if fused else chosen["sa_block_q_dq"], block_kv_dq=None if fused else chosen["sa_block_kv_dq"],
        use_fused_bwd_kernel=fused, q_layout=layout["q"], k_layout=layout["k"], v_layout=layout["v"])


class _BlockBounds:
    """For JAX's computable masks (mixed in before CausalMask / LocalMask): a block of the mask that
    is wholly visible or wholly hidden is answered as a 1 x 1 array, decided from the bounds of its
    query positions and key columns, and only the blocks a diagonal or a window edge crosses are
    computed element by element. Splash builds its mask tables on the host by asking for every
    query x key block of the whole sequence whether any and whether all of it is visible, and only
    those two answers (and the crossed blocks' contents) go into the tables: so the tables are the
    same (tested), in time proportional to the number of blocks rather than to length squared
    (65,536 tokens in blocks of 512: 0.42 s for the three tables, 12.5 s with JAX's masks;
    benchmarks/splash_mask_tables.py)."""

    def __getitem__(self, idx) -> np.ndarray:
        q_slice, kv_slice = idx
        if isinstance(q_slice, slice) and isinstance(kv_slice, slice):
            k_start, k_stop, step = kv_slice.indices(self.shape[1])
            rows = self.q_sequence[q_slice]
            if step == 1 and k_stop > k_start and rows.size:
                state = self._block_state(int(rows.min()), int(rows.max()), k_start, k_stop - 1)
                if state is not None:
                    return np.full((1, 1), state)
        return super().__getitem__(idx)


class _Causal(_BlockBounds, sa.CausalMask):
    def _block_state(self, q_min: int, q_max: int, k_first: int, k_last: int) -> bool | None:
        """Query q sees key k when q + offset >= k: all of the block, none of it, or None (computed)."""
        if q_min + self.offset >= k_last:
            return True
        if q_max + self.offset < k_first:
            return False
        return None


class _Local(_BlockBounds, sa.LocalMask):
    def _block_state(self, q_min: int, q_max: int, k_first: int, k_last: int) -> bool | None:
        """Query q sees keys q + offset - left .. q + offset + right (None: no bound on that side)."""
        left, right = self.window_size
        low, high = q_min + self.offset, q_max + self.offset
        if (left is not None and low - left > k_last) or (right is not None and high + right < k_first):
            return False
        if (left is None or high - left <= k_first) and (right is None or low + right >= k_last):
            return True
        return None


class _Chunked(_BlockBounds, ChunkedCausalMask):
    def _block_state(self, q_min: int, q_max: int, k_first: int, k_last: int) -> bool | None:
        """Query q sees key k when both are in one chunk (index // chunk_size) and k <= q."""
        c = self.chunk_size
        if k_first > q_max or k_last // c < q_min // c:
            return False
        if q_min // c == q_max // c == k_first // c == k_last // c and q_min >= k_last:
            return True
        return None


def _kernel(groups: int, length: int, window: int, cap: float, blocks: sa.BlockSizes, interpret: bool,
            q_shards: int = 1, balanced: bool = False, chunk: int = 0):
    """A splash MQA kernel for `groups` query heads sharing one kv head, its mask tables over the
    whole sequence split into `q_shards` parts of queries (in `balanced_order` when `balanced`:
    each mask row is computed from its query's position). Built afresh for every call being
    traced: its mask tables become arrays of the trace that builds it, so a kernel kept from one
    trace (a scan's body: deepseek's dense layers) and used in another (its expert layers) would
    hold a leaked tracer."""
    if chunk:
        mask = _Chunked((length, length), chunk_size=chunk)
    elif window:
        mask = _Local((length, length), window_size=(window - 1, 0), offset=0)
    else:
        mask = _Causal((length, length))
    if balanced:
        mask.q_sequence = balanced_order(length, q_shards)
    return sa.make_splash_mqa(sa.MultiHeadMask([mask] * groups), block_sizes=blocks, attn_logits_soft_cap=cap or None,
                              head_shards=1, q_seq_shards=q_shards, interpret=interpret)


def _attend(kernel, q_btnh, k_bskh, v_bskh, segment_q_bt, segment_kv_bs, sinks_n=None, *, scale):
    """Splash attention of local queries [B, T, N, H] over keys and values [B, S, K, H] (S = T,
    or the whole sequence when the queries are one device's part of it), with the sink logits
    `sinks_n` [N] (attention_sink) when given."""
    b, t, n, h = q_btnh.shape
    kv = k_bskh.shape[2]
    # scaled in float32, then rounded once: a bfloat16 scale is off by up to 0.4% (1/12, Gemma 2 27B's, by +0.2%;
    # DeepSeek-V3's by -0.35%), which changed every score's temperature under splash alone
    q = (q_btnh.astype(jnp.float32) * scale).astype(q_btnh.dtype)
    q = q.reshape(b, t, kv, n // kv, h).transpose(0, 2, 3, 1, 4)
    k, v = k_bskh.transpose(0, 2, 1, 3), v_bskh.transpose(0, 2, 1, 3)  # [B, K, S, H]
    sinks_kg = None if sinks_n is None else sinks_n.reshape(kv, n // kv)

    def run(kernel, q_gth, k_sh, v_sh, sinks_g, seg_q, seg_kv):
        return kernel(q_gth, k_sh, v_sh, segment_ids=sa.SegmentIds(q=seg_q, kv=seg_kv), sinks=sinks_g)

    def one(*args):  # (matmul_precision does not reach the kernel's products; its masks are arguments, not closed over)
        return at_default_precision(run, kernel, *args)

    per_head = jax.vmap(one, in_axes=(0, 0, 0, None if sinks_kg is None else 0, None, None))  # over kv heads
    out = jax.vmap(per_head, in_axes=(0, 0, 0, None, 0, 0))(q, k, v, sinks_kg, segment_q_bt, segment_kv_bs)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)  # out: [B, K, G, T, H]


def _to_balanced(x, axis: str, shards: int):
    """One device's contiguous parts 2i and 2i+1 of the sequence [B, T/S, ...] -> its parts of the
    balanced layout (j, then 2S-1-j), by two collective permutes (the even parts, the odd ones)."""
    even, odd = jnp.split(x, 2, axis=1)
    dest = lambda p: p if p < shards else 2 * shards - 1 - p  # noqa: E731  (the device that holds part p)
    got_even = jax.lax.ppermute(even, axis, [(i, dest(2 * i)) for i in range(shards)])
    got_odd = jax.lax.ppermute(odd, axis, [(i, dest(2 * i + 1)) for i in range(shards)])
    j_even = jax.lax.axis_index(axis) % 2 == 0  # part j is even on even devices, part 2S-1-j on odd ones
    return jnp.concatenate([jnp.where(j_even, got_even, got_odd), jnp.where(j_even, got_odd, got_even)], axis=1)


def _from_balanced(x, axis: str, shards: int):
    """The inverse of `_to_balanced`: the balanced parts' rows back to their contiguous devices."""
    first, second = jnp.split(x, 2, axis=1)
    j_even = jax.lax.axis_index(axis) % 2 == 0
    even, odd = jnp.where(j_even, first, second), jnp.where(j_even, second, first)
    # the part of that parity device j holds
    held = lambda j, parity: j if j % 2 == parity else 2 * shards - 1 - j  # noqa: E731
    back_even = jax.lax.ppermute(even, axis, [(j, held(j, 0) // 2) for j in range(shards)])
    back_odd = jax.lax.ppermute(odd, axis, [(j, held(j, 1) // 2) for j in range(shards)])
    return jnp.concatenate([back_even, back_odd], axis=1)


def _attend_split(kernel, q_btnh, k_bskh, v_bskh, segment_bt, sinks_n=None, *, scale, sequence_axis,
                  balanced_shards):
    """`_attend` on one device's shard inside `shard_map`: with a sequence axis, the keys, values
    and kv segment ids of the whole sequence are gathered over it first; with `balanced_shards`
    the queries are exchanged into the balanced layout, and the outputs back."""
    segment_kv = segment_q = segment_bt
    if sequence_axis:
        gather = functools.partial(jax.lax.all_gather, axis_name=sequence_axis, axis=1, tiled=True)
        k_bskh, v_bskh, segment_kv = gather(k_bskh), gather(v_bskh), gather(segment_bt)
    if not balanced_shards:
        return _attend(kernel, q_btnh, k_bskh, v_bskh, segment_q, segment_kv, sinks_n, scale=scale)
    q_btnh, segment_q = (_to_balanced(a, sequence_axis, balanced_shards) for a in (q_btnh, segment_bt))
    out = _attend(kernel, q_btnh, k_bskh, v_bskh, segment_q, segment_kv, sinks_n, scale=scale)
    return _from_balanced(out, sequence_axis, balanced_shards)


def splash_attention(q_btnh, k_bskh, v_bskh, segment_bt, *, scale: float, logits_soft_cap: float = 0.0,
                     window: int = 0, blocks: sa.BlockSizes, load_balance: bool = False, interpret: bool = False,
                     sinks_n=None, chunk: int = 0):
    """Causal attention of q [B, T, N, H] over k, v [B, T, K, H] within segments, as
    `attention.dot_product_attention` computes it, with the splash kernel (and the sink logits
    `sinks_n` [N], which the kernel takes per query head; `chunk`: attention within chunks of
    that many tokens, a `ChunkedCausalMask`). Under a mesh whose sequence axis
    splits T, `blocks` are those of `block_sizes(..., q_shards=<that axis' size>)`, and
    `load_balance` (`load_balanced`'s answer) gives each device an early and a late part."""
    b, t, n, _ = q_btnh.shape
    groups = n // k_bskh.shape[2]
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or math.prod(mesh.shape.values()) == 1:
        kernel = _kernel(groups, t, window, float(logits_soft_cap), blocks, interpret, chunk=chunk)
        return _attend(kernel, q_btnh, k_bskh, v_bskh, segment_bt, segment_bt, sinks_n, scale=scale)
    sizes = dict(mesh.shape)
    batch = tuple(a for a in ("data", "fsdp", "expert") if sizes.get(a, 1) > 1)
    ways = math.prod(sizes[a] for a in batch)
    batch = batch if batch and b % ways == 0 else ()
    heads = "tensor" if sizes.get("tensor", 1) > 1 else None
    if heads and k_bskh.shape[2] % sizes["tensor"]:  # fewer kv heads than tensor ways: one per query head
        k_bskh, v_bskh = jnp.repeat(k_bskh, groups, axis=2), jnp.repeat(v_bskh, groups, axis=2)
        groups = 1
    shards = sizes.get("sequence", 1)
    sequence = "sequence" if shards > 1 else None
    balanced = load_balance and shards > 1
    kernel = _kernel(groups, t, window, float(logits_soft_cap), blocks, interpret, shards, balanced, chunk)
    # the kernel's mask tables split like the queries (over sequence); read off a mesh of the same
    # shape whose axes are all Auto: under the pipeline's shard_map the ambient mesh's stage axis is
    # Manual, which the kernel's own check of the tables' shard shape cannot handle
    plain = jax.sharding.AbstractMesh(tuple(sizes.values()), tuple(sizes),
                                      axis_types=(jax.sharding.AxisType.Auto,) * len(sizes))
    kernel_spec = kernel.manual_sharding_spec(jax.sharding.NamedSharding(plain, P(None, sequence)))
    batch_spec = (batch if len(batch) > 1 else batch[0]) if batch else None
    qkv = P(batch_spec, sequence, heads, None)
    attend = functools.partial(_attend_split, scale=scale, sequence_axis=sequence,
                               balanced_shards=shards if balanced else 0)
    if sinks_n is None:
        return jax.shard_map(attend, in_specs=(kernel_spec, qkv, qkv, qkv, P(batch_spec, sequence)), out_specs=qkv,
                             check_vma=False)(kernel, q_btnh, k_bskh, v_bskh, segment_bt)
    return jax.shard_map(attend, in_specs=(kernel_spec, qkv, qkv, qkv, P(batch_spec, sequence), P(heads)),
                         out_specs=qkv, check_vma=False)(kernel, q_btnh, k_bskh, v_bskh, segment_bt, sinks_n)
