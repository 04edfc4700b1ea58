"""The training objective: the summed cross-entropy of a batch's next tokens, with the model's
auxiliary terms (MoE routing statistics, the multi-token-prediction depths' losses).

`loss_terms` is what the train step differentiates and the evaluation step measures;
`cross_entropy_sum` (and `greedy_tokens`) take the output layer's logits a chunk of tokens at a
time with num_vocab_tiling, so logits [B, T, V] never exist at once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from tessera.config import ConfigError
from tessera.models import ModelDef
from tessera.models.mtp import chain_weights, shift_left

MTP_SUMS = "mtp_loss_sums"  # loss_terms' aux with mtp_num_layers: each depth's summed cross-entropy [D]
Z_SUM = "z_loss_sum"  # loss_terms' aux with z_loss_multiplier > 0: the targets' summed log(Z)^2 (unweighted)


def loss_sums(model: ModelDef, params, batch, dropout_key, packed: bool = False):
    """(sum of token losses, number of target tokens) for a batch (see `loss_terms`)."""
    return loss_terms(model, params, batch, dropout_key, packed)[:2]


def loss_terms(model: ModelDef, params, batch, dropout_key, packed: bool = False):
    """(sum of token losses, number of target tokens, aux) for a batch of `tokens` [B, T+1].

    Inputs are tokens[:, :-1] and targets tokens[:, 1:]. A target counts only if it is not
    padding (segment id 0) and belongs to the same segment as its input token. `packed`: rows
    hold several documents, so attention must use a kernel that honours segment ids. `aux`:
    the model's auxiliary scalars (MoE load-balancing loss and dropped-token fraction; with
    mtp_num_layers, the multi-token-prediction loss and its depths' statistics, `mtp_terms`; with
    z_loss_multiplier, Z_SUM, the targets' summed log(Z)^2 of the main output).
    """
    tokens, segments = batch["tokens"], batch["segment_ids"]
    inputs, targets, weights = tokens[:, :-1], tokens[:, 1:], target_weights(segments)
    x_btd, aux = model.hidden_with_aux(params, inputs, batch["positions"][:, :-1], segments[:, :-1], dropout_key,
                                       packed=packed)
    logits_fn = lambda x: model.logits(params, x)  # noqa: E731
    if model.cfg.z_loss_multiplier > 0:
        loss_sum, aux[Z_SUM] = cross_entropy_and_log_z_sums(logits_fn, x_btd, targets, weights,
                                                            model.cfg.num_vocab_tiling)
    else:
        loss_sum = cross_entropy_sum(logits_fn, x_btd, targets, weights, model.cfg.num_vocab_tiling)
    if model.cfg.mtp_num_layers:
        aux = {**aux, **mtp_terms(model, params, x_btd, batch, dropout_key, packed)}
    return loss_sum, jnp.sum(weights).astype(jnp.float32), aux


def target_weights(segments_bt):
    """Which targets of tokens [B, T+1] count: not padding (segment id 0) and in the same segment as
    their input token."""
    return (segments_bt[:, 1:] != 0) & (segments_bt[:, 1:] == segments_bt[:, :-1])


def mtp_terms(model: ModelDef, params, x_btd, batch, dropout_key, packed: bool = False) -> dict:
    """The multi-token-prediction depths' aux (`tessera.models.mtp`): "mtp_loss", the mean over
    depths of each depth's mean cross-entropy (`mtp_depths`), MTP_SUMS, each depth's summed
    cross-entropy [D] (a train step's micro-batches add them up), and the depths' MoE statistics
    ("mtp_moe_...", MTP_LOAD)."""
    _, aux, sums, counts = mtp_depths(model, params, x_btd, batch, dropout_key, packed)
    return {**aux, "mtp_loss": jnp.mean(sums / jnp.maximum(counts, 1.0)), MTP_SUMS: sums}


def mtp_target_counts(segments_bt, depths: int):
    """The targets each multi-token-prediction depth scores in a batch of segment ids [B, T+1]: [depths]."""
    weights = target_weights(segments_bt)
    return jnp.stack([jnp.sum(chain_weights(weights, k)) for k in range(1, depths + 1)]).astype(jnp.float32)


def mtp_depths(model: ModelDef, params, x_btd, batch, dropout_key, packed: bool = False):
    """(hiddens [h^1, ..., h^D], aux, loss sums [D], target counts [D]) of the multi-token-prediction
    depths on `loss_terms`'s hidden state x: depth k's cross-entropy on the targets k places further
    on, where a position whose chain of targets leaves the document, or reaches padding, does not
    count."""
    tokens, segments = batch["tokens"], batch["segment_ids"]
    inputs, targets, weights = tokens[:, :-1], tokens[:, 1:], target_weights(segments)
    hiddens, aux = model.mtp_hidden(params, x_btd, inputs, batch["positions"][:, :-1], segments[:, :-1],
                                    dropout_key, packed)
    sums, counts = [], []
    for k, h_btd in enumerate(hiddens, start=1):
        w = chain_weights(weights, k)
        sums.append(cross_entropy_sum(lambda x, k=k: model.logits(params, x, k), h_btd, shift_left(targets, k), w,
                                      model.cfg.num_vocab_tiling))
        counts.append(jnp.sum(w).astype(jnp.float32))
    return hiddens, aux, jnp.stack(sums), jnp.stack(counts)


def cross_entropy_sum(logits_fn, x_btd, targets_bt, weights_bt, tiles: int = 1):
    """sum(weights * cross-entropy(logits_fn(x), targets)) over the tokens of x [B, T, D].

    tiles > 1 (num_vocab_tiling): the B*T tokens are split into `tiles` chunks (`token_chunks`)
    and a scan computes one chunk's logits and loss at a time, recomputing them in the backward
    pass: logits [B, T, V] never exist at once. `logits_fn` maps [B', T', D] -> [B', T', V]."""

    def chunk(x, t, w):
        return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits_fn(x), t) * w)

    return _summed_over_tiles(chunk, x_btd, targets_bt, weights_bt, tiles)


def cross_entropy_and_log_z_sums(logits_fn, x_btd, targets_bt, weights_bt, tiles: int = 1):
    """(`cross_entropy_sum`, sum(weights * log(Z)^2)) of the same logits, log Z = logsumexp(logits) computed
    once for both (the z-loss, z_loss_multiplier); chunked with tiles > 1 as `cross_entropy_sum`."""

    def chunk(x, t, w):
        logits = logits_fn(x)
        log_z = jax.nn.logsumexp(logits, axis=-1)
        target = jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0]
        return jnp.sum((log_z - target) * w), jnp.sum(jnp.square(log_z) * w)

    return _summed_over_tiles(chunk, x_btd, targets_bt, weights_bt, tiles)


def _summed_over_tiles(chunk, x_btd, targets_bt, weights_bt, tiles: int):
    """`chunk`(x, targets, weights) (a float32 scalar, or a tuple of them) of the whole batch: with tiles > 1,
    summed over `token_chunks`' chunks by a scan that recomputes each chunk's logits in the backward pass."""
    if tiles == 1:
        return chunk(x_btd, targets_bt, weights_bt)
    split, _ = token_chunks(x_btd.shape[:2], tiles)
    xs = (split(x_btd), split(targets_bt), split(weights_bt))
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(chunk, *(a[0] for a in xs)))

    def body(totals, parts):
        return jax.tree.map(jnp.add, totals, jax.checkpoint(chunk)(*parts)), None

    totals, _ = jax.lax.scan(body, zeros, xs)
    return totals


def cross_entropy_sum_and_greedy(logits_fn, x_btd, targets_bt, weights_bt, tiles: int = 1):
    """(`cross_entropy_sum`, `greedy_tokens`) of the same logits, each chunk's computed once
    (evaluation, no gradient): with tiles > 1 separate calls would compute every chunk twice."""

    def chunk(x, t, w):
        logits = logits_fn(x)
        loss = jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, t) * w)
        return loss, jnp.argmax(logits, axis=-1)

    if tiles == 1:
        return chunk(x_btd, targets_bt, weights_bt)
    split, join = token_chunks(x_btd.shape[:2], tiles)

    def body(total, xs):
        loss, greedy = chunk(*xs)
        return total + loss, greedy

    total, greedy = jax.lax.scan(body, jnp.zeros((), jnp.float32), (split(x_btd), split(targets_bt), split(weights_bt)))
    return total, join(greedy)


def greedy_tokens(logits_fn, x_btd, tiles: int = 1):
    """argmax(logits_fn(x)) [B, T]: the most likely next token at each position of x [B, T, D];
    with tiles > 1 one chunk of the tokens at a time (`token_chunks`), like `cross_entropy_sum`."""
    if tiles == 1:
        return jnp.argmax(logits_fn(x_btd), axis=-1)
    split, join = token_chunks(x_btd.shape[:2], tiles)
    return join(jax.lax.map(lambda x: jnp.argmax(logits_fn(x), axis=-1), split(x_btd)))


def token_chunks(shape_bt, tiles: int):
    """(split, join) for num_vocab_tiling: split maps [B, T, ...] to [tiles, B*T/tiles, 1, ...], chunk
    i holding the tokens j with j % tiles == i (so every chunk keeps the batch's sharding); join
    maps [tiles, B*T/tiles, 1] back to [B, T]."""
    b, t = shape_bt
    if (b * t) % tiles:
        raise ConfigError(f"num_vocab_tiling={tiles} does not divide the {b} x {t} = {b * t} tokens of the batch; "
                          "change num_vocab_tiling")

    def split(a):
        return jnp.moveaxis(a.reshape(b * t // tiles, tiles, 1, *a.shape[2:]), 1, 0)

    def join(a):
        return jnp.moveaxis(a, 0, 1).reshape(b, t)

    return split, join
