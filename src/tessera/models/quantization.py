"""Quantized training of the dense projections, on Google's qwix library.

`quantization` (MaxText's values) picks what the projections' matmuls run in; master weights,
gradients and optimizer state stay in `weight_dtype`, and everything outside these matmuls
(norms, attention's score and value products, softmax, the loss) is unchanged.

| mode | forward operands | backward: incoming gradients | output logits |
| --- | --- | --- | --- |
| `int8` | int8, absmax scale per channel | int8, per channel | not quantized |
| `fp8` | float8 e4m3, per channel | float8 e5m2 (the wider range gradients need) | not quantized |
| `fp8_full` | as fp8 | as fp8 | quantized too |
| `nanoo_fp8` | float8 e4m3fnuz (AMD MI300's format) | float8 e5m2fnuz | not quantized |

Quantized are the attention's q/k/v/output projections, the MLP's and the experts' input and
output projections (capacity routing's einsums; dropless routing's grouped matmuls run qwix's
quantized ragged dot, also with `megablox=true`, in place of the Pallas kernel). Each projection
is qwix's quantized-training dot product (`dot_general_qt`): it quantizes both operands with their own scales (the
contracting axis reduced, every other axis keeping its own scale: per channel), multiplies
in the quantized type with int32 (int8) or float32 (fp8) accumulation, rescales, and in the
backward pass quantizes the incoming gradient the same way for both products; gradients reach
the float weights straight through the rounding.
"""

from __future__ import annotations

import functools
import logging
import re

import jax.numpy as jnp

from tessera.config import ConfigError
from tessera.config.fields import QUANTIZATION_MODES

log = logging.getLogger("tessera")

MODES = QUANTIZATION_MODES
# GPUs whose matrix units take OCP float8 (e4m3fn/e5m2): NVIDIA Ada, Hopper, Blackwell, AMD MI350
# (a substring of the device kind); AMD MI300/MI325 take the fnuz variants instead (nanoo_fp8)
_FP8_GPUS = ("H100", "H200", "H800", "H20", "GH200", "B100", "B200", "GB200", "L4", "L40", "MI350", "MI355")
_FNUZ_GPUS = ("MI300", "MI325")


def library() -> str:
    """"qwix <version>", for log lines and reports."""
    import qwix

    return f"qwix {qwix.__version__}"


@functools.cache
def _config(mode: str):
    from qwix._src.core.dot_general_qt import DotGeneralQtConfig

    if mode == "int8":
        fwd = bwd = jnp.int8
    elif mode in ("fp8", "fp8_full"):
        fwd, bwd = jnp.float8_e4m3fn, jnp.float8_e5m2
    elif mode == "nanoo_fp8":
        fwd, bwd = jnp.float8_e4m3fnuz, jnp.float8_e5m2fnuz
    else:
        raise ValueError(f"quantization={mode!r} is not one of {MODES}")
    return DotGeneralQtConfig(lhs_qtype=fwd, rhs_qtype=fwd, dlhs_grad_qtype=bwd, drhs_grad_qtype=bwd)


@functools.cache
def dot_general(mode: str):
    """A `jax.lax.dot_general` replacement that computes in `mode` (for jnp.einsum's
    `_dot_general`): qwix's quantized-training dot product with the mode's types."""
    from qwix._src.core.dot_general_qt import dot_general_qt

    config = _config(mode)

    def quantized(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **_):
        dtype = jnp.result_type(lhs, rhs)
        out = dot_general_qt(*_widened(lhs, rhs), dimension_numbers, config).astype(dtype)
        return out if preferred_element_type is None else out.astype(preferred_element_type)

    return quantized


def ragged_dot(lhs, rhs, group_sizes, mode: str):
    """jax.lax.ragged_dot (dropless MoE's grouped matmul) quantized as `mode` says: qwix's
    quantized-training ragged dot with the mode's forward and gradient types."""
    from qwix._src.core.ragged_dot_qt import RaggedDotQtConfig, ragged_dot_qt

    c = _config(mode)
    config = RaggedDotQtConfig(lhs_qtype=c.lhs_qtype, rhs_qtype=c.rhs_qtype, dlhs_grad_qtype=c.dlhs_grad_qtype,
                               drhs_grad_qtype=c.drhs_grad_qtype)
    return ragged_dot_qt(*_widened(lhs, rhs), group_sizes, config).astype(jnp.result_type(lhs, rhs))


def _widened(*operands):
    """The operands qwix gets: float16 ones as float32 copies (their gradients converted back),
    others as they are. qwix 0.1.8 mishandles float16 operands: int8 products come out as zeros,
    and the float8 modes return float32 gradients, which JAX's transposes then refuse."""
    if all(jnp.dtype(a.dtype) != jnp.float16 for a in operands):
        return operands
    return tuple(a.astype(jnp.float32) if a.dtype == jnp.float16 else a for a in operands)


def einsum(spec: str, x, w, mode: str):
    """jnp.einsum(spec, x, w) with the matmul quantized as `mode` says (a no-op for "")."""
    if not mode:
        return jnp.einsum(spec, x, w)
    return jnp.einsum(spec, x, w, _dot_general=dot_general(mode))


def _ocp_float8(device_kind: str, compute_capability: str) -> bool:
    """Whether a GPU multiplies OCP float8: an NVIDIA GPU from compute capability 8.9 (Ada) on, when
    the device reports its capability (RTX 4090 and RTX 6000 Ada as well as L4 and H100); else as
    its name says (_FP8_GPUS)."""
    cc = re.fullmatch(r"(\d+)\.(\d+)", compute_capability or "")
    if cc:
        return (int(cc[1]), int(cc[2])) >= (8, 9)
    return any(g in device_kind for g in _FP8_GPUS)


def check_platform(mode: str, device_kind: str, platform: str, compute_capability: str = "",
                   tied_logits: bool = False) -> None:
    """ConfigError when the devices cannot run `mode`; a log line saying what implements it.
    `compute_capability`: an NVIDIA GPU's ("9.0"), when known ("" otherwise). `tied_logits`
    (logits_via_embedding): the logits are the token table's product, which fp8_full leaves in float."""
    if not mode:
        return
    if mode == "fp8_full" and tied_logits:
        log.warning("quantization=fp8_full: the output logits are the token table's product here "
                    "(logits_via_embedding=true), which stays unquantized; the run is quantization=fp8's")
    if mode.startswith("fp8") and platform == "gpu" and not _ocp_float8(device_kind, compute_capability):
        fnuz = any(g in device_kind for g in _FNUZ_GPUS)
        cc = f" (compute capability {compute_capability})" if re.fullmatch(r"\d+\.\d+", compute_capability) else ""
        raise ConfigError(
            f"quantization={mode}: {device_kind}{cc} has no OCP float8 matrix units (they start with NVIDIA Ada and "
            "Hopper, compute capability 8.9: L4, L40, RTX 4090, H100, H200, B200; AMD MI350); "
            + ("use quantization=nanoo_fp8, its own float8 format" if fnuz else "use quantization=int8 or leave it empty"))
    if mode == "nanoo_fp8" and platform in ("gpu", "tpu") and not any(g in device_kind for g in _FNUZ_GPUS):
        raise ConfigError(f"quantization=nanoo_fp8 is AMD MI300's float8 format, which {device_kind} does not run; "
                          "use quantization=fp8 (or int8)")
    where = {"cpu": "XLA:CPU emulates the low-precision products (correct, not faster)",
             "gpu": "cuBLASLt's low-precision GEMMs through XLA",
             "tpu": "the TPU's matrix units through XLA"}.get(platform, platform)
    log.info("quantization=%s: projections quantized by %s; %s", mode, library(), where)


# ---------------------------------------------------------------------------- quantized checkpoints
# A quantized checkpoint holds, for every weight matrix, {"qvalue": int8 or float8, "scale":
# float32} with one absmax scale per row of its last axis (every other axis keeps its own scales);
# vectors (norm scales, biases, attention sinks) stay as they are, also when scanned layers stack
# them into [layers, ...] arrays. `decode.py save_quantized_params_path=...` writes one;
# `checkpoint_is_quantized=true` reads it back, dequantized to the weights' dtype.

_STORAGE = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "fp8_full": jnp.float8_e4m3fn,
            "nanoo_fp8": jnp.float8_e4m3fnuz}


def storage_type(mode: str):
    """The type quantized weights are stored in for `mode` (int8, or float8 e4m3 for the fp8 modes)."""
    if mode not in _STORAGE:
        raise ConfigError(f"quantized checkpoints need quantization=int8, fp8, fp8_full or nanoo_fp8 (it is {mode!r}): "
                          "it decides the stored type")
    return _STORAGE[mode]


STACKING_AXES = ("layers", "exp")  # logical axes that stack matrices or vectors, one per layer or expert


def _quantizable(names: tuple) -> bool:
    """A weight matrix (logical axis `names`): it reads or writes the residual stream (an embed axis,
    as MLA's latent axes are named too) and has another axis besides the stacking ones. A norm's
    [layers, norm] scale or a [layers, heads, head_dim] bias is no matrix."""
    rest = [n for n in names if n not in STACKING_AXES]
    return "embed" in rest and len(rest) >= 2


def _is_names(x) -> bool:
    return isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x)


def quantize_params(params, mode: str, logical_axes):
    """The parameters (logical axes `logical_axes`) in a quantized checkpoint's form (see above)."""
    import jax
    import qwix

    qtype = storage_type(mode)

    def one(names, w):
        if not _quantizable(names):
            return w
        q = qwix.quantize(w.astype(jnp.float32), qtype, channelwise_axes=tuple(range(w.ndim - 1)),
                          scale_dtype=jnp.float32)
        return {"qvalue": q.qvalue, "scale": q.scale}

    return jax.tree.map(one, logical_axes, params, is_leaf=_is_names)


def quantized_abstract(abstract_params, mode: str, logical_axes):
    """ShapeDtypeStructs of `quantize_params`'s result, with the weights' shardings (the scale
    keeps the weight's sharding but for its last axis, which it reduces to 1)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    qtype = storage_type(mode)

    def one(names, s):
        if not _quantizable(names):
            return s
        sharding = getattr(s, "sharding", None)
        scale_sharding = None
        if isinstance(sharding, NamedSharding):
            spec = (tuple(sharding.spec) + (None,) * len(s.shape))[:len(s.shape) - 1]
            scale_sharding = NamedSharding(sharding.mesh, PartitionSpec(*spec, None))
        return {"qvalue": jax.ShapeDtypeStruct(s.shape, qtype, sharding=sharding),
                "scale": jax.ShapeDtypeStruct((*s.shape[:-1], 1), jnp.float32, sharding=scale_sharding)}

    return jax.tree.map(one, logical_axes, abstract_params, is_leaf=_is_names)


def dequantize_params(tree, abstract_params, logical_axes):
    """The float parameters (each in its abstract dtype) of a quantized checkpoint's tree."""
    import jax

    def one(names, s, stored):
        if not _quantizable(names):
            return stored
        return (stored["qvalue"].astype(jnp.float32) * stored["scale"]).astype(s.dtype)

    return jax.tree.map(one, logical_axes, abstract_params, tree, is_leaf=_is_names)
