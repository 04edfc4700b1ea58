"""Building blocks shared by the decoder families: norms, embeddings, rotary positions, MLP.

Parameters carry logical axis names (`sharding_names`); `tessera.mesh` maps them to mesh axes.
Eager sharding is off: parameters are placed by the trainer with `jit(out_shardings=...)`.

Shapes use the suffix convention of STYLE.md: B batch, T length, D embed, N query heads,
K kv heads, H head dim, F mlp, V vocab.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from tessera.cpu_matmul import bf16_matmul
from tessera.mesh import shard_logically, traced_platform
from tessera.models.quantization import einsum as quantized_einsum


def project(spec: str, x, w, preferred_element_type=None, quantization: str = ""):
    """`jnp.einsum(spec, x, w)`: activations x times a weight w (or, in attention, keys and
    values), both in the compute dtype. `quantization` (int8, fp8, fp8_full) runs the product
    quantized (`tessera.models.quantization`, on qwix); "" leaves it as it is.

    Elsewhere than on XLA:CPU this is exactly the einsum. On XLA:CPU (benchmarks/README.md,
    cpu_llama, has the measurements):
    - the gradient of w (x^T times the output's gradient, contracting the batch and length
      axes of both) is one matmul with its operands laid out the way XLA:CPU's YNNPACK fusion
      takes them (`_canonical_operand_grad`); left to itself XLA transposes the larger operand
      inside an elementwise fusion and runs the product as a plain dot, outside YNNPACK;
    - bfloat16 operands go into the matmul as they are when the CPU has a bfloat16 dot-product
      instruction, and are multiplied as float32 copies (the result rounded to bfloat16, or to
      `preferred_element_type`) when it has none, where XLA:CPU's bfloat16 matmul is slower
      than its float32 one (`tessera.cpu_matmul` decides, once per process). The products of
      bfloat16 values are exact in float32 and both ways accumulate in float32, so either is a
      bfloat16 matmul that accumulates in float32, as a TPU's matrix unit does. A product of
      bfloat16 with float32 (attention's, whose queries, keys and values are float32 on
      XLA:CPU) always widens the bfloat16 side."""
    if quantization:
        out = quantized_einsum(spec, x, w, quantization)
        return out if preferred_element_type is None else out.astype(preferred_element_type)
    if traced_platform() != "cpu":
        return jnp.einsum(spec, x, w, preferred_element_type=preferred_element_type)
    return _project_cpu(spec, preferred_element_type, x, w)


def _matmul_operands(*arrays):
    """The operands as XLA:CPU should multiply them: as they are when all are bfloat16 and the
    CPU multiplies bfloat16 natively (or none is bfloat16); else bfloat16 ones as float32 copies."""
    bf16, dtypes = jnp.dtype(jnp.bfloat16), {jnp.dtype(a.dtype) for a in arrays}
    if bf16 not in dtypes or (dtypes == {bf16} and bf16_matmul() == "native"):
        return arrays
    return tuple(a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in arrays)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _project_cpu(spec, preferred, x, w):
    out = jnp.einsum(spec, *_matmul_operands(x, w), preferred_element_type=preferred)
    return out.astype(preferred or jnp.result_type(x, w))


def _project_fwd(spec, preferred, x, w):
    return _project_cpu(spec, preferred, x, w), (x, w)


def _project_bwd(spec, preferred, residuals, g):
    x, w, g = _matmul_operands(*residuals, g)
    # the product typed as g (float32 where the forward asked for a float32 result of float16 operands)
    dx = jax.vjp(lambda x_: jnp.einsum(spec, x_, w, preferred_element_type=g.dtype), x)[1](g)[0]
    dw = _canonical_operand_grad(spec, x, w, g)
    return dx.astype(residuals[0].dtype), dw.astype(residuals[1].dtype)


_project_cpu.defvjp(_project_fwd, _project_bwd)


def _canonical_operand_grad(spec: str, x, w, g):
    """The gradient of w in `einsum(spec, x, w)` given the output's gradient g, as one batched
    matmul [batch, M, K] x [batch, K, N] with both operands row-major (XLA:CPU's YNNPACK fusion
    takes no other layout). w's axes are batch axes (in x, w and the output), axes it shares
    with x only (contracted in the forward product) and axes it shares with the output only;
    the gradient contracts the axes x shares with the output only. Of x and g, the one with
    fewer elements is transposed into place (an optimization barrier keeps XLA from folding the
    transpose back into the dot); the result, the size of w, is transposed to w's order."""
    inputs, out = spec.split("->")
    xs, ws = inputs.split(",")
    batch = "".join(c for c in ws if c in xs and c in out)
    from_x = "".join(c for c in ws if c in xs and c not in out)
    from_g = "".join(c for c in ws if c in out and c not in xs)
    summed = "".join(c for c in xs if c in out and c not in ws)
    if len(batch + from_x + from_g) != len(ws) or len(batch + from_x + summed) != len(xs):
        # an axis of one operand only (summed away in the forward product): the plain gradient
        return jax.vjp(lambda w_: jnp.einsum(spec, x, w_), w)[1](g)[0]

    def arranged(a, have: str, want: str):
        if have == want:
            return a
        return jax.lax.optimization_barrier(jnp.transpose(a, [have.index(c) for c in want]))

    if x.size <= g.size:  # x^T g: [batch, from_x, summed] x [batch, summed, from_g]
        lhs_axes, rhs_axes, product = batch + from_x + summed, batch + summed + from_g, batch + from_x + from_g
        lhs, rhs = arranged(x, xs, lhs_axes), arranged(g, out, rhs_axes)
    else:  # g^T x: [batch, from_g, summed] x [batch, summed, from_x]
        lhs_axes, rhs_axes, product = batch + from_g + summed, batch + summed + from_x, batch + from_g + from_x
        lhs, rhs = arranged(g, out, lhs_axes), arranged(x, xs, rhs_axes)
    # the product in the order the matmul makes it, then (when w's order differs) transposed behind a
    # barrier: else XLA swaps the operands to produce w's order directly, transposing the larger one
    grad = jnp.einsum(f"{lhs_axes},{rhs_axes}->{product}", lhs, rhs)
    if product == ws:
        return grad
    return jnp.transpose(jax.lax.optimization_barrier(grad), [product.index(c) for c in ws])


def param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str | None, ...], dtype, std: float | None,
          fill: float = 1.0):
    """A parameter with logical axis names; normal(std) init, or the constant `fill` when std is None."""
    if std is None:
        value = jnp.full(shape, fill, dtype)
    else:
        value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


def fan_in_std(fan_in: int) -> float:
    """LeCun normal: keeps activations at unit variance through a matmul with `fan_in` inputs."""
    return fan_in**-0.5


class RMSNorm(nnx.Module):
    """Root-mean-square norm with a learned scale (no bias, no mean subtraction).

    `zero_centered=True` stores the scale as an offset from one (x * (1 + scale), initialized
    to zero), the layout of Gemma checkpoints, so converted weights are used bit for bit.
    """

    def __init__(self, dim: int, eps: float, dtype, weight_dtype, rngs: nnx.Rngs, zero_centered: bool = False):
        self.scale = param(rngs, (dim,), ("norm",), weight_dtype, None, fill=0.0 if zero_centered else 1.0)
        self.eps, self.dtype, self.zero_centered = eps, dtype, zero_centered

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        x = rms_normalized(x_btd, self.eps)
        scale = self.scale[...].astype(jnp.float32)
        return (x * (1.0 + scale if self.zero_centered else scale)).astype(self.dtype)


def rms_normalized(x: jax.Array, eps: float) -> jax.Array:
    """x / sqrt(mean(x^2) + eps) over the last axis, in float32 (an RMS norm without its scale)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


class LayerNorm(nnx.Module):
    """Layer norm with a learned scale and bias (mean and variance over the last axis)."""

    def __init__(self, dim: int, eps: float, dtype, weight_dtype, rngs: nnx.Rngs):
        self.scale = param(rngs, (dim,), ("norm",), weight_dtype, None)
        self.bias = param(rngs, (dim,), ("norm",), weight_dtype, None, fill=0.0)
        self.eps, self.dtype = eps, dtype

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        x = x_btd.astype(jnp.float32)
        centered = x - jnp.mean(x, axis=-1, keepdims=True)
        x = centered * jax.lax.rsqrt(jnp.mean(centered * centered, axis=-1, keepdims=True) + self.eps)
        return (x * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(self.dtype)


class Embed(nnx.Module):
    """Token embedding table [V, D]; also the output projection when logits are tied."""

    def __init__(self, vocab: int, dim: int, dtype, weight_dtype, use_iota: bool, rngs: nnx.Rngs):
        self.table_vd = param(rngs, (vocab, dim), ("vocab", "embed"), weight_dtype, fan_in_std(dim))
        self.dtype, self.use_iota = dtype, use_iota

    def __call__(self, tokens_bt: jax.Array) -> jax.Array:
        table = shard_logically(self.table_vd[...].astype(self.dtype), ("vocab", "embed_lookup"))
        if self.use_iota:
            one_hot_btv = jax.nn.one_hot(tokens_bt, table.shape[0], dtype=self.dtype)
            return jnp.einsum("btv,vd->btd", one_hot_btv, table)
        return jnp.take(table, tokens_bt, axis=0)

    def attend(self, x_btd: jax.Array, in_fp32: bool) -> jax.Array:
        """Tied output logits x @ table^T: [B, T, D] -> [B, T, V]."""
        table = self.table_vd[...]
        dtype = jnp.float32 if in_fp32 else self.dtype
        return project("btd,vd->btv", x_btd.astype(dtype), table.astype(dtype))


def rope_frequencies(head_dim: int, max_timescale: float, llama3_scaling: tuple | None = None) -> np.ndarray:
    """Inverse wavelengths [H/2] of the rotary embedding: max_timescale^(-i / (H/2)).

    `llama3_scaling` = (factor, low_freq_factor, high_freq_factor, original_max_position), the
    long-context rule of Llama 3.1: with r = original_max_position / wavelength (how many
    periods fit in the original context), frequencies with r >= high_freq_factor are kept,
    those with r <= low_freq_factor are divided by `factor`, and in between the two are mixed
    linearly in r (with high_freq_factor = low_freq_factor there is no such band).
    """
    half = head_dim // 2
    inv_freq = float(max_timescale) ** (-np.arange(half, dtype=np.float64) / half)
    if llama3_scaling is not None:
        factor, low, high, original = llama3_scaling
        periods = original * inv_freq / (2 * np.pi)
        if high > low:
            keep = np.clip((periods - low) / (high - low), 0.0, 1.0)
        else:  # no band to mix in (Llama 4 Scout: both 1): kept above it, divided below
            keep = (periods >= high).astype(np.float64)
        inv_freq = keep * inv_freq + (1.0 - keep) * inv_freq / factor
    return inv_freq.astype(np.float32)


def yarn_frequencies(rotary_dim: int, max_timescale: float, factor: float, original_max_position: int,
                     beta_fast: float, beta_slow: float, truncate: bool = True) -> np.ndarray:
    """Inverse wavelengths [rotary_dim/2] of YaRN (Peng et al. 2023): frequencies that turn more
    than `beta_fast` times within the original context are kept, those turning fewer than
    `beta_slow` times are divided by `factor`, and between the two the two are mixed linearly by
    dimension index. `truncate` rounds the ends of that ramp outwards to whole dimensions
    (DeepSeek-V3); gpt-oss keeps them fractional."""
    half = rotary_dim // 2
    inv_freq = float(max_timescale) ** (-np.arange(half, dtype=np.float64) / half)

    def dimension_turning(turns: float) -> float:  # the (fractional) dimension index turning `turns` times
        return rotary_dim * math.log(original_max_position / (turns * 2 * math.pi)) / (2 * math.log(max_timescale))

    low, high = dimension_turning(beta_fast), dimension_turning(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    ramp = np.clip((np.arange(half) - low) / ((high - low) or 0.001), 0.0, 1.0)  # 0: kept, 1: divided
    return (inv_freq * (1.0 - ramp) + inv_freq / factor * ramp).astype(np.float32)


def yarn_score_scale(factor: float, mscale: float) -> float:
    """YaRN's multiplier of the attention scores: (0.1 * mscale * ln(factor) + 1)^2 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else (0.1 * mscale * math.log(factor) + 1.0) ** 2


def rotary_tables(positions_bt: jax.Array, inv_freq_h: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """(sin, cos) [B, T, 1, H/2] in float32 of the rotary angles: positions times the inverse
    wavelengths `inv_freq_h` (from `rope_frequencies`).

    The two tables are materialized (behind an optimization barrier) rather than left for XLA to
    fuse into their consumers: fused, every element of the rotated [B, T, N, H] tensor, and of its
    gradient, evaluated its own sine and cosine (N times the table's work, twice more in the
    gradient's padded halves). On XLA:CPU those fusions took 160 ms of a 2.7 s float32 training
    step of `benchmarks/cpu_llama.py` and 320 ms in bfloat16; with the tables, a few. Computed
    once per attention layer, shared by its queries and keys.
    """
    angle_bth = positions_bt[..., None].astype(jnp.float32) * jnp.asarray(inv_freq_h)
    sin_bth, cos_bth = jax.lax.optimization_barrier((jnp.sin(angle_bth), jnp.cos(angle_bth)))
    return sin_bth[:, :, None, :], cos_bth[:, :, None, :]


def rotate(x_btnh: jax.Array, tables: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotary position embedding: rotates the two halves of the head dimension of `x_btnh` by
    `rotary_tables`' angles. The half-split layout (pairs (i, i + H/2)) is the one Hugging Face
    checkpoints use, so converted weights need no permutation. Tables narrower than half the head
    (partial_rotary_factor < 1) rotate its first 2 x their width dimensions and leave the rest."""
    sin, cos = tables
    half = sin.shape[-1]
    x = x_btnh.astype(jnp.float32)
    first, second, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    out = jnp.concatenate([first * cos - second * sin, second * cos + first * sin, rest], axis=-1)
    return out.astype(x_btnh.dtype)


ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu": jax.nn.gelu,  # the tanh approximation, as GPT-2/3 and Gemma use
    "relu": jax.nn.relu,
    "tanh": jnp.tanh,
    "sigmoid": jax.nn.sigmoid,
    "linear": lambda x: x,
}


class Mlp(nnx.Module):
    """Feed-forward block: act0(x W0) [* act1(x W1)] W_out. Two activations make it gated.

    `use_bias` adds a bias after every projection (GPT-3 style). `fused` (gated only) stores
    W0 and W1 as one [D, 2, F] weight `wi_dcf` (wi_dcf[:, i] is wi_i) run as one matmul.
    The pre-activation projections are named mlpwi_0 and mlpwi_1 for rematerialization, their
    gated product mlpwi and the output mlpwo. `in_fp32` (activations_in_float32) computes the
    activations and their product in float32, rounded to `dtype` once before W_out."""

    def __init__(self, dim: int, hidden: int, activations: list[str], dtype, weight_dtype, rngs: nnx.Rngs,
                 use_bias: bool = False, fused: bool = False, quantization: str = "", in_fp32: bool = False):
        n = len(activations)
        if fused:
            self.wi_dcf = param(rngs, (dim, n, hidden), ("embed", None, "mlp"), weight_dtype, fan_in_std(dim))
            if use_bias:
                self.bi_cf = param(rngs, (n, hidden), (None, "mlp"), weight_dtype, None, fill=0.0)
        else:
            for i in range(n):  # wi_0 (gate when two activations), wi_1 (up)
                setattr(self, f"wi_{i}", param(rngs, (dim, hidden), ("embed", "mlp"), weight_dtype, fan_in_std(dim)))
                if use_bias:
                    setattr(self, f"bi_{i}", param(rngs, (hidden,), ("mlp",), weight_dtype, None, fill=0.0))
        self.wo_fd = param(rngs, (hidden, dim), ("mlp", "embed"), weight_dtype, fan_in_std(hidden))
        if use_bias:
            self.bo_d = param(rngs, (dim,), ("norm",), weight_dtype, None, fill=0.0)
        self.activations, self.dtype, self.use_bias, self.fused = tuple(activations), dtype, use_bias, fused
        self.quantization, self.in_fp32 = quantization, in_fp32

    @classmethod
    def of(cls, cfg, rngs: nnx.Rngs, hidden: int = 0, *, use_bias: bool | None = None, fused: bool | None = None
           ) -> Mlp:
        """The model's MLP (a ModelConfig's sizes, activations, dtypes, biases, fusion, quantization and
        activations_in_float32), `hidden` wide (default mlp_dim); `use_bias` and `fused` override the config's."""
        return cls(cfg.emb_dim, hidden or cfg.mlp_dim, cfg.mlp_activations, cfg.dtype, cfg.weight_dtype, rngs,
                   use_bias=cfg.mlp_bias if use_bias is None else use_bias,
                   fused=cfg.fused_mlp if fused is None else fused, quantization=cfg.quantization,
                   in_fp32=cfg.activations_in_float32)

    def project_in(self, x_btd: jax.Array) -> list[jax.Array]:
        """The input projections x W_i (+ b_i), one [B, T, F] per activation."""
        w = lambda p: p[...].astype(self.dtype)  # noqa: E731
        if self.fused:
            h_btcf = project("btd,dcf->btcf", x_btd, w(self.wi_dcf), quantization=self.quantization)
            if self.use_bias:
                h_btcf = h_btcf + w(self.bi_cf)
            return [h_btcf[:, :, i] for i in range(len(self.activations))]
        outs = [project("btd,df->btf", x_btd, w(getattr(self, f"wi_{i}")), quantization=self.quantization)
                for i in range(len(self.activations))]
        return [o + w(getattr(self, f"bi_{i}")) for i, o in enumerate(outs)] if self.use_bias else outs

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        h_btf = None
        for i, (name, a) in enumerate(zip(self.activations, self.project_in(x_btd))):
            a = checkpoint_name(a, f"mlpwi_{i}")
            a = ACTIVATIONS[name](a.astype(jnp.float32) if self.in_fp32 else a)
            h_btf = a if h_btf is None else h_btf * a
        h_btf = h_btf.astype(self.dtype)  # (activations_in_float32: rounded once, here)
        h_btf = checkpoint_name(shard_logically(h_btf, ("batch", "length", "act_mlp")), "mlpwi")
        out = project("btf,fd->btd", h_btf, self.wo_fd[...].astype(self.dtype), quantization=self.quantization)
        if self.use_bias:
            out = out + self.bo_d[...].astype(self.dtype)
        return checkpoint_name(out, "mlpwo")


def soft_cap(x: jax.Array, cap: float) -> jax.Array:
    """cap * tanh(x / cap): keeps values in (-cap, cap), near the identity for |x| << cap. 0: off."""
    return x if not cap else cap * jnp.tanh(x / cap)


def sinusoidal_positions(positions_bt: jax.Array, dim: int, max_timescale: float = 10000.0) -> jax.Array:
    """Fixed position embeddings [B, T, D] (sin on the first half of D, cos on the second)."""
    half = dim // 2
    inv_freq = max_timescale ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle_bth = positions_bt[..., None].astype(jnp.float32) * inv_freq
    return jnp.concatenate([jnp.sin(angle_bth), jnp.cos(angle_bth)], axis=-1)


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    """Inverted dropout; the identity when `key` is None (evaluation) or `rate` is 0."""
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)
