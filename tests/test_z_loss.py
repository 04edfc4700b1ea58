"""The z-loss (z_loss_multiplier): z x log(Z)^2 per target token added to the training objective, Z the output
softmax's normalizer; the logged loss stays the cross-entropy, the term is logged as z_loss."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import REPO, tiny_config
from tessera.config import load_config
from tessera.losses import cross_entropy_and_log_z_sums, cross_entropy_sum
from tessera.train import run


@pytest.mark.parametrize("tiles", [1, 4])
def test_the_sums_are_optaxs_cross_entropy_and_the_squared_logsumexp_with_their_gradients(tiles):
    """One logsumexp serves both sums; in chunks (num_vocab_tiling) they and their gradients are the whole
    batch's. Float32, 8 x 6 tokens of a 40-word output layer with logits up to about 10."""
    kx, kw, kt, ks = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(kx, (8, 6, 16))
    w = 2.0 * jax.random.normal(kw, (16, 40))
    targets = jax.random.randint(kt, (8, 6), 0, 40)
    weights = (jax.random.uniform(ks, (8, 6)) > 0.3).astype(jnp.float32)

    def sums(w, tiles):
        return cross_entropy_and_log_z_sums(lambda x: x @ w, x, targets, weights, tiles)

    loss, z = sums(w, tiles)
    logits = x @ w
    np.testing.assert_allclose(loss, jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, targets)
                                             * weights), rtol=1e-5)
    np.testing.assert_allclose(loss, cross_entropy_sum(lambda x: x @ w, x, targets, weights, tiles), rtol=1e-6)
    np.testing.assert_allclose(z, jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2 * weights), rtol=1e-5)
    objective = lambda w, tiles: sums(w, tiles)[0] + 0.3 * sums(w, tiles)[1]  # noqa: E731

    def by_hand(w):
        logits = x @ w
        log_z = jax.nn.logsumexp(logits, axis=-1)
        target = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        return jnp.sum((log_z - target + 0.3 * log_z**2) * weights)

    np.testing.assert_allclose(jax.grad(objective)(w, tiles), jax.grad(by_hand)(w), rtol=1e-4, atol=1e-5)


def _records(tmp_path, name, **keys):
    run(tiny_config(tmp_path / name, steps=8, learning_rate=0.03, per_device_batch_size=2, **keys), jax.devices()[:1])
    return [json.loads(line) for line in (tmp_path / name / "test" / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def strong(tmp_path_factory):
    """8 steps of the tiny model with a strong z-loss (0.5 x log(Z)^2, log Z about log 96 = 4.6 at the start)."""
    return _records(tmp_path_factory.mktemp("z"), "strong", z_loss_multiplier=0.5)


def test_the_z_loss_trains_log_z_toward_zero_and_leaves_the_logged_loss_the_cross_entropy(strong, tmp_path, caplog):
    """Step 1 sees the same weights with any multiplier: the same loss (the cross-entropy, comparable with
    eval_loss and with runs without a z-loss), and z_loss = multiplier x mean log(Z)^2, so z_loss / multiplier
    is the same mean. Trained, the strong z-loss pulls log(Z)^2 far below where a negligible one leaves it.
    Without a z-loss no z_loss is logged."""
    with caplog.at_level("INFO", logger="tessera"):
        weak = _records(tmp_path, "weak", z_loss_multiplier=1e-9)
    none = _records(tmp_path, "none")
    assert strong[0]["loss"] == pytest.approx(weak[0]["loss"], rel=1e-6) == pytest.approx(none[0]["loss"], rel=1e-6)
    assert strong[0]["z_loss"] / 0.5 == pytest.approx(weak[0]["z_loss"] / 1e-9, rel=1e-5)
    assert 15 < weak[0]["z_loss"] / 1e-9 < 30  # about (log 96)^2 = 20.8 at initialization
    assert strong[-1]["z_loss"] / 0.5 < 0.5 * weak[-1]["z_loss"] / 1e-9  # measured: 7.4 against 28.7
    assert [r["loss"] for r in none] == pytest.approx([r["loss"] for r in weak], rel=1e-4)
    assert "z_loss" not in none[0]
    assert f"(z-loss {weak[-1]['z_loss']:.3g})" in caplog.text


def test_maxtexts_z_loss_key_is_this_one():
    """MaxText recipes' z_loss_multiplier=1e-4 was refused ("not in Tessera") until the z-loss was here."""
    cfg = load_config([str(REPO / "configs" / "base.yml"), "z_loss_multiplier=1e-4"], env={})
    assert cfg.model.z_loss_multiplier == 1e-4


@pytest.mark.parametrize("keys", [dict(gradient_accumulation_steps=2), dict(num_vocab_tiling=4)],
                         ids=["micro-batches", "vocabulary tiles"])
def test_the_z_loss_is_the_same_in_micro_batches_and_in_vocabulary_tiles(strong, tmp_path, keys):
    """The z-loss sums of two micro-batches add up to the batch's (logged per target token of the step), and
    chunks of the logits give the whole batch's: the same losses and z_loss over 8 steps (1e-4: the order of
    float32 sums, amplified by AdamW)."""
    got = _records(tmp_path, "other", z_loss_multiplier=0.5, **keys)
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in strong], rtol=1e-4)
    np.testing.assert_allclose([r["z_loss"] for r in got], [r["z_loss"] for r in strong], rtol=1e-4)
