"""XLA:CPU's causal attention with its own backward pass (models/attention_cpu.py) against the reference's
autodiff: outputs and gradients, where it applies and where the reference keeps the call."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tessera.models import attention_cpu
from tessera.models.attention import dot_product_attention


def _inputs(b, t, n, kv, h, hv, seed=0):
    rng = np.random.default_rng(seed)
    shapes = [(b, t, n, h), (b, t, kv, h), (b, t, kv, hv), (b, t, n, hv)]
    return [jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes]


def _value_and_grads(segments, packed, remat, q, k, v, g, **kw):
    """The attention's output and the gradients of q, k, v for the cotangent g, traced anew (so a monkeypatched
    `attention_cpu.applies` is seen), optionally under jax.checkpoint as remat_policy=full runs it."""

    def attend(q, k, v):
        return dot_product_attention(q, k, v, segments, segments, scale=0.3, packed=packed, **kw)

    fn = jax.checkpoint(attend) if remat else attend
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(g))


def _reference(monkeypatch, *args, **kw):
    with monkeypatch.context() as m:
        m.setattr(attention_cpu, "applies", lambda *a, **k: False)
        return jax.jit(lambda *a: _value_and_grads(*args[:3], *a, **kw))(*args[3:])


def _assert_close(got, ref, rtol=5e-6):
    """Each array within rtol of the largest magnitude of the reference's (float32 sums in another order)."""
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        scale = float(jnp.max(jnp.abs(b)))
        np.testing.assert_allclose(a, b, rtol=0, atol=rtol * scale, err_msg=name)


@pytest.mark.parametrize("shape, packed, remat", [
    ((2, 512, 4, 4, 16, 16), False, True),   # heads of their own, 4 chunks of 128, as remat full runs it
    ((2, 384, 6, 2, 16, 16), True, False),   # groups of 3 query heads, packed documents across chunk edges
    ((1, 256, 4, 1, 24, 8), True, True),     # one kv head (MQA), values narrower than keys (as MLA's)
    ((2, 100, 4, 2, 8, 8), True, False),     # 100 queries: one chunk of all of them
])
def test_equals_the_reference_in_outputs_and_gradients(monkeypatch, shape, packed, remat):
    b, t, n, kv, h, hv = shape
    q, k, v, g = _inputs(b, t, n, kv, h, hv)
    rng = np.random.default_rng(1)
    if packed:  # documents of random lengths, some crossing a chunk's edge
        segments = jnp.asarray(np.sort(rng.integers(1, 4, size=(b, t)), axis=1), jnp.int32)
    else:
        segments = jnp.ones((b, t), jnp.int32)
    calls = []
    real = attention_cpu.causal_attention
    monkeypatch.setattr(attention_cpu, "causal_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    got = jax.jit(lambda *a: _value_and_grads(segments, packed, remat, *a))(q, k, v, g)
    assert calls, "the CPU form was not used"
    ref = _reference(monkeypatch, segments, packed, remat, q, k, v, g)
    _assert_close(got, ref)


def test_unpacked_rows_leave_padding_out_only_where_it_is_never_read(monkeypatch):
    """packed=False: the segment ids are not consulted, so a padded row's real tokens (before the padding)
    get the same outputs and gradients as the reference gives them with segments; padding's own rows differ."""
    q, k, v, g = _inputs(2, 256, 4, 2, 8, 8, seed=3)
    segments = jnp.asarray(np.where(np.arange(256) < 200, 1, 0)[None].repeat(2, 0), jnp.int32)
    g = g * (segments[:, :, None, None] == 1)  # the loss never counts padding
    got = jax.jit(lambda *a: _value_and_grads(segments, False, False, *a))(q, k, v, g)
    ref = _reference(monkeypatch, segments, True, False, q, k, v, g)
    real = slice(0, 200)
    _assert_close([x[:, real] for x in got], [x[:, real] for x in ref])
    assert not np.allclose(got[0][:, 200:], ref[0][:, 200:], atol=1e-3)


@pytest.mark.parametrize("change", [
    dict(dtype=jnp.bfloat16), dict(logits_soft_cap=30.0), dict(window=64), dict(chunk=64), dict(sinks=True),
    dict(cross=True), dict(key_segments=True),
])
def test_the_reference_keeps_what_the_cpu_form_does_not_serve(monkeypatch, change):
    q, k, v, _ = _inputs(1, 256, 4, 2, 8, 8)
    if "dtype" in change:
        q, k, v = (a.astype(change["dtype"]) for a in (q, k, v))
    if change.get("cross"):
        k, v = k[:, :128], v[:, :128]
    segments = jnp.ones((1, 256), jnp.int32)
    kw = {key: val for key, val in change.items() if key in ("logits_soft_cap", "window", "chunk")}
    if change.get("sinks"):
        kw["sinks_n"] = jnp.zeros((4,), jnp.float32)
    monkeypatch.setattr(attention_cpu, "causal_attention", lambda *a, **k: pytest.fail("CPU form used"))
    seg_k = segments[:, :k.shape[1]] if change.get("cross") else segments
    if change.get("key_segments"):  # keys with segment ids of their own: the CPU form reads the queries' only
        seg_k = jnp.ones((1, 256), jnp.int32)
    jax.jit(lambda q, k, v: dot_product_attention(q, k, v, segments, seg_k, **kw))(q, k, v)
    assert attention_cpu.applies(*(a.astype(jnp.float32) for a in (q, k, v)), logits_soft_cap=0.0, window=0,
                                 chunk=0, sinks_n=None) == (not change.get("cross"))
